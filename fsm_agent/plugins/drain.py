"""Built-in drain plugin: preemption notice as an input, an orderly stop that is not a failure.

A drain is requested by

- a signal of ``--drain-signals SIGUSR2,...`` (none by default; a signal cannot be both a drain
  signal and in ``--signals-to-handle``, which keeps torch's meaning: stop the job),
- a file appearing at ``--drain-file PATH`` (a node-health daemon's mark; looked at every 0.5 s
  while the workers run, and before each rendezvous),
- ``POST /drain`` on the status endpoint (``--status-port``; see the ``status-http`` plugin),
- a peer's job-wide drain (``--drain-scope job``), read from the rendezvous store.

The statechart's ``drain_requested`` rows then send every worker ``--drain-checkpoint-signal``
(default SIGUSR1), wait up to ``--drain-timeout`` seconds for them to exit by themselves, stop the
rest, and end the run with ``DRAIN_EXIT_CODE`` (75: requeue). ``--drain-scope node`` (the default):
only this node leaves; the others see a departed node and re-rendezvous without counting a
restart. ``--drain-scope job``: every node of the job drains. A drain never spends the restart
budget; it is a ``drain`` record in the events file, the ``fsm_agent.drains`` and
``run_drained`` metrics and the ``drain`` field of ``/status``.
"""

from __future__ import annotations

import os

from fsm_agent.errors import ConfigError
from fsm_agent.plugins import hookimpl
from fsm_agent.signal_names import signal_numbers
from fsm_agent.worker import DEFAULT_DRAIN_TIMEOUT_S, DRAIN_SCOPES, DrainSettings

PLUGIN_NAME = "drain"
#: What a ``--drain-file`` already there at start does (``--drain-file-at-start``).
FILE_AT_START = ("refuse", "drain")


def _signal_number(name: str) -> int:
    """``SIGUSR2`` (or ``USR2``) as its number.

    Raises:
        ValueError: not a signal, or one that cannot be caught.
    """
    numbers = signal_numbers(name)
    if len(numbers) != 1:
        raise ValueError(f"expected one signal name like SIGUSR1, got {name.strip()!r}")
    return int(numbers[0])


def _signal_numbers(names: str) -> tuple[int, ...]:
    return tuple(int(n) for n in signal_numbers(names))


def _check_signals(names: str) -> None:
    signal_numbers(names)  # raises ValueError naming a bad one


def _check_timeout(seconds: float) -> None:
    if seconds < 0:
        raise ValueError(f"expected seconds >= 0, got {seconds}")


@hookimpl
def fsm_agent_addoption(options):
    options.add(
        "signals",
        type=str,
        default="",
        check=_check_signals,
        help="signals that request a drain, e.g. SIGUSR2 (default: none); not a --signals-to-handle one",
    )
    options.add(
        "file",
        type=str,
        default="",
        help="a file whose appearance requests a drain (a node-health daemon's mark); default: none",
    )
    options.add(
        "file_at_start",
        type=str,
        default="refuse",
        choices=FILE_AT_START,
        help="a --drain-file already there when the agent starts: refuse (exit 2, one line: a mark "
        "never removed would requeue the job forever) or drain (at once, exit 75)",
    )
    options.add(
        "timeout",
        type=float,
        default=DEFAULT_DRAIN_TIMEOUT_S,
        check=_check_timeout,
        help="seconds the workers get after the checkpoint signal to exit by themselves; then stopped",
    )
    options.add(
        "scope",
        type=str,
        default="node",
        choices=DRAIN_SCOPES,
        help="node: only this node leaves, the others re-rendezvous; job: the whole job drains",
    )
    options.add(
        "checkpoint_signal",
        type=str,
        default="SIGUSR1",
        check=_signal_number,
        help="the signal the workers get when a drain starts (their cue to checkpoint and exit 0)",
    )


@hookimpl
def fsm_agent_configure(config, agent):
    options = config.plugin_options(PLUGIN_NAME) if config is not None else {}
    settings = DrainSettings(
        signals=_signal_numbers(options.get("signals") or ""),
        file=options.get("file") or None,
        timeout_s=float(options["timeout"] if options.get("timeout") is not None else DEFAULT_DRAIN_TIMEOUT_S),
        scope=options.get("scope") or "node",
        checkpoint_signal=_signal_number(options.get("checkpoint_signal") or "SIGUSR1"),
    )
    if settings.file and os.path.lexists(settings.file) and (options.get("file_at_start") or "refuse") == "refuse":
        # Draining at once would end every start of the job with 75 (requeue) while the mark stays.
        raise ConfigError(
            f"--drain-file {settings.file}: it exists already, before the job started (a mark never removed, "
            f"or this node is being drained): remove it, run the job on another node, or give "
            f"--drain-file-at-start drain to drain at once (exit 75)"
        )
    agent.drain_on(settings)
