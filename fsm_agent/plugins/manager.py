"""The plugins of a run: ``load_plugins()`` -> ``LoadedPlugins`` (the plugin manager, its backend
registry and its plugins' options, each built once), ``get_plugin_manager()`` (hookspecs + built-in
plugins + entry points, with disable-by-name) and ``fsm-agent plugins``.

Built-ins are registered with the same ``pm.register`` call that entry-point plugins reach.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from collections.abc import Iterable
from typing import Any

import attrs
import pluggy

from fsm_agent.config import OptionRegistry
from fsm_agent.errors import ConfigError, FsmAgentError, PluginError
from fsm_agent.plugins import ENTRY_POINT_GROUP, PROJECT_NAME, hookspecs
from fsm_agent.plugins.listeners import reject_listener_wrappers
from fsm_agent.plugins.registry import BackendRegistry
from fsm_agent.settings import DISABLE_PLUGINS_ENV, parse_names

log = logging.getLogger(__name__)

#: name -> module of the plugins that ship with fsm-agent (registered before entry points).
BUILTIN_PLUGINS: dict[str, str] = {
    "rendezvous-c10d": "fsm_agent.plugins.rendezvous_c10d",
    "rendezvous-static": "fsm_agent.plugins.rendezvous_static",
    "rendezvous-fsm": "fsm_agent.plugins.rendezvous_fsm",
    "rendezvous-torchrun-handlers": "fsm_agent.plugins.rendezvous_torchrun_handlers",
    "launcher-subprocess": "fsm_agent.plugins.launcher_subprocess",
    "launcher-preload": "fsm_agent.plugins.launcher_preload",
    "restart-policy": "fsm_agent.plugins.restart_policy",
    "inprocess": "fsm_agent.plugins.inprocess",
    "attribution": "fsm_agent.plugins.attribution",
    "progress": "fsm_agent.plugins.progress",
    "checkpoint": "fsm_agent.plugins.checkpoint",
    "drain": "fsm_agent.plugins.drain",
    "health-check": "fsm_agent.plugins.health_check",
    "node-checks": "fsm_agent.plugins.node_checks",
    "node-check-local": "fsm_agent.plugins.node_check_local",
    "node-check-network": "fsm_agent.plugins.node_check_network",
    "straggler": "fsm_agent.plugins.straggler",
    "metrics-logging": "fsm_agent.plugins.metrics_logging",
    "events-jsonl": "fsm_agent.plugins.events_jsonl",
    "status-http": "fsm_agent.plugins.status_http",
    "scheduler-slurm": "fsm_agent.plugins.scheduler_slurm",
    "scheduler-kubernetes": "fsm_agent.plugins.scheduler_kubernetes",
}
#: Test tooling, registered like a built-in but only while ``pytest --statechart-coverage``
#: records (it sets the recorder's directory variable for the agents it runs), and never listed
#: by ``fsm-agent plugins`` or the plugin guide. Its name stays valid for ``--disable-plugin``.
TEST_TOOLING_PLUGINS: dict[str, tuple[str, str]] = {
    "statechart-coverage": ("fsm_agent.plugins.coverage_recorder", "FSM_STATECHART_COVERAGE_DIR"),
}
#: Built-ins that cannot be disabled: without them the agent cannot run at all.
ESSENTIAL_PLUGINS = frozenset({"launcher-subprocess"})
#: The variable of the ``--disable-plugin`` setting (declared once, in settings.py).
DISABLE_ENV = DISABLE_PLUGINS_ENV


def disabled_from_env() -> tuple[str, ...]:
    return parse_names(os.environ.get(DISABLE_ENV, ""))


def plugin_names() -> list[str]:
    """Every name ``--disable-plugin`` accepts: the built-ins' and the ``fsm_agent`` entry points'
    (installed plugins, listed without importing them), sorted."""
    from importlib.metadata import entry_points

    return sorted({*BUILTIN_PLUGINS, *TEST_TOOLING_PLUGINS, *(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))})


def check_disabled(flag_names: Iterable[str], file_names: Iterable[str] = (), file_label: str = "") -> None:
    """Refuse a name to disable that no plugin has, wherever it came from: the config file's
    ``disabled_plugins`` (``file_names``, read from ``file_label``), ``FSM_AGENT_DISABLE_PLUGINS``
    or ``--disable-plugin`` (``flag_names``).

    Raises:
        ConfigError: one line naming the unknown name, where it was given and every known name.
    """
    given = [
        (f"disabled_plugins of {file_label}", tuple(file_names)),
        (DISABLE_ENV, disabled_from_env()),
        ("--disable-plugin", tuple(flag_names)),
    ]
    if not any(names for _, names in given):
        return  # the common case: no scan of the installed distributions on every start
    known = plugin_names()
    for where, names in given:
        for name in names:
            if name not in known:
                raise ConfigError(
                    f"unknown plugin {name!r} in {where}: known plugins are {', '.join(known)}; fix {where}"
                )


def get_plugin_manager(disabled: Iterable[str] = (), load_entry_points: bool = True) -> pluggy.PluginManager:
    """A fresh PluginManager with every hookspec, the built-ins and the installed plugins.

    Args:
        disabled: plugin names to block (``--disable-plugin``); ``FSM_AGENT_DISABLE_PLUGINS`` adds more.
        load_entry_points: also load the ``fsm_agent`` entry-point group (tests may turn it off).

    Raises:
        ConfigError: an essential plugin was asked to be disabled.
        PluginError: a plugin failed to import or implements a hook that does not exist.
    """
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    for name in (*disabled, *disabled_from_env()):
        if name in ESSENTIAL_PLUGINS:
            raise ConfigError(f"--disable-plugin {name}: {name!r} is essential and cannot be disabled")
        pm.set_blocked(name)
    for name, module_name in BUILTIN_PLUGINS.items():
        if not pm.is_blocked(name):
            pm.register(importlib.import_module(module_name), name)
    for name, (module_name, active_env) in TEST_TOOLING_PLUGINS.items():
        if os.environ.get(active_env) and not pm.is_blocked(name):
            pm.register(importlib.import_module(module_name), name)
    if load_entry_points:
        _load_entry_points(pm)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"plugin {exc.plugin!r} is invalid: {exc}") from None
    reject_listener_wrappers(pm)
    return pm


def _load_entry_points(pm: pluggy.PluginManager) -> None:
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if pm.is_blocked(ep.name) or pm.has_plugin(ep.name):
            continue
        dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist else "unknown distribution"
        try:
            plugin = ep.load()
        except Exception as exc:  # any import-time failure of a third-party plugin
            error = PluginError(
                f"plugin {ep.name!r} from {dist} failed to load: {type(exc).__name__}: {exc}; "
                f"fix or uninstall it, or disable it with --disable-plugin {ep.name}"
            )
            error.plugin = ep.name
            raise error from None
        try:
            pm.register(plugin, name=ep.name)
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"plugin {ep.name!r} from {dist} is invalid: {exc}") from None
        # what load_setuptools_entrypoints records (pluggy wraps the dist; its readers take either)
        pm._plugin_distinfo.append((plugin, ep.dist))  # type: ignore[arg-type]


@attrs.frozen
class LoadedPlugins:
    """The loaded plugins of one run, built once per process and handed down: ``fsm-agent run``
    loads them to read their options and gives them to the launch (``run_agent(plugins=...)``).

    ``registry`` and ``options`` are asked of the plugins on first use and then kept, so each
    plugin's ``fsm_agent_register_backends`` and ``fsm_agent_addoption`` run once per run, at the
    moment they are first needed (a plugin whose backends fail still lets ``--help`` answer).

    Attributes:
        pm: the plugin manager (``get_plugin_manager``).
    """

    pm: pluggy.PluginManager

    @functools.cached_property
    def registry(self) -> BackendRegistry:
        """The backends the plugins registered (``build_registry``).

        Raises:
            PluginError: a plugin's ``fsm_agent_register_backends`` failed.
        """
        return build_registry(self.pm)

    @functools.cached_property
    def options(self) -> OptionRegistry:
        """The options the plugins declared (``collect_options``).

        Raises:
            PluginError: a plugin's ``fsm_agent_addoption`` failed or declared a bad option.
        """
        return collect_options(self.pm)


def load_plugins(disabled: Iterable[str] = (), load_entry_points: bool = True) -> LoadedPlugins:
    """``LoadedPlugins`` of ``get_plugin_manager(disabled, load_entry_points)`` (its errors)."""
    return LoadedPlugins(get_plugin_manager(disabled=disabled, load_entry_points=load_entry_points))


def build_registry(pm: pluggy.PluginManager) -> BackendRegistry:
    """Ask every plugin for its backends, one plugin at a time so duplicates name their owner."""
    registry = BackendRegistry()
    for impl in pm.hook.fsm_agent_register_backends.get_hookimpls():
        registry.current_plugin = impl.plugin_name
        _call_setup_hook(pm, impl, "fsm_agent_register_backends", {"registry": registry})
    return registry


def collect_options(pm: pluggy.PluginManager) -> OptionRegistry:
    """Ask every plugin for its options (``fsm_agent_addoption``), one plugin at a time so each
    option is owned by the plugin that declared it."""
    options = OptionRegistry()
    for impl in pm.hook.fsm_agent_addoption.get_hookimpls():  # registration order
        options.current_plugin = impl.plugin_name
        _call_setup_hook(pm, impl, "fsm_agent_addoption", {name: options for name in impl.argnames})
    return options


def _call_setup_hook(pm: pluggy.PluginManager, impl: Any, hook_name: str, kwargs: dict[str, Any]) -> None:
    """Call one plugin's setup hook; an unexpected exception becomes a PluginError naming the
    plugin, its distribution and the cause (one line from the CLI instead of a traceback)."""
    try:
        impl.function(**kwargs)
    except FsmAgentError:
        raise
    except Exception as exc:
        dist = next(
            (f"{d.metadata['name']} {d.version}" for plugin, d in pm.list_plugin_distinfo() if plugin is impl.plugin),
            "fsm-agent" if impl.plugin_name in BUILTIN_PLUGINS else "no installed distribution",
        )
        raise PluginError(
            f"plugin {impl.plugin_name!r} from {dist} failed in {hook_name}: "
            f"{type(exc).__name__}: {exc}; fix or uninstall it, or disable it with "
            f"--disable-plugin {impl.plugin_name}"
        ) from None


#: Plugin kinds, in the order ``fsm-agent plugins`` lists them.
PLUGIN_KINDS = ("rendezvous", "launcher", "scheduler", "metrics", "event recording", "lifecycle")
#: Listener hooks that make a plugin a metrics or event-recording plugin.
_KIND_OF_HOOK = {
    "fsm_agent_put_metric": "metrics",
    "fsm_agent_record_event": "event recording",
    "fsm_agent_discover_job": "scheduler",
}
#: Kinds of built-ins that ``plugin_rows`` cannot see from their hooks alone: the listener that
#: events-jsonl registers in ``fsm_agent_configure``, and the torchrun.handlers bridge, which
#: registers nothing when no ``torchrun.handlers`` entry point is installed. A third-party plugin
#: in the same situation declares its kinds with a module (or object) attribute
#: ``FSM_AGENT_KINDS = ("metrics",)``.
_DECLARED_KINDS = {"events-jsonl": ("event recording",), "rendezvous-torchrun-handlers": ("rendezvous",)}


def plugin_rows(pm: pluggy.PluginManager, registry: BackendRegistry | None = None) -> list[dict[str, Any]]:
    """One row per registered plugin: name, kinds, backends, hooks, distribution/version, built-in or not.

    Kinds come from the hooks: ``fsm_agent_register_backends`` gives the kinds of the backends the
    plugin registered (``rendezvous``, ``launcher``; ``registry`` or a fresh ``build_registry(pm)``),
    ``fsm_agent_put_metric`` gives ``metrics``, ``fsm_agent_record_event`` ``event recording``,
    ``fsm_agent_discover_job`` ``scheduler``; a plugin
    with none of these is ``lifecycle``. A plugin's ``FSM_AGENT_KINDS`` attribute overrides them.

    Raises:
        PluginError: a plugin's ``fsm_agent_register_backends`` failed (from ``build_registry``).
    """
    if registry is None:
        registry = build_registry(pm)
    backends: dict[str, list[tuple[str, str]]] = {}
    for kind in ("rendezvous", "launcher"):
        for backend in registry.names(kind):
            backends.setdefault(registry.owner(kind, backend), []).append((kind, backend))
    dists = {id(plugin): dist for plugin, dist in pm.list_plugin_distinfo()}
    rows = []
    for name, plugin in pm.list_name_plugin():
        if plugin is None or name in TEST_TOOLING_PLUGINS:
            continue
        dist = dists.get(id(plugin))
        hooks = sorted(h.name for h in pm.get_hookcallers(plugin) or [])
        own = backends.get(name, [])
        declared = getattr(plugin, "FSM_AGENT_KINDS", None) or _DECLARED_KINDS.get(name)
        if isinstance(declared, str):
            declared = (declared,)
        found = {kind for kind, _ in own} | {_KIND_OF_HOOK[h] for h in hooks if h in _KIND_OF_HOOK}
        kinds = list(declared) if declared else [k for k in PLUGIN_KINDS if k in found] or ["lifecycle"]
        rows.append(
            {
                "name": name,
                "kinds": kinds,
                "backends": {
                    kind: [b for k, b in own if k == kind]
                    for kind in ("rendezvous", "launcher")
                    if any(k == kind for k, _ in own)
                },
                "hooks": hooks,
                "builtin": name in BUILTIN_PLUGINS,
                "distribution": dist.metadata["name"] if dist else "fsm-agent",
                "version": dist.version if dist else _own_version(),
            }
        )
    return rows


def _own_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fsm-agent")
    except PackageNotFoundError:
        return "0+unknown"


def cli_main(argv: list[str]) -> int:
    """``fsm-agent plugins``: list every loaded plugin (a table, or ``--json``).

    A plugin that fails to load raises ``PluginError``: the CLI prints it as one line and exits non-zero.
    """
    import json

    from fsm_agent.argparsing import OneLineParser

    parser = OneLineParser(
        prog="fsm-agent plugins",
        description="List every loaded plugin: its name, distribution and version, "
        "whether it is built-in, its kind(s), the backends it registers and the hooks it implements.",
        epilog=f"{DISABLE_ENV}=a,b also disables plugins.",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON list of rows instead of a table")
    parser.add_argument(
        "--disable-plugin",
        action="append",
        default=[],
        metavar="NAME",
        help="do not load plugin NAME (repeatable; a comma-separated list works too)",
    )
    args = parser.parse_args(argv)
    disabled = [n.strip() for value in args.disable_plugin for n in value.split(",") if n.strip()]
    check_disabled(disabled)
    plugins = load_plugins(disabled=disabled)
    rows = plugin_rows(plugins.pm, plugins.registry)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = [("NAME", "DISTRIBUTION", "VERSION", "BUILT-IN", "KINDS", "BACKENDS", "HOOKS")]
    for row in rows:
        table.append(
            (
                row["name"],
                row["distribution"],
                row["version"],
                "yes" if row["builtin"] else "no",
                ", ".join(row["kinds"]),
                ", ".join(b for names in row["backends"].values() for b in names) or "-",
                ", ".join(h.removeprefix("fsm_agent_") for h in row["hooks"]) or "-",
            )
        )
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]) - 1)]
    for line in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths)) + "  " + line[-1])
    return 0
