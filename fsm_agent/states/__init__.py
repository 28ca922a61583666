"""The worker-group statechart: WorkerState, the one transition table, and build_machine()."""

from fsm_agent.states.machine import build_machine
from fsm_agent.states.table import AUTO_TRIGGERS, TERMINAL, TRANSITIONS
from fsm_agent.states.worker_state import WorkerState

__all__ = ["WorkerState", "TRANSITIONS", "AUTO_TRIGGERS", "TERMINAL", "build_machine"]
