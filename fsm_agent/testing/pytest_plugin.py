"""pytest fixtures of the fsm-agent test kit (entry point ``pytest11: fsm_agent``).

Loaded for every pytest run where fsm-agent is installed, so it imports nothing heavy until a
fixture is used.
"""

from __future__ import annotations

import pytest


@pytest.fixture
def plugin_manager():
    """A fresh fsm-agent PluginManager: hookspecs and built-in plugins, no entry points.

    Override this fixture to load entry points or block plugins.
    """
    from fsm_agent.plugins.manager import get_plugin_manager

    return get_plugin_manager(load_entry_points=False)


@pytest.fixture
def hook_recorder(plugin_manager):
    """A HookRecorder watching ``plugin_manager``; ``make_agent`` attaches it to each agent."""
    from fsm_agent.testing.recorder import HookRecorder

    recorder = HookRecorder(plugin_manager)
    yield recorder
    recorder.close()


@pytest.fixture
def make_agent(plugin_manager, hook_recorder, tmp_path):
    """An AgentFactory: ``make_agent(rendezvous=FakeRendezvous(...), launcher=FakeLauncher(...),
    max_restarts=..., plugins=[...], ...)`` builds the real ElasticAgent (run it with ``.run()``).

    The agent uses ``plugin_manager``, is followed by ``hook_recorder`` and logs under ``tmp_path/logs``.
    """
    from fsm_agent.testing.scenario import AgentFactory

    factory = AgentFactory(plugin_manager=plugin_manager, recorder=hook_recorder, log_dir=str(tmp_path / "logs"))
    yield factory
    factory.close()


@pytest.fixture
def agent_factory(make_agent):
    """The same AgentFactory as ``make_agent``."""
    return make_agent
