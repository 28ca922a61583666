"""Drain on loopback: real agents and workers, a drain asked by a signal, a file or ``POST /drain``.

Each worker writes a checkpoint file when it gets the drain's checkpoint signal (SIGUSR1) and
exits 0; the agent exits with ``DRAIN_EXIT_CODE`` (75, requeue), records a ``drain`` event and
spends no restart.
"""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from fsm_agent.testing.processes import wait_until
from fsm_agent.worker import DRAIN_EXIT_CODE
from tests.conftest import free_port, one_error_line
from tests.helpers.events import read_events, transitions

pytestmark = pytest.mark.integration

#: argv: OUT_DIR. Records its start, then waits; SIGUSR1 (the checkpoint signal) writes
#: ckpt_<rank>.json and exits 0.
WORKER = r"""
import json, os, signal, sys, time
out, rank = sys.argv[1], os.environ["RANK"]

def checkpoint(signum, frame):
    path = os.path.join(out, "ckpt_%s.json" % rank)
    with open(path + ".tmp", "w") as f:
        json.dump({"rank": int(rank), "signal": signum, "pid": os.getpid()}, f)
    os.replace(path + ".tmp", path)
    sys.exit(0)

signal.signal(signal.SIGUSR1, checkpoint)
open(os.path.join(out, "start_%s" % rank), "w").close()
while True:
    time.sleep(1)
"""
NPROC = 2
#: Generous bounds for a loaded 2-core machine (a drain here takes well under a second).
START_TIMEOUT_S = 120
END_TIMEOUT_S = 120


def _start(agent_processes, tmp_path: Path, *flags: str):
    (tmp_path / "worker.py").write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    events = tmp_path / "events.jsonl"
    proc = agent_processes.start(
        "--standalone",
        "--nproc-per-node",
        str(NPROC),
        "--max-restarts",
        "3",
        "--events-file",
        str(events),
        "--drain-timeout",
        "60",
        *flags,
        "worker.py",
        str(out),
    )
    started = wait_until(
        lambda: len(list(out.glob("start_*"))) == NPROC or proc.poll() is not None, timeout=START_TIMEOUT_S
    )
    if not started or proc.poll() is not None:
        _, err = proc.communicate(timeout=END_TIMEOUT_S)
        pytest.fail(f"workers did not start: rc={proc.poll()}\n{err}")
    return proc, out, events


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5):
            return True
    except OSError:
        return False


def _assert_drained(proc, out: Path, events: Path, source: str) -> str:
    _, err = proc.communicate(timeout=END_TIMEOUT_S)
    assert proc.returncode == DRAIN_EXIT_CODE, err
    checkpoints = sorted(json.loads(p.read_text())["rank"] for p in out.glob("ckpt_*.json"))
    assert checkpoints == list(range(NPROC)), err  # every worker completed its checkpoint
    assert transitions(events) == [("INIT", "HEALTHY", "start"), ("HEALTHY", "FAILED", "drain_requested")]
    records = read_events(events)
    (drain,) = [e for e in records if e["kind"] == "drain"]
    assert drain["source"] == source and drain["scope"] == "node", drain
    assert drain["checkpointed"] is True and drain["exits"] == {"0": 0, "1": 0}, drain
    assert drain["checkpoint_signal"] == "SIGUSR1"
    assert all(e["restart_count"] == 0 for e in records)  # the restart budget is untouched
    (change,) = [e for e in records if e["kind"] == "transition" and e["trigger"] == "drain_requested"]
    assert "failure_class" not in change and change["drain_scope"] == "node", change
    assert "DRAINED (node scope)" in err and f"requeue (exit code {DRAIN_EXIT_CODE})" in err, err
    return err


def test_drain_by_signal_checkpoints_and_exits_with_the_requeue_code(agent_processes, tmp_path):
    proc, out, events = _start(agent_processes, tmp_path, "--drain-signals", "SIGUSR2")
    proc.send_signal(signal.SIGUSR2)
    err = _assert_drained(proc, out, events, "signal")
    assert "requested by signal SIGUSR2" in err


def test_drain_by_file_checkpoints_and_exits_with_the_requeue_code(agent_processes, tmp_path):
    mark = tmp_path / "drain-me"
    proc, out, events = _start(agent_processes, tmp_path, "--drain-file", str(mark))
    mark.write_text("maintenance\n")
    err = _assert_drained(proc, out, events, "file")
    assert f"requested by file {mark}" in err


def test_drain_by_http_post_checkpoints_and_exits_with_the_requeue_code(agent_processes, tmp_path):
    port = free_port()
    proc, out, events = _start(agent_processes, tmp_path, "--status-port", str(port))
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(urllib.error.HTTPError) as bad:  # an unknown scope is refused, nothing drains
        urllib.request.urlopen(urllib.request.Request(f"{url}/drain?scope=rack", method="POST"), timeout=30)
    assert bad.value.code == 400
    with urllib.request.urlopen(urllib.request.Request(f"{url}/drain", data=b"", method="POST"), timeout=30) as reply:
        assert reply.status == 202
        answer = json.loads(reply.read())
    assert answer["drain"]["source"] == "http" and answer["drain"]["by"] == "127.0.0.1", answer
    err = _assert_drained(proc, out, events, "http")
    assert "requested by http 127.0.0.1" in err


@pytest.mark.parametrize("backend", ["c10d", "fsm"])
def test_drain_while_waiting_for_the_other_nodes_leaves_at_once(agent_processes, tmp_path, backend):
    """``--nnodes 2`` and no second node: the agent waits in its first rendezvous (c10d: a store call
    in a helper thread; fsm: Python waits in the agent's thread). A drain signal ends the wait:
    exit 75 long before the join timeout, no worker ever started, no restart."""
    (tmp_path / "worker.py").write_text(WORKER)
    events = tmp_path / "events.jsonl"
    port = free_port()
    proc = agent_processes.start(
        "--nnodes",
        "2",
        "--rdzv-backend",
        backend,
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "--rdzv-id",
        "drain-waiting",
        "--rdzv-conf",
        "join_timeout=600",
        "--events-file",
        str(events),
        "--drain-signals",
        "SIGUSR2",
        "--status-port",
        str(port),
        "worker.py",
        str(tmp_path),
    )
    assert wait_until(
        lambda: proc.poll() is not None or _answers(f"http://127.0.0.1:{port}/healthz"), timeout=START_TIMEOUT_S
    )
    time.sleep(2)  # the status server starts just before the run: let the agent reach its join
    assert proc.poll() is None, proc.communicate()[1]
    proc.send_signal(signal.SIGUSR2)
    _, err = proc.communicate(timeout=END_TIMEOUT_S)
    assert proc.returncode == DRAIN_EXIT_CODE, err
    assert transitions(events) == [("INIT", "FAILED", "drain_requested")], err
    assert not list(tmp_path.glob("start_*"))


def test_a_drain_signal_that_is_also_a_stop_signal_is_a_one_line_error(agent_processes, tmp_path):
    (tmp_path / "worker.py").write_text(WORKER)
    done = agent_processes.run(
        "--standalone", "--drain-signals", "SIGTERM", "worker.py", str(tmp_path), timeout=END_TIMEOUT_S
    )
    assert done.returncode == 2, done.stderr
    line = one_error_line(done.stderr)
    assert "--drain-signals SIGTERM: SIGTERM is both a drain signal and in --signals-to-handle" in line, line
    assert "give --drain-signals another signal" in line and "--disable-plugin" not in line, line


def test_early_handlers_keep_a_drain_signal_for_the_agent(tmp_path):
    """Before the options are read, ``fsmrun --drain-signals USR2`` keeps SIGUSR2 for the agent
    instead of dying of its default action."""
    import subprocess
    import sys

    code = (
        "import os, signal, sys; sys.argv = ['fsmrun', '--drain-signals', 'USR2', 'train.py']\n"
        "from fsm_agent import _early_signals as early\n"
        "early.install(); os.kill(os.getpid(), signal.SIGUSR2); print(early.take_early_drain())"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == str(int(signal.SIGUSR2)), done.stderr


def test_job_wide_drain_of_two_fsm_nodes_on_loopback(agent_processes, tmp_path):
    """Two agents of one job (backend ``fsm``, 127.0.0.1): ``--drain-scope job`` on node 0 and its
    drain signal: both nodes' workers checkpoint and both agents exit 75 (node 1 learnt it from the
    rendezvous store: source ``peer``)."""
    (tmp_path / "worker.py").write_text(WORKER)
    port = free_port()
    procs, outs, events = [], [], []
    for node in range(2):
        out = tmp_path / f"out{node}"
        out.mkdir()
        outs.append(out)
        events.append(tmp_path / f"events{node}.jsonl")
        procs.append(
            agent_processes.start(
                "--nnodes",
                "2",
                "--nproc-per-node",
                str(NPROC),
                "--rdzv-backend",
                "fsm",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                "drain-job",
                "--local-addr",
                "127.0.0.1",
                "--events-file",
                str(events[node]),
                *(["--drain-signals", "SIGUSR2", "--drain-scope", "job"] if node == 0 else []),
                "worker.py",
                str(out),
            )
        )
    assert wait_until(
        lambda: all(len(list(o.glob("start_*"))) == NPROC for o in outs) or any(p.poll() is not None for p in procs),
        timeout=START_TIMEOUT_S,
    )
    assert all(p.poll() is None for p in procs), [p.communicate()[1] for p in procs if p.poll() is not None]
    procs[0].send_signal(signal.SIGUSR2)
    errs = [p.communicate(timeout=END_TIMEOUT_S)[1] for p in procs]
    assert [p.returncode for p in procs] == [DRAIN_EXIT_CODE, DRAIN_EXIT_CODE], errs
    checkpointed = [sorted(json.loads(p.read_text())["rank"] for p in out.glob("ckpt_*.json")) for out in outs]
    assert sorted(checkpointed) == [[0, 1], [2, 3]], errs  # every worker of the job (global ranks)
    drains = [[e for e in read_events(path) if e["kind"] == "drain"][0] for path in events]
    assert [(d["scope"], d["source"], d["checkpointed"]) for d in drains] == [
        ("job", "signal", True),
        ("job", "peer", True),
    ], drains
