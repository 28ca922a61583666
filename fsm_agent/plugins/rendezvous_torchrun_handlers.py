"""Built-in bridge: rendezvous handlers from torch's ``torchrun.handlers`` entry points.

torch calls each entry point with no arguments and registers the returned creator
(``rendezvous/registry.py:_register_out_of_tree_handlers``); we do the same, except that a
failing entry point is an error naming it instead of a swallowed warning.
"""

from __future__ import annotations

from importlib.metadata import entry_points

from fsm_agent.errors import PluginError
from fsm_agent.plugins import hookimpl


@hookimpl(trylast=True)
def fsm_agent_register_backends(registry):
    for ep in entry_points(group="torchrun.handlers"):
        if ep.name in registry.names("rendezvous"):
            continue
        try:
            creator = ep.load()()
        except Exception as exc:
            dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist else "unknown distribution"
            raise PluginError(f"torchrun.handlers entry point {ep.name!r} from {dist} failed to load: {exc}") from None
        registry.add_rendezvous(ep.name, creator)
