"""Event records for the benchmark workers: one JSON line per event, appended to ``$FSMBENCH_EVENTS``.

Only the standard library, and nothing heavier than ``os``/``time``: the ``started`` stamp must
measure the launcher, not this module. Each record is one ``os.write`` of a short line to a file
opened with ``O_APPEND``, so lines from concurrent workers never interleave. Timestamps are
``time.time()`` (CLOCK_REALTIME), the clock every process on the machine shares with the harness.
"""

import os
import time

_PATH = os.environ.get("FSMBENCH_EVENTS")
_ENV = os.environ


def _int(name, default=-1):
    try:
        return int(_ENV.get(name, default))
    except ValueError:
        return default


RANK = _int("RANK")
LOCAL_RANK = _int("LOCAL_RANK")
GROUP_RANK = _int("GROUP_RANK")
WORLD_SIZE = _int("WORLD_SIZE")
ATTEMPT = _int("TORCHELASTIC_RESTART_COUNT", 0)


def emit(event, t=None):
    """Append ``{event, t, rank, local_rank, group_rank, world_size, attempt, pid}`` to the events file."""
    if t is None:
        t = time.time()
    if not _PATH:
        return
    line = (
        '{"event": "%s", "t": %r, "rank": %d, "local_rank": %d, "group_rank": %d, '
        '"world_size": %d, "attempt": %d, "pid": %d}\n'
        % (event, t, RANK, LOCAL_RANK, GROUP_RANK, WORLD_SIZE, ATTEMPT, os.getpid())
    )
    fd = os.open(_PATH, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def sleep_forever():
    """Block until a signal ends the process (SIGTERM keeps its default action: exit)."""
    while True:
        time.sleep(3600)
