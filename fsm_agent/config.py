"""LaunchConfig (attrs, frozen), the configuration file's strict loader, plugin options.

``LaunchConfig`` mirrors ``torch.distributed.launcher.api.LaunchConfig`` field by field where torch
has the field, with torchrun's CLI defaults; fsm-agent's additions are marked "fsm-agent:".
The CLI (``fsm_agent.resolve``) and the Python API (``fsm_agent.launch``) both build one of these.

Values come from, highest precedence first: command-line flags, the environment
(``FSM_AGENT_<NAME>``, then torchrun's ``PET_<NAME>``), a TOML file (``--config FILE``, or
``[tool.fsm_agent]`` in ``./pyproject.toml``), then the defaults. Every setting is declared once in
``fsm_agent.settings`` (``SETTINGS``: flag, variables, file key, ``Kind``); the merge lives in
``fsm_agent.resolve``. This module owns:

- ``load_file_values``: the file structured with cattrs into a schema generated from the settings'
  ``KEYS``, with strict scalar hooks (``"false"`` is not a boolean, ``2.7`` is not an integer),
  unknown keys rejected, and **every** error reported at once, each with its key path::

      fsm.toml: 3 errors: max_restarts: expected an integer >= 0, got "three"; ...

- ``OptionRegistry``: what ``fsm_agent_addoption(options)`` receives; ``options.add(...)`` checks
  the declaration and makes the option a ``Setting`` (``fsm_agent.settings.plugin_option``): a flag,
  an ``FSM_AGENT_<PLUGIN>_<NAME>`` variable and a ``[plugins.<plugin>]`` key, parsed, read from the
  environment, loaded from the file and shown by ``fsm-agent config`` by the same code as every
  other setting; the plugin reads its values back with ``config.plugin_options("<plugin>")``.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Any, cast

import attrs

from fsm_agent.errors import ConfigError, PluginError
from fsm_agent.settings import (
    CONFIG_DESTS,
    KEYS,
    PLUGINS_SECTION,
    RAW,
    RENDEZVOUS_OPTIONS,
    SECTIONS,
    START_METHODS,
    TYPE_KINDS,
    Kind,
    Setting,
    env_name,
    plugin_option,
    show,
)

__all__ = [
    "CONFIG_DESTS",
    "KEYS",
    "RENDEZVOUS_OPTIONS",
    "SECTIONS",
    "ConfigFile",
    "FileValues",
    "LaunchConfig",
    "OptionRegistry",
    "PLUGINS_SECTION",
    "env_name",
    "find_config_file",
    "load_file_values",
]

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    try:
        # The ignores apply when mypy targets Python >= 3.11 (tomllib found), not 3.10 (it is not).
        import tomli as tomllib  # type: ignore[no-redef, unused-ignore]
    except ModuleNotFoundError:
        tomllib = None  # type: ignore[assignment, unused-ignore]


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


@attrs.frozen
class LaunchConfig:
    """One agent's configuration. Times are seconds.

    Attributes:
        min_nodes / max_nodes: ``--nnodes MIN:MAX``; 0 < min <= max.
        nproc_per_node: workers on this node (``--nproc-per-node``, already resolved to an int).
        run_id: ``--rdzv-id``; agents with the same id and endpoint form one job.
        role: ``--role``.
        rdzv_endpoint / rdzv_backend / rdzv_configs: ``--rdzv-endpoint``, ``--rdzv-backend``, ``--rdzv-conf``.
        rdzv_timeout: torch's legacy field: when not -1, seconds put into ``rdzv_configs["timeout"]``.
        max_restarts: ``--max-restarts``.
        monitor_interval: ``--monitor-interval`` seconds (periodic checks only; exits are event-driven).
        start_method: ``--start-method`` for callable entrypoints.
        log_dir: ``--log-dir``; None makes a temporary directory (kept, and printed, as torch does).
        redirects / tee: ``-r`` / ``-t`` values as torch's ``Std`` strings ("0".."3" or "0:3,1:2").
        local_ranks_filter: ``--local-ranks-filter`` as a set of local ranks, or None for all.
        log_line_prefix_template: ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``.
        logs_specs: a torch ``LogsSpecs`` instance (as torch's LaunchConfig takes), the name of a
            ``torchrun.logs_specs`` entry point (``--logs-specs``), or None for the built-in layout.
        local_addr: ``--local-addr``.
        node_rank / master_addr / master_port: static-rendezvous flags.
        event_log_handler: ``--event-log-handler`` (torch's event destination name).
        numa_binding: ``--numa-binding``.
        numa_options: torch's ``NumaOptions`` (Python API); sets ``numa_binding`` to its affinity mode.
        metrics_cfg: torch's metrics configuration, handed to ``torch.distributed.elastic.metrics``.
        signals_to_handle: ``--signals-to-handle`` (comma-separated signal names).
        duplicate_stdout_filters / duplicate_stderr_filters: substrings copied to filtered_*.log.
        virtual_local_rank: ``--virtual-local-rank``.
        shutdown_timeout: ``--shutdown-timeout`` / ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` (30).
        exit_barrier_timeout: fsm-agent: ``--exit-barrier-timeout`` (torch hard-codes 300).
        hang_timeout: fsm-agent: ``--hang-timeout`` seconds without ``fsm_agent.heartbeat()`` (None: off).
        forward_signals: fsm-agent: ``--forward-signals`` names of signals relayed to the workers.
        events_file: fsm-agent: ``--events-file``; None writes ``events.jsonl`` in the log directory.
        launcher: fsm-agent: ``--launcher`` name of the launcher backend (``subprocess``).
        disabled_plugins: fsm-agent: plugin names to block.
        standalone: ``--standalone`` was given (informational; the rdzv fields already reflect it).
        scheduler: fsm-agent: ``--scheduler`` (``auto``, ``none`` or a name; informational: the
            discovered defaults are already in the other fields; docs/schedulers.md).
        plugins: fsm-agent: ``{plugin name: {option name: value}}``, the options plugins declared in
            ``fsm_agent_addoption``; read one plugin's with ``plugin_options(name)``.
    """

    min_nodes: int = 1
    max_nodes: int = 1
    nproc_per_node: int = 1
    run_id: str = "none"
    role: str = "default"
    rdzv_endpoint: str = ""
    rdzv_backend: str = "static"
    rdzv_configs: dict[str, Any] = attrs.field(factory=dict)
    rdzv_timeout: int = -1
    max_restarts: int = 0
    monitor_interval: float = 0.1
    start_method: str = "spawn"
    log_dir: str | None = None
    redirects: str = "0"
    tee: str = "0"
    local_ranks_filter: frozenset[int] | None = None
    log_line_prefix_template: str | None = None
    logs_specs: Any = None
    local_addr: str | None = None
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    event_log_handler: str = "null"
    numa_binding: str | None = None
    numa_options: Any = None
    metrics_cfg: dict[str, str] = attrs.field(factory=dict)
    signals_to_handle: str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    duplicate_stdout_filters: tuple[str, ...] = ()
    duplicate_stderr_filters: tuple[str, ...] = ()
    virtual_local_rank: bool = False
    shutdown_timeout: float = 30.0
    exit_barrier_timeout: float = 300.0
    hang_timeout: float | None = None
    forward_signals: str = ""
    events_file: str | None = None
    launcher: str = "subprocess"
    disabled_plugins: tuple[str, ...] = ()
    standalone: bool = False
    scheduler: str = "auto"
    plugins: dict[str, dict[str, Any]] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        if self.rdzv_timeout != -1:  # torch's LaunchConfig.__post_init__ does the same
            object.__setattr__(self, "rdzv_configs", {**self.rdzv_configs, "timeout": self.rdzv_timeout})
        if self.numa_options is not None and self.numa_binding is None:
            mode = getattr(self.numa_options, "affinity_mode", None)
            object.__setattr__(self, "numa_binding", str(getattr(mode, "value", mode)))
        _check(
            0 < self.min_nodes <= self.max_nodes,
            f"--nnodes {self.min_nodes}:{self.max_nodes}: need 0 < MIN <= MAX (e.g. --nnodes 1:2)",
        )
        _check(
            self.nproc_per_node > 0, f"--nproc-per-node {self.nproc_per_node}: must be > 0 (e.g. --nproc-per-node 2)"
        )
        _check(self.max_restarts >= 0, f"--max-restarts {self.max_restarts}: must be >= 0")
        _check(self.monitor_interval > 0, f"--monitor-interval {self.monitor_interval}: must be > 0 seconds")
        _check(self.shutdown_timeout >= 0, f"--shutdown-timeout {self.shutdown_timeout}: must be >= 0 seconds")
        _check(
            self.exit_barrier_timeout >= 0, f"--exit-barrier-timeout {self.exit_barrier_timeout}: must be >= 0 seconds"
        )
        _check(
            self.hang_timeout is None or self.hang_timeout > 0,
            f"--hang-timeout {self.hang_timeout}: must be > 0 seconds",
        )
        _check(
            self.start_method in START_METHODS, f"--start-method {self.start_method!r}: use spawn, fork or forkserver"
        )

    def evolve(self, **changes: Any) -> LaunchConfig:
        return attrs.evolve(self, **changes)

    @classmethod
    def coerce(cls, config: Any) -> LaunchConfig:
        """``config`` itself, or torch's ``torch.distributed.launcher.api.LaunchConfig`` turned into one.

        torch's fields keep torch's values (its defaults included: ``rdzv_backend="etcd"``,
        ``role="default_role"``, ``max_restarts=3``, ``rdzv_configs["timeout"]=900``); the static
        backend's ``rdzv_configs["rank"]`` becomes ``node_rank``. An empty ``run_id`` gets a random
        one, written back to ``config.run_id``, as torch's ``launch_agent`` does.

        Raises:
            ConfigError: ``config`` is neither, or a value is out of range.
        """
        if isinstance(config, cls):
            return config
        torch_names = ("min_nodes", "max_nodes", "nproc_per_node", "rdzv_backend", "rdzv_configs")
        if not all(hasattr(config, name) for name in torch_names):
            raise ConfigError(
                f"launch config {type(config).__name__!r}: expected fsm_agent.LaunchConfig or "
                "torch.distributed.launcher.api.LaunchConfig"
            )
        if not config.run_id:
            import logging
            import uuid

            config.run_id = str(uuid.uuid4().int)
            logging.getLogger(__name__).warning("config has no run_id, generated a random run_id: %s", config.run_id)
        rdzv_configs = dict(config.rdzv_configs)
        node_rank = int(rdzv_configs.get("rank", 0)) if config.rdzv_backend == "static" else 0
        same = (
            "min_nodes",
            "max_nodes",
            "nproc_per_node",
            "run_id",
            "role",
            "rdzv_endpoint",
            "rdzv_backend",
            "max_restarts",
            "monitor_interval",
            "start_method",
            "log_line_prefix_template",
            "local_addr",
            "event_log_handler",
            "signals_to_handle",
            "virtual_local_rank",
            "logs_specs",
            "numa_options",
        )
        values = {name: getattr(config, name) for name in same if hasattr(config, name)}
        shutdown_timeout = getattr(config, "shutdown_timeout", None)
        return cls(
            **values,
            rdzv_configs=rdzv_configs,
            node_rank=node_rank,
            metrics_cfg=dict(getattr(config, "metrics_cfg", None) or {}),
            duplicate_stdout_filters=tuple(getattr(config, "duplicate_stdout_filters", None) or ()),
            duplicate_stderr_filters=tuple(getattr(config, "duplicate_stderr_filters", None) or ()),
            shutdown_timeout=float(
                os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30") if shutdown_timeout is None else shutdown_timeout
            ),
        )

    def plugin_options(self, plugin: str) -> Mapping[str, Any]:
        """The options plugin ``plugin`` declared in ``fsm_agent_addoption``, as resolved (read-only).

        Every declared option is present (its default when no source set it) when the config
        came from the command line; a config built in Python has only what its ``plugins`` holds,
        so plugins read with ``.get(name, default)``.
        """
        return MappingProxyType(dict(self.plugins.get(plugin, {})))


#: Where a pyproject.toml keeps fsm-agent's settings.
PYPROJECT_TABLE = ("tool", "fsm_agent")


# ------------------------------------------------------------------------------------------------
# Plugin options (fsm_agent_addoption)
# ------------------------------------------------------------------------------------------------

_OPTION_NAME = re.compile(r"[a-z][a-z0-9_]*")


@attrs.define
class OptionRegistry:
    """What ``fsm_agent_addoption(options)`` receives: ``options.add(...)`` declares one option.

    The plugin manager sets ``current_plugin`` around each plugin's call, so options are owned
    by the plugin that declared them (``collect_options`` in ``fsm_agent.plugins.manager``).
    """

    _options: dict[tuple[str, str], Setting] = attrs.Factory(dict)
    current_plugin: str = "?"

    def add(
        self,
        name: str,
        *,
        type: type = str,
        default: Any = None,
        help: str = "",  # noqa: A002
        flag: str | None = None,
        env: str | None = None,
        choices: Iterable[Any] | None = None,
        check: Callable[[Any], None] | None = None,
    ) -> Setting:
        """Declare option ``name`` of the current plugin.

        Args:
            name: snake_case (``[a-z][a-z0-9_]*``); the TOML key under ``[plugins.<plugin>]``.
            type: ``str``, ``int``, ``float`` or ``bool``; values are checked strictly.
            default: used when no flag, env var or file sets it (None: unset).
            help: one line of help.
            flag: the flag, default ``--<plugin>-<name>`` (dashes).
            env: the environment variable, default ``FSM_AGENT_<PLUGIN>_<NAME>``.
            choices: the allowed values.
            check: called with the typed value; raise ValueError("expected ...") to reject it.

        Returns:
            The option's ``Setting`` (``fsm_agent.settings.plugin_option``): its flag, variable and
            file key are read like every other setting's.

        Raises:
            PluginError: a bad name or type, or a name/flag/env var already declared.
        """
        plugin = self.current_plugin
        if not _OPTION_NAME.fullmatch(name):
            raise PluginError(
                f"plugin {plugin!r} declared option {name!r}: names are snake_case ([a-z][a-z0-9_]*), e.g. 'port'"
            )
        if type not in TYPE_KINDS:
            raise PluginError(
                f"plugin {plugin!r} option {name!r}: type must be str, int, float or bool, "
                f"not {getattr(type, '__name__', type)!r}"
            )
        flag = flag or f"--{plugin}-{name}".replace("_", "-")
        if not flag.startswith("--"):
            raise PluginError(f"plugin {plugin!r} option {name!r}: flag {flag!r} must start with '--'")
        option = plugin_option(
            plugin,
            name,
            value_type=type,
            default=default,
            help=help,
            flag=flag,
            env=env or env_name(plugin, name),
            choices=tuple(choices) if choices is not None else None,
            check=check,
        )
        for other in self._options.values():
            for attr in ("key", "flag", "env"):
                if getattr(other, attr) == getattr(option, attr):
                    raise PluginError(
                        f"plugin {plugin!r} declares {attr} {getattr(option, attr)!r}, "
                        f"already declared by plugin {other.plugin!r}"
                    )
        self._options[(plugin, name)] = option
        return option

    def __iter__(self) -> Iterator[Setting]:
        return iter(self._options.values())

    def __len__(self) -> int:
        return len(self._options)

    def plugins(self) -> list[str]:
        return list(dict.fromkeys(o.plugin for o in self if o.plugin is not None))

    def of(self, plugin: str) -> list[Setting]:
        return [o for o in self if o.plugin == plugin]

    def defaults(self) -> dict[str, dict[str, Any]]:
        result: dict[str, dict[str, Any]] = {}
        for option in self:
            result.setdefault(cast(str, option.plugin), {})[option.name] = option.default
        return result


# ------------------------------------------------------------------------------------------------
# Finding and reading the file
# ------------------------------------------------------------------------------------------------


@attrs.frozen
class ConfigFile:
    """A configuration file that was read.

    Attributes:
        path: as given (``--config``) or ``pyproject.toml`` (found in the current directory).
        table: ``tool.fsm_agent`` for a pyproject.toml, None when the whole file is the config.
        data: the raw TOML table (the ``[tool.fsm_agent]`` table for a pyproject.toml).
    """

    path: str
    table: str | None
    data: dict[str, Any]

    @property
    def label(self) -> str:
        return f"{self.path} [{self.table}]" if self.table else self.path


def _read_toml(path: str, origin: str) -> dict[str, Any]:
    if tomllib is None:  # pragma: no cover
        raise ConfigError(f"{origin} {path}: reading TOML needs Python >= 3.11 or the 'tomli' package")
    try:
        with open(path, "rb") as fh:
            data: dict[str, Any] = tomllib.load(fh)
            return data
    except FileNotFoundError:
        raise ConfigError(f"{origin} {path}: no such file; check the path") from None
    except OSError as exc:
        raise ConfigError(f"{origin} {path}: cannot read it: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:  # tomllib decodes the whole file first
        line = exc.object[: exc.start].count(b"\n") + 1
        raise ConfigError(
            f"{path}: byte 0x{exc.object[exc.start]:02x} on line {line} is not UTF-8; TOML is UTF-8: save it as UTF-8"
        ) from None


def find_config_file(explicit: str | None, origin: str = "--config", cwd: str | None = None) -> ConfigFile | None:
    """The file to read: ``explicit`` (``--config``/``FSM_AGENT_CONFIG``), else a ``pyproject.toml``
    in ``cwd`` (the current directory) that has a ``[tool.fsm_agent]`` table, else None.

    An explicit file named ``pyproject.toml`` is read from its ``[tool.fsm_agent]`` table; any
    other file is the configuration from its top level.

    Raises:
        ConfigError: the explicit file is missing, unreadable, not UTF-8 or not TOML; the
            pyproject.toml is not UTF-8 or not TOML; ``[tool.fsm_agent]`` is not a table.
    """
    if explicit:
        data = _read_toml(explicit, origin)
        if os.path.basename(explicit) != "pyproject.toml":
            return ConfigFile(path=explicit, table=None, data=data)
        return ConfigFile(path=explicit, table=".".join(PYPROJECT_TABLE), data=_pyproject_table(explicit, data) or {})
    path = os.path.join(cwd or os.getcwd(), "pyproject.toml")
    if not os.path.isfile(path):
        return None
    table = _pyproject_table("pyproject.toml", _read_toml(path, "pyproject.toml"))
    if table is None:
        return None
    return ConfigFile(path="pyproject.toml" if cwd is None else path, table=".".join(PYPROJECT_TABLE), data=table)


def _pyproject_table(path: str, data: dict[str, Any]) -> dict[str, Any] | None:
    table: Any = data
    for part in PYPROJECT_TABLE:
        if not isinstance(table, dict) or part not in table:
            _check_table_name(path, table if part == PYPROJECT_TABLE[-1] else None)
            return None
        table = table[part]
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [tool.fsm_agent] must be a table, got {show(table)}")
    return table


def _check_table_name(path: str, tool: Any) -> None:
    """A ``[tool.fsm-agent]`` (or ``[tool.fsm_agnet]``) table would be ignored silently: refuse it."""
    if not isinstance(tool, dict):
        return
    wanted = PYPROJECT_TABLE[-1]
    for name in tool:
        if difflib.get_close_matches(re.sub(r"[-.\s]", "_", name.lower()), [wanted], n=1, cutoff=0.8):
            raise ConfigError(
                f"{path}: [tool.{name}] is not read; fsm-agent's table is [tool.{wanted}] "
                f"(an underscore, as in the module name): rename it"
            )


def raw_disabled_plugins(data: Mapping[str, Any]) -> tuple[str, ...]:
    """``disabled_plugins`` from a raw file table, before it is validated (may be malformed: ignored)."""
    value = data.get("disabled_plugins")
    if isinstance(value, list):
        return tuple(s.strip() for s in value if isinstance(s, str) and s.strip())
    return ()


# ------------------------------------------------------------------------------------------------
# Structuring the file with cattrs: every error at once, each with its key path.
# ------------------------------------------------------------------------------------------------


def _optional_fields(pairs: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    return {name: attrs.field(type=typ | None, default=None) for name, typ in pairs}


def _table_class(name: str, settings: Iterable[Setting]) -> type:
    """The attrs class of one file table: an optional field per setting, typed by its ``Kind``."""
    fields = _optional_fields((s.name, cast(Kind, s.kind).type) for s in settings)  # a file key has a kind
    return attrs.make_class(name, fields, frozen=True)


def _schema() -> type:
    """The file's attrs class, generated from ``KEYS``: top-level keys plus one class per section."""
    sections = {
        section: _table_class(f"{section.capitalize()}Section", (k for k in KEYS if k.section == section))
        for section in SECTIONS
    }
    top = [(k.name, cast(Kind, k.kind).type) for k in KEYS if not k.section]  # every file key has a kind
    fields = _optional_fields([*top, *sections.items(), (PLUGINS_SECTION, RAW.type)])
    return attrs.make_class("ConfigFileSchema", fields, frozen=True)


_SCHEMA = _schema()


def make_config_converter() -> Any:
    """A cattrs converter for configuration data: strict and complete.

    - unknown keys are errors (``forbid_extra_keys``);
    - every ``Kind`` checks its value strictly (no ``"false"`` -> True, no ``2.7`` -> 2) and
      converts it to what the flag's argparse action stores;
    - strict hooks for plain ``int``/``float``/``bool``/``str`` too;
    - a table where a section is expected is an error naming the section.
    """
    import cattrs

    converter = cattrs.Converter(forbid_extra_keys=True)
    converter.register_structure_hook_func(
        lambda t: isinstance(getattr(t, "fsm_agent_kind", None), Kind),
        lambda value, t: t.fsm_agent_kind.structure(value),
    )
    for python_type, kind in TYPE_KINDS.items():

        def structure_kind(value: Any, _t: type, kind: Kind = kind) -> Any:
            return kind.structure(value)

        converter.register_structure_hook(python_type, structure_kind)

    from cattrs.gen import make_dict_structure_fn

    section_hooks: dict[type, Callable[[Any, type], Any]] = {}

    def is_section(t: Any) -> bool:
        return isinstance(t, type) and attrs.has(t)

    def structure_section(value: Any, t: type) -> Any:
        if not isinstance(value, dict):
            raise ValueError(f"expected a table, got {show(value)}")
        if t not in section_hooks:
            section_hooks[t] = make_dict_structure_fn(t, converter)
        return section_hooks[t](value, t)

    converter.register_structure_hook_func(is_section, structure_section)
    return converter


def _error_lines(exc: BaseException, path: str) -> Iterator[str]:
    """``key.path: message`` for every leaf of a cattrs error group."""
    from cattrs.errors import (
        AttributeValidationNote,
        ClassValidationError,
        ForbiddenExtraKeysError,
        IterableValidationError,
        IterableValidationNote,
    )

    def join(name: Any) -> str:
        return f"{path}.{toml_key(name)}" if path else toml_key(name)

    if isinstance(exc, ForbiddenExtraKeysError):
        known = [f.name for f in attrs.fields(exc.cl)]
        for extra in sorted(exc.extra_fields):
            yield f"{join(extra)}: {_unknown_key_hint(path, extra, known)}"
    elif isinstance(exc, (ClassValidationError, IterableValidationError)):
        with_notes, without = exc.group_exceptions()
        for sub, note in with_notes:
            if isinstance(note, AttributeValidationNote):
                yield from _error_lines(sub, join(note.name))
            elif isinstance(note, IterableValidationNote):
                yield from _error_lines(sub, join(note.index))
            else:  # pragma: no cover - cattrs always attaches one of the two
                yield from _error_lines(sub, path)
        for sub in without:
            yield from _error_lines(sub, path)
    elif isinstance(exc, (ValueError, TypeError)):
        yield f"{path or '(top level)'}: {exc}"
    else:  # pragma: no cover - a bug in a hook, reported rather than hidden
        yield f"{path or '(top level)'}: {type(exc).__name__}: {exc}"


def _unknown_key_hint(section: str, key: str, known: list[str]) -> str:
    where = f"in [{section}]" if section else "at the top level"
    if not section and key == "tool":
        return (
            "unknown key at the top level; a [tool.fsm_agent] table is read from pyproject.toml only: "
            "in this file put its keys at the top level"
        )
    elsewhere = [k.key for k in KEYS if k.name == key and k.section != section]
    if elsewhere:
        return f"unknown key {where}; did you mean {elsewhere[0]}?"
    close = difflib.get_close_matches(key, [k for k in known if k != PLUGINS_SECTION], n=1)
    if close:
        return f"unknown key; did you mean {join_key(section, close[0])}?"
    return f"unknown key {where} (see docs/configuration.md for the keys)"


def toml_key(name: Any) -> str:
    """A key as TOML writes it: bare when it can be, else a quoted string with its control
    characters escaped (a ``\r`` in a key must not break an error message into two lines)."""
    text = str(name)
    return text if re.fullmatch(r"[A-Za-z0-9_-]+", text) else json.dumps(text)


def join_key(section: str, name: str) -> str:
    return f"{section}.{name}" if section else name


@attrs.frozen
class FileValues:
    """What a configuration file sets, checked and converted.

    Attributes:
        values: ``{key: value}`` for every ``KEYS`` key the file sets, each already in the form
            the key's flag stores in the argparse namespace (``rendezvous.<option>`` keys: typed).
        plugins: ``{plugin: {option name: typed value}}`` from ``[plugins.<plugin>]`` tables.
    """

    values: dict[str, Any]
    plugins: dict[str, dict[str, Any]]

    def get(self, setting: Setting, default: Any = None) -> Any:
        """The file's value of ``setting`` (a ``KEYS`` key or a plugin option), or ``default``."""
        if setting.plugin is not None:
            return self.plugins.get(setting.plugin, {}).get(setting.name, default)
        return self.values.get(cast(str, setting.key), default)


def load_file_values(
    config_file: ConfigFile, options: OptionRegistry | Iterable[Setting] = (), disabled: Iterable[str] = ()
) -> FileValues:
    """Check a file against the schema (``KEYS`` plus the declared plugin options), all at once.

    A ``[plugins.<name>]`` table of a disabled plugin is ignored; one of a plugin that declares
    no options (or is not installed) is an error.

    Raises:
        ConfigError: one line, ``<file>: N errors: <path>: <message>; ...``, listing every error.
    """
    from cattrs.errors import BaseValidationError

    converter = make_config_converter()
    errors: list[str] = []
    parsed: Any = None
    try:
        parsed = converter.structure(config_file.data, _SCHEMA)
    except BaseValidationError as exc:
        errors.extend(_error_lines(exc, ""))
    except (ValueError, TypeError) as exc:  # pragma: no cover - data is always a dict
        errors.append(f"(top level): {exc}")

    values: dict[str, Any] = {}
    if parsed is not None:
        for key in KEYS:
            holder = getattr(parsed, key.section) if key.section else parsed
            value = getattr(holder, key.name) if holder is not None else None
            if value is not None:
                values[cast(str, key.key)] = value  # KEYS: the settings with a key

    plugins = _load_plugin_tables(
        config_file.data.get(PLUGINS_SECTION), list(options), set(disabled), converter, errors
    )
    if errors:
        count = f"{len(errors)} error{'s' if len(errors) > 1 else ''}"
        raise ConfigError(
            f"{config_file.label}: {count}: " + "; ".join(errors),
            details=[f"{config_file.label}: {error}" for error in errors],
        )
    return FileValues(values=values, plugins=plugins)


def _load_plugin_tables(
    tables: Any, options: list[Setting], disabled: set[str], converter: Any, errors: list[str]
) -> dict[str, dict[str, Any]]:
    from cattrs.errors import BaseValidationError

    if tables is None:
        return {}
    if not isinstance(tables, dict):
        errors.append(f"{PLUGINS_SECTION}: expected a table of plugin tables, got {show(tables)}")
        return {}
    declared = list(dict.fromkeys(o.plugin for o in options if o.plugin is not None))
    result: dict[str, dict[str, Any]] = {}
    for plugin, table in tables.items():
        path = f"{PLUGINS_SECTION}.{plugin}"
        if plugin in disabled:
            continue
        if plugin not in declared:
            known = ", ".join(declared) or "none"
            errors.append(f"{path}: no loaded plugin named {plugin!r} declares options (plugins with options: {known})")
            continue
        schema = _table_class(f"PluginSection_{len(result)}", (o for o in options if o.plugin == plugin))
        try:
            parsed = converter.structure(table, schema)
        except BaseValidationError as exc:
            errors.extend(_error_lines(exc, path))
            continue
        except (ValueError, TypeError) as exc:
            errors.append(f"{path}: {exc}")
            continue
        result[plugin] = {
            name: value for name, value in attrs.asdict(parsed, recurse=False).items() if value is not None
        }
    return result
