"""WorkerState: the worker group's lifecycle states, with torch's names and values."""

from __future__ import annotations

import enum


class WorkerState(str, enum.Enum):
    """State of a worker group, mirroring ``torch.distributed.elastic.agent.server.WorkerState``.

    The state belongs to the whole worker group of one agent, not to single workers.

    - UNKNOWN: the agent lost track of its workers (or an agent error); terminal here.
    - INIT: group created, workers not started yet (rendezvous pending).
    - HEALTHY: all workers running.
    - UNHEALTHY: workers running but judged hung or stuck.
    - STOPPED: workers stopped by the agent, about to rendezvous and restart.
    - SUCCEEDED: all workers exited 0 (terminal).
    - FAILED: workers failed and no restart is left (terminal).
    """

    UNKNOWN = "UNKNOWN"
    INIT = "INIT"
    HEALTHY = "HEALTHY"
    UNHEALTHY = "UNHEALTHY"
    STOPPED = "STOPPED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"

    @staticmethod
    def is_running(state: WorkerState) -> bool:
        """True for HEALTHY and UNHEALTHY, as torch's ``WorkerState.is_running``."""
        return state in (WorkerState.HEALTHY, WorkerState.UNHEALTHY)

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({WorkerState.SUCCEEDED, WorkerState.FAILED, WorkerState.UNKNOWN})
