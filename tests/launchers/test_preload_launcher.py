"""The preload launcher: workers forked from a zygote that imported the heavy modules once."""

from __future__ import annotations

import json
import os
import signal
import textwrap
import time

import psutil
import pytest

from fsm_agent.testing.processes import wait_until
from tests.helpers.events import read_events, transitions

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def write(path, body: str) -> str:
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_script_sees_what_python_u_script_would(tmp_path, agents):
    script = write(
        tmp_path / "w.py",
        """
        import json, os, sys
        import json as again  # modules the zygote preloaded are importable as usual
        if __name__ == "__main__":
            with open(f"seen_{os.environ['RANK']}.json", "w") as f:
                json.dump({"argv": sys.argv, "cwd": os.getcwd(), "sid": os.getsid(0) == os.getpid(),
                           "rank": os.environ["RANK"], "preloaded": "json" in sys.modules}, f)
    """,
    )
    proc = agents.start(
        "--standalone",
        "--nproc-per-node",
        "2",
        "--launcher",
        "preload",
        "--preload-modules",
        "json",
        script,
        "--flag",
        "x${local_rank}",
    )
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    seen = [json.loads((tmp_path / f"seen_{r}.json").read_text()) for r in "01"]
    assert [s["argv"] for s in seen] == [[script, "--flag", "x0"], [script, "--flag", "x1"]]
    assert all(s["cwd"] == str(tmp_path) and s["sid"] and s["preloaded"] for s in seen)


@pytest.mark.parametrize(
    "body, code",
    [
        ("import sys; sys.exit(7)", 7),
        ("raise ValueError('boom')", 1),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", 137),
    ],
)
def test_exit_codes_reach_the_agent(tmp_path, agents, body, code):
    script = write(tmp_path / "w.py", body + "\n")
    proc = agents.start("--standalone", "--launcher", "preload", "--preload-modules", "json", script)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err


def test_restart_skips_the_import(tmp_path, agents):
    """Attempt 0's rank 1 fails; attempt 1 runs from the same zygote and succeeds."""
    script = write(
        tmp_path / "w.py",
        """
        import os, sys
        if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1":
            sys.exit(3)
        open(f"done_{os.environ['RANK']}_{os.environ['TORCHELASTIC_RESTART_COUNT']}", "w").close()
    """,
    )
    events = tmp_path / "e.jsonl"
    proc = agents.start(
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--launcher",
        "preload",
        "--preload-modules",
        "json",
        "--events-file",
        str(events),
        script,
    )
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert {p.name for p in tmp_path.glob("done_*_1")} == {"done_0_1", "done_1_1"}
    assert [t[2] for t in transitions(events)] == ["start", "workers_failed", "restart", "workers_succeeded"]


def test_module_and_binary_entrypoints(tmp_path, agents):
    (tmp_path / "mymod.py").write_text("import os\nopen('module_ran', 'w').close()\n")
    proc = agents.start(
        "--standalone",
        "--launcher",
        "preload",
        "--preload-modules",
        "json",
        "-m",
        "mymod",
        env={"PYTHONPATH": str(tmp_path)},
    )
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and (tmp_path / "module_ran").exists(), err
    proc = agents.start(
        "--standalone", "--launcher", "preload", "--preload-modules", "json", "--no-python", "touch", "binary_ran"
    )
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and (tmp_path / "binary_ran").exists(), err


def test_python_with_interpreter_options_runs_as_given(tmp_path, agents):
    """``--no-python python -c CODE``: the interpreter's own options are not mistaken for a script."""
    import sys

    proc = agents.start(
        "--standalone",
        "--launcher",
        "preload",
        "--preload-modules",
        "json",
        "--no-python",
        sys.executable,
        "-c",
        "open('c_ran', 'w').close()",
    )
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and (tmp_path / "c_ran").exists(), err


def test_the_import_is_reported_apart_from_the_agent(tmp_path, agents):
    """The zygote's import time: one ``launcher_timings`` event (after the first start, before HEALTHY)
    and the metrics ``fsm_agent.launcher.preload_import_s`` / ``preload_wait_s``."""
    script = write(
        tmp_path / "w.py", "import os, sys\nsys.exit(3 if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0' else 0)\n"
    )
    events = tmp_path / "e.jsonl"
    proc = agents.start(
        "--standalone",
        "--max-restarts",
        "1",
        "--launcher",
        "preload",
        "--preload-modules",
        "json",
        "--events-file",
        str(events),
        script,
        env={"LOGLEVEL": "INFO"},
    )
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    timings = [r for r in read_events(events) if r["kind"] == "launcher_timings"]
    assert len(timings) == 1, "one zygote, one import: a restart reports nothing new"
    assert timings[0]["preload_import_s"] >= 0 and timings[0]["preload_wait_s"] >= 0
    assert timings[0]["restart_count"] == 0 and timings[0]["state"] == "INIT"
    assert "[metric][fsm_agent]: launcher.preload_import_s=" in err
    assert "[metric][fsm_agent]: launcher.preload_wait_s=" in err


_TWO_PRELOADED_WORKERS = ["--standalone", "--nproc-per-node", "2", "--launcher", "preload", "--preload-modules", "json"]
_RUNS_UNTIL_STOPPED = """
    import os, sys, time
    if os.environ["TORCHELASTIC_RESTART_COUNT"] != "0":
        sys.exit(0)
    open(f"ready_{os.environ['RANK']}", "w").close()
    time.sleep(600)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_agents_process_group_stops_the_workers_at_once(tmp_path, agents, sig):
    """Slurm's scancel, a terminal's Ctrl-C and ``kill -TERM -PGID`` signal the agent's whole process
    group, zygote included. The zygote stays to report the stopped workers' exits: before, it died
    with the signal, the agent never heard of them and waited its 30 s stop timeout, then 10 s more."""
    write(tmp_path / "w.py", _RUNS_UNTIL_STOPPED)
    proc = agents.start(*_TWO_PRELOADED_WORKERS, "w.py")
    assert wait_until(lambda: len(list(tmp_path.glob("ready_*"))) == 2, timeout=120), "workers never started"
    signalled = time.monotonic()
    os.killpg(proc.pid, sig)
    out, err = proc.communicate(timeout=60)
    took = time.monotonic() - signalled
    assert proc.returncode != 0 and f"agent received signal {int(sig)}" in err, err
    assert took < 20, f"the agent took {took:.1f} s to stop its workers after {sig.name}"


@pytest.mark.parametrize("import_ends", [True, False], ids=["import-ends", "import-never-ends"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_the_zygote_imports_ends_the_agent_at_once(tmp_path, agents, sig, import_ends):
    """The stop comes after the rendezvous, while the zygote still imports (a module that waits for
    the test's go). The agent does not wait for the import (a torch import from a network file
    system can take minutes; before, it waited up to 120 s, then started workers and stopped them);
    and should the workers start before it looks, a stop that comes right after a fork must not
    meet the zygote's ignore in the new process (seen: the agent then waited its 30 s stop timeout)."""
    (tmp_path / "slowmod.py").write_text("import os, time\nwhile not os.path.exists('go'):\n    time.sleep(0.05)\n")
    write(tmp_path / "w.py", _RUNS_UNTIL_STOPPED)
    args = [a if a != "json" else "slowmod" for a in _TWO_PRELOADED_WORKERS]
    path = os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])
    proc = agents.start(*args, "w.py", env={"PYTHONPATH": path, "LOGLEVEL": "INFO"})
    seen = []
    while not any("rendezvous complete" in line for line in seen[-1:]):  # then it waits for the zygote
        seen.append(proc.stderr.readline())
        assert seen[-1], "the agent ended before its rendezvous completed:\n" + "".join(seen)
    signalled = time.monotonic()
    os.killpg(proc.pid, sig)
    if import_ends:
        (tmp_path / "go").touch()
    out, err = proc.communicate(timeout=60)
    took = time.monotonic() - signalled
    assert proc.returncode == 128 + int(sig), "".join(seen) + err
    assert took < 20, f"the agent took {took:.1f} s to stop after {sig.name}"


def test_a_lost_zygote_fails_its_workers_and_the_restart_forks_from_a_new_one(tmp_path, agents):
    """The zygote killed while its workers run (the OOM killer, a stray kill): its workers die with it,
    the agent sees them fail, with their exit codes, and restarts from a new zygote. Before, the
    agent never learned of the exits and spun on the closed socket."""
    write(tmp_path / "w.py", _RUNS_UNTIL_STOPPED)
    events = tmp_path / "e.jsonl"
    proc = agents.start(*_TWO_PRELOADED_WORKERS, "--max-restarts", "1", "--events-file", str(events), "w.py")
    assert wait_until(lambda: len(list(tmp_path.glob("ready_*"))) == 2, timeout=120), "workers never started"
    (zygote,) = [p for p in psutil.Process(proc.pid).children() if "zygote.py" in " ".join(p.cmdline())]
    zygote.kill()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert f"the zygote (pid {zygote.pid}) exited with code -9" in err
    assert [t[2] for t in transitions(events)] == ["start", "workers_failed", "restart", "workers_succeeded"]
    failed = next(r for r in read_events(events) if r.get("trigger") == "workers_failed")
    assert "SIGKILL" in json.dumps(failed) or "-9" in json.dumps(failed), failed
