"""c10d (torch's DynamicRendezvousHandler): survivors notice a lost or departed node by themselves.

Real agents on loopback, ``--nnodes 1:2`` (and a standby beyond MAX), ``--max-restarts 0``: the
survivor must re-rendezvous as a membership change (class ``node_lost``, not counted), or it
would end FAILED. torch alone (torchrun) keeps the stale group running until its workers fail.

* SIGKILL of an agent and its workers: seen once the victim's keep-alive expires
  (``keep_alive_interval x keep_alive_max_attempt`` = 1 x 5 s here: torch's own heartbeats
  can be 3 s apart right after a round completes, so 1 x 2 s would drop live nodes on a busy machine) plus the survivor's check.
* SIGTERM of an agent: it leaves the round (torch's exit operation) instead of closing the
  rendezvous, so the survivor sees it at its next check, long before torch's default keep-alive
  timeout (5 x 3 s, kept in that test).
"""

from __future__ import annotations

import pickle
import signal
import socket
import time
from datetime import timedelta

import pytest

from fsm_agent.testing.node_loss import NodeLossJob
from fsm_agent.testing.processes import wait_until
from tests.conftest import free_port, torchrun_cmd

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

#: What a survivor does after losing its peer: one re-rendezvous (not a restart), then success.
AFTER_LOSS = [
    ("HEALTHY", "STOPPED", "membership_changed"),
    ("STOPPED", "HEALTHY", "restart"),
    ("HEALTHY", "SUCCEEDED", "workers_succeeded"),
]
#: Generous: a loaded 2-core machine; the bounds below say what each includes.
MARGIN_S = 10.0
#: keep_alive_interval x keep_alive_max_attempt of c10d_flags' default conf.
KEEP_ALIVE_S = 5.0


def c10d_flags(
    port: int, nnodes: str = "1:2", conf: str = "keep_alive_interval=1,keep_alive_max_attempt=5"
) -> list[str]:
    # last_call_timeout=3: both agents are in the first round; a lone survivor's round completes 3 s after it joins
    return [
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "node-loss",
        "--local-addr",
        "127.0.0.1",
        "--monitor-interval",
        "0.1",
        "--max-restarts",
        "0",
        "--rdzv-conf",
        f"join_timeout=60,last_call_timeout=3,{conf}",
    ]


def rendezvous_state(port: int):
    """torch's ``_RendezvousState`` of run ``node-loss``, read through torch's own c10d backend."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    return pickle.loads(C10dRendezvousBackend(store, "node-loss").get_state()[0])


def start_store_host(job: NodeLossJob, port: int) -> None:
    """Agent a, then wait until it hosts the rendezvous store (on loopback every agent matches the
    endpoint's host: the first to bind the port hosts it)."""
    job.start("a")

    def listening() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            return False

    assert wait_until(listening, timeout=60), job.diagnostics()


def lose_peer_and_check(
    job: NodeLossJob, port: int, sig: int, detect_bound_s: float, peer_command: list[str] | None = None
) -> dict:
    """a (the store host) and b (``peer_command``: e.g. torchrun) form a world of 2; b is lost by
    ``sig``; a goes on as a world of 1."""
    start_store_host(job, port)
    job.start("b", command=peer_command)
    job.wait_for_world(2, {"a", "b"})
    job.finish_next_world()
    lost_at = job.lose("b", sig)
    restarted = job.wait_for_world(1, {"a"}, since=lost_at)
    assert job.agent("a").wait(60) == 0, job.diagnostics()
    change = job.first_transition("a", "membership_changed", lost_at)
    timings = {"detect_s": change["ts"] - lost_at, "running_again_s": restarted - lost_at}
    print(f"\n{signal.Signals(sig).name} -> survivor: " + ", ".join(f"{k}={v:.2f}" for k, v in timings.items()))
    assert change["failure_class"] == "node_lost", change
    assert timings["detect_s"] < detect_bound_s, timings
    assert timings["running_again_s"] < detect_bound_s + 3 + MARGIN_S, timings  # + last_call_timeout
    assert job.transitions("a", since=lost_at) == AFTER_LOSS, job.diagnostics()
    assert all(e["restart_count"] == 0 for e in job.events("a"))  # a membership change, not a restart
    after = [r for r in job.records() if r["ts"] >= lost_at]
    assert [(r["name"], r["world"], r["group_rank"], r["group_world"], r["restart_count"]) for r in after] == [
        ("a", 1, 0, 1, 0)
    ]
    return timings


def test_sigkilled_node_is_lost_after_its_keep_alive(job_factory):
    # keep-alive 1 s x 5: expired at most 5 s after the kill; + the survivor's check (torch caches 1 s)
    port = free_port()
    lose_peer_and_check(job_factory(c10d_flags(port)), port, signal.SIGKILL, detect_bound_s=KEEP_ALIVE_S + 1 + MARGIN_S)


def test_sigtermed_node_leaves_and_is_seen_before_any_keep_alive(job_factory):
    port = free_port()
    job = job_factory(c10d_flags(port, conf="keep_alive_interval=5,keep_alive_max_attempt=3"))
    timings = lose_peer_and_check(job, port, signal.SIGTERM, detect_bound_s=MARGIN_S)
    assert job.agent("b").returncode == 128 + signal.SIGTERM
    # torch's keep-alive (5 x 3 s) would take 10-15 s after b's last heartbeat; b left at once.
    assert timings["detect_s"] < 10.0, timings


def test_standby_is_promoted_when_a_participant_dies(job_factory):
    """Three agents, ``--nnodes 1:2``: torch keeps c in its redundancy list; when b dies, c joins
    a's next round (world kept at 2), without counting a restart anywhere."""
    port = free_port()
    job = job_factory(c10d_flags(port))
    start_store_host(job, port)
    job.start("b")
    job.wait_for_world(2, {"a", "b"})
    job.start("c")
    assert wait_until(lambda: len(rendezvous_state(port).redundancy_list) == 1, timeout=60), job.diagnostics()
    lost_at, took_s = job.kill_and_wait_for_the_standby("b", {"a", "c"})
    assert took_s < KEEP_ALIVE_S + 1 + MARGIN_S
    assert job.transitions("a", since=lost_at) == AFTER_LOSS, job.diagnostics()
    assert job.transitions("c") == [("INIT", "HEALTHY", "start"), ("HEALTHY", "SUCCEEDED", "workers_succeeded")]
    after = sorted((r["name"], r["group_world"], r["restart_count"]) for r in job.records() if r["ts"] >= lost_at)
    assert after == [("a", 2, 0), ("c", 2, 0)]


def test_torchrun_peer_killed_fsm_agent_survivor_goes_on(job_factory):
    """A mixed job on one c10d endpoint: the fsm-agent node notices its torchrun peer's death (torch's
    state is shared, so torchrun's keep-alives are what expire) and goes on alone."""
    port = free_port()
    lose_peer_and_check(
        job_factory(c10d_flags(port)),
        port,
        signal.SIGKILL,
        detect_bound_s=KEEP_ALIVE_S + 1 + MARGIN_S,
        peer_command=torchrun_cmd(),
    )


def test_a_rerendezvous_with_a_standby_settles_once(job_factory):
    """Three agents, ``--nnodes 1:2``, c the standby; b's worker fails once (a counted restart). The
    re-rendezvous puts c and the restarting node in torch's wait list for two seats; the node left
    there must stay a standby. torch's ``num_nodes_waiting`` keeps counting it, and the two in the
    round would re-rendezvous every time they poll, for ever."""
    port = free_port()
    job = job_factory(c10d_flags(port))
    start_store_host(job, port)
    job.start("b", "--max-restarts", "1")
    job.wait_for_world(2, {"a", "b"})
    job.start("c", "--max-restarts", "1")
    assert wait_until(lambda: len(rendezvous_state(port).redundancy_list) == 1, timeout=60), job.diagnostics()
    crashed_at = job.crash("b")
    assert wait_until(lambda: len({r["name"] for r in job.records() if r["ts"] > crashed_at}) >= 2, timeout=60), (
        job.diagnostics()
    )
    time.sleep(15)  # a churning round restarts its workers every 1-3 s
    starts = [r for r in job.records() if r["ts"] > crashed_at]
    assert len(starts) == 2 and {r["group_world"] for r in starts} == {2}, (starts, job.diagnostics())
    for name in "abc":
        assert job.agent(name).poll() is None, job.diagnostics()
