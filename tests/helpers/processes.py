"""Commands run to the end as subprocesses, each in a session of its own.

A command that outlives its timeout has its process group SIGKILLed (by pid, never by name) and
fails the test with its output; when the wait is interrupted (Ctrl-C), its group is killed before
the exception goes on.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

#: The checkout (its ``fsm_agent`` is the one a subprocess imports with ``pythonpath(CHECKOUT)``).
CHECKOUT = Path(__file__).resolve().parents[2]


def pythonpath(*folders: Path | str, env: Mapping[str, str] = os.environ) -> str:
    """A ``PYTHONPATH`` of ``folders`` first, then ``env``'s own ``PYTHONPATH`` (if any)."""
    return os.pathsep.join(filter(None, [*map(str, folders), env.get("PYTHONPATH")]))


def checkout_env(**extra: str) -> dict[str, str]:
    """This environment without PET_*/FSM_AGENT_* variables, this checkout first on ``PYTHONPATH``
    (a subprocess imports its ``fsm_agent``), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "FSM_AGENT_"))}
    env["PYTHONPATH"] = pythonpath(CHECKOUT, env=env)
    env.update(extra)
    return env


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def run_in_session(
    args: list[str],
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    cwd: Path | str | None = None,
) -> subprocess.CompletedProcess:
    """Run ``args`` to the end in a new session (stdin ``/dev/null``, stdout and stderr captured as
    text); the result also has the process's ``pid``. Past ``timeout`` seconds its process group
    is killed and an ``AssertionError`` with the output so far fails the test."""
    proc = subprocess.Popen(
        args,
        cwd=cwd,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, err = proc.communicate()
        raise AssertionError(
            f"{shlex.join(map(str, args))} did not finish within {timeout:g} s\n"
            f"--- stdout ---\n{out}\n--- stderr ---\n{err}"
        ) from None
    except BaseException:  # interrupted: nothing of it stays behind
        _kill_group(proc)
        proc.communicate()
        raise
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    done.pid = proc.pid
    return done


def run_fsm_agent(
    argv: list[str], env: Mapping[str, str] | None = None, cwd: Path | str | None = None, *, timeout: float = 240
) -> subprocess.CompletedProcess:
    """``python -m fsm_agent ARGV`` (any subcommand) to the end, with ``run_in_session``."""
    return run_in_session([sys.executable, "-m", "fsm_agent", *argv], env=env, cwd=cwd, timeout=timeout)


def run_cli(argv: list[str], cwd: Path, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m fsm_agent run ARGV`` in ``cwd`` from this checkout, without PET_/FSM_AGENT_ variables
    (plus ``env_extra``); its group is killed past 120 s (the fuzzers)."""
    return run_fsm_agent(["run", *argv], checkout_env(**(env_extra or {})), cwd, timeout=120)


def run_benchmark(script: str, args: list[str], tmp_path: Path, timeout: float) -> tuple[int, str]:
    """Run ``benchmarks/<script> <args>`` to the end with ``TMPDIR=tmp_path/tmp``: the benchmark
    passes it to every agent and worker it starts (see ``left_by_benchmark``). Returns its exit code
    and the tails of its output, for messages."""
    scratch = tmp_path / "tmp"
    scratch.mkdir(exist_ok=True)
    done = run_in_session(  # past the timeout, its whole group goes (the agents, the workers, the store)
        [sys.executable, str(CHECKOUT / "benchmarks" / script), *args],
        cwd=CHECKOUT,
        timeout=timeout,
        env={**os.environ, "TMPDIR": str(scratch)},
    )
    return done.returncode, f"stdout:\n{done.stdout[-6000:]}\nstderr:\n{done.stderr[-8000:]}"


def left_by_benchmark(tmp_path: Path) -> list[str]:
    """What a ``run_benchmark`` run left: processes whose TMPDIR lies under ``tmp_path`` (pid and
    command line), and the entries of its temporary directory."""
    import psutil

    found = [f"file {entry}" for entry in sorted((tmp_path / "tmp").iterdir())]
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and proc.environ().get("TMPDIR", "").startswith(str(tmp_path)):
                found.append(f"process {proc.pid} {' '.join(proc.cmdline())[:200]}")
        except (psutil.Error, OSError):
            continue
    return found
