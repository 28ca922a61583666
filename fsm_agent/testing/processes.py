"""AgentProcesses: real ``fsm-agent`` processes for end-to-end tests, always cleaned up.

Each agent starts in its own session (so it leads a process group); ``kill_all`` SIGKILLs every
group it started (never by name) and reaps the agents. The ``agent_processes`` fixture of the
test kit yields one and cleans up after the test; elsewhere (a module-scoped fixture, a helper)
use it as a context manager, which calls ``kill_all`` on the way out::

    with AgentProcesses(tmp_path) as agents:
        done = agents.run("--standalone", "--nproc-per-node", "2", "train.py", timeout=240)
    assert done.returncode == 0, done.stderr

Every agent's ``TMPDIR`` is a directory of the AgentProcesses' own that ``kill_all`` removes:
what a SIGKILLed agent cannot remove goes with it. Harnesses of their own (that start agents
some other way, or kill every process of a job by pid) use ``tmpdir_env``, ``is_cgroup_keeper``
and ``remove_worker_cgroups`` to leave nothing behind either.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from fsm_agent.stack_dump import running


def wait_until(predicate: Callable[[], object], timeout: float = 60.0, interval: float = 0.05) -> bool:
    """Call ``predicate`` every ``interval`` seconds until it is true or ``timeout`` seconds have
    passed; return whether it became true (it is asked once more at the deadline)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def tmpdir_env(directory: Path | str) -> dict[str, str]:
    """Make ``directory`` and return ``{"TMPDIR": directory}``, for the environment of a started agent.

    Without ``--log-dir`` an agent makes its log directory (``fsm_agent_*``) in the temporary
    directory, and always its heartbeat directory (``fsm_agent_hb_*``); it removes both on its way
    out, but an agent that is SIGKILLed (or dies of any signal it does not handle) cannot. With
    ``TMPDIR`` in the test's ``tmp_path`` (or in a directory the test removes) they go with it, as
    does whatever its workers (or a torchrun started for comparison: ``torchelastic_*``, which
    torchrun never removes) put in the temporary directory. Keep the path short where workers use
    multiprocessing's forkserver (``--start-method forkserver``): its socket,
    ``<TMPDIR>/pymp-*/listener-*``, needs a path of at most 107 bytes.
    """
    Path(directory).mkdir(parents=True, exist_ok=True)
    return {"TMPDIR": str(directory)}


def is_cgroup_keeper(cmdline: Sequence[str]) -> bool:
    """Whether ``cmdline`` is that of an agent's cgroup keeper (``python -I -S .../containment.py --keep DIR``).

    A cleanup that kills every process of a job by pid should let the keepers finish first: once
    its agent is gone a keeper kills and removes the workers' cgroup, and a keeper killed before
    it is done leaves that cgroup behind (see ``remove_worker_cgroups``).
    """
    return "--keep" in cmdline and any(os.path.basename(arg) == "containment.py" for arg in cmdline)


def remove_worker_cgroups(agent_pids: Iterable[int], timeout: float = 5.0) -> list[str]:
    """Kill the processes in, and remove, the worker cgroups the agents ``agent_pids`` left behind.

    An agent's workers live in ``fsm-agent-<agent pid>-<random>``, a child of the agent's cgroup;
    the agent removes it on its way out, its keeper when the agent dies (SIGKILL included). Only a
    keeper that was killed too (by pid, before it was done) leaves it: call this once the agents
    are reaped and their keepers had their chance. Agents are looked up in this process's cgroup
    (theirs, unless something moved them); a pid that is alive again is no longer the agent's.

    Returns:
        the paths of the cgroups that were still there (each removed, unless still busy after ``timeout`` s).
    """
    from fsm_agent.plugins.containment import PREFIX, WorkerCgroup, cgroup_dir

    parent = cgroup_dir()
    if parent is None:
        return []
    found = []
    for pid in sorted(set(agent_pids)):
        if running(pid):
            continue
        for path in sorted(glob.glob(os.path.join(glob.escape(parent), f"{PREFIX}{pid}-*"))):
            cgroup = WorkerCgroup(path)
            cgroup.kill()
            cgroup.remove(timeout)
            found.append(path)
    return found


class AgentProcesses:
    """Start ``python -m fsm_agent <command> ARGS`` processes in ``cwd``; kill their groups at the end.

    Args:
        cwd: working directory of every agent (workers write relative files there).
        command: the subcommand words put before each call's arguments (default ``("run",)``;
            ``()`` to name the subcommand in each call: ``run("plugins", "--json")``).
        env: the base environment (default: this process's); ``start(env=...)`` adds to it.

    Attributes:
        tmp_dir: every agent's ``TMPDIR`` (unless ``start(env=...)`` sets one): a fresh temporary
            directory, made by the first ``start`` and removed by ``kill_all`` once the agents are
            reaped. What an agent SIGKILLed (by ``kill_all`` or by the test) cannot remove, its
            temporary log and heartbeat directories, goes with it (see ``tmpdir_env``).
    """

    def __init__(self, cwd: Path | str, command: tuple[str, ...] = ("run",), env: dict[str, str] | None = None):
        self.cwd, self.command, self.env = Path(cwd), tuple(command), env
        self.procs: list[subprocess.Popen] = []
        self.tmp_dir: Path | None = None

    def start(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start one agent; stdout and stderr are pipes (use ``proc.communicate(timeout=...)``)."""
        base = dict(os.environ) if self.env is None else dict(self.env)
        if self.tmp_dir is None:
            self.tmp_dir = Path(tempfile.mkdtemp(prefix="fsm_agent_processes_"))
        proc = subprocess.Popen(
            [sys.executable, "-m", "fsm_agent", *self.command, *args],
            cwd=self.cwd,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            env={**base, **tmpdir_env(self.tmp_dir), **(env or {})},
        )
        self.procs.append(proc)
        return proc

    def run(self, *args: str, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """Start one agent (as ``start``) and wait for it: its exit code, stdout and stderr.

        Like ``subprocess.run``: an agent still running after ``timeout`` seconds has its process
        group SIGKILLed and reaped, then ``subprocess.TimeoutExpired`` (with the output so far) is raised.
        """
        proc = self.start(*args, env=env)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._kill(proc)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(proc.args, timeout, output=out, stderr=err) from None
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def kill_all(self) -> None:
        """SIGKILL every started agent's process group, reap the agents and remove ``tmp_dir``."""
        for proc in self.procs:
            self._kill(proc)
            proc.communicate()
        if self.tmp_dir is not None:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
            self.tmp_dir = None

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    def __enter__(self) -> AgentProcesses:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.kill_all()
