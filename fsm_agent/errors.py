"""The one exception module: every error fsm-agent raises on purpose derives from FsmAgentError.

``cli.py`` is the only place that turns these into exit codes; it prints ``str(exc)``
on one line, so every message names the input, the value and the fix; an error that gathers
several (every error of a config file) prints its ``headline`` and then one ``details`` line each.
"""

from __future__ import annotations

from collections.abc import Sequence


class FsmAgentError(Exception):
    """Base class of all fsm-agent errors. ``exit_code`` is what the CLI exits with.

    Args:
        details: several errors reported at once, each naming its input (``str(exc)`` still
            holds them all on one line).
        headline: the line the CLI prints above ``details`` (default ``N errors:``).
    """

    exit_code: int = 1

    def __init__(self, *args: object, details: Sequence[str] = (), headline: str = ""):
        super().__init__(*args)
        self.details = tuple(details)
        self.headline = headline


class ConfigError(FsmAgentError):
    """Bad user input: a flag, an environment variable or a config file value.

    The message names the input and the fix, e.g.
    ``--nnodes '3:2': MIN must be <= MAX (use e.g. --nnodes 2:3)``.
    """

    exit_code = 2


class PluginError(FsmAgentError):
    """A plugin failed to load, registered a conflicting backend or broke the hook contract.

    Attributes:
        plugin: the name of the plugin that failed to load, where known (else None).
    """

    exit_code = 2
    plugin: str | None = None


class StateError(FsmAgentError):
    """A transition could not complete: the state, the trigger and the cause are in the message."""


class RendezvousFailed(FsmAgentError):
    """The rendezvous could not complete (timeout, closed, store unreachable).

    Backends that do not build on torch raise this (or a subclass); torch's
    ``RendezvousError`` is treated the same way by the agent.
    """

    exit_code = 1


class RendezvousNotNeeded(FsmAgentError):
    """This node is beyond ``max_nodes`` and the job no longer needs it: a clean exit.

    Mirrors torch's ``RendezvousGracefulExitError``.
    """

    exit_code = 0
