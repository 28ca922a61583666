"""Built-in plugin ``node-checks``: when and how long the node checks run (``fsm_agent.node_checks``).

The checks themselves are plugins implementing ``fsm_agent_node_check`` (built-in:
``node-check-network``, ``node-check-local``; a site's own through an entry point): with none
switched on, nothing runs and nothing is exchanged. This plugin only sets the agent's side:

- ``--node-check-timeout S`` (``[plugins.node-checks] timeout``, default 30): seconds every check of
  a node may take together; a node whose checks have not answered by then fails them ("did not
  finish"), never a hang of the job.
- ``--node-check-every-round BOOL`` (default true): check again in every new round (a restart, a
  re-rendezvous, a round re-formed after an exclusion), not only before the first workers start.
"""

from __future__ import annotations

from fsm_agent.plugins import hookimpl
from fsm_agent.plugins.registry import positive_seconds

PLUGIN_NAME = "node-checks"


@hookimpl
def fsm_agent_addoption(options):
    options.add(
        "timeout",
        type=float,
        default=30.0,
        flag="--node-check-timeout",
        env="FSM_AGENT_NODE_CHECK_TIMEOUT",
        check=positive_seconds,
        help="seconds a node's checks may take together before the round starts; past it they count as failed",
    )
    options.add(
        "every_round",
        type=bool,
        default=True,
        flag="--node-check-every-round",
        env="FSM_AGENT_NODE_CHECK_EVERY_ROUND",
        help="run the node checks in every new round (restarts, re-rendezvous), not only the first (default: true)",
    )


@hookimpl
def fsm_agent_configure(config, agent):
    options = config.plugin_options(PLUGIN_NAME) if config is not None else {}
    every_round = options.get("every_round")
    agent.configure_node_checks(
        timeout_s=options.get("timeout") or 30.0, every_round=True if every_round is None else bool(every_round)
    )
