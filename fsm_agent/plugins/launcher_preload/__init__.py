"""Built-in launcher ``preload``: workers forked from a zygote that has already imported torch.

``--launcher preload`` starts one helper process (``fsm_agent.plugins.launcher_preload.zygote``) that imports the modules
of ``--preload-modules`` (default ``torch``) once; each worker of each attempt is then a fork
of it running the script with ``runpy``, so a restarted worker skips ``import torch``. The
worker sees what ``python -u script.py`` would: ``sys.argv``, ``__main__``, the environment,
the working directory, its own session and process group. ``--no-python`` binaries are exec'd.
Exits are seen through the worker's pidfd and the zygote's report of the exit code.

Not for callable entrypoints (``--run-path``, ``elastic_launch(fn)``): use ``subprocess``.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from typing import Any

from fsm_agent.env import substitute_local_rank
from fsm_agent.errors import ConfigError
from fsm_agent.logs import WorkerLogs
from fsm_agent.plugins import hookimpl
from fsm_agent.plugins.launcher_subprocess import (
    SubprocessLauncher, _Handle, _killpg, _TeeReader, set_parent_death_signal,
)

PLUGIN_NAME = "launcher-preload"
ZYGOTE_START_TIMEOUT = 120.0  # seconds: importing torch on a loaded machine can take a while


@hookimpl
def fsm_agent_register_backends(registry):
    registry.add_launcher("preload", PreloadLauncher)


@hookimpl
def fsm_agent_addoption(options):
    options.add("modules", type=str, default="torch", flag="--preload-modules", env="FSM_AGENT_PRELOAD_MODULES",
                help="comma-separated modules the preload launcher's zygote imports once (default: torch)")


class _ForkedHandle(_Handle):
    """A worker forked by the zygote: its exit code arrives as a message, not from waitpid."""

    def poll(self) -> int | None:
        return self.exitcode


class PreloadLauncher(SubprocessLauncher):
    """The subprocess launcher's interface, with workers forked from a pre-imported zygote."""

    workers_are_our_children = False  # the zygote forks them, and puts each in the cgroup

    def __init__(self, agent: Any = None) -> None:
        super().__init__(agent)
        options = agent.config.plugin_options(PLUGIN_NAME) if agent is not None and agent.config is not None else {}
        self._modules = options.get("modules") or "torch"
        self._zygote: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._pending_exits: dict[int, int] = {}

    # -- the zygote -------------------------------------------------------------------------------
    def _ensure_zygote(self) -> None:
        if self._zygote is not None and self._zygote.poll() is None:
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._zygote = subprocess.Popen(
            [sys.executable, "-m", "fsm_agent.plugins.launcher_preload.zygote", self._modules, str(theirs.fileno())],
            pass_fds=(theirs.fileno(),), preexec_fn=set_parent_death_signal, stdin=subprocess.DEVNULL)
        theirs.close()
        self._sock = ours
        ready = self._receive(ZYGOTE_START_TIMEOUT)
        if ready and ready.get("module"):
            raise ConfigError(f"--preload-modules: the preload launcher's zygote could not import {ready['module']!r} "
                              f"({ready.get('error')}); name importable modules (default: torch) or use "
                              "--launcher subprocess")
        if not ready or not ready.get("ready"):
            raise ConfigError(f"--launcher preload: the zygote did not start (importing {self._modules!r} failed?); "
                              "use --launcher subprocess")

    def _receive(self, timeout: float | None) -> dict | None:
        ready, _, _ = select.select([self._sock], [], [], timeout)
        if not ready:
            return None
        data = self._sock.recv(1 << 16)
        return json.loads(data) if data else None

    def _drain(self) -> None:
        """Read every message waiting on the socket (exit reports) without blocking."""
        while self._sock is not None:
            message = self._receive(0)
            if message is None:
                return
            if "exited" in message:
                self._pending_exits[message["exited"]] = message["code"]
        # attach exit codes to handles (an exit can be reported before we know the pid's handle)

    def _settle(self) -> None:
        self._drain()
        for h in self._handles.values():
            if h.exitcode is None and h.pid in self._pending_exits:
                h.exitcode, h.exited_at = self._pending_exits.pop(h.pid), time.time()

    # -- the launcher interface -----------------------------------------------------------------
    def start(self, spec, envs, logs, filtered=(None, None)) -> dict[int, int]:
        if callable(spec.entrypoint):
            raise ConfigError("--launcher preload runs scripts, modules and binaries, not Python callables "
                              "(--run-path, elastic_launch(fn)); use --launcher subprocess")
        self._ensure_zygote()
        return super().start(spec, envs, logs, filtered)

    def _start_program(self, spec, local_rank: int, env: dict[str, str], wlogs: WorkerLogs,
                       born_in_cgroup: bool = False) -> _Handle:
        argv, mode = _command(spec.entrypoint, substitute_local_rank(tuple(spec.args), local_rank))
        fds, readers = [], []
        for path, tee, console, index in ((wlogs.stdout, wlogs.tee_stdout, sys.stdout, 0),
                                          (wlogs.stderr, wlogs.tee_stderr, sys.stderr, 1)):
            if tee:
                read_end, write_end = os.pipe()
                fds.append(write_end)
                readers.append((os.fdopen(read_end, "rb"), path, console, index))
            elif path:
                fds.append(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644))
            else:
                fds.append(os.dup(index + 1))  # inherit the agent's stdout/stderr
        request = {"op": "spawn", "local_rank": local_rank, "argv": argv, "env": env, "cwd": os.getcwd(), "mode": mode,
                   "cgroup": self._cgroup_path}
        socket.send_fds(self._sock, [json.dumps(request).encode()], fds)
        for fd in fds:
            os.close(fd)
        while True:  # exit reports of earlier workers may come first
            message = self._receive(ZYGOTE_START_TIMEOUT)
            if message is None:
                raise RuntimeError("the preload zygote stopped answering")
            if "exited" in message:
                self._pending_exits[message["exited"]] = message["code"]
            elif message.get("spawned") == local_rank:
                break
        pid = message["pid"]
        try:
            wait_fd = os.pidfd_open(pid)  # wakes the agent at the exit; the code comes as a message
        except ProcessLookupError:  # already exited and reaped by the zygote: its report wakes us
            wait_fd = os.dup(self._sock.fileno())
        handle = _ForkedHandle(local_rank=local_rank, pid=pid, wait_fd=wait_fd, owns_fd=True)
        for pipe, path, console, index in readers:
            handle.readers.append(_TeeReader(pipe, path, console, wlogs.prefix, self._filtered[index]))
        return handle

    def wait_fds(self) -> dict[int, int]:
        fds = super().wait_fds()
        if self._sock is not None:
            fds[self._sock.fileno()] = -1
        return fds

    def poll(self) -> dict[int, int]:
        self._settle()
        return super().poll()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
        self._settle()
        live = [h for h in self._handles.values() if h.exitcode is None]
        for h in live:
            _killpg(h.pid, sig)
        deadline = time.monotonic() + timeout
        while live and (remaining := deadline - time.monotonic()) > 0:
            select.select([self._sock], [], [], remaining)
            self._settle()
            live = [h for h in live if h.exitcode is None]
        for h in live:
            _killpg(h.pid, signal.SIGKILL)
        end = time.monotonic() + 10
        while live and time.monotonic() < end:
            select.select([self._sock], [], [], 0.5)
            self._settle()
            live = [h for h in live if h.exitcode is None]
        self.close()

    def close(self) -> None:
        if self._zygote is not None:
            self._not_ours.add(self._zygote.pid)  # the sweep spares the zygote between attempts
        super().close()

    def shutdown(self) -> None:
        """End the zygote, then remove the workers' cgroup (called when the agent is done)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._zygote is not None:
            try:
                self._zygote.wait(5)
            except subprocess.TimeoutExpired:
                self._zygote.kill()
                self._zygote.wait()
        super().shutdown()


def _command(entrypoint: str, args: tuple) -> tuple[list[str], str]:
    """(argv, mode) for the zygote from the agent's ``python -u [-m] script args`` command."""
    args = [str(a) for a in args]
    if os.path.basename(entrypoint).startswith("python"):
        rest = list(args)
        while rest and rest[0] in ("-u",):
            rest = rest[1:]
        if rest[:1] == ["-m"]:
            return rest[1:], "module"
        if rest and not rest[0].startswith("-"):
            return rest, "script"
        # Any other interpreter option (``-c CODE``, ``-X ...``): run the command as given.
    return [entrypoint, *args], "exec"
