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

pytestmark = pytest.mark.slow

AFTER_LOSS = [("HEALTHY", "STOPPED", "membership_changed"), ("STOPPED", "HEALTHY", "restart"),
              ("HEALTHY", "SUCCEEDED", "workers_succeeded")]
MARGIN_S = 10.0


def etcd_flags(etcd_server, keep_alive: str) -> list[str]:
    return ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "etcd-v3", "--rdzv-endpoint",
            etcd_server.endpoint, "--rdzv-id", f"loss-{uuid.uuid4().hex[:8]}", "--local-addr", "127.0.0.1",
            "--monitor-interval", "0.1", "--max-restarts", "0",
            "--rdzv-conf", f"join_timeout=60,last_call_timeout=3,{keep_alive}"]


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


@pytest.mark.parametrize("sig, keep_alive_s, detect_bound_s", [
    # a machine dying: seen once its keep-alive (1 s x 5) expired, plus the check (torch caches 1 s)
    (signal.SIGKILL, 5, 5 + 1 + MARGIN_S),
    # an operator's SIGTERM: the agent leaves its round, seen long before torch's 5 x 3 s keep-alive
    (signal.SIGTERM, 15, MARGIN_S),
], ids=["sigkill", "sigterm"])
def test_survivor_goes_on_alone_when_its_peer_is_lost(job, etcd_server, sig, keep_alive_s, detect_bound_s):
    conf = "keep_alive_interval=1,keep_alive_max_attempt=5" if keep_alive_s == 5 else \
        "keep_alive_interval=5,keep_alive_max_attempt=3"
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
