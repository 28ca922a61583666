"""c10d (#39.2): a node that does not host the store waits for a store host that starts late.

Pods, VMs and Slurm steps start in any order. torch's c10d backend gives an ``is_host=0`` node
``read_timeout`` seconds to reach the store (torchrun fails too); fsm-agent waits up to
``join_timeout``, with a progress line every 30 s, and fails at ``join_timeout`` with one line.
Real agents on loopback, probe workers; the same in network namespaces:
``test_c10d_late_store_host_netns.py``.
"""

from __future__ import annotations

import time

import pytest

from tests.conftest import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

#: The store host starts this long after the others: well past read_timeout (5 s) + torch's margin.
LATE_S = 20.0


def c10d_flags(port: int, is_host: int, join_timeout: int) -> list[str]:
    flags = f"--nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:{port} --rdzv-id late-host"
    conf = f"is_host={is_host},join_timeout={join_timeout},read_timeout=5"
    return [*flags.split(), "--rdzv-conf", conf, "--local-addr", "127.0.0.1"]


def test_an_early_node_waits_for_a_store_host_that_starts_late(launcher):
    port = free_port()
    early = launcher.fsm(*c10d_flags(port, 0, 90), launcher.probe)
    time.sleep(LATE_S)
    assert early.alive(), early.wait(1)
    host = launcher.fsm(*c10d_flags(port, 1, 90), launcher.probe)
    host.wait(120).check()
    early.wait(120).check()
    assert sorted(launcher.records()) == [0, 1]


def test_a_store_host_that_never_starts_fails_at_join_timeout_with_one_line(launcher):
    """join_timeout 40 s: one progress line at 30 s, then the failure, one line naming the endpoint."""
    port = free_port()
    result = launcher.fsm(*c10d_flags(port, 0, 40), launcher.probe).wait(150)
    assert result.returncode != 0 and launcher.records() == {}
    assert 35 <= result.duration < 120, result
    assert "Traceback" not in result.stderr
    waiting = [line for line in result.stderr.splitlines() if "waiting for the store host" in line]
    assert len(waiting) == 1 and f"127.0.0.1:{port}" in waiting[0], result.stderr
    failed = [line for line in result.stderr.splitlines() if "nothing listened there within" in line]
    assert len(failed) == 1, result.stderr
    assert f"127.0.0.1:{port}" in failed[0] and "join_timeout=40s" in failed[0] and "is_host=0" in failed[0]
