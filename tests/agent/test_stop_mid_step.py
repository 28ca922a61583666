"""A stop signal that comes while the agent is between two things.

A check command it runs (a health check, a node check's device command): the command's process
group is killed and the agent ends within a second or two, as docs/failure-handling.md's "Stop
signals" promises; before, the agent ended only when the command did (28 s for a ``sleep 30``),
past Slurm's usual 30 s KillWait. A restart's backoff after a worker failed: the signal is the
root cause of the summary, the failure is listed below it; before, the failure was named.
"""

from __future__ import annotations

import os
import signal
import textwrap
import time

import psutil
import pytest

from fsm_agent.testing.processes import wait_until

pytestmark = [pytest.mark.integration]

#: The check command: its shell's pid in a file (its process group: it runs in a session of its
#: own), then a wait far past the test's bound.
CHECK = "echo $$ > check.pid; exec sleep 60"

_RUNS_UNTIL_STOPPED = """
    import os, time
    open(f"ready_{os.environ['RANK']}", "w").close()
    time.sleep(600)
"""


@pytest.mark.parametrize(
    "check_args",
    [
        ["--health-check-command", CHECK, "--health-check-interval", "0.2", "--health-check-timeout", "120"],
        ["--node-check-device-command", CHECK, "--node-check-device-timeout", "120", "--node-check-timeout", "120"],
    ],
    ids=["health-check", "node-check"],
)
def test_a_stop_signal_kills_the_check_command_and_the_agent_ends_at_once(tmp_path, agents, check_args):
    (tmp_path / "w.py").write_text(textwrap.dedent(_RUNS_UNTIL_STOPPED))
    proc = agents.start("--standalone", "--nproc-per-node", "2", *check_args, "w.py")
    pid_file = tmp_path / "check.pid"
    assert wait_until(lambda: pid_file.exists() and pid_file.read_text().strip(), timeout=120), "no check ran"
    check_pid = int(pid_file.read_text())
    signalled = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=90)
    took = time.monotonic() - signalled
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert took < 15, f"the agent took {took:.1f} s to stop while its check command ran"
    assert not psutil.pid_exists(check_pid) or psutil.Process(check_pid).status() == psutil.STATUS_ZOMBIE
    assert "Traceback" not in err, err


def test_a_stop_during_a_restart_backoff_is_the_root_cause_and_the_failure_is_listed(tmp_path, agents):
    (tmp_path / "w.py").write_text(
        "import os, sys\nif os.environ['RANK'] == '0':\n    sys.exit(3)\nimport time\ntime.sleep(600)\n"
    )
    events = tmp_path / "e.jsonl"
    args = ["--max-restarts", "1", "--restart-backoff", "120", "--events-file", str(events), "w.py"]
    proc = agents.start("--standalone", "--nproc-per-node", "2", *args)
    assert wait_until(lambda: events.exists() and '"workers_failed"' in events.read_text(), timeout=120)
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    summary = err[err.index("Root Cause") :]
    cause, failures = summary.split("Failures:")
    assert "agent received signal 15 (SIGTERM)" in cause and "exitcode" not in cause, summary
    assert "exitcode  : 3" in failures, summary
