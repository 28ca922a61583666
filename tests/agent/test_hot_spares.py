"""Hot spares on the ``fsm`` backend: real agents on loopback, ``--nnodes 2:2``, a third agent.

* Three agents for 2:2 never fail the job: two run it, the third waits as a standby (INIT, no
  workers, a ``standby`` event, the log line, ``/status``) and leaves with exit 0 when the job ends.
* A standby takes the seat of a SIGKILLed active node in the next round: the world stays 2 nodes
  and no restart is counted (``--max-restarts 0`` would end FAILED otherwise).
* A restart (a worker failure) does not hand the restarting round to the standby while the other
  node of the previous round is still coming (here: stopped with SIGSTOP for a while).

c10d: ``tests/rendezvous/test_c10d_node_loss.py::test_standby_is_promoted_when_a_participant_dies``;
network namespaces: ``tests/agent/test_netns.py::test_fsm_hot_spare_*``.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from fsm_agent.testing.node_loss import NodeLossJob
from fsm_agent.testing.processes import wait_until
from tests.conftest import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

AFTER_LOSS = [
    ("HEALTHY", "STOPPED", "membership_changed"),
    ("STOPPED", "HEALTHY", "restart"),
    ("HEALTHY", "SUCCEEDED", "workers_succeeded"),
]
#: A standby that takes a seat: one round, one attempt.
PROMOTED = [("INIT", "HEALTHY", "start"), ("HEALTHY", "SUCCEEDED", "workers_succeeded")]
#: A standby when the job ends without it.
NOT_NEEDED = [("INIT", "SUCCEEDED", "rendezvous_not_needed")]
MARGIN_S = 30.0


def fsm_flags(port: int, *conf: str) -> list[str]:
    return [
        "--nnodes",
        "2:2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "fsm",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "hot-spares",
        "--local-addr",
        "127.0.0.1",
        "--monitor-interval",
        "0.1",
        "--max-restarts",
        "0",
        "--rdzv-conf",
        ",".join(["join_timeout=120", *conf]),
    ]


def standby_events(job: NodeLossJob, name: str) -> list[dict]:
    return [e for e in job.events(name) if e["kind"] == "standby"]


def wait_for_standby(job: NodeLossJob, name: str) -> dict:
    assert wait_until(lambda: standby_events(job, name), timeout=60), job.diagnostics()
    return standby_events(job, name)[0]


def start_host_then(job: NodeLossJob, port: int, *names: str, extra: tuple[str, ...] = ()) -> None:
    """a first (it hosts the store on loopback), then ``names``; ``extra``: flags for each."""
    job.start("a", *extra)
    assert wait_until(lambda: _listening(port), timeout=60), job.diagnostics()
    for name in names:
        job.start(name, *extra)


def _listening(port: int) -> bool:
    import socket

    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def test_three_agents_for_two_nodes_never_fail_the_job(job_factory):
    """b and c start together: either may be the standby. A worker failure of an active node (a
    counted restart) re-forms the same two; the third stays a standby and exits 0 with the job."""
    port = free_port()
    job = job_factory(fsm_flags(port))
    start_host_then(job, port, "b", "c", extra=("--max-restarts", "1"))
    assert wait_until(
        lambda: len({r["name"] for r in job.records()}) == 2 and any(standby_events(job, n) for n in "abc"), timeout=60
    ), job.diagnostics()
    first = {r["name"] for r in job.records()}
    (spare,) = set("abc") - first
    job.finish_next_world()
    crashed_at = job.crash(sorted(first)[0])
    codes = {name: job.agent(name).wait(60) for name in "abc"}
    assert codes == {"a": 0, "b": 0, "c": 0}, job.diagnostics()
    ran = {r["name"] for r in job.records()}
    assert ran == first and {r["group_world"] for r in job.records()} == {2}, job.records()
    assert sorted((r["name"], r["restart_count"]) for r in job.records() if r["ts"] >= crashed_at) == sorted(
        (name, 1) for name in first
    )
    event = standby_events(job, spare)[0]
    assert event["state"] == "INIT" and event["message"].startswith("standby: the job has 2 nodes")
    assert event["group_rank"] is None and all(w["pid"] is None for w in event["workers"])  # no workers
    assert len(standby_events(job, spare)) == 1
    assert job.transitions(spare) == NOT_NEEDED
    assert "standby: the job has 2 nodes" in (job.dir / f"agent_{spare}.err").read_text()
    for name in first:
        assert not standby_events(job, name)


def test_standby_takes_the_seat_of_a_sigkilled_node_without_a_restart(job_factory):
    port = free_port()
    job = job_factory(fsm_flags(port))
    start_host_then(job, port, "b")
    job.wait_for_world(2, {"a", "b"})
    job.start("c", "--status-port", "0")
    wait_for_standby(job, "c")
    # fsm-agent status shows the standby: INIT, no workers
    err = job.dir / "agent_c.err"
    assert wait_until(lambda: re.search(r"status at (http://\S+)/status", err.read_text()), timeout=30)
    url = re.search(r"status at (http://\S+)/status", err.read_text()).group(1)
    doc = json.loads(urllib.request.urlopen(url + "/status", timeout=10).read())
    assert doc["state"] == "INIT" and doc["standby"].startswith("standby: the job has 2 nodes"), doc
    assert doc["workers"] == []
    shown = subprocess.run(
        [sys.executable, "-m", "fsm_agent", "status", url], capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0 and "(standby)" in shown.stdout, shown.stdout + shown.stderr

    lost_at, took_s = job.kill_and_wait_for_the_standby("b", {"a", "c"})
    assert took_s < MARGIN_S
    assert job.transitions("a", since=lost_at) == AFTER_LOSS, job.diagnostics()
    assert job.first_transition("a", "membership_changed", lost_at)["failure_class"] == "node_lost"
    assert job.transitions("c") == PROMOTED, job.diagnostics()
    after = sorted((r["name"], r["group_world"], r["restart_count"]) for r in job.records() if r["ts"] >= lost_at)
    assert after == [("a", 2, 0), ("c", 2, 0)]
    assert all(e["restart_count"] == 0 for name in "ac" for e in job.events(name))


def test_standby_waits_while_the_previous_rounds_node_is_still_coming(job_factory):
    port = free_port()
    # b is stopped for PAUSE_S: a keep-alive of 2 s x 15 keeps it live (not lost) meanwhile
    job = job_factory(fsm_flags(port, "keep_alive_interval=2", "keep_alive_max_attempt=15"))
    pause_s = 6.0
    start_host_then(job, port, "b", extra=("--max-restarts", "1"))
    job.wait_for_world(2, {"a", "b"})
    job.start("c")
    wait_for_standby(job, "c")
    job.agent("b").send_signal(signal.SIGSTOP)  # a slow survivor: it does not re-join for pause_s
    try:
        crashed_at = job.crash("a")  # a's worker fails: a restart (counted), a new round opens
        assert wait_until(
            lambda: any(
                e["kind"] == "transition" and e["trigger"] == "workers_failed"
                for e in job.events("a")
                if e["ts"] >= crashed_at
            ),
            timeout=60,
        ), job.diagnostics()
        time.sleep(pause_s)
        assert not [r for r in job.records() if r["ts"] >= crashed_at], job.records()  # c was not seated
        job.finish_next_world()
    finally:
        job.agent("b").send_signal(signal.SIGCONT)
    job.wait_for_world(2, {"a", "b"}, since=crashed_at, running={"a", "b"})
    codes = {name: job.agent(name).wait(60) for name in "abc"}
    assert codes == {"a": 0, "b": 0, "c": 0}, job.diagnostics()
    assert not [r for r in job.records() if r["name"] == "c"]
    assert job.transitions("c") == NOT_NEEDED
    after = sorted((r["name"], r["group_world"]) for r in job.records() if r["ts"] >= crashed_at)
    assert after == [("a", 2), ("b", 2)]
