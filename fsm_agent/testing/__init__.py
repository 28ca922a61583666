"""fsm_agent.testing: a statechart-driven test kit for fsm-agent and its plugins.

Installed with fsm-agent and loaded by pytest through the ``pytest11`` entry point, so a plugin
package's tests get the fixtures without any conftest:

- ``make_agent`` (alias ``agent_factory``): an AgentFactory building the real ElasticAgent on
  fakes, with a real plugin manager and real hook dispatch; log directory under ``tmp_path``.
- ``plugin_manager``: a fresh PluginManager (built-ins, no entry points); override the fixture
  to change it.
- ``hook_recorder``: a HookRecorder on that manager, attached to every agent ``make_agent`` builds.

Public names (imported lazily: ``import fsm_agent.testing`` does not import torch):

- fakes: ``FakeRendezvous``, ``Round``, ``FakeLauncher``, ``Attempt``, ``StartRecord``,
  ``StopRecord``, ``FakeLauncherError``, ``send_signal``
- hooks: ``HookRecorder``, ``HookCall``, ``TransitionHooks``
- real processes: ``AgentProcesses`` (fixture ``agent_processes``; ``run`` one agent to the end,
  ``start`` one in the background; a context manager outside a fixture), ``wait_until``
- running: ``build_agent``, ``AgentFactory``, ``Scenario``, ``ScenarioResult``, ``trace``,
  ``assert_trace``, ``format_transition``, ``PHRASES``

Example::

    from fsm_agent.testing import Scenario

    def test_restart_then_success(make_agent, hook_recorder):
        run = Scenario("worker 1 exits 1 -> restart -> all succeed", max_restarts=1).run(make_agent)
        run.assert_trace(["INIT->HEALTHY", "HEALTHY->STOPPED", "STOPPED->HEALTHY", "HEALTHY->SUCCEEDED"])
        hook_recorder.assert_sequence(["worker_exited", "record_event", "restart_policy", "state_changed",
                                       "record_event", "put_metric*3"], transition=1)
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "fsm_agent.testing.fakes": (
        "FakeRendezvous",
        "Round",
        "FakeLauncher",
        "Attempt",
        "StartRecord",
        "StopRecord",
        "FakeLauncherError",
        "send_signal",
    ),
    "fsm_agent.testing.recorder": ("HookRecorder", "HookCall", "TransitionHooks"),
    "fsm_agent.testing.processes": ("AgentProcesses", "wait_until"),
    "fsm_agent.testing.scenario": (
        "build_agent",
        "AgentFactory",
        "Scenario",
        "ScenarioResult",
        "trace",
        "assert_trace",
        "format_transition",
        "PHRASES",
    ),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'fsm_agent.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
