"""fsm-agent's c10d wrapper (``FreshStoreHandler``) on torch's real handler: lost, departed and
re-joining nodes, and the guard on torch's private layout.

Handlers of one run in threads of this process, over one real TCPStore on 127.0.0.1 and torch's own
``C10dRendezvousBackend``: what ``fsm-agent --rdzv-backend c10d`` builds, minus the agent.
The layout read is torch's private one, so these tests are the check for the torch range in
pyproject (``TORCH_LAYOUT_TESTED``): they run on whichever torch of that range is installed.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path

import pytest

from fsm_agent.errors import RendezvousFailed
from fsm_agent.plugins import rendezvous_c10d
from fsm_agent.plugins.rendezvous_c10d import FreshStoreHandler, check_torch_layout
from fsm_agent.testing.processes import wait_until

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

KEEP_ALIVE_S = 1 * 3  # keep_alive_interval x keep_alive_max_attempt below


@pytest.fixture
def run():
    """A real TCPStore and a ``make()`` that builds a wrapped torch handler of one run on it."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    run_id = f"membership-{uuid.uuid4().hex[:8]}"
    made = []

    def make(max_nodes: int = 2) -> FreshStoreHandler:
        params = RendezvousParameters(
            "c10d",
            f"127.0.0.1:{store.port}",
            run_id,
            1,
            max_nodes,
            local_addr="127.0.0.1",
            join_timeout=30,
            last_call_timeout=1,
            keep_alive_interval=1,
            keep_alive_max_attempt=3,
        )
        client = TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=30))  # one per node
        backend = C10dRendezvousBackend(client, run_id)
        made.append(FreshStoreHandler(create_handler(client, backend, params), backend))
        return made[-1]

    yield make
    for handler in made:
        handler._handler._stop_heartbeats()


def join_all(*handlers: FreshStoreHandler) -> list:
    """``next_rendezvous`` of every handler at once (it blocks until the round completes)."""
    infos: dict[int, object] = {}
    threads = [
        threading.Thread(target=lambda i=i, h=h: infos.__setitem__(i, h.next_rendezvous()))
        for i, h in enumerate(handlers)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(infos) == len(handlers), "the round did not complete"
    return [infos[i] for i in range(len(handlers))]


def test_installed_torch_is_in_the_tested_range():
    import torch

    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert f'"torch{rendezvous_c10d.TORCH_LAYOUT_TESTED}"' in pyproject, "keep TORCH_LAYOUT_TESTED = pyproject's range"
    major, minor = (int(part) for part in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())
    assert (2, 4) <= (major, minor) < (3, 0), torch.__version__


def test_a_handler_without_torch_dynamic_layout_is_one_line_naming_what_is_missing():
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

    static = StaticTCPRendezvous("127.0.0.1", 1, 0, 1, "static", 10)
    with pytest.raises(RendezvousFailed) as caught:
        check_torch_layout(static)
    message = str(caught.value)
    assert "\n" not in message
    assert "StaticTCPRendezvous._state_holder" in message and rendezvous_c10d.TORCH_LAYOUT_TESTED in message
    assert "--rdzv-backend fsm" in message


def test_nothing_lost_in_a_healthy_round(run):
    a, b = run(), run()
    assert a.num_nodes_lost() == 0  # before any round
    infos = join_all(a, b)
    assert sorted(info.world_size for info in infos) == [2, 2]
    time.sleep(KEEP_ALIVE_S + 1)  # heartbeats keep both alive
    assert (a.num_nodes_lost(), b.num_nodes_lost()) == (0, 0)
    assert (a.num_nodes_waiting(), b.num_nodes_waiting()) == (0, 0)


def test_a_node_whose_keep_alive_stops_is_lost_after_the_keep_alive_timeout(run):
    a, b = run(), run()
    join_all(a, b)
    stopped = time.monotonic()
    b._handler._stop_heartbeats()  # as a machine dying: its keep-alive just stops
    assert wait_until(lambda: a.num_nodes_lost() == 1, timeout=KEEP_ALIVE_S + 5, interval=0.1)
    seen = time.monotonic() - stopped
    # b's last heartbeat was at most keep_alive_interval (1 s) before it stopped; + torch's 1 s cache
    assert KEEP_ALIVE_S - 1 - 0.5 <= seen <= KEEP_ALIVE_S + 1 + 2, seen


def test_a_node_that_leaves_is_lost_at_the_next_check(run):
    a, b = run(), run()
    join_all(a, b)
    left = time.monotonic()
    b.leave()
    assert wait_until(lambda: a.num_nodes_lost() == 1, timeout=KEEP_ALIVE_S, interval=0.1)
    assert time.monotonic() - left < 1.0 + 0.5  # torch's 1 s state cache, not the keep-alive timeout
    assert not a.is_closed()  # leaving is not torch's shutdown(): the rendezvous stays open
    assert [info.world_size for info in join_all(a)] == [1]  # a goes on alone


def test_a_node_that_rejoins_is_waiting_not_lost(run):
    a, b = run(), run()
    join_all(a, b)
    rejoin = threading.Thread(target=b.next_rendezvous, daemon=True)  # as after its workers failed
    rejoin.start()
    assert wait_until(lambda: a.num_nodes_waiting() == 1, timeout=10, interval=0.1)
    assert a.num_nodes_lost() == 0
    join_all(a)
    rejoin.join(30)
    assert a.num_nodes_lost() == 0 and b.num_nodes_lost() == 0


def test_a_node_no_longer_in_the_round_counts_itself(run):
    a, b = run(), run()
    join_all(a, b)
    a._handler._stop_heartbeats()  # a's own keep-alive lapses (a stalled host): torch drops it
    assert wait_until(lambda: a.num_nodes_lost() >= 1, timeout=KEEP_ALIVE_S + 5, interval=0.1)
