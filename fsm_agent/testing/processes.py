"""AgentProcesses: real ``fsm-agent`` processes for end-to-end tests, always cleaned up.

Each agent starts in its own session (so it leads a process group); ``kill_all`` SIGKILLs every
group it started (never by name) and reaps the agents. The ``agent_processes`` fixture of the
test kit yields one and cleans up after the test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path


class AgentProcesses:
    """Start ``python -m fsm_agent <command> ARGS`` processes in ``cwd``; kill their groups at the end.

    Args:
        cwd: working directory of every agent (workers write relative files there).
        command: the subcommand words put before each call's arguments (default ``("run",)``).
        env: the base environment (default: this process's); ``start(env=...)`` adds to it.
    """

    def __init__(self, cwd: Path | str, command: tuple[str, ...] = ("run",), env: dict[str, str] | None = None):
        self.cwd, self.command, self.env = Path(cwd), tuple(command), env
        self.procs: list[subprocess.Popen] = []

    def start(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start one agent; stdout and stderr are pipes (use ``proc.communicate(timeout=...)``)."""
        base = dict(os.environ) if self.env is None else dict(self.env)
        proc = subprocess.Popen([sys.executable, "-m", "fsm_agent", *self.command, *args], cwd=self.cwd, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                env={**base, **(env or {})})
        self.procs.append(proc)
        return proc

    def kill_all(self) -> None:
        """SIGKILL every started agent's process group and reap the agents."""
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.communicate()
