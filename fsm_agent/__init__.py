"""fsm-agent: an elastic agent for PyTorch distributed training, driven by a statechart with plugins.

Public API: ``launch_agent``/``elastic_launch`` (torch's launcher API: ``{global_rank: value}``, or
``WorkerGroupFailedError``, a torch ``ChildFailedError``), ``run_agent`` (the same run, returning
the ``RunResult``), ``LaunchConfig``, the data
model (``WorkerSpec``, ``Worker``, ``WorkerGroup``, ``WorkerState``, ``RunResult``), ``hookimpl``, and
``heartbeat()`` and ``compute()`` for workers (progress and compute-time reports: ``--hang-timeout``,
``--straggler-window``).
"""

from fsm_agent import _early_signals

_early_signals.install()  # first: the agent command handles signals from its first milliseconds on

from fsm_agent import _early_zygote  # noqa: E402

_early_zygote.install()  # then --launcher preload's zygote starts importing torch while the agent starts

from typing import Any  # noqa: E402

from fsm_agent.config import LaunchConfig
from fsm_agent.heartbeat import compute, heartbeat
from fsm_agent.plugins import hookimpl
from fsm_agent.states.worker_state import WorkerState
from fsm_agent.worker import RunResult, Worker, WorkerFailure, WorkerGroup, WorkerSpec


_LAUNCH_NAMES = ("launch_agent", "elastic_launch", "run_agent", "WorkerGroupFailedError", "AgentFailedError")


def __getattr__(name: str) -> Any:  # the launcher pulls in the agent; keep `import fsm_agent` light
    if name in _LAUNCH_NAMES:
        from fsm_agent import launch

        return getattr(launch, name)
    raise AttributeError(name)


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
    *_LAUNCH_NAMES,
]
