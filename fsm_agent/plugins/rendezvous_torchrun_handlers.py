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
    eps = [ep for ep in entry_points(group="torchrun.handlers") if ep.name not in registry.names("rendezvous")]
    if eps:
        _import_torch_rendezvous()
    for ep in eps:
        try:
            creator = ep.load()()
        except Exception as exc:
            dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist else "unknown distribution"
            raise PluginError(
                f"torchrun.handlers entry point {ep.name!r} from {dist} failed to load: "
                f"{type(exc).__name__}: {exc}; fix or uninstall it, or ignore every torchrun.handlers "
                f"entry point with --disable-plugin rendezvous-torchrun-handlers"
            ) from None
        registry.add_rendezvous(ep.name, creator)


def _import_torch_rendezvous() -> None:
    """Import torch's rendezvous package before any handler module, in the order torchrun has.

    Importing ``torch.distributed.elastic.rendezvous`` loads every ``torchrun.handlers`` entry point
    itself. A handler module that imports that package at its top (as most do) and is loaded first
    would be reached again, half-imported, from inside torch's loop: torch would log a
    circular-import traceback. torch's warnings for failing entry points are muted while it loads
    them; the loop above reports such an entry point as one line instead.
    """
    import logging
    import sys

    if "torch.distributed.elastic.rendezvous" in sys.modules:
        return
    torch_log = logging.getLogger("torch.distributed.elastic.rendezvous.registry")
    disabled, torch_log.disabled = torch_log.disabled, True
    try:
        import torch.distributed.elastic.rendezvous  # noqa: F401
    finally:
        torch_log.disabled = disabled
