"""The agent's own temporary directories, for whoever cleans up after an agent that died.

An agent removes the directories it made (its temporary log directory when no ``--log-dir`` was
given, its heartbeat directory) on its way out; a SIGKILLed agent cannot. Each is registered here
when made, and the workers' cgroup keeper (``fsm_agent.plugins.containment``), which outlives a
SIGKILLed agent, removes them when the agent died. Without a cgroup there is no keeper, and the
directories stay.
"""

from __future__ import annotations

_registered: list[str] = []


def remove_if_the_agent_dies(path: str) -> None:
    """Register ``path`` (a directory this agent made and removes itself on a normal exit).

    Call it before the workers first start: the keeper is given the list when it starts."""
    _registered.append(path)


def forget(path: str) -> None:
    """``path`` was removed by the agent itself: a keeper started later need not know it."""
    if path in _registered:
        _registered.remove(path)


def registered() -> tuple[str, ...]:
    """The directories registered so far, oldest first."""
    return tuple(_registered)
