"""End to end: the ``--log-dir`` layout, as torch writes it, and the ``@record`` error-file protocol.

torch's layout (``DefaultLogsSpecs``)::

    <log_dir>/<run_id>_<random>/attempt_<restart_count>/<local_rank>/{stdout.log, stderr.log, error.json}

fsm-agent writes the same tree, plus its own ``events.jsonl`` in the run directory.
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest

from tests.conftest import write_script
from tests.helpers.events import read_events

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

#: torch's @record; local rank 1 raises on the first attempt, everything else succeeds.
RECORD_FAIL_ONCE = r"""
import os, time
from torch.distributed.elastic.multiprocessing.errors import record

@record
def main():
    count = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    print("attempt %d rank %s run_id %s" % (count, os.environ["RANK"], os.environ["TORCHELASTIC_RUN_ID"]), flush=True)
    if os.environ["LOCAL_RANK"] == "1" and count == 0:
        # Raise only once rank 0 has printed: the restart stops it otherwise (same layout under both launchers).
        attempt_dir = os.path.dirname(os.path.dirname(os.environ["TORCHELASTIC_ERROR_FILE"]))
        peer = os.path.join(attempt_dir, "0", "stdout.log")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (os.path.exists(peer) and "run_id" in open(peer).read()):
            time.sleep(0.01)
        raise ValueError("boom-e2e from local rank 1")

main()
"""

#: Local rank 1 raises under @record; local rank 0 would run for a minute (the agent stops it).
RECORD_FAIL = r"""
import os, time
from torch.distributed.elastic.multiprocessing.errors import record

def inner_function_e2e():
    raise ValueError("boom-e2e from local rank 1")

@record
def main():
    print("error_file %s" % os.environ["TORCHELASTIC_ERROR_FILE"], flush=True)
    if os.environ["LOCAL_RANK"] == "1":
        inner_function_e2e()
    time.sleep(60)

main()
"""


def tree(run_dir: Path) -> set[str]:
    return {str(p.relative_to(run_dir)) for p in run_dir.rglob("*")}


def only_run_dir(log_dir: Path) -> Path:
    entries = list(log_dir.iterdir())
    assert len(entries) == 1 and entries[0].is_dir(), entries
    return entries[0]


def test_layout_matches_torchrun_with_a_restart(launcher):
    """Same flags, same @record script: fsm-agent's tree equals torchrun's (plus events.jsonl)."""
    script = write_script(launcher.dir, "record_fail_once.py", RECORD_FAIL_ONCE)
    flags = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "-r", "3"]
    torch_logs, fsm_logs = launcher.dir / "torch_logs", launcher.dir / "fsm_logs"
    launcher.torchrun(*flags, "--log-dir", torch_logs, script).wait().check()
    fsm = launcher.run_fsm(*flags, "--log-dir", fsm_logs, script).check()
    # The restart warning names the first failure, as torchrun's log line does.
    assert "workers failed (first: local_rank 1, rank 1, exitcode 1): restart 1 of 1" in fsm.stderr
    torch_run, fsm_run = only_run_dir(torch_logs), only_run_dir(fsm_logs)

    expected = {"attempt_0", "attempt_1", "attempt_0/1/error.json"} | {
        f"attempt_{a}/{lr}{leaf}" for a in (0, 1) for lr in (0, 1) for leaf in ("", "/stdout.log", "/stderr.log")
    }
    assert tree(torch_run) == expected
    assert tree(fsm_run) == expected | {"events.jsonl"}

    for attempt in (0, 1):
        for lr in (0, 1):
            stdout = (fsm_run / f"attempt_{attempt}/{lr}/stdout.log").read_text()
            assert stdout.startswith(f"attempt {attempt} rank {lr} run_id ")
            run_id = stdout.split("run_id ")[1].strip()
            assert fsm_run.name.startswith(run_id + "_")  # <run_id>_<random>
    error = json.loads((fsm_run / "attempt_0/1/error.json").read_text())
    torch_error = json.loads((torch_run / "attempt_0/1/error.json").read_text())
    assert set(error) == set(torch_error) == {"message"}
    assert set(error["message"]) == set(torch_error["message"])
    assert set(error["message"]["extraInfo"]) == set(torch_error["message"]["extraInfo"])
    assert error["message"]["message"] == "ValueError: boom-e2e from local rank 1"
    events = read_events(fsm_run / "events.jsonl")
    assert events[-1]["kind"] == "run_end" and events[-1]["exit_code"] == 0


def test_record_error_json_and_summary(launcher):
    """A worker failing under torch's @record: torch-format error.json at TORCHELASTIC_ERROR_FILE; the
    summary names it the root cause and shows its traceback; the worker the agent stopped is no failure."""
    script = write_script(launcher.dir, "record_fail.py", RECORD_FAIL)
    log_dir = launcher.dir / "logs"
    result = launcher.run_fsm(
        "--nproc-per-node", "2", "--log-dir", log_dir, "-r", "1", "--shutdown-timeout", "5", script
    )
    assert result.returncode == 1  # the root cause's exit code: an uncaught Python exception
    run_dir = only_run_dir(log_dir)
    error_file = run_dir / "attempt_0/1/error.json"
    assert (run_dir / "attempt_0/1/stdout.log").read_text() == f"error_file {error_file}\n"
    assert not (run_dir / "attempt_0/0/error.json").exists()

    data = json.loads(error_file.read_text())
    message = data["message"]
    assert message["message"] == "ValueError: boom-e2e from local rank 1"
    assert int(message["extraInfo"]["timestamp"]) > 0
    callstack = message["extraInfo"]["py_callstack"]
    assert callstack.startswith("Traceback (most recent call last):")
    assert "inner_function_e2e" in callstack

    summary = result.stderr
    assert "record_fail.py FAILED" in summary
    root = summary.split("Root Cause")[1]
    assert "ValueError: boom-e2e from local rank 1" in root
    assert "inner_function_e2e" in root and 'raise ValueError("boom-e2e from local rank 1")' in root
    assert str(error_file) in root
    assert "<NO_OTHER_FAILURES>" in summary


def test_without_log_dir_the_summary_says_the_error_file_is_gone(launcher):
    """The summary is printed after the temporary log dir is removed: it must not name a file as if it were there."""
    script = write_script(launcher.dir, "record_fail.py", RECORD_FAIL)
    result = launcher.run_fsm("--nproc-per-node", "2", "--shutdown-timeout", "5", script)
    assert result.returncode == 1
    root = result.stderr.split("Root Cause")[1].split("Failures:")[0]
    assert "ValueError: boom-e2e from local rank 1" in root and "inner_function_e2e" in root
    path = re.search(r"error_file: (\S+)", root).group(1)
    assert path.endswith("/attempt_0/1/error.json") and not os.path.exists(path)
    assert (
        f"error_file: {path} (removed at exit with the temporary log directory; its message and traceback "
        f"are above; --log-dir DIR keeps it)" in root
    )


def test_a_worker_killed_by_sigkill_gets_no_record_hint(launcher):
    """@record cannot catch SIGKILL: the summary says what killed it instead of suggesting @record."""
    script = write_script(launcher.dir, "killed.py", "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    result = launcher.run_fsm("--log-dir", launcher.dir / "logs", script)
    assert result.returncode == 128 + signal.SIGKILL
    root = result.stderr.split("Root Cause")[1]
    assert "exitcode  : -9 (SIGKILL)" in root
    assert (
        "traceback : none: killed by SIGKILL (the kernel's OOM killer sends it too: see dmesg), the worker could "
        "not record one"
    ) in root
    assert "@record" not in root


def test_layout_of_a_successful_run(launcher):
    """-r 3, no failure: logs hold the streams, no error.json, TORCHELASTIC_ERROR_FILE points into the tree."""
    log_dir = launcher.dir / "logs"
    result = launcher.run_fsm("--nproc-per-node", "2", "--log-dir", log_dir, "-r", "3", launcher.probe).check()
    assert "probe-out" not in result.stdout
    run_dir = only_run_dir(log_dir)
    assert tree(run_dir) == {
        "events.jsonl",
        "attempt_0",
        "attempt_0/0",
        "attempt_0/1",
        "attempt_0/0/stdout.log",
        "attempt_0/0/stderr.log",
        "attempt_0/1/stdout.log",
        "attempt_0/1/stderr.log",
    }
    for rank, record in launcher.records().items():
        lr = record["env"]["LOCAL_RANK"]
        assert record["env"]["TORCHELASTIC_ERROR_FILE"] == str(run_dir / "attempt_0" / lr / "error.json")
        assert run_dir.name.startswith(record["env"]["TORCHELASTIC_RUN_ID"] + "_")
        assert (run_dir / "attempt_0" / lr / "stdout.log").read_text() == f"probe-out rank={rank} local_rank={lr}\n"
    for line in (run_dir / "events.jsonl").read_text().splitlines():
        json.loads(line)


def test_log_dir_devnull_writes_nothing(launcher):
    """--log-dir /dev/null (torch's convention): no files at all and TORCHELASTIC_ERROR_FILE=""."""
    launcher.run_fsm("--log-dir", os.devnull, launcher.probe).check()
    assert launcher.records()[0]["env"]["TORCHELASTIC_ERROR_FILE"] == ""


#: Writes $FSM_E2E_OUT/ready_<RANK>, then sleeps (until the agent stops it).
SLEEPER = r"""
import os, time
open(os.path.join(os.environ["FSM_E2E_OUT"], "ready_" + os.environ["RANK"]), "w").close()
time.sleep(120)
"""

#: Fails on the first attempt, succeeds on the restart.
FAIL_ONCE = "import os, sys\nsys.exit(1 if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0' else 0)\n"


@pytest.mark.parametrize(
    "case",
    [
        # forkserver: multiprocessing's pymp-* directory goes at exit (atexit runs before os._exit)
        "success",
        "failure",
        "restart",
        "sigterm",
        "forkserver",
    ],
)
def test_an_agent_that_ends_leaves_nothing_in_its_temporary_directory(launcher, case):
    """Without --log-dir (and with --hang-timeout: a heartbeat directory too), an agent that succeeds,
    fails, restarts or is stopped by SIGTERM removes everything it made in TMPDIR on its way out.
    (An agent that is SIGKILLed cannot: the test harnesses give agents a TMPDIR of their own.)"""
    scratch = launcher.tmp  # this test's agent's TMPDIR
    assert list(scratch.iterdir()) == []
    flags = ["--nproc-per-node", "2", "--hang-timeout", "30"]
    if case == "sigterm":
        agent = launcher.fsm(*flags, write_script(launcher.dir, "sleeper.py", SLEEPER))
        for rank in (0, 1):
            launcher.wait_for_file(launcher.out / f"ready_{rank}")
        assert list(scratch.iterdir()), "the agent made nothing in TMPDIR: this test checks nothing"
        agent.send_signal(signal.SIGTERM)
        assert agent.wait().returncode == 128 + signal.SIGTERM
    elif case == "failure":
        assert launcher.run_fsm(*flags, write_script(launcher.dir, "fail.py", "raise SystemExit(3)\n")).returncode == 3
    elif case == "restart":
        launcher.run_fsm(*flags, "--max-restarts", "1", write_script(launcher.dir, "fail_once.py", FAIL_ONCE)).check()
    else:
        extra = ["--run-path", "--start-method", "forkserver"] if case == "forkserver" else []
        launcher.run_fsm(*flags, *extra, launcher.probe).check()
        assert sorted(launcher.records()) == [0, 1]
    assert sorted(p.name for p in scratch.iterdir()) == []


def test_redirected_output_without_a_log_dir_is_kept_and_named(launcher):
    """-r 3 and no --log-dir: the output exists only in the temporary dir, so the agent keeps it and says where."""
    script = write_script(launcher.dir, "say.py", "print('only in the file', flush=True)\n")
    result = launcher.run_fsm("--nproc-per-node", "2", "-r", "3", script).check()
    assert "only in the file" not in result.stdout
    kept = Path(re.search(r"kept in (\S+) \(no --log-dir was given\)", result.stderr).group(1))
    assert kept.parent.parent == launcher.tmp  # <TMPDIR>/fsm_agent_*/<run_id>_*
    for local_rank in (0, 1):
        assert (kept / f"attempt_0/{local_rank}/stdout.log").read_text() == "only in the file\n"
