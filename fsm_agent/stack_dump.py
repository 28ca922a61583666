"""Stack dumps of hung workers that leave them alive, so that every node dumps before any rank dies.

Without py-spy, a hung worker's stacks used to come from SIGABRT and ``PYTHONFAULTHANDLER=1``: the
worker dumped and died at once. In a multi-node job every agent detects the same hang within a
monitor interval or so of the others, and the first worker to die closes its connections: a peer
that was hung in ``recv`` for seconds then fails in the last milliseconds before its own agent's
SIGABRT, and dumps while handling that error, not where it hung. The attribution then sees no odd
rank out (the flake of the ``hang_in_collective`` fault on a loaded machine).

So a worker registers faulthandler on ``DUMP_SIGNAL`` (``install``, run by the launchers' start-up
hooks when ``STACK_DUMP_SIGNAL_ENV`` is set): that signal prints every thread's stack to its stderr
and the worker goes on. The agent dumps, holds the kill a moment (``failures.dump_hung_stacks``),
then kills. A worker that did not register (another Python, ``--no-python``) still gets SIGABRT.

Worker side and agent side are both here; the file imports nothing of ``fsm_agent``, because the
preload launcher's zygote loads it by path.
"""

from __future__ import annotations

import os
import signal

#: Set in the worker's environment (to the signal's number) when the agent detects hangs.
STACK_DUMP_SIGNAL_ENV = "FSM_AGENT_STACK_DUMP_SIGNAL"
#: A real-time signal nothing in torch, gloo or Slurm sends (SIGUSR1/2 are Slurm's and users');
#: None where there are none (not Linux): then SIGABRT, as before.
DUMP_SIGNAL: int | None = signal.SIGRTMIN + 6 if hasattr(signal, "SIGRTMIN") else None


def install() -> None:
    """Worker side: make ``$FSM_AGENT_STACK_DUMP_SIGNAL`` dump every thread's Python stack to stderr
    (``faulthandler.register``; the worker goes on). A no-op when the variable is unset or invalid."""
    value = os.environ.get(STACK_DUMP_SIGNAL_ENV, "")
    if not value.isdigit():
        return
    import faulthandler
    import sys

    try:
        faulthandler.register(int(value), file=sys.stderr, all_threads=True, chain=False)
    except (ValueError, RuntimeError, OSError, AttributeError):  # no stderr, or a signal it refuses
        pass


def catches(pid: int, signum: int) -> bool:
    """Agent side: whether process ``pid`` has a handler for ``signum`` (``SigCgt`` in
    ``/proc/PID/status``), i.e. the signal dumps its stacks instead of killing it. False when
    that cannot be read (not Linux, the process gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def running(pid: int) -> bool:
    """Whether a live process (not a zombie) has ``pid`` (``/proc/PID/stat``; False off Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def signal_main_thread(pid: int, signum: int) -> None:
    """Send ``signum`` to the main thread of process ``pid`` (``tgkill``; its thread id is the
    pid), so that faulthandler's dump marks the main thread "Current thread" (a signal to the
    process may land on a gloo or NCCL thread). Falls back to ``kill`` where libc has no tgkill.
    Raises ProcessLookupError when the process is gone."""
    import ctypes

    try:
        tgkill = ctypes.CDLL(None, use_errno=True).tgkill
    except (OSError, AttributeError):
        os.kill(pid, signum)
        return
    if tgkill(pid, pid, signum) != 0:
        err = ctypes.get_errno()
        raise ProcessLookupError(err, os.strerror(err))
