"""Worker-side progress heartbeat: call ``fsm_agent.heartbeat(step=N)`` once per training step.

Each worker gets ``FSM_AGENT_HEARTBEAT_FILE`` whenever a feature reads heartbeats: hang
detection (``fsm-agent run --hang-timeout S``) or progress-aware restarts (``--progress-file``,
``--max-no-progress-restarts``). A call touches that file at most every ``min_interval`` seconds
(one ``os.utime`` syscall; otherwise a clock read). With ``step``, the step is also stored into
the file through a shared memory map: a memory write, no syscall, so the agent sees the exact
last step a worker reached even after it crashed. Calling it every step costs about a
microsecond. A worker that has sent one heartbeat and then none for ``S`` seconds is reported
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
_UNRESOLVED = object()  # read the variable at the next call
_path: object = os.environ.get(HEARTBEAT_FILE_ENV) or None
_last = float("-inf")
_map: mmap.mmap | None = None


def _forget_after_fork() -> None:
    global _path, _last, _map
    _path, _last, _map = _UNRESOLVED, float("-inf"), None


os.register_at_fork(after_in_child=_forget_after_fork)


def _step_map(path: str) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if os.fstat(fd).st_size < STEP_FORMAT.size:
            os.ftruncate(fd, STEP_FORMAT.size)
        return mmap.mmap(fd, STEP_FORMAT.size)
    finally:
        os.close(fd)


def heartbeat(min_interval: float = 0.1, *, step: int | None = None) -> None:
    """Report progress to the agent (no-op when not launched by fsm-agent with a heartbeat feature on).

    Args:
        min_interval: seconds; liveness touches closer together than this are not written (the
            step always is).
        step: keyword only: the training step (iteration) just reached, an int; the agent records
            the last one of each restart cycle (``fsm-agent status``, the events file's ``cycle``
            records). None: liveness only.
    """
    global _path, _last, _map
    if _path is None:
        return
    if _path is _UNRESOLVED:
        _path = os.environ.get(HEARTBEAT_FILE_ENV) or None
        if _path is None:
            return
    if step is not None:
        if _map is None:
            _map = _step_map(_path)
        STEP_FORMAT.pack_into(_map, 0, step)
    now = time.monotonic()
    if now - _last < min_interval:
        return
    _last = now
    try:
        os.utime(_path)
    except FileNotFoundError:
        open(_path, "a").close()


def read_step(path: str) -> int | None:
    """The last step ``heartbeat(step=...)`` stored in the heartbeat file ``path``, or None."""
    try:
        with open(path, "rb") as f:
            data = f.read(STEP_FORMAT.size)
    except FileNotFoundError:
        return None
    return STEP_FORMAT.unpack(data)[0] if len(data) == STEP_FORMAT.size else None
