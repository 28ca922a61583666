"""LaunchConfig (attrs, frozen), the configuration-file schema and its strict loader, plugin options.

``LaunchConfig`` mirrors ``torch.distributed.launcher.api.LaunchConfig`` field by field where torch
has the field, with torchrun's CLI defaults; fsm-agent's additions are marked "fsm-agent:".
The CLI (``cli.py``) and the Python API (``fsm_agent.launch``) both build one of these.

Values come from, highest precedence first: command-line flags, the environment
(``FSM_AGENT_<NAME>``, then torchrun's ``PET_<NAME>``), a TOML file (``--config FILE``, or
``[tool.fsm_agent]`` in ``./pyproject.toml``), then the defaults. The merge works on the argparse
namespace and lives in ``cli.py`` (``resolve_run_args``); this module owns the data:

- ``KEYS``: every file key, the flag (argparse dest) it stands for, and its value ``Kind``.
- ``load_file_values``: the file structured with cattrs into a schema generated from ``KEYS``,
  with strict scalar hooks (``"false"`` is not a boolean, ``2.7`` is not an integer), unknown
  keys rejected, and **every** error reported at once, each with its key path::

      fsm.toml: 3 errors: max_restarts: expected an integer >= 0, got "three"; ...

- ``OptionRegistry`` / ``PluginOption``: options a plugin declares in ``fsm_agent_addoption``;
  each becomes a flag, an ``FSM_AGENT_<PLUGIN>_<NAME>`` env var and a ``[plugins.<plugin>]`` key,
  and the plugin reads it back with ``config.plugin_options("<plugin>")``.

``docs/configuration.md`` is generated from ``KEYS``, the run parser and the built-in plugins'
options (``fsm-agent config --reference``); ``tests/config`` checks it is up to date.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import signal
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Any

import attrs

from fsm_agent.errors import ConfigError, PluginError

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    try:
        import tomli as tomllib  # type: ignore[no-redef]
    except ModuleNotFoundError:
        tomllib = None  # type: ignore[assignment]


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
        _check(0 < self.min_nodes <= self.max_nodes,
               f"--nnodes {self.min_nodes}:{self.max_nodes}: need 0 < MIN <= MAX (e.g. --nnodes 1:2)")
        _check(self.nproc_per_node > 0,
               f"--nproc-per-node {self.nproc_per_node}: must be > 0 (e.g. --nproc-per-node 2)")
        _check(self.max_restarts >= 0, f"--max-restarts {self.max_restarts}: must be >= 0")
        _check(self.monitor_interval > 0, f"--monitor-interval {self.monitor_interval}: must be > 0 seconds")
        _check(self.shutdown_timeout >= 0, f"--shutdown-timeout {self.shutdown_timeout}: must be >= 0 seconds")
        _check(self.exit_barrier_timeout >= 0,
               f"--exit-barrier-timeout {self.exit_barrier_timeout}: must be >= 0 seconds")
        _check(self.hang_timeout is None or self.hang_timeout > 0,
               f"--hang-timeout {self.hang_timeout}: must be > 0 seconds")
        _check(self.start_method in ("spawn", "fork", "forkserver"),
               f"--start-method {self.start_method!r}: use spawn, fork or forkserver")

    def evolve(self, **changes: Any) -> "LaunchConfig":
        return attrs.evolve(self, **changes)

    @classmethod
    def coerce(cls, config: Any) -> "LaunchConfig":
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
            raise ConfigError(f"launch config {type(config).__name__!r}: expected fsm_agent.LaunchConfig or "
                              "torch.distributed.launcher.api.LaunchConfig")
        if not config.run_id:
            import logging
            import uuid

            config.run_id = str(uuid.uuid4().int)
            logging.getLogger(__name__).warning("config has no run_id, generated a random run_id: %s", config.run_id)
        rdzv_configs = dict(config.rdzv_configs)
        node_rank = int(rdzv_configs.get("rank", 0)) if config.rdzv_backend == "static" else 0
        same = ("min_nodes", "max_nodes", "nproc_per_node", "run_id", "role", "rdzv_endpoint", "rdzv_backend",
                "max_restarts", "monitor_interval", "start_method", "log_line_prefix_template", "local_addr",
                "event_log_handler", "signals_to_handle", "virtual_local_rank", "logs_specs", "numa_options")
        values = {name: getattr(config, name) for name in same if hasattr(config, name)}
        shutdown_timeout = getattr(config, "shutdown_timeout", None)
        return cls(**values, rdzv_configs=rdzv_configs, node_rank=node_rank,
                   metrics_cfg=dict(getattr(config, "metrics_cfg", None) or {}),
                   duplicate_stdout_filters=tuple(getattr(config, "duplicate_stdout_filters", None) or ()),
                   duplicate_stderr_filters=tuple(getattr(config, "duplicate_stderr_filters", None) or ()),
                   shutdown_timeout=float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30")
                                          if shutdown_timeout is None else shutdown_timeout))

    def plugin_options(self, plugin: str) -> Mapping[str, Any]:
        """The options plugin ``plugin`` declared in ``fsm_agent_addoption``, as resolved (read-only).

        Every declared option is present (its default when no source set it) when the config
        came from the command line; a config built in Python has only what its ``plugins`` holds,
        so plugins read with ``.get(name, default)``.
        """
        return MappingProxyType(dict(self.plugins.get(plugin, {})))


# ------------------------------------------------------------------------------------------------
# Value kinds: what a file (or a plugin option) may hold, checked strictly.
# ------------------------------------------------------------------------------------------------

NPROC_NAMES = ("auto", "cpu", "gpu", "xpu")
START_METHODS = ("spawn", "fork", "forkserver")
NUMA_BINDING_MODES = ("node", "socket", "exclusive", "core-complex")
#: torch's ``Std`` syntax, but a map may name multi-digit local ranks (torch: single digit only).
STD_VALUE = re.compile(r"[0-3]")
STD_MAP = re.compile(r"\d+:[0-3](,\d+:[0-3])*")
UNHANDLEABLE_SIGNALS = frozenset({"SIGKILL", "SIGSTOP"})


def show(value: Any) -> str:
    """A value as the user wrote it in TOML: ``"abc"``, ``true``, ``[1, 2]``."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return repr(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


class _Invalid(ValueError):
    """A value failed its kind's check; the kind turns it into "expected ..., got ..."."""


def _need(condition: bool) -> None:
    if not condition:
        raise _Invalid()


@attrs.frozen
class Kind:
    """One kind of configuration value.

    Attributes:
        describe: what is expected, completing "expected ...", e.g. ``seconds > 0``.
        toml: the TOML type(s), for docs/configuration.md.
        convert: TOML value -> the value the flag's argparse action stores; raises ValueError
            (a bare ``_Invalid`` gets the "expected ..., got ..." message).
        type: a unique class standing for this kind in attrs/cattrs schemas.
    """

    describe: str
    toml: str
    convert: Callable[[Any], Any]
    type: type = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "type", type(f"Kind[{self.describe}]", (), {"fsm_agent_kind": self}))

    def structure(self, value: Any) -> Any:
        """Check and convert a TOML value; raises ValueError("expected ..., got ...")."""
        try:
            return self.convert(value)
        except _Invalid as exc:
            detail = f" ({exc.args[0]})" if exc.args else ""
            raise ValueError(f"expected {self.describe}, got {show(value)}{detail}") from None


def _string(value: Any) -> str:
    _need(isinstance(value, str))
    return value


def _bool(value: Any) -> bool:
    _need(isinstance(value, bool))
    return value


def _int_at_least(minimum: int) -> Callable[[Any], int]:
    def convert(value: Any) -> int:
        _need(_is_int(value) and value >= minimum)
        return value
    return convert


def _seconds(positive: bool) -> Callable[[Any], float]:
    def convert(value: Any) -> float:
        _need(_is_number(value) and (value > 0 if positive else value >= 0))
        return value
    return convert


def _port(value: Any) -> int:
    _need(_is_int(value) and 1 <= value <= 65535)
    return value


def _nnodes(value: Any) -> str:
    if _is_int(value):
        _need(value > 0)
        return str(value)
    _need(isinstance(value, str))
    parts = value.split(":")
    _need(1 <= len(parts) <= 2 and all(p.strip().isdigit() for p in parts))
    low, high = int(parts[0]), int(parts[-1])
    _need(0 < low <= high)
    return value


def _nproc(value: Any) -> str:
    if _is_int(value):
        _need(value > 0)
        return str(value)
    _need(value in NPROC_NAMES)
    return value


def _std(value: Any) -> str:
    if _is_int(value):
        _need(0 <= value <= 3)
        return str(value)
    _need(isinstance(value, str) and bool(STD_VALUE.fullmatch(value) or STD_MAP.fullmatch(value)))
    return value


def _signals(value: Any) -> str:
    names = value.split(",") if isinstance(value, str) else value
    _need(isinstance(names, list) and all(isinstance(n, str) for n in names))
    names = [n.strip() for n in names if n.strip()]
    for name in names:
        if name not in signal.Signals.__members__ or name in UNHANDLEABLE_SIGNALS:
            raise _Invalid(f"{name!r} {'cannot be trapped' if name in UNHANDLEABLE_SIGNALS else 'is not a signal'}")
    return ",".join(names)


def _ranks(value: Any) -> str:
    _need(isinstance(value, list) and all(_is_int(r) and r >= 0 for r in value))
    return ",".join(str(r) for r in value)


def _strings(value: Any) -> list[str]:
    _need(isinstance(value, list) and all(isinstance(s, str) for s in value))
    return list(value)


def _names(value: Any) -> tuple[str, ...]:
    _need(isinstance(value, list) and all(isinstance(s, str) and s.strip() for s in value))
    return tuple(s.strip() for s in value)


def _conf(value: Any) -> dict[str, Any]:
    _need(isinstance(value, dict))
    for key, item in value.items():
        if not key or not isinstance(item, (str, int, float, bool)):
            raise _Invalid(f"key {key!r}: expected a string, number or boolean" if key else "empty key")
        if key in RENDEZVOUS_OPTIONS:
            raise _Invalid(f"set {key!r} as rendezvous.{key}, where its type is checked")
    return dict(value)


def choice_kind(values: Iterable[Any]) -> Kind:
    """A kind accepting exactly one of ``values`` (same type: no ``"1"`` for ``1``)."""
    values = tuple(values)

    def convert(value: Any) -> Any:
        _need(any(type(value) is type(v) and value == v for v in values))
        return value

    return Kind(f"one of {', '.join(show(v) for v in values)}", "string", convert)


STRING = Kind("a string", "string", _string)
BOOL = Kind("true or false", "boolean", _bool)
COUNT = Kind("an integer >= 0", "integer", _int_at_least(0))
POSITIVE_INT = Kind("an integer > 0", "integer", _int_at_least(1))
SECONDS = Kind("seconds >= 0", "number", _seconds(positive=False))
POSITIVE_SECONDS = Kind("seconds > 0", "number", _seconds(positive=True))
PORT = Kind("a port number 1-65535", "integer", _port)
NNODES = Kind('a node count > 0 or "MIN:MAX" with 0 < MIN <= MAX', 'integer or "MIN:MAX"', _nnodes)
NPROC = Kind(f"a worker count > 0 or one of {', '.join(show(n) for n in NPROC_NAMES)}",
             "integer or string", _nproc)
STD = Kind('0 (none), 1 (stdout), 2 (stderr), 3 (both) or a map of local rank to value such as "0:3,1:2"',
           "integer or string", _std)
SIGNALS = Kind('signal names the agent can trap, such as ["SIGTERM", "SIGINT"]', "array of strings", _signals)
RANKS = Kind("a list of local ranks >= 0, such as [0, 1]", "array of integers", _ranks)
STRINGS = Kind("a list of strings", "array of strings", _strings)
NAMES = Kind("a list of plugin names", "array of strings", _names)
#: Passed through unchecked (``[plugins]`` is checked against the declared options separately).
_RAW = Kind("anything", "table", lambda value: value)
CONF = Kind("a table of backend options (strings, numbers or booleans)", "table", _conf)


# ------------------------------------------------------------------------------------------------
# The file schema: every key, the flag it stands for, its kind.
# ------------------------------------------------------------------------------------------------


@attrs.frozen
class ConfigKey:
    """One key of the configuration file.

    Attributes:
        key: dotted TOML path, e.g. ``rendezvous.backend`` (``[rendezvous]`` table, key ``backend``).
        dest: the ``fsm-agent run`` flag's argparse dest it stands for (flag, env vars and default
            come from that flag); None for rendezvous options, which go into ``rdzv_configs``.
        kind: what the value may be.
        field: the LaunchConfig field(s) it ends up in.
        help: description for keys without a flag (the flag's help otherwise).
        default: the default as documented, where the flag's own default does not say it.
    """

    key: str
    dest: str | None
    kind: Kind
    field: str
    help: str = ""
    default: str | None = None

    @property
    def section(self) -> str:
        return self.key.rpartition(".")[0]

    @property
    def name(self) -> str:
        return self.key.rpartition(".")[2]


def _key(key: str, kind: Kind, dest: str | None = "", field: str = "", **kwargs: Any) -> ConfigKey:
    name = key.rpartition(".")[2]
    return ConfigKey(key=key, dest=name if dest == "" else dest, kind=kind, field=field or name, **kwargs)


#: Typed rendezvous options (``[rendezvous]`` keys that go into ``rdzv_configs``; torch's names).
RENDEZVOUS_OPTIONS: dict[str, tuple[Kind, str]] = {
    "join_timeout": (POSITIVE_SECONDS, "c10d: seconds to wait for the rendezvous to complete (torch: 600)"),
    "last_call_timeout": (POSITIVE_SECONDS, "c10d: seconds to wait for more nodes once min_nodes joined (torch: 30)"),
    "close_timeout": (POSITIVE_SECONDS, "c10d: seconds to wait for the rendezvous to close (torch: 30)"),
    "read_timeout": (POSITIVE_SECONDS, "c10d: seconds for a store read (torch: 60)"),
    "keep_alive_interval": (POSITIVE_SECONDS, "c10d: seconds between keep-alive heartbeats (torch: 5)"),
    "keep_alive_max_attempt": (POSITIVE_INT, "c10d: missed heartbeats before a node is dead (torch: 3)"),
    "is_host": (BOOL, "c10d: whether this node hosts the rendezvous store (torch: inferred from the endpoint)"),
    "timeout": (POSITIVE_SECONDS, "static: seconds to wait for all nodes (torchrun: 900)"),
}

#: Every file key, in documentation order. Top-level keys, then ``[rendezvous]``, then ``[logs]``.
KEYS: tuple[ConfigKey, ...] = (
    _key("nnodes", NNODES, field="min_nodes, max_nodes"),
    _key("nproc_per_node", NPROC),
    _key("max_restarts", COUNT),
    _key("monitor_interval", POSITIVE_SECONDS),
    _key("role", STRING),
    _key("start_method", choice_kind(START_METHODS)),
    _key("standalone", BOOL, field="standalone, rdzv_backend, rdzv_endpoint, run_id"),
    _key("shutdown_timeout", SECONDS, default="`$TORCH_ELASTIC_SHUTDOWN_TIMEOUT`, else `30`"),
    _key("exit_barrier_timeout", SECONDS),
    _key("signals_to_handle", SIGNALS),
    _key("hang_timeout", POSITIVE_SECONDS, default="unset (no heartbeat hang detection)"),
    _key("forward_signals", SIGNALS, default="`\"\"` (none)"),
    _key("virtual_local_rank", BOOL),
    _key("numa_binding", choice_kind(NUMA_BINDING_MODES)),
    _key("event_log_handler", STRING),
    _key("launcher", STRING),
    _key("scheduler", STRING),
    _key("disabled_plugins", NAMES, default="`[]`; the file's list, the env list and the flags add up"),
    _key("rendezvous.backend", STRING, dest="rdzv_backend", field="rdzv_backend"),
    _key("rendezvous.endpoint", STRING, dest="rdzv_endpoint", field="rdzv_endpoint"),
    _key("rendezvous.run_id", STRING, dest="rdzv_id", field="run_id"),
    _key("rendezvous.conf", CONF, dest="rdzv_conf", field="rdzv_configs",
         default="`{}`; per option, `--rdzv-conf` (or its env var) wins over the file"),
    *(_key(f"rendezvous.{name}", kind, dest=None, field="rdzv_configs", help=help_text)
      for name, (kind, help_text) in RENDEZVOUS_OPTIONS.items()),
    _key("rendezvous.node_rank", COUNT),
    _key("rendezvous.master_addr", STRING),
    _key("rendezvous.master_port", PORT, default="unset (`29500`)"),
    _key("rendezvous.local_addr", STRING, default="unset (the address that routes to the endpoint)"),
    _key("logs.log_dir", STRING, default="unset (a new temporary directory)"),
    _key("logs.redirects", STD),
    _key("logs.tee", STD),
    _key("logs.local_ranks_filter", RANKS, default="unset (every rank)"),
    _key("logs.duplicate_stdout_filters", STRINGS),
    _key("logs.duplicate_stderr_filters", STRINGS),
    _key("logs.logs_specs", STRING, default="unset (the built-in layout)"),
    _key("logs.events_file", STRING, default="unset (`events.jsonl` in the run's log directory)"),
)
KEYS_BY_NAME: dict[str, ConfigKey] = {k.key: k for k in KEYS}
#: The argparse dests that are configuration (they get ``FSM_AGENT_<DEST>`` env vars).
CONFIG_DESTS: frozenset[str] = frozenset(k.dest for k in KEYS if k.dest)
SECTIONS = ("rendezvous", "logs")
PLUGINS_SECTION = "plugins"
#: Where a pyproject.toml keeps fsm-agent's settings.
PYPROJECT_TABLE = ("tool", "fsm_agent")


# ------------------------------------------------------------------------------------------------
# Plugin options (fsm_agent_addoption)
# ------------------------------------------------------------------------------------------------

_OPTION_NAME = re.compile(r"[a-z][a-z0-9_]*")
_OPTION_TYPES: dict[type, Kind] = {
    str: STRING, bool: BOOL,
    int: Kind("an integer", "integer", lambda v: (_need(_is_int(v)), v)[1]),
    float: Kind("a number", "number", lambda v: (_need(_is_number(v)), float(v))[1]),
}
_TRUE = frozenset({"1", "true", "t", "yes", "y", "on"})
_FALSE = frozenset({"0", "false", "f", "no", "n", "off"})


def env_name(*parts: str) -> str:
    """``FSM_AGENT_`` + the parts upper-cased, dashes as underscores: ``("status-http", "port")``."""
    return "FSM_AGENT_" + "_".join(p.upper().replace("-", "_") for p in parts)


@attrs.frozen
class PluginOption:
    """One option declared by a plugin.

    Attributes:
        plugin: the declaring plugin's name (as ``--disable-plugin`` knows it).
        name: snake_case name; the TOML key ``[plugins.<plugin>] <name>``.
        type: ``str``, ``int``, ``float`` or ``bool``.
        default: the value when no source sets it (may be None: "unset").
        help: one line for ``--help`` and docs/configuration.md.
        flag: the command-line flag (``--<plugin>-<name>`` unless declared); it takes one value,
            booleans too (``--x true``).
        env: the environment variable (``FSM_AGENT_<PLUGIN>_<NAME>`` unless declared).
        choices: allowed values, or None.
        check: extra validation: called with the typed value, raises ValueError("expected ...").
    """

    plugin: str
    name: str
    type: type
    default: Any
    help: str
    flag: str
    env: str
    choices: tuple[Any, ...] | None = None
    check: Callable[[Any], None] | None = attrs.field(default=None, eq=False)

    @property
    def key(self) -> str:
        return f"{PLUGINS_SECTION}.{self.plugin}.{self.name}"

    @property
    def dest(self) -> str:
        """The argparse dest of the flag (not an identifier: it cannot clash with torchrun's)."""
        return f"plugin:{self.plugin}:{self.name}"

    @property
    def kind(self) -> Kind:
        base = choice_kind(self.choices) if self.choices else _OPTION_TYPES[self.type]
        if self.check is None:
            return base
        check = self.check

        def convert(value: Any) -> Any:
            value = base.structure(value)
            try:
                check(value)
            except ValueError as exc:  # a check that names the value already says "got ..."
                text = str(exc)
                raise ValueError(text if ", got " in text else f"{text}, got {show(value)}") from None
            return value

        return Kind(base.describe, base.toml, convert)

    def from_string(self, raw: str) -> Any:
        """A flag or env var value -> the typed value; raises ValueError("expected ..., got ...")."""
        text = raw.strip()
        value: Any = raw
        try:
            if self.type is bool:
                lowered = text.lower()
                if lowered not in _TRUE | _FALSE:
                    raise ValueError
                value = lowered in _TRUE
            elif self.type is int:
                value = int(text)
            elif self.type is float:
                value = float(text)
        except ValueError:
            raise ValueError(f"expected {_OPTION_TYPES[self.type].describe}, got {show(raw)}") from None
        return self.kind.structure(value)


@attrs.define
class OptionRegistry:
    """What ``fsm_agent_addoption(options)`` receives: ``options.add(...)`` declares one option.

    The plugin manager sets ``current_plugin`` around each plugin's call, so options are owned
    by the plugin that declared them (``collect_options`` in ``fsm_agent.plugins.manager``).
    """

    _options: dict[tuple[str, str], PluginOption] = attrs.Factory(dict)
    current_plugin: str = "?"

    def add(self, name: str, *, type: type = str, default: Any = None, help: str = "",  # noqa: A002
            flag: str | None = None, env: str | None = None, choices: Iterable[Any] | None = None,
            check: Callable[[Any], None] | None = None) -> PluginOption:
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
            The PluginOption.

        Raises:
            PluginError: a bad name or type, or a name/flag/env var already declared.
        """
        plugin = self.current_plugin
        if not _OPTION_NAME.fullmatch(name):
            raise PluginError(f"plugin {plugin!r} declared option {name!r}: names are snake_case "
                              f"([a-z][a-z0-9_]*), e.g. 'port'")
        if type not in _OPTION_TYPES:
            raise PluginError(f"plugin {plugin!r} option {name!r}: type must be str, int, float or bool, "
                              f"not {getattr(type, '__name__', type)!r}")
        option = PluginOption(
            plugin=plugin, name=name, type=type, default=default, help=help,
            flag=flag or f"--{plugin}-{name}".replace("_", "-"), env=env or env_name(plugin, name),
            choices=tuple(choices) if choices is not None else None, check=check)
        if not option.flag.startswith("--"):
            raise PluginError(f"plugin {plugin!r} option {name!r}: flag {option.flag!r} must start with '--'")
        for other in self._options.values():
            for attr in ("key", "flag", "env"):
                if getattr(other, attr) == getattr(option, attr):
                    raise PluginError(f"plugin {plugin!r} declares {attr} {getattr(option, attr)!r}, "
                                      f"already declared by plugin {other.plugin!r}")
        self._options[(plugin, name)] = option
        return option

    def __iter__(self) -> Iterator[PluginOption]:
        return iter(self._options.values())

    def __len__(self) -> int:
        return len(self._options)

    def plugins(self) -> list[str]:
        return list(dict.fromkeys(o.plugin for o in self))

    def of(self, plugin: str) -> list[PluginOption]:
        return [o for o in self if o.plugin == plugin]

    def defaults(self) -> dict[str, dict[str, Any]]:
        result: dict[str, dict[str, Any]] = {}
        for option in self:
            result.setdefault(option.plugin, {})[option.name] = option.default
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
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"{origin} {path}: no such file; check the path") from None
    except OSError as exc:
        raise ConfigError(f"{origin} {path}: cannot read it: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None


def find_config_file(explicit: str | None, origin: str = "--config", cwd: str | None = None) -> ConfigFile | None:
    """The file to read: ``explicit`` (``--config``/``FSM_AGENT_CONFIG``), else a ``pyproject.toml``
    in ``cwd`` (the current directory) that has a ``[tool.fsm_agent]`` table, else None.

    An explicit file named ``pyproject.toml`` is read from its ``[tool.fsm_agent]`` table; any
    other file is the configuration from its top level.

    Raises:
        ConfigError: the explicit file is missing, unreadable or not TOML; the pyproject.toml is
            not TOML; ``[tool.fsm_agent]`` is not a table.
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
            raise ConfigError(f"{path}: [tool.{name}] is not read; fsm-agent's table is [tool.{wanted}] "
                              f"(an underscore, as in the module name): rename it")


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


def _schema() -> type:
    """The file's attrs class, generated from ``KEYS``: top-level keys plus one class per section."""
    sections = {
        section: attrs.make_class(f"{section.capitalize()}Section", _optional_fields(
            (k.name, k.kind.type) for k in KEYS if k.section == section), frozen=True)
        for section in SECTIONS
    }
    top = [(k.name, k.kind.type) for k in KEYS if not k.section]
    fields = _optional_fields([*top, *sections.items(), (PLUGINS_SECTION, _RAW.type)])
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
        lambda value, t: t.fsm_agent_kind.structure(value))
    for python_type, kind in _OPTION_TYPES.items():
        converter.register_structure_hook(python_type, lambda value, _t, kind=kind: kind.structure(value))

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
    from cattrs.errors import (AttributeValidationNote, ClassValidationError, ForbiddenExtraKeysError,
                               IterableValidationError, IterableValidationNote)

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
        return ("unknown key at the top level; a [tool.fsm_agent] table is read from pyproject.toml only: "
                "in this file put its keys at the top level")
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


def load_file_values(config_file: ConfigFile, options: OptionRegistry | Iterable[PluginOption] = (),
                     disabled: Iterable[str] = ()) -> FileValues:
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
                values[key.key] = value

    plugins = _load_plugin_tables(config_file.data.get(PLUGINS_SECTION), list(options), set(disabled),
                                  converter, errors)
    if errors:
        count = f"{len(errors)} error{'s' if len(errors) > 1 else ''}"
        raise ConfigError(f"{config_file.label}: {count}: " + "; ".join(errors),
                          details=[f"{config_file.label}: {error}" for error in errors])
    return FileValues(values=values, plugins=plugins)


def _load_plugin_tables(tables: Any, options: list[PluginOption], disabled: set[str], converter: Any,
                        errors: list[str]) -> dict[str, dict[str, Any]]:
    from cattrs.errors import BaseValidationError

    if tables is None:
        return {}
    if not isinstance(tables, dict):
        errors.append(f"{PLUGINS_SECTION}: expected a table of plugin tables, got {show(tables)}")
        return {}
    declared = list(dict.fromkeys(o.plugin for o in options))
    result: dict[str, dict[str, Any]] = {}
    for plugin, table in tables.items():
        path = f"{PLUGINS_SECTION}.{plugin}"
        if plugin in disabled:
            continue
        if plugin not in declared:
            known = ", ".join(declared) or "none"
            errors.append(f"{path}: no loaded plugin named {plugin!r} declares options "
                          f"(plugins with options: {known})")
            continue
        schema = attrs.make_class(f"PluginSection_{len(result)}", _optional_fields(
            (o.name, o.kind.type) for o in options if o.plugin == plugin), frozen=True)
        try:
            parsed = converter.structure(table, schema)
        except BaseValidationError as exc:
            errors.extend(_error_lines(exc, path))
            continue
        except (ValueError, TypeError) as exc:
            errors.append(f"{path}: {exc}")
            continue
        result[plugin] = {name: value for name, value in attrs.asdict(parsed, recurse=False).items()
                          if value is not None}
    return result
