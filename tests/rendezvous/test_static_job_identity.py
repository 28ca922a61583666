"""Static rendezvous (#30.3): an agent never joins another job's store, and a store that went away
ends the wait with one line.

Real agents on loopback, two static jobs on one ``--master-port`` (29500 for a user who gives none;
a free port here). Job A's two nodes run; job B's node rank 0 cannot bind the port (one line,
exit 2), and its node rank 1, which reaches job A's store, must stop too: with torch's static
handler it started a worker in job A's store, and once job A ended, that agent asked the gone
store every 0.5 s with a C++ stack each time, forever.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.conftest import free_port, write_script

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

#: Each worker writes started_<tag>_<RANK> and sleeps until the file ``release`` exists (at most 120 s).
WORKER = r"""
import os, sys, time
out = os.environ["FSM_E2E_OUT"]
open(os.path.join(out, "started_%s_%s" % (sys.argv[1], os.environ["RANK"])), "w").close()
deadline = time.monotonic() + 120
while not os.path.exists(os.path.join(out, "release")) and time.monotonic() < deadline:
    time.sleep(0.1)
"""
#: Generous: agents on a loaded 2-core machine.
STOP_WITHIN_S = 60.0


def static_flags(port: int, rank: int, run_id: str | None) -> list[str]:
    flags = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    flags += ["--node-rank", str(rank), "--local-addr", "127.0.0.1", "--monitor-interval", "0.1"]
    return flags + (["--rdzv-id", run_id] if run_id else [])


def start_job_a(launcher, port: int, run_id: str | None):
    script = write_script(launcher.dir, "worker.py", WORKER)
    agents = [launcher.fsm(*static_flags(port, rank, run_id), script, "a") for rank in (0, 1)]
    launcher.wait_for_file(launcher.out / "started_a_0", timeout=STOP_WITHIN_S)
    launcher.wait_for_file(launcher.out / "started_a_1", timeout=STOP_WITHIN_S)
    return script, agents


@pytest.mark.parametrize(
    ("run_a", "run_b", "names"),
    [
        (None, None, ["node rank 1 is already taken", "'none'"]),  # torchrun's default run id, both jobs
        ("job-a", "job-b", ["another job", "'job-a'", "'job-b'"]),
    ],
    ids=["same-run-id", "other-run-id"],
)
def test_a_second_job_on_the_same_port_is_refused_on_every_node(launcher, run_a, run_b, names):
    port = free_port()
    script, job_a = start_job_a(launcher, port, run_a)
    b0 = launcher.fsm(*static_flags(port, 0, run_b), script, "b")
    b1 = launcher.fsm(*static_flags(port, 1, run_b), script, "b")
    assert b0.wait(STOP_WITHIN_S).returncode == 2
    result = b1.wait(STOP_WITHIN_S)
    assert result.returncode != 0, result
    lines = [line for line in result.stderr.splitlines() if "static rendezvous at" in line]
    assert len(lines) == 1, result.stderr
    assert all(name in lines[0] for name in names), lines[0]
    assert "--master-port" in lines[0] and "Traceback" not in result.stderr
    assert not list(launcher.out.glob("started_b_*")), "job B started a worker"
    (launcher.out / "release").touch()
    for agent in job_a:  # job A is not disturbed
        agent.wait(STOP_WITHIN_S).check()


def test_a_node_stops_with_one_line_when_the_store_host_is_gone(launcher):
    """Node rank 0's agent (the store's host) SIGKILLed with its workers: node rank 1 stops its
    worker and exits within seconds, not after the 900 s timeout (nor never), and prints no
    TCPStore stack."""
    port = free_port()
    _, (a0, a1) = start_job_a(launcher, port, "gone")
    os.killpg(a0.pid, signal.SIGKILL)
    killed = time.monotonic()
    result = a1.wait(STOP_WITHIN_S)
    assert result.returncode != 0, result
    assert time.monotonic() - killed < STOP_WITHIN_S
    lines = [line for line in result.stderr.splitlines() if "hosted by node rank 0" in line]
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0], result.stderr
    assert "sendBytes failed" not in result.stderr and "frame #" not in result.stderr, result.stderr
