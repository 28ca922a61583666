"""Which hooks are listeners, and the one rule that follows: no wrapper implementations of them.

A listener hook (metrics, events, lifecycle notifications) is called by the agent one
implementation at a time (``ElasticAgent._broadcast``), so that one failing listener cannot
silence the others; pluggy would stop a hook call at the first exception. A ``wrapper=True``
implementation of such a hook would therefore never run. Read by the plugin manager, the agent
(for plugins registered after the manager was built) and the plugin guide's generator.
"""

from __future__ import annotations

import pluggy

from fsm_agent.errors import PluginError

LISTENER_HOOKS = (
    "fsm_agent_rendezvous_completed",
    "fsm_agent_workers_started",
    "fsm_agent_worker_exited",
    "fsm_agent_put_metric",
    "fsm_agent_record_event",
    "fsm_agent_state_changed",
    "fsm_agent_unconfigure",
)


def reject_listener_wrappers(pm: pluggy.PluginManager) -> None:
    """Refuse, by plugin name, a ``wrapper=True`` implementation of a listener hook.

    Raises:
        PluginError: one line naming the plugin and the hook.
    """
    for name in LISTENER_HOOKS:
        for impl in getattr(pm.hook, name).get_hookimpls():
            if impl.wrapper or impl.hookwrapper:
                raise PluginError(
                    f"plugin {impl.plugin_name!r}: {name} is a listener hook, called once per "
                    f"implementation; wrapper implementations are not supported there"
                )
