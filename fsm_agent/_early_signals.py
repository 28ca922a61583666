"""Signals that reach ``fsm-agent run`` / ``fsmrun`` in its first milliseconds, before its options are read.

``launch_agent`` handles stop signals and drops signals to relay (``--forward-signals``) until the
agent's own handlers take over; but reading the options takes a while (importing the CLI), and
until then a signal has its default action: SIGUSR1 ``--forward-signals``-listed kills the agent
(exit 138), Ctrl-C prints a ``KeyboardInterrupt`` traceback. The console scripts' entry
(``fsm_agent._entry``) calls ``install`` before anything else: from then on, in the agent command only (argv
says ``fsm-agent run``, ``fsmrun`` or ``python -m fsm_agent run``), a stop signal ends the process
with 128+N and no traceback, a signal to relay is dropped, and a drain signal (``--drain-signals``)
is kept for the agent (``take_early_drain``), which drains as soon as it runs. The names come from a quick look at
argv and the environment (``--signals-to-handle``/``FSM_AGENT_SIGNALS_TO_HANDLE``/``PET_SIGNALS_TO_HANDLE``, ``--forward-signals``/
``FSM_AGENT_FORWARD_SIGNALS``, ``--drain-signals``/``FSM_AGENT_DRAIN_SIGNALS``); ``launch_agent`` puts the full configuration's handlers in place.
A worker or a program that imports ``fsm_agent`` is left alone.

One stop signal ends the process; a second one (GNU ``timeout`` and schedulers signal the whole
process group, so the agent often gets two within microseconds) must not cut its way out short:
once any stop signal was taken (``note_stop``: these handlers, ``launch``'s, the agent's), these
handlers do nothing more.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator

from fsm_agent.signal_names import signal_numbers

_DEFAULT_STOP = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


def _is_agent_command(argv: list[str], orig: list[str]) -> bool:
    name = os.path.basename(argv[0]) if argv else ""
    if name == "fsmrun":
        return True
    if name == "fsm-agent":
        return argv[1:2] == ["run"]
    for i, arg in enumerate(orig[:-2]):  # python [opts] -m fsm_agent run ...
        if arg == "-m" and orig[i + 1] == "fsm_agent":
            return orig[i + 2] == "run"
    return False


def _option(argv: list[str], flag: str, env: str, default: str) -> str:
    value = os.environ.get(env, default)
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        if arg in (flag, flag.replace("-", "_").replace("__", "--")) and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def _names(value: str) -> list[int]:
    """The trappable signals of ``value``; a bad name is skipped here (the agent's own parse names it)."""
    sigs = []
    for name in value.split(","):
        with contextlib.suppress(ValueError):
            sigs.extend(signal_numbers(name))
    return sigs


#: The first stop signal this process took, if any (see ``note_stop``).
_stopping: list[int] = []


def note_stop(signum: int) -> None:
    """Record that this process took the stop signal ``signum`` and is on its way out: from then
    on the early handlers ignore stop signals, so the summary and cleanup are never cut short."""
    if not _stopping:
        _stopping.append(signum)


#: Whether ``install`` found this process to be the agent command (the handlers are this process's).
_installed: list[bool] = []


def take_early_stop() -> int | None:
    """In the agent command: the stop signal this process already took before its agent ran
    (``note_stop``: these handlers, or ``launch``'s), or None. An agent that runs after one means
    its ``SystemExit`` was swallowed on the way: the agent stops then. Elsewhere (a program that
    imports fsm_agent, a test process) always None."""
    return _stopping[0] if _stopping and _installed else None


#: Inside ``undisturbed``: how deep, and the first stop signal held there (delivered at its end).
_undisturbed_depth: list[int] = [0]
_held: list[int] = []


@contextlib.contextmanager
def undisturbed() -> Iterator[None]:
    """Hold stop signals while the block runs, then deliver the first one held to whichever handler
    is in place. For importing torch: an exception a handler raises inside torch's C++ module
    initialisation cannot unwind it, and the process aborts (SIGABRT, exit 134) instead of
    stopping with 128+N. A handler asks ``held(signum)`` first."""
    _undisturbed_depth[0] += 1
    try:
        yield
    finally:
        _undisturbed_depth[0] -= 1
        if not _undisturbed_depth[0] and _held:
            signum = _held.pop()
            _held.clear()
            signal.raise_signal(signum)


def held(signum: int) -> bool:
    """For a stop-signal handler: True when ``signum`` is held by ``undisturbed`` (return at once)."""
    if not _undisturbed_depth[0]:
        return False
    if not _held:
        _held.append(signum)
    return True


def _exit(signum: int, frame: object) -> None:
    if held(signum):
        return
    if _stopping:  # already on the way out (a second signal of the same kill): let it finish
        return
    note_stop(signum)
    raise SystemExit(128 + signum)


def _drop(signum: int, frame: object) -> None:
    pass


#: The drain signal this process got before its agent ran, if any (see ``take_early_drain``).
_drain_asked: list[int] = []


def _note_drain(signum: int, frame: object) -> None:
    if not _drain_asked:
        _drain_asked.append(signum)


def take_early_drain() -> int | None:
    """The drain signal that arrived before the agent's own handlers were in place (once), or None."""
    return _drain_asked.pop() if _drain_asked else None


def install() -> None:
    """Install the early handlers when this process is the agent command (see the module docstring)."""
    argv, orig = list(sys.argv), list(getattr(sys, "orig_argv", []))
    if not _is_agent_command(argv, orig) or sys.platform == "win32":
        return
    _installed.append(True)
    args = argv[1:] if argv and os.path.basename(argv[0]) != "-m" else orig
    try:
        stop_env = (
            "FSM_AGENT_SIGNALS_TO_HANDLE" if "FSM_AGENT_SIGNALS_TO_HANDLE" in os.environ else "PET_SIGNALS_TO_HANDLE"
        )
        stop = _names(_option(args, "--signals-to-handle", stop_env, _DEFAULT_STOP))
        relay = _names(_option(args, "--forward-signals", "FSM_AGENT_FORWARD_SIGNALS", ""))
        for sig in relay:
            if signal.getsignal(sig) == signal.SIG_DFL:
                signal.signal(sig, _drop)
        for sig in _names(_option(args, "--drain-signals", "FSM_AGENT_DRAIN_SIGNALS", "")):
            if signal.getsignal(sig) == signal.SIG_DFL and sig not in stop:
                signal.signal(sig, _note_drain)
        for sig in stop:
            if signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler):  # nohup's SIG_IGN stays
                signal.signal(sig, _exit)
    except (ValueError, OSError):  # not the main thread, or an odd platform: the defaults stay
        pass
