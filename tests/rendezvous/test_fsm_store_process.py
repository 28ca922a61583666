"""The light alternative to etcd: the ``fsm`` rendezvous store as a process of its own
(``python -m fsm_agent.store``, on a host that runs no workers; every agent ``is_host=0``).

No agent hosts the store, so any compute node may be lost, the first one started included: the
survivors re-rendezvous without it. The store process itself is a single point of failure (one
process, state in memory, no replication): when it is lost, the agents end FAILED, torch's error summary naming
the endpoint (no traceback). etcd with three members survives that too
(plugins/fsm-agent-etcd/tests/test_etcd_cluster.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import pytest

from fsm_agent.testing.node_loss import NodeLossJob

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture
def store_process():
    """``python -m fsm_agent.store`` on a free 127.0.0.1 port, its own session; SIGKILLed by pid at teardown."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "fsm_agent.store", "--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        line = proc.stdout.readline()  # "fsm store listening on 127.0.0.1:PORT (pid N)"
        assert line.startswith("fsm store listening on 127.0.0.1:"), line
        proc.endpoint = line.split()[4]
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()


def store_flags(endpoint: str) -> list[str]:
    return [
        "--nnodes",
        "2:3",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "fsm",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        "light",
        "--local-addr",
        "127.0.0.1",
        "--monitor-interval",
        "0.1",
        "--max-restarts",
        "0",
        "--rdzv-conf",
        "is_host=0,join_timeout=120,last_call_timeout=3",
    ]


def test_first_node_lost_with_the_store_outside_the_agents(tmp_path, store_process):
    job = NodeLossJob(tmp_path, store_flags(store_process.endpoint))
    try:
        for name in ("a", "b", "c"):
            job.start(name)
        job.wait_for_world(3, {"a", "b", "c"}, timeout=240)
        job.finish_next_world()
        lost_at = job.lose("a", signal.SIGKILL)  # the first agent started
        job.wait_for_world(2, {"b", "c"}, since=lost_at, timeout=120, running=set())  # they may be done already
        assert job.agent("b").wait(120) == 0, job.diagnostics()
        assert job.agent("c").wait(120) == 0, job.diagnostics()
        after = [r for r in job.records() if r["ts"] >= lost_at]
        assert sorted(r["name"] for r in after) == ["b", "c"]
        assert all(r["world"] == 2 and r["group_world"] == 2 for r in after)
        assert store_process.poll() is None  # the store served the whole job
    finally:
        job.close()


def test_the_store_process_lost_ends_the_job_in_one_line(tmp_path, store_process):
    job = NodeLossJob(tmp_path, store_flags(store_process.endpoint))
    try:
        job.start("a")
        job.start("b")
        job.wait_for_world(2, {"a", "b"}, timeout=240)
        os.killpg(store_process.pid, signal.SIGKILL)
        for name in ("a", "b"):
            assert job.agent(name).wait(180) != 0, job.diagnostics()
            err = (tmp_path / f"agent_{name}.err").read_text()
            assert f"rendezvous failed: backend=fsm endpoint={store_process.endpoint}" in err, job.diagnostics()
            (cause,) = [line for line in err.splitlines() if "rendezvous failed:" in line and "connection" in line]
            assert cause.count("backend=fsm") == 1, cause  # said once (#30.9)
            assert "Traceback" not in err, job.diagnostics()
    finally:
        job.close()
