"""Built-in launcher ``preload``: workers forked from a zygote that has already imported torch.

``--launcher preload`` starts one helper process (``fsm_agent.plugins.launcher_preload.zygote``) as soon as
the launcher is built, before the rendezvous, so that importing the modules of ``--preload-modules``
(default ``torch``) once is paid while the nodes gather; each worker of each attempt, the first
included, is then a fork of it running the script with ``runpy``: no worker imports torch itself,
and the agent process does not either (except under ``--restart-mode inprocess``, whose store the
agent hosts). The workers' rank 0 hosts their TCPStore, as under the subprocess launcher
(``TORCHELASTIC_USE_AGENT_STORE=False``; in-process restart: the agent's, ``True``): a store that
outlived ``destroy_process_group`` would hand a re-created process group the earlier group's keys.
In-process restart forks a replacement for one failed worker from the same zygote (``replace_workers``).
The import's seconds are reported apart from the agent's own (metric ``fsm_agent.launcher.preload_import_s``,
event ``launcher_timings``). The
worker sees what ``python -u script.py`` would: ``sys.argv``, ``__main__``, the environment,
the working directory, its own session and process group. ``--no-python`` binaries are exec'd.
Exits are seen through the worker's pidfd and the zygote's report of the exit code; when the zygote
itself dies (killed, out of memory), its workers die with it (``PR_SET_PDEATHSIG``), the agent, their
child subreaper, reaps them for their codes, and the next start forks from a new zygote.

Not for callable entrypoints (``--run-path``, ``elastic_launch(fn)``): use ``subprocess``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
from typing import Any

from fsm_agent import _early_zygote
from fsm_agent.env import substitute_local_rank
from fsm_agent.errors import ConfigError
from fsm_agent.interrupts import STOP_LOOK_S, SignalStop, stop_taken
from fsm_agent.logs import WorkerLogs
from fsm_agent.plugins import hookimpl
from fsm_agent.plugins.launcher_subprocess import (
    SubprocessLauncher,
    _Handle,
    _killpg,
    _TeeReader,
)

log = logging.getLogger(__name__)

PLUGIN_NAME = "launcher-preload"
ZYGOTE_START_TIMEOUT = 120.0  # seconds: importing torch on a loaded machine can take a while


@hookimpl
def fsm_agent_register_backends(registry):
    registry.add_launcher("preload", PreloadLauncher)


@hookimpl
def fsm_agent_addoption(options):
    options.add(
        "modules",
        type=str,
        default="torch",
        flag="--preload-modules",
        env="FSM_AGENT_PRELOAD_MODULES",
        help="comma-separated modules the preload launcher's zygote imports once (default: torch)",
    )


@hookimpl
def fsm_agent_configure(config, agent):
    if getattr(config, "launcher", "preload") != "preload":
        _early_zygote.discard()  # argv looked like --launcher preload, but the run uses another launcher


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
        self._ready: dict | None = None  # the zygote's first message, once read
        self._pending_exits: dict[int, int] = {}
        self._timings: dict[str, float] = {}
        self._zygote_lost = False  # its socket closed under us: exits are read from the kernel
        if agent is not None:  # an agent's launcher: the import starts now, overlapped with the rendezvous
            self._spawn_zygote()

    # -- the zygote -------------------------------------------------------------------------------
    def _spawn_zygote(self) -> None:
        # The one the agent command started in its first milliseconds (fsm_agent._early_zygote), if it fits.
        self._zygote, self._sock = _early_zygote.take(self._modules) or _early_zygote.spawn(self._modules)
        self._ready, self._zygote_lost = None, False

    def _lose_zygote(self) -> None:
        """The zygote's socket closed while this launcher still used it: the zygote died (killed,
        out of memory). Its workers die with it (their parent-death signal); their exit codes are
        read from the kernel from now on (``_settle``), and the next start forks a new zygote."""
        assert self._sock is not None
        self._sock.close()
        self._sock, self._zygote_lost = None, True
        code = None
        if self._zygote is not None:  # reaped: its orphans have been handed to their new parent
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = self._zygote.wait(5)
        live = sorted(h.local_rank for h in self._handles.values() if h.exitcode is None)
        log.warning(
            "--launcher preload: the zygote (pid %s) exited with code %s; its workers (local ranks %s) "
            "end with it, and the next start forks from a new zygote",
            self._zygote.pid if self._zygote is not None else "?",
            code,
            live or "none",
        )

    def _await_ready(self) -> dict:
        """The zygote's first message (waiting for its imports if need be); ``{}`` when it never came.

        Raises:
            SignalStop: the agent took a stop signal while it waited.
        """
        if self._ready is None:
            waited = time.monotonic()
            deadline = waited + ZYGOTE_START_TIMEOUT
            while self._ready is None:
                if (stop := stop_taken()) is not None:  # the import may take minutes (a network file system)
                    raise SignalStop(stop)  # the start is cut short, as the agent's interruptible calls
                message = self._receive(min(STOP_LOOK_S, max(0.0, deadline - time.monotonic())))
                if message is None:
                    if self._sock is None or time.monotonic() >= deadline:
                        self._ready = {}
                elif "ready" in message:
                    self._ready = message
            if self._ready.get("ready"):
                self._timings = {
                    "preload_import_s": float(self._ready.get("import_s", 0.0)),
                    "preload_wait_s": time.monotonic() - waited,
                }
        return self._ready

    def _ensure_zygote(self) -> None:
        """A zygote that has imported the modules: the one started with the launcher, or a new one
        where that one died after it was ready.

        Raises:
            ConfigError: a module of ``--preload-modules`` could not be imported, or the zygote did not start.
        """
        if self._zygote is None or (self._ready and self._ready.get("ready") and self._zygote.poll() is not None):
            self._end_zygote()
            self._spawn_zygote()
        ready = self._await_ready()
        if ready.get("module"):
            raise ConfigError(
                f"--preload-modules: the preload launcher's zygote could not import {ready['module']!r} "
                f"({ready.get('error')}); name importable modules (default: torch) or use "
                "--launcher subprocess"
            )
        if not ready.get("ready"):
            raise ConfigError(
                f"--launcher preload: the zygote did not start (importing {self._modules!r} failed?); "
                "use --launcher subprocess"
            )

    def _receive(self, timeout: float | None) -> dict | None:
        """The zygote's next message, or None when none came within ``timeout`` seconds or the
        zygote is gone (its socket closed: ``_lose_zygote``)."""
        if self._sock is None:
            return None
        ready, _, _ = select.select([self._sock], [], [], timeout)
        if not ready:
            return None
        data = self._sock.recv(1 << 16)
        if not data:
            self._lose_zygote()
            return None
        return json.loads(data)

    def _ask(self, request: dict, answered: Any, fds: list[int] = ()) -> dict:
        """Send one request and return the zygote's answer (the first message ``answered`` accepts);
        exit reports that come first are kept for ``poll``."""
        socket.send_fds(self._sock, [json.dumps(request).encode()], list(fds))
        while True:
            message = self._receive(ZYGOTE_START_TIMEOUT)
            if message is None:
                raise RuntimeError("the preload zygote stopped answering")
            if "exited" in message:
                self._pending_exits[message["exited"]] = message["code"]
            elif answered(message):
                return message

    def _drain(self) -> None:
        """Read every message waiting on the socket (exit reports) without blocking."""
        while self._sock is not None:
            message = self._receive(0)
            if message is None:
                return
            if "exited" in message:
                self._pending_exits[message["exited"]] = message["code"]
            elif "ready" in message and self._ready is None:
                self._ready = message
        # attach exit codes to handles (an exit can be reported before we know the pid's handle)

    def take_timings(self) -> dict[str, float]:
        """Seconds not yet reported: ``preload_import_s`` (the zygote importing ``--preload-modules``,
        paid once per run, overlapped with the rendezvous) and ``preload_wait_s`` (how long the first
        start waited for that import after the rendezvous)."""
        timings, self._timings = self._timings, {}
        return timings

    def _settle(self) -> None:
        self._drain()
        for h in self._handles.values():
            if h.exitcode is None and h.pid in self._pending_exits:
                h.exitcode, h.exited_at = self._pending_exits.pop(h.pid), time.time()
        if self._zygote_lost:  # no report comes any more: ask the kernel
            for h in self._handles.values():
                if h.exitcode is None and (code := _orphan_exit(h)) is not None:
                    h.exitcode, h.exited_at = code, time.time()

    # -- the launcher interface -----------------------------------------------------------------
    def start(self, spec, envs, logs, filtered=(None, None)) -> dict[int, int]:
        if callable(spec.entrypoint):
            raise ConfigError(
                "--launcher preload runs scripts, modules and binaries, not Python callables "
                "(--run-path, elastic_launch(fn)); use --launcher subprocess"
            )
        self._ensure_zygote()
        return super().start(spec, envs, logs, filtered)

    def replace_workers(self, spec, envs, logs) -> dict[int, int]:
        self._ensure_zygote()  # a zygote lost since the start is started again, not asked and found dead
        return super().replace_workers(spec, envs, logs)

    def _start_program(
        self, spec, local_rank: int, env: dict[str, str], wlogs: WorkerLogs, born_in_cgroup: bool = False
    ) -> _Handle:
        argv, mode = _command(spec.entrypoint, substitute_local_rank(tuple(spec.args), local_rank))
        fds, readers = [], []
        for path, tee, console, index in (
            (wlogs.stdout, wlogs.tee_stdout, sys.stdout, 0),
            (wlogs.stderr, wlogs.tee_stderr, sys.stderr, 1),
        ):
            if tee:
                read_end, write_end = os.pipe()
                fds.append(write_end)
                readers.append((os.fdopen(read_end, "rb"), path, console, index))
            elif path:
                fds.append(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644))
            else:
                fds.append(os.dup(index + 1))  # inherit the agent's stdout/stderr
        request = {
            "op": "spawn",
            "local_rank": local_rank,
            "argv": argv,
            "env": env,
            "cwd": os.getcwd(),
            "mode": mode,
            "cgroup": self._cgroup_path,
        }
        try:
            message = self._ask(request, lambda m: m.get("spawned") == local_rank, fds)
        finally:
            for fd in fds:
                os.close(fd)
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
            self._await_exit(live, remaining)
            live = [h for h in live if h.exitcode is None]
        for h in live:
            _killpg(h.pid, signal.SIGKILL)
        end = time.monotonic() + 10
        while live and time.monotonic() < end:
            self._await_exit(live, 0.5)
            live = [h for h in live if h.exitcode is None]
        self.close()

    def _await_exit(self, live: list[_Handle], seconds: float) -> None:
        """Wait up to ``seconds`` for news of the ``live`` workers' exits: the zygote's report, or
        once it is gone their pidfds; then take what came (``_settle``)."""
        ready = [self._sock] if self._sock is not None else [h.wait_fd for h in live]
        select.select(ready, [], [], seconds)
        self._settle()

    def close(self) -> None:
        if self._zygote is not None:  # the sweep spares the zygote and its standbys
            self._not_ours.add(self._zygote.pid)
            if self._cgroup is None:  # else the sweep is the cgroup's, and none of them is in it
                self._not_ours |= _children(self._zygote.pid) - {h.pid for h in self._handles.values()}
        super().close()

    def _end_zygote(self) -> None:
        """Close the zygote's socket: it exits; reap it."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._zygote is not None:
            if not (self._ready or {}).get("ready"):  # still importing: it reads no socket, and ran nothing of ours
                self._zygote.kill()
            try:
                self._zygote.wait(5)
            except subprocess.TimeoutExpired:
                self._zygote.kill()
                self._zygote.wait()

    def shutdown(self) -> None:
        """End the zygote, then remove the workers' cgroup (called when the agent is done)."""
        self._end_zygote()
        super().shutdown()


def _orphan_exit(handle: _Handle) -> int | None:
    """The exit code of a worker whose zygote is gone, None while it runs. The agent, a child
    subreaper while workers run, has adopted it and reaps it now; one it did not adopt (reaped by
    the zygote before it died) and that has ended counts as killed (-9), as the parent-death
    signal kills the rest."""
    try:
        pid, status = os.waitpid(handle.pid, os.WNOHANG)
    except ChildProcessError:
        ended, _, _ = select.select([handle.wait_fd], [], [], 0)
        return -signal.SIGKILL if ended else None
    return os.waitstatus_to_exitcode(status) if pid else None


def _children(pid: int) -> set[int]:
    """The direct children of ``pid`` (empty if it is gone)."""
    import psutil

    try:
        return {child.pid for child in psutil.Process(pid).children()}
    except psutil.Error:
        return set()


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
