"""The preload launcher's zygote, started in the agent command's first milliseconds.

``fsm-agent run --launcher preload`` spends a few tenths of a second importing its own modules
before it reads its options and builds the launcher; the zygote (``fsm_agent.plugins.launcher_preload``)
then still has to import torch, which the first workers wait for. So, like ``_early_signals``, the
console scripts' entry (``fsm_agent._entry``) calls ``install`` first: in the agent command only, when a quick look at argv and the
environment (``--launcher``/``FSM_AGENT_LAUNCHER``, ``--preload-modules``/``FSM_AGENT_PRELOAD_MODULES``)
says preload, the zygote is started at once and its import overlaps the agent's start and the
rendezvous. The launcher takes it (``take``) when the modules it was configured with are the same,
else it ends it and starts its own. A zygote nobody takes dies with the agent (parent-death signal).

Only the standard library here: this runs before anything else of fsm-agent is imported, and
the zygote loads this file by itself (``parent_death_signal``) before its imports.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys

_PR_SET_PDEATHSIG = 1
DEFAULT_MODULES = "torch"
#: The zygote's program, run as a file (see its docstring).
ZYGOTE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plugins", "launcher_preload", "zygote.py")

_early: tuple[str, subprocess.Popen, socket.socket] | None = None


def parent_death_signal(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` (default SIGKILL) to this process when its parent dies (Linux only)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def spawn(modules: str) -> tuple[subprocess.Popen, socket.socket]:
    """Start a zygote importing the comma-separated ``modules``; returns it and the agent's end of
    its ``SOCK_SEQPACKET`` socket (the protocol is in ``fsm_agent.plugins.launcher_preload.zygote``).

    Raises:
        OSError: the process could not be started.
    """
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        zygote = subprocess.Popen(
            [sys.executable, ZYGOTE, modules, str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            preexec_fn=parent_death_signal,
            stdin=subprocess.DEVNULL,
        )
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return zygote, ours


def take(modules: str) -> tuple[subprocess.Popen, socket.socket] | None:
    """The zygote ``install`` started, when it imports ``modules`` (else it is ended); None when there is none."""
    global _early
    early, _early = _early, None
    if early is None:
        return None
    started_with, zygote, sock = early
    if started_with == modules and zygote.poll() is None:
        return zygote, sock
    _end(zygote, sock)
    return None


def discard() -> None:
    """End the zygote ``install`` started, if nobody took it (the run uses another launcher)."""
    global _early
    early, _early = _early, None
    if early is not None:
        _end(*early[1:])


def _end(zygote: subprocess.Popen, sock: socket.socket) -> None:
    sock.close()
    zygote.kill()
    zygote.wait()


def install() -> None:
    """Start the zygote when this process is the agent command with ``--launcher preload``."""
    from fsm_agent._early_signals import _is_agent_command, _option

    global _early
    argv, orig = list(sys.argv), list(getattr(sys, "orig_argv", []))
    if _early is not None or not _is_agent_command(argv, orig) or sys.platform != "linux":
        return
    args = argv[1:] if argv and os.path.basename(argv[0]) != "-m" else orig
    if _option(args, "--launcher", "FSM_AGENT_LAUNCHER", "subprocess") != "preload":
        return
    modules = _option(args, "--preload-modules", "FSM_AGENT_PRELOAD_MODULES", DEFAULT_MODULES) or DEFAULT_MODULES
    try:
        _early = (modules, *spawn(modules))
    except OSError:  # the launcher tries again, and says why if it fails too
        _early = None
