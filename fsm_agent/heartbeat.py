"""Worker-side progress heartbeat: call ``fsm_agent.heartbeat(step=N)`` once per training step.

Each worker gets ``FSM_AGENT_HEARTBEAT_FILE`` whenever a feature reads heartbeats: hang
detection (``fsm-agent run --hang-timeout S``) or progress-aware restarts (``--progress-file``,
``--max-no-progress-restarts``). A call touches that file at most every ``min_interval`` seconds
(one ``os.utime`` syscall; otherwise a clock read). With ``step``, the step is also stored into
the file through a shared memory map: a memory write, no syscall, so the agent sees the exact
last step a worker reached even after it crashed. Calling it every step costs about a
microsecond. With ``compute_s`` (or the ``compute()`` timer around the step's compute), the
worker's own compute time is added to a running total in the same map: that is what the
``straggler`` plugin judges in a job whose every step ends in a collective, where all ranks
reach each step together (NVIDIA resiliency extension's section timing, the worker side). A worker that has sent one heartbeat and then none for ``S`` seconds is reported
hung. Outside fsm-agent (no variable set) the call does nothing. A process forked after the
import (the ``preload`` launcher's zygote, ``--start-method fork``) reads the variable again at its
first call, from the environment its launcher gave it.
This module imports nothing beyond the standard library.
"""

from __future__ import annotations

import mmap
import os
import struct
import time

HEARTBEAT_FILE_ENV = "FSM_AGENT_HEARTBEAT_FILE"
#: The step's layout at the start of the heartbeat file: one signed 64-bit little-endian integer.
STEP_FORMAT = struct.Struct("<q")
#: After the step: the worker's total compute seconds this process (a little-endian double),
#: and how many reports added to it (signed 64-bit; 0: never reported).
COMPUTE_FORMAT = struct.Struct("<dq")
_MAP_SIZE = STEP_FORMAT.size + COMPUTE_FORMAT.size
_UNRESOLVED = object()  # read the variable at the next call
_path: object = os.environ.get(HEARTBEAT_FILE_ENV) or None
_last = float("-inf")
_map: mmap.mmap | None = None
_compute_total, _compute_reports = 0.0, 0


def _forget_after_fork() -> None:
    global _path, _last, _map, _compute_total, _compute_reports
    _path, _last, _map = _UNRESOLVED, float("-inf"), None
    _compute_total, _compute_reports = 0.0, 0


os.register_at_fork(after_in_child=_forget_after_fork)


def _step_map(path: str) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if os.fstat(fd).st_size < _MAP_SIZE:
            os.ftruncate(fd, _MAP_SIZE)
        return mmap.mmap(fd, _MAP_SIZE)
    finally:
        os.close(fd)


def _resolved() -> str | None:
    """The heartbeat file's path, read from the environment again after a fork; None: off."""
    global _path
    if _path is _UNRESOLVED:
        _path = os.environ.get(HEARTBEAT_FILE_ENV) or None
    return _path  # type: ignore[return-value]


def _add_compute(path: str, seconds: float) -> None:
    global _map, _compute_total, _compute_reports
    if _map is None:
        _map = _step_map(path)
    _compute_total += seconds
    _compute_reports += 1
    COMPUTE_FORMAT.pack_into(_map, STEP_FORMAT.size, _compute_total, _compute_reports)


def heartbeat(min_interval: float = 0.1, *, step: int | None = None, compute_s: float | None = None) -> None:
    """Report progress to the agent (no-op when not launched by fsm-agent with a heartbeat feature on).

    Args:
        min_interval: seconds; liveness touches closer together than this are not written (the
            step always is).
        step: keyword only: the training step (iteration) just reached, an int; the agent records
            the last one of each restart cycle (``fsm-agent status``, the events file's ``cycle``
            records). None: liveness only.
        compute_s: keyword only: seconds this worker computed since its last report (forward,
            backward, optimizer: the part before the step's collective, without waiting in it).
            The ``straggler`` plugin then judges ranks by compute time per step instead of step
            time. None: not reported (or ``compute()`` reports it).
    """
    global _last, _map
    path = _resolved()
    if path is None:
        return
    if compute_s is not None:
        _add_compute(path, compute_s)
    if step is not None:
        if _map is None:
            _map = _step_map(path)
        STEP_FORMAT.pack_into(_map, 0, step)
    now = time.monotonic()
    if now - _last < min_interval:
        return
    _last = now
    try:
        os.utime(path)
    except FileNotFoundError:
        open(path, "a").close()


class compute:
    """Context manager: ``with fsm_agent.compute(): ...`` around a step's compute (before its
    collective) adds the seconds it took (``time.perf_counter``) to the worker's compute total,
    as ``heartbeat(compute_s=...)`` does; the next ``heartbeat(step=N)`` needs no argument. No
    torch here: with CUDA, call ``torch.cuda.synchronize()`` at the end of the block so the
    time is the GPU's, not the kernel launches'. Does nothing outside fsm-agent."""

    def __enter__(self) -> compute:
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        path = _resolved()
        if path is not None:
            _add_compute(path, time.perf_counter() - self._start)


def read_compute(path: str) -> float | None:
    """The total compute seconds ``heartbeat(compute_s=...)``/``compute()`` stored in the
    heartbeat file ``path``, or None when the worker never reported one."""
    try:
        with open(path, "rb") as f:
            data = f.read(_MAP_SIZE)
    except FileNotFoundError:
        return None
    if len(data) < _MAP_SIZE:
        return None
    total, reports = COMPUTE_FORMAT.unpack_from(data, STEP_FORMAT.size)
    return total if reports > 0 else None


def read_step(path: str) -> int | None:
    """The last step ``heartbeat(step=...)`` stored in the heartbeat file ``path``, or None."""
    try:
        with open(path, "rb") as f:
            data = f.read(STEP_FORMAT.size)
    except FileNotFoundError:
        return None
    return STEP_FORMAT.unpack(data)[0] if len(data) == STEP_FORMAT.size else None
