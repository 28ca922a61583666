"""fsm-agent's plugin contract: pluggy hooks, named ``fsm_agent_*``, in the entry-point group ``fsm_agent``.

A plugin is a module (or object) with ``@hookimpl`` functions. Ship it as a distribution with::

    [project.entry-points.fsm_agent]
    myplugin = "fsm_agent_myplugin"

and implement any hooks of ``fsm_agent.plugins.hookspecs``, for example::

    from fsm_agent.plugins import hookimpl

    @hookimpl
    def fsm_agent_put_metric(metric_group, metric_name, metric_value):
        print(metric_group, metric_name, metric_value)

Selectable backends (rendezvous, launcher) are contributed by name through
``fsm_agent_register_backends(registry)``; listeners (metrics, events) receive every call.
Built-in plugins (``fsm_agent.plugins.*``) register through the same mechanism.
"""

import pluggy

PROJECT_NAME = "fsm_agent"
ENTRY_POINT_GROUP = "fsm_agent"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

__all__ = ["hookimpl", "hookspec", "PROJECT_NAME", "ENTRY_POINT_GROUP"]
