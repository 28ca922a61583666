"""fsm-agent-example: a launcher (``--launcher example``) and the ``FSM_EXAMPLE_ATTEMPT`` variable.

Loaded by fsm-agent through the entry point ``example`` of the ``fsm_agent`` group.

- ``fsm_agent_register_backends``: the launcher ``example`` (``fsm_agent_example.launcher``).
- Option ``attempt_env`` (``--example-attempt-env true``, ``FSM_AGENT_EXAMPLE_ATTEMPT_ENV``,
  ``[plugins.example] attempt_env``; off by default, so installing the package changes no run):
  every worker gets ``FSM_EXAMPLE_ATTEMPT``, how many times this node's workers were started
  before. Each agent gets its own AttemptCounter (registered in ``fsm_agent_configure``), which
  counts the statechart's ``start`` (INIT -> HEALTHY) and ``restart`` (STOPPED -> HEALTHY)
  transitions, whatever sent the group to STOPPED: unlike ``TORCHELASTIC_RESTART_COUNT`` it
  also counts restarts caused by a membership change.
"""

from __future__ import annotations

from fsm_agent.plugins import hookimpl
from fsm_agent_example.launcher import ExampleLauncher

__all__ = ["ATTEMPT_ENV", "PLUGIN_NAME", "AttemptCounter", "ExampleLauncher"]

PLUGIN_NAME = "example"
#: How many times this node's workers were started before this attempt (0 for the first).
ATTEMPT_ENV = "FSM_EXAMPLE_ATTEMPT"


class AttemptCounter:
    """One agent's count of worker-group starts."""

    def __init__(self, plugin_manager):
        self.plugin_manager = plugin_manager
        self.starts = 0

    @hookimpl
    def fsm_agent_worker_env(self, worker, worker_group):
        return {ATTEMPT_ENV: str(self.starts)}

    @hookimpl
    def fsm_agent_state_changed(self, transition):
        if transition.trigger in ("start", "restart"):  # the group reached HEALTHY: its workers run
            self.starts += 1

    @hookimpl
    def fsm_agent_unconfigure(self, result):
        self.plugin_manager.unregister(self)


@hookimpl
def fsm_agent_register_backends(registry):
    registry.add_launcher(PLUGIN_NAME, ExampleLauncher)


@hookimpl
def fsm_agent_addoption(options):
    options.add(
        "attempt_env",
        type=bool,
        default=False,
        help=f"give every worker {ATTEMPT_ENV}: how many times this node's workers were started "
        f"before (failures and membership changes alike)",
    )


@hookimpl
def fsm_agent_configure(config, agent):
    if config is not None and config.plugin_options(PLUGIN_NAME).get("attempt_env", False):
        agent.plugin_manager.register(AttemptCounter(agent.plugin_manager), f"example-attempts-{id(agent)}")
