"""fsm-agent: an elastic agent for PyTorch distributed training, driven by a statechart with plugins.

Public API: ``launch_agent``/``elastic_launch`` (torch's launcher API: ``{global_rank: value}``, or
``WorkerGroupFailedError``, a torch ``ChildFailedError``), ``run_agent`` (the same run, returning
the ``RunResult``), ``LaunchConfig``, the data
model (``WorkerSpec``, ``Worker``, ``WorkerGroup``, ``WorkerState``, ``RunResult``), ``hookimpl``, and
``heartbeat()`` and ``compute()`` for workers (progress and compute-time reports: ``--hang-timeout``,
``--straggler-window``).

Importing the package has no side effects and is light: each name is imported when first used
(so a worker's ``from fsm_agent import heartbeat`` costs no agent, and nothing imports torch); no
process is started and no signal handler installed (the console scripts do that, in
``fsm_agent._entry``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Bound now, not lazily: the function ``heartbeat`` shares its name with its module, and importing
# ``fsm_agent.heartbeat`` (a worker's ``from fsm_agent.heartbeat import ...``) would otherwise leave
# the module where the function belongs. Standard library only, no side effects.
from fsm_agent.heartbeat import compute, heartbeat

if TYPE_CHECKING:
    from fsm_agent.config import LaunchConfig
    from fsm_agent.launch import AgentFailedError as AgentFailedError
    from fsm_agent.launch import WorkerGroupFailedError as WorkerGroupFailedError
    from fsm_agent.launch import elastic_launch, launch_agent, run_agent
    from fsm_agent.plugins import hookimpl
    from fsm_agent.states.worker_state import WorkerState
    from fsm_agent.worker import RunResult, Worker, WorkerFailure, WorkerGroup, WorkerSpec

#: Each public name -> the module that defines it.
_EXPORTS = {
    "LaunchConfig": "fsm_agent.config",
    "WorkerSpec": "fsm_agent.worker",
    "Worker": "fsm_agent.worker",
    "WorkerGroup": "fsm_agent.worker",
    "WorkerState": "fsm_agent.states.worker_state",
    "WorkerFailure": "fsm_agent.worker",
    "RunResult": "fsm_agent.worker",
    "hookimpl": "fsm_agent.plugins",
    "launch_agent": "fsm_agent.launch",
    "elastic_launch": "fsm_agent.launch",
    "run_agent": "fsm_agent.launch",
    "WorkerGroupFailedError": "fsm_agent.launch",
    "AgentFailedError": "fsm_agent.launch",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fsm_agent' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later reads do not come here
    return value


#: ``from fsm_agent import *``: every public name but the two errors, which derive from torch's
#: ``ChildFailedError`` and so import torch (``from fsm_agent import WorkerGroupFailedError`` does).
__all__ = [
    "LaunchConfig",
    "WorkerSpec",
    "Worker",
    "WorkerGroup",
    "WorkerState",
    "WorkerFailure",
    "RunResult",
    "hookimpl",
    "heartbeat",
    "compute",
    "launch_agent",
    "elastic_launch",
    "run_agent",
]
