"""A node whose workers all succeeded is neither lost nor gone for the nodes still running (#30.1).

Two agents of one job, one worker each: the workers join one gloo ``all_reduce``, then the "fast"
node's worker returns at once and the "slow" node's runs ``SLOW_S`` seconds longer, past every
backend's keep-alive timeout (c10d: 5 s x 3). The fast node either waits in its exit barrier
(torchrun's way: both exit 0 when the slow one is done) or, given a short
``--exit-barrier-timeout``, leaves after its barrier gives up. Either way the slow node's
workers run on, once, in the same round: no "node lost", no re-rendezvous, both agents exit 0.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import free_port, write_script

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

#: Seconds the slow node's worker runs after the fast one finished (more than c10d's 15 s keep-alive).
SLOW_S = 22

WORKER = r"""
import datetime, json, os, sys, time
import torch
import torch.distributed as dist

role = sys.argv[1]
out = os.environ["FSM_E2E_OUT"]
with open(os.path.join(out, "start_%s_%s.json" % (role, os.getpid())), "w") as f:
    json.dump({"role": role, "restart_count": os.environ["TORCHELASTIC_RESTART_COUNT"]}, f)
dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=90))
value = torch.tensor([1.0])
dist.all_reduce(value)
dist.destroy_process_group()
if role == "slow":
    time.sleep(float(sys.argv[2]))
with open(os.path.join(out, "done_%s.json" % role), "w") as f:
    json.dump({"sum": value.item()}, f)
"""


def _flags(backend: str, port: int, *, hosts: bool) -> list[str]:
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "0", "--monitor-interval", "0.5"]
    if backend == "static":
        # node rank 0 hosts the store
        return [*common, "--master-addr", "127.0.0.1", "--master-port", str(port), "--node-rank", "0" if hosts else "1"]
    return [
        *common,
        "--rdzv-backend",
        backend,
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "finished-peer",
        "--rdzv-conf",
        f"is_host={int(hosts)}",
        "--local-addr",
        "127.0.0.1",
    ]


@pytest.mark.parametrize("fast_node", ["waits", "leaves"])
@pytest.mark.parametrize("backend", ["c10d", "fsm", "static"])
def test_a_finished_node_is_not_taken_for_lost(launcher, backend, fast_node):
    """``waits``: the fast node hosts the store and waits in its exit barrier (the default 300 s).
    ``leaves``: the slow node hosts the store; the fast one's barrier gives up after 2 s and its
    agent ends (its keep-alive stops, on c10d and fsm it leaves the round)."""
    script = write_script(launcher.dir, "finish_apart.py", WORKER)
    port = free_port()
    fast_hosts = fast_node == "waits"
    barrier = [] if fast_hosts else ["--exit-barrier-timeout", "2"]
    fast = launcher.fsm(*_flags(backend, port, hosts=fast_hosts), *barrier, script, "fast")
    slow = launcher.fsm(*_flags(backend, port, hosts=not fast_hosts), script, "slow", SLOW_S)
    slow_result = slow.wait().check()
    fast_result = fast.wait().check()

    for result in (fast_result, slow_result):
        assert "node lost" not in result.stderr and "re-rendezvous" not in result.stderr, result.stderr
        assert "membership changed" not in result.stderr, result.stderr
    starts = [json.loads(p.read_text()) for p in launcher.out.glob("start_*.json")]
    assert sorted(s["role"] for s in starts) == ["fast", "slow"], f"a worker was started again: {starts}"
    assert all(s["restart_count"] == "0" for s in starts), starts
    for role in ("fast", "slow"):
        assert json.loads((launcher.out / f"done_{role}.json").read_text())["sum"] == 2.0
    if fast_hosts:  # it waited in its exit barrier for the slow node, as torchrun's agent does
        assert fast_result.duration >= SLOW_S, fast_result.duration
