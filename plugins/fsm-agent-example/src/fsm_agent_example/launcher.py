"""ExampleLauncher: the launcher interface of fsm-agent, written from scratch in one page.

What the agent calls (see ``fsm_agent.plugins.launcher_subprocess.SubprocessLauncher``):
``start``, ``wait_fds``, ``poll``, ``exit_times``, ``pids``, ``signal_worker``,
``return_values``, ``stop`` and ``close``. ``fsm_agent.testing.conformance.LauncherConformance``
checks each of them with real processes.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import time
from typing import Any


class _Worker:
    def __init__(self, popen: subprocess.Popen):
        self.popen = popen
        self.fd = os.pidfd_open(popen.pid)  # readable once the process has exited
        self.exited_at: float | None = None

    def poll(self) -> int | None:
        code = self.popen.poll()
        if code is not None and self.exited_at is None:
            self.exited_at = time.time()
        return code


def _killpg(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


class ExampleLauncher:
    """Each worker runs ``entrypoint *args`` in a new session (it leads its process group)."""

    def __init__(self, agent: Any = None):
        self._workers: dict[int, _Worker] = {}

    def start(self, spec, envs, logs, filtered=(None, None)) -> dict[int, int]:
        if callable(spec.entrypoint):
            raise TypeError("the example launcher runs programs, not Python callables: use --launcher subprocess")
        self.close()
        self._workers = {}
        for rank in sorted(envs):
            args = [spec.entrypoint, *(str(a).replace("${local_rank}", str(rank)) for a in spec.args)]
            streams = [open(path, "ab") if path else None for path in (logs[rank].stdout, logs[rank].stderr)]
            try:
                popen = subprocess.Popen(
                    args,
                    env=envs[rank],
                    stdout=streams[0],
                    stderr=streams[1],
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            finally:
                for stream in streams:
                    if stream is not None:
                        stream.close()
            self._workers[rank] = _Worker(popen)
        return self.pids()

    def wait_fds(self) -> dict[int, int]:
        return {w.fd: rank for rank, w in self._workers.items() if w.popen.returncode is None}

    def poll(self) -> dict[int, int]:
        return {rank: code for rank, w in self._workers.items() if (code := w.poll()) is not None}

    def exit_times(self) -> dict[int, float]:
        return {rank: w.exited_at for rank, w in self._workers.items() if w.exited_at is not None}

    def pids(self) -> dict[int, int]:
        return {rank: w.popen.pid for rank, w in self._workers.items()}

    def signal_worker(self, local_rank: int, sig: int) -> None:
        worker = self._workers.get(local_rank)
        if worker is not None and worker.poll() is None:
            _killpg(worker.popen.pid, sig)

    def return_values(self) -> dict[int, Any]:
        return {}  # programs return nothing

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
        live = [w for w in self._workers.values() if w.poll() is None]
        for w in live:
            _killpg(w.popen.pid, sig)
        deadline = time.monotonic() + timeout
        while live and (remaining := deadline - time.monotonic()) > 0:
            select.select([w.fd for w in live], [], [], remaining)
            live = [w for w in live if w.poll() is None]
        for w in live:
            _killpg(w.popen.pid, signal.SIGKILL)
            w.popen.wait()
            w.poll()
        self._kill_groups()

    def close(self) -> None:
        self._kill_groups()
        for w in self._workers.values():
            if w.fd >= 0 and w.popen.returncode is not None:
                os.close(w.fd)
                w.fd = -1

    def _kill_groups(self) -> None:
        """What the workers left in their process groups (grandchildren) goes with them."""
        for w in self._workers.values():
            if w.poll() is not None:
                _killpg(w.popen.pid, signal.SIGKILL)
