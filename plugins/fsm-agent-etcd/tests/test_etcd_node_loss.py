"""etcd-v3 survivors notice a lost (SIGKILLed) or departed (SIGTERMed) node by themselves.

Real agents and a real etcd (conftest.py), ``--nnodes 1:2``, ``--max-restarts 0``: the survivor
re-rendezvouses as a membership change (class ``node_lost``, not counted) and runs again as a
world of 1. The state is torch's, so fsm-agent's c10d wrapper (``FreshStoreHandler``) reads it
the same way. Unlike c10d, either node may be the victim: etcd is not an agent.
"""

from __future__ import annotations

import signal
import uuid

import pytest

from fsm_agent.testing.node_loss import NodeLossJob
from fsm_agent.testing.processes import wait_until

pytestmark = pytest.mark.slow

AFTER_LOSS = [
    ("HEALTHY", "STOPPED", "membership_changed"),
    ("STOPPED", "HEALTHY", "restart"),
    ("HEALTHY", "SUCCEEDED", "workers_succeeded"),
]
MARGIN_S = 10.0


def etcd_flags(etcd_server, keep_alive: str) -> list[str]:
    return [
        "--nnodes",
        "1:2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "etcd-v3",
        "--rdzv-endpoint",
        etcd_server.endpoint,
        "--rdzv-id",
        f"loss-{uuid.uuid4().hex[:8]}",
        "--local-addr",
        "127.0.0.1",
        "--monitor-interval",
        "0.1",
        "--max-restarts",
        "0",
        "--rdzv-conf",
        f"join_timeout=60,last_call_timeout=3,{keep_alive}",
    ]


@pytest.fixture
def job(tmp_path):
    """``job(flags)``: a NodeLossJob in tmp_path; its agents and workers are killed at teardown."""
    made: list[NodeLossJob] = []

    def make(flags: list[str]) -> NodeLossJob:
        made.append(NodeLossJob(tmp_path, flags))
        return made[-1]

    yield make
    for one in made:
        one.close()


@pytest.mark.parametrize(
    "sig, keep_alive_s, detect_bound_s",
    [
        # a machine dying: seen once its keep-alive (1 s x 5) expired, plus the check (torch caches 1 s)
        (signal.SIGKILL, 5, 5 + 1 + MARGIN_S),
        # an operator's SIGTERM: the agent leaves its round, seen long before torch's 5 x 3 s keep-alive
        (signal.SIGTERM, 15, MARGIN_S),
    ],
    ids=["sigkill", "sigterm"],
)
def test_survivor_goes_on_alone_when_its_peer_is_lost(job, etcd_server, sig, keep_alive_s, detect_bound_s):
    conf = (
        "keep_alive_interval=1,keep_alive_max_attempt=5"
        if keep_alive_s == 5
        else "keep_alive_interval=5,keep_alive_max_attempt=3"
    )
    loss = job(etcd_flags(etcd_server, conf))
    loss.start("a")
    loss.start("b")
    loss.wait_for_world(2, {"a", "b"})
    loss.finish_next_world()
    victim, survivor = "a", "b"  # a may have group rank 0 (it hosts the workers' store): etcd holds the rendezvous
    lost_at = loss.lose(victim, sig)
    restarted = loss.wait_for_world(1, {survivor}, since=lost_at)
    assert loss.agent(survivor).wait(60) == 0, loss.diagnostics()
    change = loss.first_transition(survivor, "membership_changed", lost_at)
    detect, running = change["ts"] - lost_at, restarted - lost_at
    print(f"\n{signal.Signals(sig).name} -> etcd-v3 survivor: detect_s={detect:.2f}, running_again_s={running:.2f}")
    assert change["failure_class"] == "node_lost", change
    assert detect < detect_bound_s
    assert running < detect_bound_s + 3 + MARGIN_S  # + last_call_timeout
    assert loss.transitions(survivor, since=lost_at) == AFTER_LOSS, loss.diagnostics()
    assert all(e["restart_count"] == 0 for e in loss.events(survivor))
    if sig == signal.SIGTERM:
        assert loss.agent(victim).returncode == 128 + signal.SIGTERM
        assert detect < keep_alive_s - 5  # before torch's keep-alive could have dropped it (>= 10 s)


def redundancy_list(etcd_server, run_id: str) -> set:
    """torch's redundancy list of ``run_id``, read through this plugin's backend."""
    import pickle

    from fsm_agent_etcd import create_backend
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    backend, _ = create_backend(RendezvousParameters("etcd-v3", etcd_server.endpoint, run_id, 1, 2))
    state = backend.get_state()
    return set(pickle.loads(state[0]).redundancy_list) if state else set()


def test_standby_takes_the_seat_of_a_lost_node(job, etcd_server):
    """Hot spares on etcd-v3 as on c10d (torch's redundancy list, one handler): three agents,
    ``--nnodes 1:2``; c waits as a standby; when b is SIGKILLed, c joins a's next round (world kept
    at 2) and nobody counts a restart."""
    flags = etcd_flags(etcd_server, "keep_alive_interval=1,keep_alive_max_attempt=5")
    run_id = flags[flags.index("--rdzv-id") + 1]
    loss = job(flags)
    loss.start("a")
    loss.start("b")
    loss.wait_for_world(2, {"a", "b"})
    loss.start("c")
    assert wait_until(lambda: len(redundancy_list(etcd_server, run_id)) == 1, timeout=60), loss.diagnostics()
    loss.finish_next_world()
    victim = next(r["name"] for r in loss.records() if r["group_rank"] == 1)  # either a or b: etcd is not an agent
    survivor = "ab".replace(victim, "")
    lost_at = loss.lose(victim, signal.SIGKILL)
    restarted = loss.wait_for_world(2, {survivor, "c"}, since=lost_at, running={survivor, "c"})
    for name in (survivor, "c"):
        assert loss.agent(name).wait(60) == 0, loss.diagnostics()
    print(f"\nSIGKILL -> etcd-v3 standby promoted, world of 2 running again: {restarted - lost_at:.2f}s")
    assert restarted - lost_at < 5 + 1 + MARGIN_S
    assert loss.transitions(survivor, since=lost_at) == AFTER_LOSS, loss.diagnostics()
    assert loss.transitions("c") == [("INIT", "HEALTHY", "start"), ("HEALTHY", "SUCCEEDED", "workers_succeeded")]
    after = sorted((r["name"], r["group_world"], r["restart_count"]) for r in loss.records() if r["ts"] >= lost_at)
    assert after == sorted([(survivor, 2, 0), ("c", 2, 0)])
