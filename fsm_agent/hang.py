"""Hang detection: progress heartbeats and torch's FileTimer watchdog protocol, read by the agent.

Two sources, both per worker:

- ``fsm_agent.heartbeat()`` touches ``FSM_AGENT_HEARTBEAT_FILE``; once a worker has sent one
  heartbeat, ``hang_timeout`` seconds without another is a hang. The same file carries the step
  of ``heartbeat(step=N)``, read by ``steps()`` for progress-aware restarts (``track_steps()``
  hands out the file without a hang timeout).
- torch's ``FileTimerClient`` (``TORCHELASTIC_ENABLE_FILE_TIMER=1``): workers write JSON timer
  requests ``{version, pid, scope_id, expiration_time, signal}`` to the FIFO
  ``TORCHELASTIC_TIMER_FILE``; an expired timer is a hang. Unlike torch's FileTimerServer, the
  agent never signals itself: it stops and restarts the group.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import tempfile
import time

from fsm_agent.heartbeat import HEARTBEAT_FILE_ENV, read_compute, read_step
from fsm_agent.stack_dump import DUMP_SIGNAL, STACK_DUMP_SIGNAL_ENV
from fsm_agent.tempdirs import forget, remove_if_the_agent_dies

log = logging.getLogger(__name__)
ENABLE_FILE_TIMER_ENV = "TORCHELASTIC_ENABLE_FILE_TIMER"
TIMER_FILE_ENV = "TORCHELASTIC_TIMER_FILE"


class HangDetector:
    """Tracks heartbeats and file timers of one agent's workers.

    Args:
        hang_timeout: seconds without a heartbeat that make a worker hung; None disables heartbeats.
        file_timer: read torch's FileTimer FIFO (default: ``TORCHELASTIC_ENABLE_FILE_TIMER == "1"``).
    """

    def __init__(self, hang_timeout: float | None, file_timer: bool | None = None):
        self.hang_timeout = hang_timeout
        if file_timer is None:
            file_timer = os.environ.get(ENABLE_FILE_TIMER_ENV) == "1"
        # Only when something goes in it: a directory in /tmp is one more thing a SIGKILLed agent leaves.
        needs_dir = hang_timeout is not None or (file_timer and not os.environ.get(TIMER_FILE_ENV))
        self._dir = _heartbeat_dir() if needs_dir else None
        self._steps = False
        self._timers: dict[tuple[int, str], tuple[float, int]] = {}
        self._fifo_r = self._fifo_keepalive_w = None
        self._pending = b""
        self.fifo_path = None
        if file_timer:
            self.fifo_path = os.environ.get(TIMER_FILE_ENV) or os.path.join(self._dir, "watchdog_timer")
            if not os.path.exists(self.fifo_path):
                os.mkfifo(self.fifo_path)
            self._fifo_r = os.open(self.fifo_path, os.O_RDONLY | os.O_NONBLOCK)
            # Our own writer keeps the FIFO from reading as EOF (always readable) between clients.
            self._fifo_keepalive_w = os.open(self.fifo_path, os.O_WRONLY | os.O_NONBLOCK)

    @property
    def enabled(self) -> bool:
        return self.hang_timeout is not None or self._fifo_r is not None

    @property
    def _heartbeats(self) -> bool:
        return self.hang_timeout is not None or self._steps

    def track_steps(self) -> None:
        """Hand every worker a heartbeat file, also without a hang timeout, so ``steps()`` can
        read what ``fsm_agent.heartbeat(step=N)`` reported (progress-aware restarts)."""
        self._steps = True
        if self._dir is None:
            self._dir = _heartbeat_dir()

    def steps(self, local_world_size: int) -> dict[int, int]:
        """{local_rank: the last step its worker reported this attempt}, for workers that did."""
        if not self._heartbeats:
            return {}
        steps = {r: read_step(self._heartbeat_file(r)) for r in range(local_world_size)}
        return {r: step for r, step in steps.items() if step is not None}

    def compute(self, local_world_size: int) -> dict[int, float]:
        """{local_rank: its worker's total compute seconds this attempt}, for workers that
        reported one (``fsm_agent.heartbeat(compute_s=...)``, ``fsm_agent.compute()``)."""
        if not self._heartbeats:
            return {}
        totals = {r: read_compute(self._heartbeat_file(r)) for r in range(local_world_size)}
        return {r: total for r, total in totals.items() if total is not None}

    def worker_env(self, local_rank: int) -> dict[str, str]:
        """Variables that connect one worker to the detector."""
        env = {}
        if self._heartbeats:
            env[HEARTBEAT_FILE_ENV] = self._heartbeat_file(local_rank)
        if self.hang_timeout is not None:
            env["PYTHONFAULTHANDLER"] = "1"  # a SIGABRT then dumps every thread's stack
            if DUMP_SIGNAL is not None:  # and this signal too, without killing (fsm_agent/stack_dump.py)
                env[STACK_DUMP_SIGNAL_ENV] = str(int(DUMP_SIGNAL))
        if self.fifo_path is not None:
            env[TIMER_FILE_ENV] = self.fifo_path
        return env

    def _heartbeat_file(self, local_rank: int) -> str:
        return os.path.join(self._dir, f"heartbeat_{local_rank}")

    def new_attempt(self, local_world_size: int) -> None:
        """Forget the previous attempt's heartbeats and timers."""
        for local_rank in range(local_world_size if self._heartbeats else 0):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._heartbeat_file(local_rank))
        self._timers.clear()

    def workers_replaced(self, local_ranks: set[int]) -> None:
        """Forget the heartbeats of workers whose processes were replaced (in-process restart):
        a new process is not hung by its predecessor's last heartbeat."""
        for local_rank in sorted(local_ranks) if self._heartbeats else ():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._heartbeat_file(local_rank))

    def wait_fds(self) -> list[int]:
        return [self._fifo_r] if self._fifo_r is not None else []

    def read_timer_requests(self) -> None:
        """Drain the FIFO: acquire (expiration >= 0) or release (< 0) timers, keyed by (pid, scope)."""
        if self._fifo_r is None:
            return
        try:
            while chunk := os.read(self._fifo_r, 65536):
                self._pending += chunk
        except BlockingIOError:
            pass
        *lines, self._pending = self._pending.split(b"\n")
        for line in lines:
            try:
                request = json.loads(line)
                key = (int(request["pid"]), str(request["scope_id"]))
                expiration, sig = float(request["expiration_time"]), int(request.get("signal", 9))
            except (ValueError, KeyError, TypeError):
                log.warning("ignoring malformed watchdog timer request: %r", line[:200])
                continue
            if expiration < 0:
                self._timers.pop(key, None)
            elif sig > 0:  # torch: a non-positive signal means "do not kill"
                self._timers[key] = (expiration, sig)

    def hung_workers(self, pids: dict[int, int], exited: set[int]) -> dict[int, str]:
        """{local_rank: why} for live workers that stopped making progress."""
        now = time.time()
        hung = {}
        if self.hang_timeout is not None:
            for local_rank in pids:
                if local_rank in exited:
                    continue
                try:
                    last = os.stat(self._heartbeat_file(local_rank)).st_mtime
                except FileNotFoundError:
                    continue  # no heartbeat yet: the worker has not opted in (or is still starting)
                if now - last > self.hang_timeout:
                    hung[local_rank] = f"no heartbeat for {now - last:.1f}s (hang timeout {self.hang_timeout}s)"
        by_pid = {pid: r for r, pid in pids.items() if r not in exited}
        for (pid, scope), (expiration, _sig) in self._timers.items():
            if pid in by_pid and expiration < now:
                hung.setdefault(by_pid[pid], f"watchdog timer {scope!r} expired {now - expiration:.1f}s ago")
        return hung

    def close(self) -> None:
        for fd in (self._fifo_r, self._fifo_keepalive_w):
            if fd is not None:
                os.close(fd)
        self._fifo_r = self._fifo_keepalive_w = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            forget(self._dir)


def announce_stack_dump(stderr_path: str | None, local_rank: int, pid: int, fatal: bool = True) -> None:
    """Say, where the dump will appear, that the signal about to come is the agent's request.

    faulthandler's dump after SIGABRT (``fatal``) opens with ``Fatal Python error: Aborted``, which
    reads like a crash; the non-fatal one (``fsm_agent.stack_dump``) has no heading at all. The
    line goes to the agent's log (the console, where an unredirected worker's stderr goes too) and,
    when the worker's stderr is a file, into that file just before the dump.
    """
    if fatal:
        note = (
            f"fsm-agent: local_rank {local_rank} (pid {pid}) is hung: the agent sent it SIGABRT for a stack dump "
            f"(no py-spy installed); the 'Fatal Python error: Aborted' that follows is that dump, not a crash"
        )
    else:
        note = (
            f"fsm-agent: local_rank {local_rank} (pid {pid}) is hung: the stacks that follow are dumped on the "
            f"agent's request (no py-spy installed); the agent then kills it"
        )
    log.warning("%s", note)
    if stderr_path and stderr_path != os.devnull:
        try:
            with open(stderr_path, "a") as f:
                f.write(note + "\n")
        except OSError:
            pass


def dump_stacks(pid: int, timeout: float = 10.0) -> str:
    """Every thread's Python stack of ``pid``: py-spy if installed, else "" (the caller falls back to SIGABRT)."""
    py_spy = shutil.which("py-spy")
    if py_spy is None:
        return ""
    try:
        done = subprocess.run([py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=timeout)
        return done.stdout or done.stderr
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"py-spy failed: {exc}"


def _heartbeat_dir() -> str:
    """A new heartbeat directory, removed by the cgroup keeper if the agent dies (``fsm_agent.tempdirs``)."""
    path = tempfile.mkdtemp(prefix="fsm_agent_hb_")
    remove_if_the_agent_dies(path)
    return path
