"""Failure handling with real agents, workers and signals (docs/failure-handling.md, row by row)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from fsm_agent.testing.processes import wait_until
from tests.conftest import assert_excluded_node_left, free_port
from tests.helpers.events import read_events, transitions

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def write(path, body: str) -> str:
    path.write_text(textwrap.dedent(body))
    return str(path)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_sigterm_during_first_rendezvous_exits_143(tmp_path, agents):
    """--nnodes 2 with one agent: it waits in the rendezvous; SIGTERM ends it cleanly with 143."""
    script = write(tmp_path / "w.py", "print('never runs')\n")
    proc = agents.start(
        "--nnodes",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "--events-file",
        str(tmp_path / "e.jsonl"),
        script,
    )
    assert wait_until(lambda: (tmp_path / "e.jsonl").exists())  # the agent is built and about to rendezvous
    time.sleep(1)
    assert proc.poll() is None, proc.communicate()[1]
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 143, err
    assert "Traceback" not in err
    assert transitions(tmp_path / "e.jsonl") == [("INIT", "FAILED", "stop_requested")]


@pytest.mark.parametrize("cgroup", ["auto", "off"])
def test_daemonized_grandchild_is_swept(tmp_path, agents, cgroup):
    """Swept when the attempt ends: from the workers' cgroup, or (off) by the subreaper's sweep."""
    script = write(
        tmp_path / "w.py",
        """
        import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                open(f"daemon_{os.getpid()}", "w").close()
                time.sleep(300)
            os._exit(0)
        time.sleep(0.5)
    """,
    )
    proc = agents.start("--standalone", "--nproc-per-node", "1", script, env={"FSM_AGENT_WORKER_CGROUP": cgroup})
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert re.search(r"stopped \d leftover process\(es\) of the workers", err), err  # (off: its zombie parent too)
    daemons = [int(p.name.split("_")[1]) for p in tmp_path.glob("daemon_*")]
    assert daemons and wait_until(lambda: not any(alive(p) for p in daemons), 10), daemons
    for pid in daemons:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_each_worker_gets_the_full_grace_period(tmp_path, agents):
    """Both workers ignore SIGTERM for 1.5 s then exit; with --shutdown-timeout 4 both exit by themselves."""
    script = write(
        tmp_path / "w.py",
        """
        import os, signal, sys, time
        def on_term(signum, frame):
            time.sleep(1.5)
            open(f"graceful_{os.environ['RANK']}", "w").close()
            sys.exit(0)
        signal.signal(signal.SIGTERM, on_term)
        open(f"ready_{os.environ['RANK']}", "w").close()
        time.sleep(300)
    """,
    )
    proc = agents.start("--standalone", "--nproc-per-node", "2", "--shutdown-timeout", "4", script)
    assert wait_until(lambda: len(list(tmp_path.glob("ready_*"))) == 2)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == 143
    assert sorted(p.name for p in tmp_path.glob("graceful_*")) == ["graceful_0", "graceful_1"]


def test_forwarded_signal_reaches_workers_and_stops_nothing(tmp_path, agents):
    script = write(
        tmp_path / "w.py",
        """
        import os, signal, time
        got = []
        signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
        open(f"ready_{os.environ['RANK']}", "w").close()
        deadline = time.time() + 30
        while not got and time.time() < deadline:
            time.sleep(0.02)
        open(f"got_{os.environ['RANK']}_{bool(got)}", "w").close()
    """,
    )
    proc = agents.start("--standalone", "--nproc-per-node", "2", "--forward-signals", "SIGUSR1", script)
    assert wait_until(lambda: len(list(tmp_path.glob("ready_*"))) == 2)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert sorted(p.name for p in tmp_path.glob("got_*")) == ["got_0_True", "got_1_True"]


def test_nohup_keeps_sighup_ignored(tmp_path):
    """Started with SIGHUP ignored (as under nohup), a SIGHUP neither stops the agent nor the workers."""
    script = write(
        tmp_path / "w.py",
        """
        import os, time
        open(f"ready_{os.getpid()}", "w").close()
        time.sleep(2)
    """,
    )
    proc = subprocess.Popen(
        ["nohup", sys.executable, "-m", "fsm_agent", "run", "--standalone", script],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert wait_until(lambda: list(tmp_path.glob("ready_*")))
        proc.send_signal(signal.SIGHUP)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def test_hang_detected_within_timeout_with_stack_dump(tmp_path, agents):
    script = write(
        tmp_path / "w.py",
        """
        import os, time, fsm_agent
        for _ in range(10):
            fsm_agent.heartbeat(0.01)
            time.sleep(0.02)
        with open(f"last_beat_{os.environ['RANK']}", "w") as f:
            f.write(repr(time.time()))
        def stuck_in_collective():
            time.sleep(300)
        stuck_in_collective()
    """,
    )
    events = tmp_path / "events.jsonl"
    proc = agents.start(
        "--standalone",
        "--nproc-per-node",
        "1",
        "--hang-timeout",
        "2",
        "--log-dir",
        str(tmp_path / "logs"),
        "-r",
        "3",
        "--events-file",
        str(events),
        script,
    )
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 124, err  # a hang with no restart left
    hung = next(e for e in read_events(events) if e["kind"] == "transition" and e["trigger"] == "workers_hung")
    waited = hung["ts"] - float((tmp_path / "last_beat_0").read_text())
    # the timeout (less the few ms between the last heartbeat and writing last_beat), plus a generous margin
    assert 1.8 <= waited <= 2.0 + 3.0, waited
    stderr_log = next((tmp_path / "logs").glob("*/attempt_0/0/stderr.log")).read_text()
    stacks = next((tmp_path / "logs").glob("*/attempt_0/0/stacks.txt"), None)
    dump = (stacks.read_text() if stacks else "") + stderr_log
    assert "stuck_in_collective" in dump
    assert "class     : hang" in err
    if shutil.which("py-spy") is None:  # faulthandler's dump on the agent's signal, announced first; no abort
        note = "the stacks that follow are dumped on the agent's request"
        assert note in err and note in stderr_log
        assert stderr_log.index(note) < stderr_log.index("most recent call first")
        assert "Fatal Python error" not in stderr_log
        assert stacks is not None and "stuck_in_collective" in stacks.read_text()


def test_do_not_restart_exit_code_is_honoured(tmp_path, agents):
    script = write(tmp_path / "w.py", "import sys; sys.exit(78)\n")
    events = tmp_path / "events.jsonl"
    proc = agents.start("--standalone", "--max-restarts", "3", "--events-file", str(events), script)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 78
    assert transitions(events) == [("INIT", "HEALTHY", "start"), ("HEALTHY", "FAILED", "workers_failed")]
    assert "do not restart" in err


def test_backoff_delays_are_observed(tmp_path, agents):
    script = write(tmp_path / "w.py", "import sys; sys.exit(1)\n")
    events = tmp_path / "events.jsonl"
    proc = agents.start(
        "--standalone", "--max-restarts", "2", "--restart-backoff", "1", "--events-file", str(events), script
    )
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    stops = [e for e in read_events(events) if e["kind"] == "transition"]
    waits = [b["ts"] - a["ts"] for a, b in zip(stops, stops[1:]) if a["dest"] == "STOPPED"]
    # restart n waits 1 * 2**n * U[0.5, 1.5): at least 0.5 s then at least 1 s
    assert len(waits) == 2 and waits[0] >= 0.5 and waits[1] >= 1.0, waits


def test_no_exit_barrier_wait_after_a_peer_fails(tmp_path, agents):
    """Node 1's worker fails (no restarts); node 0's worker succeeds: node 0 leaves the barrier at
    once, and ends with the job's verdict (node 1's code), not with 0: the job failed."""
    script = write(
        tmp_path / "w.py",
        """
        import os, sys, time
        if os.environ["GROUP_RANK"] == "1":
            time.sleep(1)
            sys.exit(5)
    """,
    )
    port = free_port()
    common = [
        "--nnodes",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "xb",
        "--local-addr",
        "127.0.0.1",
        "--exit-barrier-timeout",
        "120",
    ]
    a = agents.start(*common, script)
    b = agents.start(*common, script)
    started = time.monotonic()
    outs = [p.communicate(timeout=150) for p in (a, b)]
    elapsed = time.monotonic() - started
    assert [a.returncode, b.returncode] == [5, 5], outs
    assert elapsed < 60, f"a node waited {elapsed:.0f}s in the exit barrier"  # torchrun: the full timeout


def test_endpoint_held_by_another_program_fails_fast(tmp_path, agents):
    """The c10d endpoint's port is held by an unrelated listener: a clear error, no long hang."""
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    port = squatter.getsockname()[1]
    try:
        script = write(tmp_path / "w.py", "print('never')\n")
        proc = agents.start(
            "--nnodes",
            "2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-conf",
            "read_timeout=5",
            script,
        )
        started = time.monotonic()
        out, err = proc.communicate(timeout=120)
        assert proc.returncode != 0
        assert f"127.0.0.1:{port}" in err
        assert "Traceback" not in err
        assert time.monotonic() - started < 60
    finally:
        squatter.close()


def test_health_check_command_fails_the_node_and_the_group_restarts(tmp_path, agents):
    """--health-check-command: a failing check fails every local worker (class health_check) and the
    restart policy restarts the group; the check here fails once (it removes its flag file)."""
    script = write(
        tmp_path / "w.py",
        """
        import os, sys, time
        open(f"started.{os.environ['TORCHELASTIC_RESTART_COUNT']}.{os.environ['LOCAL_RANK']}", "w").close()
        if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            time.sleep(120)
    """,
    )
    events = tmp_path / "events.jsonl"
    proc = agents.start(
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--events-file",
        str(events),
        "--health-check-command",
        "! test -e sick || { rm sick; echo 'GPU 0 fell off the bus' >&2; false; }",
        "--health-check-interval",
        "0.2",
        script,
    )
    assert wait_until(lambda: all((tmp_path / f"started.0.{r}").exists() for r in (0, 1)))
    (tmp_path / "sick").touch()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert transitions(events) == [
        ("INIT", "HEALTHY", "start"),
        ("HEALTHY", "UNHEALTHY", "health_check_failed"),
        ("UNHEALTHY", "STOPPED", "workers_failed"),
        ("STOPPED", "HEALTHY", "restart"),
        ("HEALTHY", "SUCCEEDED", "workers_succeeded"),
    ]
    failed = next(e for e in read_events(events) if e.get("trigger") == "workers_failed")
    assert failed["failure_class"] == "health_check"
    assert "health check failed: `! test -e sick" in err and "GPU 0 fell off the bus" in err


def test_excluded_node_leaves_and_the_other_continues(tmp_path, agents):
    """Two nodes (fsm backend, --nnodes 1:2); node B's health check fails with --exclude-node-on
    health_check: B ends FAILED with the verdict and exit 69, A re-rendezvouses alone and succeeds
    without spending a restart (the loss of a node is a membership change)."""
    script = write(
        tmp_path / "w.py",
        """
        import os, time
        open(f"started.{os.environ['WORLD_SIZE']}.{os.environ['RANK']}", "w").close()
        if os.environ["WORLD_SIZE"] == "2":
            time.sleep(120)  # both nodes: train until one of them is taken out
    """,
    )
    port = free_port()
    common = [
        "--nnodes",
        "1:2",
        "--rdzv-backend",
        "fsm",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "ex",
        "--local-addr",
        "127.0.0.1",
        "--rdzv-conf",
        "last_call_timeout=1",
    ]
    a = agents.start(*common, "--events-file", str(tmp_path / "a.jsonl"), script)
    b = agents.start(
        *common,
        "--events-file",
        str(tmp_path / "b.jsonl"),
        "--exclude-node-on",
        "health_check",
        "--health-check-command",
        "! test -e sick",
        "--health-check-interval",
        "0.2",
        script,
    )
    assert wait_until(lambda: all((tmp_path / f"started.2.{r}").exists() for r in (0, 1)), timeout=90)
    (tmp_path / "sick").touch()
    out_b, err_b = b.communicate(timeout=60)
    out_a, err_a = a.communicate(timeout=90)
    assert b.returncode == 69, err_b
    assert "Verdict: health_check on rank" in err_b and "this node leaves the job" in err_b
    assert a.returncode == 0, err_a
    assert_excluded_node_left(tmp_path / "b.jsonl", tmp_path / "a.jsonl")
