"""ManualLauncher: the launcher interface, with workers the test ends by hand, one call at a time.

The test kit's FakeLauncher follows a script fixed before the run; a stateful property test
decides what happens next between two steps of the agent, so its workers must be controllable
from outside: ``exit(rank, code)``, ``hang(rank)``, and faults armed for the next call
(``start_error``, ``stop_errors``, ``poll_error``). Each worker is a pipe: writing to it makes
the worker's wait fd readable, as a real worker's pidfd is when it exits.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Any

import attrs

from fsm_agent.heartbeat import HEARTBEAT_FILE_ENV

#: Fake pids: beyond Linux's PID_MAX_LIMIT (2**22), so no fake pid names a real process.
PID_BASE = 2**22 + 300_000


@attrs.define
class _Worker:
    pid: int
    read_fd: int
    write_fd: int
    env: dict[str, str]
    code: int | None = None
    exited_at: float | None = None
    reported: bool = False


class ManualLauncher:
    def __init__(self) -> None:
        self.attempts: list[dict[int, dict[str, str]]] = []  # the envs of every start
        self.stops: list[tuple[int, ...]] = []  # ranks each successful stop ended
        self.signals: list[tuple[int, int]] = []
        self.start_error: BaseException | None = None
        self.stop_errors = 0
        self.poll_error: BaseException | None = None
        self.close_calls = 0
        self._workers: dict[int, _Worker] = {}

    # -- controls --------------------------------------------------------------------------------
    def running(self) -> list[int]:
        return [rank for rank, w in self._workers.items() if w.code is None]

    def exit(self, rank: int, code: int) -> None:
        worker = self._workers[rank]
        if worker.code is None:
            worker.code, worker.exited_at = code, time.time()
            if worker.write_fd >= 0:
                os.write(worker.write_fd, b"x")

    def hang(self, rank: int) -> None:
        """The worker stops making progress: its heartbeat file is dated long ago."""
        path = self._workers[rank].env[HEARTBEAT_FILE_ENV]
        with open(path, "a"):
            pass
        os.utime(path, (0, 0))

    # -- the launcher interface ------------------------------------------------------------------
    def start(self, spec, envs: dict[int, dict[str, str]], logs: dict[int, Any], filtered=(None, None)):
        self._release()
        if self.start_error is not None:
            error, self.start_error = self.start_error, None
            raise error
        attempt = len(self.attempts)
        self._workers = {}
        self.attempts.append({rank: dict(env) for rank, env in envs.items()})
        for rank in sorted(envs):
            read_fd, write_fd = os.pipe()
            os.set_blocking(read_fd, False)
            self._workers[rank] = _Worker(PID_BASE + 100 * attempt + rank, read_fd, write_fd, dict(envs[rank]))
        return self.pids()

    def wait_fds(self) -> dict[int, int]:
        return {w.read_fd: rank for rank, w in self._workers.items() if not w.reported}

    def poll(self) -> dict[int, int]:
        if self.poll_error is not None:
            raise self.poll_error
        for worker in self._workers.values():
            if worker.code is not None:
                worker.reported = True
        return {rank: w.code for rank, w in self._workers.items() if w.reported}

    def exit_times(self) -> dict[int, float]:
        return {rank: w.exited_at for rank, w in self._workers.items() if w.reported}

    def pids(self) -> dict[int, int]:
        return {rank: w.pid for rank, w in self._workers.items()}

    def signal_worker(self, local_rank: int, sig: int) -> None:
        self.signals.append((local_rank, int(sig)))

    def return_values(self) -> dict[int, Any]:
        return {}

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
        if self.stop_errors:
            self.stop_errors -= 1
            raise RuntimeError("scripted stop failure")
        stopped = tuple(self.running())
        for rank in stopped:
            self.exit(rank, -int(sig))
        for worker in self._workers.values():
            worker.reported = True
        self.stops.append(stopped)

    def close(self) -> None:
        self.close_calls += 1
        self._release()

    def _release(self) -> None:
        for worker in self._workers.values():
            for fd in (worker.read_fd, worker.write_fd):
                with contextlib.suppress(OSError):
                    os.close(fd)
            worker.read_fd = worker.write_fd = -1
            worker.reported = True
