"""The command line: ``fsm-agent run`` / ``fsmrun`` (a drop-in torchrun) and the subcommand dispatch.

``get_run_parser()`` accepts every torchrun 2.13 flag with torchrun's spellings, defaults and
``PET_<DEST>`` environment fallbacks, plus fsm-agent's own flags (marked "fsm-agent:").
``config_from_args()`` turns the parsed flags into a ``LaunchConfig`` and the worker entrypoint,
mirroring torch's ``run.py:run`` + ``run.py:config_from_args``.

This is the only module that turns exceptions into exit codes: an ``FsmAgentError`` (bad flags
included) prints one line ``fsm-agent: error: <message>`` on stderr, never a traceback.
torch is imported lazily, only to count devices for ``--nproc-per-node gpu|xpu|auto``.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import json
import logging
import os
import re
import shutil
import signal
import sys
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NoReturn

import attrs

from fsm_agent.argparsing import OneLineParser
from fsm_agent.config import (CONFIG_DESTS, KEYS, ConfigFile, FileValues, LaunchConfig, OptionRegistry,
                              PluginOption, env_name, find_config_file, load_file_values, raw_disabled_plugins)
from fsm_agent.errors import ConfigError, FsmAgentError, PluginError
from fsm_agent.scheduler import apply_discovery, discover

log = logging.getLogger(__name__)

DEFAULT_MASTER_PORT = 29500
#: Seconds between the death signal and SIGKILL when neither the flag nor the env var says.
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
LOG_LINE_PREFIX_TEMPLATE_ENV = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"
DISABLE_PLUGINS_ENV = "FSM_AGENT_DISABLE_PLUGINS"
#: Exit code for Ctrl-C (128 + SIGINT), as a shell reports it.
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 128 + 13  # SIGPIPE, as a shell reports a writer its reader left

#: Named ``--nproc-per-node`` values (torch also accepts its privateuse1 backend name).
NPROC_NAMES = ("auto", "cpu", "gpu", "xpu")
NUMA_BINDING_MODES = ("node", "socket", "exclusive", "core-complex")
START_METHODS = ("spawn", "fork", "forkserver")

_TRUE = frozenset({"1", "true", "t", "yes", "y", "on"})
_FALSE = frozenset({"0", "false", "f", "no", "n", "off"})
#: torch's ``Std`` syntax, but a map may name multi-digit local ranks (torch: single digit only).
_STD_VALUE = re.compile(r"[0-3]")
_STD_MAP = re.compile(r"\d+:[0-3](,\d+:[0-3])*")
_UNHANDLEABLE_SIGNALS = frozenset({"SIGKILL", "SIGSTOP"})

#: Subcommands other than ``run``: name -> (module with ``cli_main(argv) -> int``, help).
_DELEGATES = {
    "statechart": ("fsm_agent.states.statechart", "render the agent's statechart (docs/statechart.md)"),
    "plugins": ("fsm_agent.plugins.manager", "list the installed plugins and backends"),
    "status": ("fsm_agent.status_cli", "show a running agent's live status (fsm-agent run --status-port)"),
    "replay": ("fsm_agent.replay", "re-drive the statechart through a recorded events file and compare the trace"),
}
#: Subcommands implemented here: name -> help.
_LOCAL_COMMANDS = {
    "run": "launch workers; takes torchrun's flags (see run --help)",
    "config": "print the effective configuration and where each value came from (takes run's flags)",
}


# ------------------------------------------------------------------------------------------------
# Flag values: parsing and validation. Each raises ConfigError naming the flag, value and fix.
# ------------------------------------------------------------------------------------------------


def parse_nnodes(value: str) -> tuple[int, int]:
    """``--nnodes N`` or ``MIN:MAX`` -> (min_nodes, max_nodes), with 0 < MIN <= MAX."""
    parts = value.split(":")
    try:
        if len(parts) > 2:
            raise ValueError(value)
        min_nodes, max_nodes = int(parts[0]), int(parts[-1])
    except ValueError:
        raise ConfigError(
            f"--nnodes {value!r}: expected N or MIN:MAX with integers (e.g. --nnodes 2 or --nnodes 1:4)"
        ) from None
    if min_nodes <= 0:
        raise ConfigError(f"--nnodes {value!r}: node counts must be > 0 (e.g. --nnodes 1 or --nnodes 1:4)")
    if min_nodes > max_nodes:
        raise ConfigError(f"--nnodes {value!r}: MIN must be <= MAX (e.g. --nnodes {max_nodes}:{min_nodes})")
    return min_nodes, max_nodes


def _nproc_as_int(value: str) -> int | None:
    """The worker count if ``value`` is an integer (must be > 0), None if it is a device name."""
    try:
        count = int(value)
    except ValueError:
        if not value.strip():
            raise ConfigError(_nproc_hint(value, "is empty")) from None
        return None
    if count <= 0:
        raise ConfigError(_nproc_hint(value, "must be > 0"))
    return count


def _nproc_hint(value: str, problem: str) -> str:
    return (f"--nproc-per-node {value!r}: {problem}; give a positive number of workers "
            f"(e.g. --nproc-per-node 2) or one of {', '.join(NPROC_NAMES)}")


def resolve_nproc_per_node(value: str) -> int:
    """``--nproc-per-node`` -> workers on this node, as torch's ``run.py:determine_local_world_size``.

    An integer is used as is (torch is not imported). ``cpu`` counts the CPUs this process may run
    on; ``gpu``/``xpu`` count devices and fail when there are none; ``auto`` counts the current
    accelerator's devices, else the CPUs; torch's privateuse1 backend name counts that backend's devices.
    """
    count = _nproc_as_int(value)
    if count is not None:
        return count
    if value == "cpu":
        return _cpu_count()
    import torch  # lazy: only device names need it

    if value == "gpu":
        if not torch.cuda.is_available():
            raise ConfigError(_nproc_hint(value, "CUDA is not available on this node"))
        count = torch.cuda.device_count()
    elif value == "xpu":
        if not torch.xpu.is_available():
            raise ConfigError(_nproc_hint(value, "XPU is not available on this node"))
        count = torch.xpu.device_count()
    elif value == "auto":
        accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
        if accelerator is not None and accelerator.is_available():
            count = accelerator.device_count()
        elif accelerator is None and torch.cuda.is_available():
            count = torch.cuda.device_count()
        else:
            count = _cpu_count()
    elif value == torch._C._get_privateuse1_backend_name():
        backend = getattr(torch, value, None)
        if backend is None or not backend.is_available():
            raise ConfigError(_nproc_hint(value, f"the {value} backend is not available on this node"))
        count = backend.device_count()
    else:
        raise ConfigError(_nproc_hint(value, "unknown value"))
    if count <= 0:
        raise ConfigError(_nproc_hint(value, f"found no {value} devices on this node"))
    return count


def _cpu_count() -> int:
    """CPUs this process may run on (affinity-aware, as ``torch._utils.cpu_count``)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def parse_master_port(value: str) -> int:
    """``--master-port N`` -> N, a TCP port 0..65535 (torch: ``int``, then a ValueError in the rendezvous)."""
    port = _port_number(value.strip())
    if port is None:
        raise ConfigError(f"--master-port {value!r}: not a TCP port; use an integer from 0 to 65535 "
                          f"(e.g. --master-port {DEFAULT_MASTER_PORT})")
    return port


def _port_number(text: str) -> int | None:
    """``text`` as a TCP port number (1 to 5 digits, below 65536, as torch's ``_try_parse_port``), else None."""
    return int(text) if re.fullmatch(r"[0-9]{1,5}", text) and int(text) < 65536 else None


#: Backends whose endpoint torch's ``parse_rendezvous_endpoint`` reads (``HOST[:PORT]``).
_HOST_PORT_BACKENDS = ("static", "c10d")


def check_rdzv_endpoint(backend: str, endpoint: str) -> None:
    """Raise ConfigError for a ``--rdzv-endpoint HOST:PORT`` whose port is not 0..65535, for the
    backends that read it with torch's ``parse_rendezvous_endpoint`` (its ValueError, one line)."""
    text = endpoint.strip()
    if backend not in _HOST_PORT_BACKENDS or not text or (text.startswith("[") and text.endswith("]")):
        return
    host, sep, port = text.rpartition(":")
    if sep and _port_number(port) is None:
        raise ConfigError(f"--rdzv-endpoint {endpoint!r}: the port {port!r} is not a TCP port; use HOST:PORT with "
                          f"PORT an integer from 0 to 65535 (e.g. --rdzv-endpoint {host or 'localhost'}:29400)")


def parse_rdzv_conf(value: str) -> dict[str, str]:
    """``--rdzv-conf k1=v1,k2=v2`` -> {k: v} (values stay strings), as torch's ``_parse_rendezvous_config``."""
    config: dict[str, str] = {}
    if not value.strip():
        return config
    for item in value.split(","):
        key, _, item_value = item.partition("=")
        key, item_value = key.strip(), item_value.strip()
        if not key:
            raise ConfigError(f"--rdzv-conf {value!r}: empty key in {item!r}; use key=value pairs "
                              f"separated by commas (e.g. --rdzv-conf join_timeout=900,read_timeout=120)")
        if not item_value:
            raise ConfigError(f"--rdzv-conf {value!r}: option {key!r} has no value (e.g. {key}=...)")
        config[key] = item_value
    return config


def check_std(value: str, flag: str) -> str:
    """Validate a ``-r/--redirects`` or ``-t/--tee`` value (torch's ``Std``); returns it unchanged.

    Either one value for every local rank (0 none, 1 stdout, 2 stderr, 3 both) or a map
    ``LOCAL_RANK:VALUE,...`` such as ``0:3,1:2``.
    """
    if not (_STD_VALUE.fullmatch(value) or _STD_MAP.fullmatch(value)):
        raise ConfigError(f"{flag} {value!r}: use 0 (none), 1 (stdout), 2 (stderr), 3 (both) "
                          f"or a map of local rank to value (e.g. {flag} 0:3,1:2)")
    return value


def parse_local_ranks_filter(value: str) -> frozenset[int] | None:
    """``--local-ranks-filter 0,1`` -> frozenset({0, 1}); empty -> None (show every rank)."""
    if not value.strip():
        return None
    try:
        ranks = frozenset(int(item) for item in value.split(","))
        if min(ranks) >= 0:
            return ranks
    except ValueError:
        pass
    raise ConfigError(f"--local-ranks-filter {value!r}: must be a comma-separated list of local ranks "
                      f"(e.g. --local-ranks-filter 0,1,2)")


def _warn_missing_local_ranks(shown: frozenset[int] | None, nproc_per_node: int) -> None:
    """Warn about ``--local-ranks-filter`` ranks that no worker of this node has (torch hides their
    output silently; when none exists, every worker's console output is hidden)."""
    missing = sorted(rank for rank in shown or () if rank >= nproc_per_node)
    if missing:
        hidden = "; no worker's output is shown" if len(missing) == len(shown or ()) else ""
        log.warning("--local-ranks-filter %s: no local rank %s with --nproc-per-node %d (local ranks 0..%d)%s",
                    ",".join(map(str, sorted(shown or ()))), ",".join(map(str, missing)), nproc_per_node,
                    nproc_per_node - 1, hidden)


def parse_filters(value: str) -> list[str]:
    """``--duplicate-std*-filters``: comma-separated substrings, ``,,`` escaping a comma (as torch).

    Empty items are dropped (torch keeps them, and an empty substring matches every line).
    """
    placeholder = "\0"
    items = value.replace(",,", placeholder).split(",")
    return [item.replace(placeholder, ",") for item in items if item]


def parse_signals(value: str, flag: str = "--signals-to-handle") -> tuple[str, ...]:
    """``SIGTERM,SIGINT`` -> the names; each must be a signal the agent can trap (``flag`` names
    the option in the error: ``--signals-to-handle`` or ``--forward-signals``)."""
    names = tuple(name.strip() for name in value.split(",")) if value.strip() else ()
    for name in names:
        if name not in signal.Signals.__members__ or name in _UNHANDLEABLE_SIGNALS:
            problem = "cannot be trapped" if name in _UNHANDLEABLE_SIGNALS else "is not a signal on this platform"
            raise ConfigError(f"{flag} {value!r}: {name!r} {problem}; use names such as "
                              f"SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")
    return names


def parse_forward_signals(value: str) -> tuple[str, ...]:
    """``--forward-signals SIGUSR1,SIGUSR2`` -> the names (the agent traps each to relay it)."""
    return parse_signals(value, flag="--forward-signals")


def parse_names(value: str) -> tuple[str, ...]:
    """``a,b`` -> ("a", "b"), blanks dropped (plugin names)."""
    return tuple(name.strip() for name in value.split(",") if name.strip())


def parse_bool(value: str, source: str) -> bool:
    """An environment flag: 1/true/yes/on or 0/false/no/off (any case)."""
    lowered = value.strip().lower()
    if lowered in _TRUE or lowered in _FALSE:
        return lowered in _TRUE
    raise ConfigError(f"{source}={value!r}: not a boolean; use 1/0, true/false or yes/no (or unset it)")


# ------------------------------------------------------------------------------------------------
# argparse plumbing: one-line errors and environment fallbacks read at parse time.
# ------------------------------------------------------------------------------------------------


def env_vars(action: argparse.Action) -> list[str]:
    """The environment variables a flag reads, highest precedence first.

    A configuration flag (one with a file key) reads ``FSM_AGENT_<DEST>`` first, then torchrun's
    ``PET_<DEST>`` where torchrun has it; fsm-agent's own flags read their one ``FSM_AGENT_*``.
    """
    own = isinstance(action, _EnvAction) and action.env_var.startswith("FSM_AGENT_")
    names = [env_name(action.dest)] if action.dest in CONFIG_DESTS and not own else []
    if isinstance(action, _EnvAction):
        names.append(action.env_var)
    return names


class _Parser(OneLineParser):
    """ArgumentParser whose errors are ConfigErrors (one line) and whose env fallbacks apply at parse time.

    Attributes:
        read_env: read the environment at all (off for ``cli_given``'s command-line-only parse).
        defer_env_errors: keep bad env vars in ``env_errors`` instead of raising (the caller
            reports them with the config file's errors).
        env_sources: after a parse, ``{dest: env var}`` for each value that came from the environment.
        env_errors: after a parse with ``defer_env_errors``, one message per bad env var.
    """

    read_env = True
    defer_env_errors = False

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        # A value set on the namespace beforehand is kept by argparse unless the flag is given,
        # so the command line wins over the env var, which wins over the default.
        namespace = argparse.Namespace() if namespace is None else namespace
        self.env_sources: dict[str, str] = {}
        errors: list[str] = []
        for action in self._actions if self.read_env else ():
            if hasattr(namespace, action.dest):
                continue
            for var in env_vars(action):
                raw = os.environ.get(var, "")
                if not raw:  # set but empty counts as unset
                    continue
                try:
                    setattr(namespace, action.dest, _from_env(action, var, raw))
                    self.env_sources[action.dest] = var
                except ConfigError as exc:
                    errors.append(str(exc))
                break
        self.env_errors = errors
        if errors and not self.defer_env_errors:  # every bad env var at once
            raise ConfigError("; ".join(errors))
        if "training_script_args" not in {action.dest for action in self._actions}:
            return super().parse_known_args(args, namespace)
        # Only the words up to the training script are the launcher's: argparse would read the
        # script's own "--r=16" as an ambiguous abbreviation of a launcher flag (pytorch#120601).
        args = list(sys.argv[1:] if args is None else args)
        _, script = _launcher_flags(args, self, unknown_takes_value=False)
        namespace, extras = super().parse_known_args(args[:script + 1], namespace)
        if script < len(args):
            namespace.training_script_args = args[script + 1:]
        return namespace, extras

class _EnvAction(argparse.Action):
    """A flag whose default can come from an environment variable (torch's ``argparse_util.env``)."""

    def __init__(self, option_strings, dest, env_var: str | None = None, **kwargs):
        self.env_var = env_var or f"PET_{dest.upper()}"
        super().__init__(option_strings, dest, **kwargs)
        self.help = f"{kwargs.get('help', '')} [env {', '.join(env_vars(self))}]"

    def from_env(self, raw: str, var: str | None = None) -> Any:
        """The flag's value for env value ``raw`` of ``var``; raises ConfigError naming the env var."""
        raise NotImplementedError

    def _convert(self, raw: str, var: str | None = None) -> Any:
        return _convert_env(self, var or self.env_var, raw)


def _convert_env(action: argparse.Action, var: str, raw: str) -> Any:
    try:
        return action.type(raw) if action.type else raw
    except FsmAgentError as exc:  # its text names the flag; the value came from ``var``
        text = str(exc).removeprefix(f"{action.option_strings[0]} {raw!r}: ")
        raise ConfigError(f"{var}={raw!r}: {text}") from None
    except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
        if isinstance(action, _PluginOptionAction):
            raise ConfigError(f"{var}={raw!r}: {exc}") from None
        type_name = getattr(action.type, "__name__", "value")
        raise ConfigError(f"{var}={raw!r}: not a valid {type_name} for "
                          f"{action.option_strings[0]}; fix or unset it") from None


def _from_env(action: argparse.Action, var: str, raw: str) -> Any:
    """A flag's value from env var ``var`` (a plain ``store`` flag: converted and checked like the flag)."""
    if isinstance(action, _EnvAction):
        return action.from_env(raw, var)
    value = _convert_env(action, var, raw)
    if action.choices is not None and value not in action.choices:
        raise ConfigError(f"{var}={raw!r}: choose from {', '.join(map(str, action.choices))}")
    return value


class _EnvStore(_EnvAction):
    """``store`` with a ``PET_<DEST>`` fallback, converted and checked like the command-line value."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)

    def from_env(self, raw: str, var: str | None = None) -> Any:
        var = var or self.env_var
        value = self._convert(raw, var)
        if self.choices is not None and value not in self.choices:
            raise ConfigError(f"{var}={raw!r}: choose from {', '.join(map(str, self.choices))}")
        return value


class _EnvFlag(_EnvAction):
    """``store_true`` with a boolean env fallback (torch's ``check_env``, without its crash on ``true``)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=False, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, True)

    def from_env(self, raw: str, var: str | None = None) -> bool:
        return parse_bool(raw, var or self.env_var)


class _EnvExtend(_EnvAction):
    """Repeatable, comma-splitting flag; the command line adds to the env var's list."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, (*(getattr(namespace, self.dest, None) or ()), *values))

    def from_env(self, raw: str, var: str | None = None) -> tuple[str, ...]:
        return self._convert(raw, var)


class _PluginOptionAction(argparse.Action):
    """A plugin option's flag: one value, checked like the option's env var and file key."""

    def __init__(self, option_strings, dest, option: PluginOption, **kwargs):
        self.option = option
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """torchrun's ``(default: X)`` after each flag's help, except where the help already says what
    happens by default (``(default: none)``, ``unset: ...``) or there is no value to show
    (None, ``''``, an empty list): never ``(default: none) (default: '')``."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default:" in text or "unset" in text or action.default in (None, "", [], ()):
            return text
        return super()._get_help_string(action)


def _spellings(*names: str) -> list[str]:
    """Every long flag also under its underscored spelling, as torchrun (``--nproc-per-node``/``--nproc_per_node``)."""
    underscored = ["--" + name[2:].replace("-", "_") for name in names if name.startswith("--") and "-" in name[2:]]
    return [*names, *underscored]


def get_run_parser(prog: str = "fsm-agent run", options: Iterable[PluginOption] = (), *,
                   for_config: bool = False) -> argparse.ArgumentParser:
    """The ``fsm-agent run`` / ``fsmrun`` parser: torchrun 2.13's flags, fsm-agent's own, plugins' options.

    Flag names, dests, defaults and ``PET_<DEST>`` fallbacks equal torchrun's. Values stay
    torchrun-shaped strings (checked here, converted by ``config_from_args``). Configuration
    flags also read ``FSM_AGENT_<DEST>`` (before ``PET_<DEST>``).

    Args:
        prog: the program name in messages.
        options: plugin options (``fsm_agent_addoption``), each added as a flag that takes one
            value; absent from the namespace unless given (the default applies later).
        for_config: the ``fsm-agent config`` variant: the training script is optional, and
            ``--json``/``--reference`` are added.

    Raises:
        PluginError: a plugin option's flag is already a flag.
    """
    parser = _Parser(
        prog=prog,
        description="Launch and supervise this node's workers: a drop-in replacement for torchrun.",
        epilog="Flags also read the environment variables shown in [env ...], FSM_AGENT_* before PET_*, "
               "then the config file (--config, or [tool.fsm_agent] in ./pyproject.toml); the command "
               "line wins (--disable-plugin adds to the env and file lists). fsm-agent's own flags "
               "are marked 'fsm-agent:'. See docs/configuration.md and 'fsm-agent config'.",
        formatter_class=_HelpFormatter,
    )

    def add(*names: str, action: type[argparse.Action] = _EnvStore, **kwargs: Any) -> None:
        parser.add_argument(*_spellings(*names), action=action, **kwargs)

    # Size.
    add("--nnodes", default="1:1", type=_returning(parse_nnodes),
        help="number of nodes, or the range MIN:MAX for an elastic job")
    add("--nproc-per-node", default="1", type=_returning(_nproc_as_int),
        help=f"workers per node: a number or one of {', '.join(NPROC_NAMES)}")
    # Rendezvous.
    add("--rdzv-backend", default="static", help="rendezvous backend (a registered name, e.g. c10d, static)")
    add("--rdzv-endpoint", default="", help="rendezvous endpoint, usually HOST:PORT")
    add("--rdzv-id", default="none", help="job id: agents with the same id and endpoint form one job")
    add("--rdzv-conf", default="", type=_returning(parse_rdzv_conf),
        help="extra rendezvous settings KEY=VALUE,KEY=VALUE,...")
    add("--standalone", action=_EnvFlag,
        help="single-node job: fsm-agent's own torch-free rendezvous (backend fsm) on a free local port "
             "with a fresh id (--rdzv-backend/--rdzv-endpoint/--rdzv-id are ignored)")
    # Worker lifecycle.
    add("--max-restarts", default=0, type=int, help="restarts of the worker group before the job fails")
    add("--monitor-interval", default=0.1, type=float, help="seconds between checks of the workers")
    add("--start-method", default="spawn", choices=START_METHODS,
        help="multiprocessing start method for function entrypoints (--run-path)")
    add("--event-log-handler", default="null", help="name of torch's event log handler (null, console, ...)")
    add("--role", default="default", help="role name of the workers")
    # Entrypoint.
    add("-m", "--module", action=_EnvFlag, help="run the script as a Python module, like 'python -m'")
    add("--no-python", action=_EnvFlag, help="run the script directly as a binary, without 'python'")
    add("--run-path", action=_EnvFlag,
        help="run the script with runpy.run_path in a Python worker process (overrides --no-python)")
    # Logs.
    add("--log-dir", default=None, help="base directory for log files; unset: a new temporary directory")
    add("-r", "--redirects", default="0", type=lambda value: check_std(value, "--redirects"),
        help="redirect worker streams to files: 0 none, 1 stdout, 2 stderr, 3 both, "
             "or per local rank such as 0:3,1:2")
    add("-t", "--tee", default="0", type=lambda value: check_std(value, "--tee"),
        help="like --redirects, but also print to the console")
    add("--local-ranks-filter", default="", type=_returning(parse_local_ranks_filter),
        help="only show these local ranks on the console, e.g. 0,1 (default: all)")
    add("--duplicate-stdout-filters", default=[], type=parse_filters,
        help="copy stdout lines containing any of these comma-separated substrings to "
             "filtered_stdout.log (',,' is a literal comma)")
    add("--duplicate-stderr-filters", default=[], type=parse_filters,
        help="as --duplicate-stdout-filters, for stderr (filtered_stderr.log)")
    # Static rendezvous and compatibility.
    add("--node-rank", default=0, type=int, help="rank of this node (static rendezvous only)")
    add("--master-addr", default="127.0.0.1", help="address of the rank-0 node (static rendezvous only)")
    add("--master-port", default=None, type=parse_master_port,
        help=f"port on the rank-0 node (static rendezvous only; {DEFAULT_MASTER_PORT} when unset): the agents' "
             "store, and the workers' MASTER_PORT. Giving it turns off the implicit single-node (--standalone) "
             "rendezvous")
    add("--local-addr", default=None, help="this node's address (default: the address of the interface that routes to the rendezvous endpoint)")
    add("--logs-specs", action="store", default=None,
        help="name of a torchrun.logs_specs entry point that lays out the log files [env FSM_AGENT_LOGS_SPECS]")
    add("--numa-binding", action="store", default=None, choices=NUMA_BINDING_MODES,
        help="bind each worker to the CPUs near its GPU [env FSM_AGENT_NUMA_BINDING]")
    add("--signals-to-handle", default="SIGTERM,SIGINT,SIGHUP,SIGQUIT", type=_returning(parse_signals),
        help="comma-separated signals that stop the job: the workers get the same signal (SIGINT as SIGINT, "
             "SIGUSR1 as SIGUSR1), SIGKILL after --shutdown-timeout or at a second such signal; the agent "
             "exits 128+N")
    add("--shutdown-timeout", default=None, type=float,
        help=f"seconds between the stop signal and SIGKILL at shutdown; "
             f"unset: ${SHUTDOWN_TIMEOUT_ENV}, else {DEFAULT_SHUTDOWN_TIMEOUT_S:g}")
    add("--virtual-local-rank", action=_EnvFlag,
        help="give every worker LOCAL_RANK=0 and only its own GPU in CUDA_VISIBLE_DEVICES")

    own = parser.add_argument_group("fsm-agent options (not in torchrun)")

    def add_own(*names: str, env: str, action: type[argparse.Action] = _EnvStore, **kwargs: Any) -> None:
        own.add_argument(*_spellings(*names), action=action, env_var=env, **kwargs)

    add_own("--exit-barrier-timeout", env="FSM_AGENT_EXIT_BARRIER_TIMEOUT", default=300.0, type=float,
            metavar="SECONDS", help="fsm-agent: seconds to wait at exit for the other nodes' workers to finish")
    add_own("--hang-timeout", env="FSM_AGENT_HANG_TIMEOUT", default=None, type=float, metavar="SECONDS",
            help="fsm-agent: a worker that called fsm_agent.heartbeat() and then none for SECONDS is hung: "
                 "its stacks are recorded and the group restarted")
    add_own("--forward-signals", env="FSM_AGENT_FORWARD_SIGNALS", default="", metavar="SIGNALS",
            type=_returning(parse_forward_signals),
            help="fsm-agent: comma-separated signals (e.g. SIGUSR1) passed on to every worker's process group "
                 "without stopping anything, e.g. for checkpoint-on-preemption; dropped while no worker runs")
    add_own("--events-file", env="FSM_AGENT_EVENTS_FILE", default=None, metavar="PATH",
            help="fsm-agent: JSON-lines file of agent events (default: events.jsonl in the log directory)")
    add_own("--launcher", env="FSM_AGENT_LAUNCHER", default="subprocess", metavar="NAME",
            help="fsm-agent: name of the launcher backend that starts the workers")
    add_own("--scheduler", env="FSM_AGENT_SCHEDULER", default="auto", metavar="NAME",
            help="fsm-agent: fill unset flags from the batch scheduler's job step: auto (any scheduler whose "
                 "job step this is, e.g. slurm inside srun), none, or a scheduler's name (docs/schedulers.md)")
    add_own("--disable-plugin", env=DISABLE_PLUGINS_ENV, action=_EnvExtend, dest="disabled_plugins",
            default=(), type=parse_names, metavar="NAME",
            help="fsm-agent: do not load this plugin (repeatable, or comma-separated; adds to the env list)")

    add_own("--config", env="FSM_AGENT_CONFIG", default=None, metavar="FILE",
            help="fsm-agent: TOML configuration file (keys: docs/configuration.md); flags and env vars win "
                 "over it. Without it, the [tool.fsm_agent] table of ./pyproject.toml is read, if there is one")
    _add_plugin_options(parser, options)
    if for_config:
        shown = parser.add_argument_group("fsm-agent config")
        shown.add_argument("--json", action="store_true", help="print JSON instead of a table")
        shown.add_argument("--reference", action="store_true",
                           help="print the reference of every key (docs/configuration.md) and exit")

    # Entrypoint, then everything after it verbatim, even words that look like launcher flags.
    parser.add_argument("training_script", nargs="?" if for_config else None, default=None,
                        help="the training script (or module with -m, binary with --no-python)")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser


def _add_plugin_options(parser: argparse.ArgumentParser, options: Iterable[PluginOption]) -> None:
    options = list(options)
    if not options:
        return
    group = parser.add_argument_group("plugin options (fsm_agent_addoption)")
    for option in options:
        said = "default:" in option.help or "unset" in option.help  # the plugin's help says it already
        default = ("" if said else " (default: unset)" if option.default in (None, "")
                   else f" (default: {option.default!r})")
        try:
            group.add_argument(*_spellings(option.flag), action=_PluginOptionAction, option=option,
                               dest=option.dest, default=argparse.SUPPRESS, type=_option_parser(option),
                               metavar=option.name.upper(),
                               help=f"{option.plugin}: {option.help}{default} [env {option.env}]")
        except argparse.ArgumentError as exc:
            raise PluginError(f"plugin {option.plugin!r} option {option.name!r}: {exc}") from None


def _option_parser(option: PluginOption) -> Callable[[str], Any]:
    def parse(raw: str) -> Any:
        try:
            return option.from_string(raw)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = option.type.__name__
    return parse


def _returning(check: Callable[[str], Any]) -> Callable[[str], str]:
    """An argparse ``type`` that validates with ``check`` but keeps the torchrun-shaped string."""

    def validated(value: str) -> str:
        check(value)
        return value

    validated.__name__ = getattr(check, "__name__", "value")
    return validated


# ------------------------------------------------------------------------------------------------
# Parsed flags -> LaunchConfig + entrypoint (torch run.py:run + config_from_args).
# ------------------------------------------------------------------------------------------------

def config_from_args(args: argparse.Namespace, *, set_omp_num_threads: bool = True,
                     ) -> tuple[LaunchConfig, str | Callable[..., Any], tuple[str, ...]]:
    """Build the launch from ``get_run_parser()``'s namespace, with torchrun's semantics.

    ``resolve_run_args`` adds what the file and plugins set: ``args.rdzv_conf_file`` (rendezvous
    options from the file; ``--rdzv-conf`` wins per option) and ``args.plugin_options``.
    ``set_omp_num_threads=False`` skips the OMP_NUM_THREADS side effect below (``fsm-agent config``).

    Returns:
        (config, entrypoint, entrypoint_args): the entrypoint is the Python interpreter
        (``$PYTHON_EXEC`` or ``sys.executable``), the binary (``--no-python``) or
        ``run_script_path`` (``--run-path``); None when no training script was given
        (``fsm-agent config``).

    Raises:
        ConfigError: a flag value is invalid or the training script does not exist.

    Side effect (as torch): sets ``OMP_NUM_THREADS=1`` in ``os.environ`` when it is unset and
    there is more than one worker, with torch's warning banner on stderr. Nothing is changed
    when an error is raised.
    """
    min_nodes, max_nodes = parse_nnodes(args.nnodes)
    entrypoint, entrypoint_args = _entrypoint(args) if args.training_script is not None else (None, ())
    try:
        nproc_per_node = resolve_nproc_per_node(args.nproc_per_node)
    except ConfigError as exc:
        var = getattr(args, "from_env", {}).get("nproc_per_node")
        if var is None:
            raise
        flag = f"--nproc-per-node {args.nproc_per_node!r}: "
        raise ConfigError(f"{var}={args.nproc_per_node!r}: {str(exc).removeprefix(flag)}; fix or unset it") from None
    rdzv_backend, rdzv_endpoint, run_id = _rendezvous(args, max_nodes, min_nodes)
    rdzv_configs: dict[str, Any] = {**getattr(args, "rdzv_conf_file", {}), **parse_rdzv_conf(args.rdzv_conf)}
    if rdzv_backend == "static":
        if not 0 <= args.node_rank < max_nodes:
            raise ConfigError(f"--node-rank {args.node_rank}: with --nnodes {args.nnodes} the node ranks are "
                              f"0..{max_nodes - 1}; give each node its own rank in that range")
        rdzv_configs["rank"] = args.node_rank  # an int, as torch's static handler expects
    elif args.node_rank != 0 and rdzv_backend != "fsm":  # fsm: a rank hint (docs/schedulers.md)
        log.warning("--node-rank %s is only used by the static and fsm rendezvous backends; ignored for %s",
                    args.node_rank, rdzv_backend)
    check_std(args.redirects, "--redirects")
    check_std(args.tee, "--tee")
    parse_signals(args.signals_to_handle)
    _warn_missing_local_ranks(parse_local_ranks_filter(args.local_ranks_filter), nproc_per_node)

    config = LaunchConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=nproc_per_node,
        run_id=run_id,
        role=args.role,
        rdzv_endpoint=rdzv_endpoint,
        rdzv_backend=rdzv_backend,
        rdzv_configs=rdzv_configs,
        max_restarts=args.max_restarts,
        monitor_interval=args.monitor_interval,
        start_method=args.start_method,
        log_dir=args.log_dir,
        redirects=args.redirects,
        tee=args.tee,
        local_ranks_filter=parse_local_ranks_filter(args.local_ranks_filter),
        log_line_prefix_template=os.environ.get(LOG_LINE_PREFIX_TEMPLATE_ENV),
        logs_specs=args.logs_specs,
        local_addr=args.local_addr,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=_master_port(args),
        event_log_handler=args.event_log_handler,
        numa_binding=args.numa_binding,
        signals_to_handle=args.signals_to_handle,
        duplicate_stdout_filters=tuple(args.duplicate_stdout_filters),
        duplicate_stderr_filters=tuple(args.duplicate_stderr_filters),
        virtual_local_rank=args.virtual_local_rank,
        shutdown_timeout=_shutdown_timeout(args.shutdown_timeout),
        exit_barrier_timeout=args.exit_barrier_timeout,
        hang_timeout=args.hang_timeout,
        forward_signals=args.forward_signals,
        events_file=args.events_file,
        launcher=args.launcher,
        disabled_plugins=tuple(dict.fromkeys(args.disabled_plugins)),
        standalone=args.standalone,
        scheduler=args.scheduler,
        plugins={plugin: dict(values) for plugin, values in getattr(args, "plugin_options", {}).items()},
    )
    if set_omp_num_threads:
        _default_omp_num_threads(nproc_per_node)
    return config, entrypoint, entrypoint_args


def _master_port(args: argparse.Namespace) -> int:
    return DEFAULT_MASTER_PORT if args.master_port is None else args.master_port


#: Where a standalone job meets: torchrun uses c10d on localhost:0; fsm-agent uses its own torch-free
#: ``fsm`` backend on a free loopback port, so the agent never imports torch (the workers' rank 0
#: hosts their store, TORCHELASTIC_USE_AGENT_STORE=False, as in torch's etcd mode).
STANDALONE_RENDEZVOUS = ("fsm", "127.0.0.1:0")


def _rendezvous(args: argparse.Namespace, max_nodes: int, min_nodes: int = 1) -> tuple[str, str, str]:
    """(backend, endpoint, run_id) after torch's standalone rules (``run.py:run``, ``get_rdzv_endpoint``).

    ``--standalone``, or implicitly a single-node static job with no endpoint and no
    ``--master-port``, becomes STANDALONE_RENDEZVOUS (an OS-chosen loopback port) with a uuid4 run id.
    A static job without an endpoint uses ``MASTER_ADDR:MASTER_PORT``.

    Raises:
        ConfigError: ``--standalone`` with ``--nnodes`` MIN > 1: no other node can ever join a
            standalone rendezvous, so it could only wait until its timeout (torchrun: 600 s).
    """
    if standalone_reason(args, max_nodes):
        if args.standalone and min_nodes > 1:
            raise ConfigError(f"--standalone with --nnodes {args.nnodes}: no other node can join a standalone "
                              f"rendezvous, so {min_nodes} nodes never meet; drop --standalone and give every "
                              f"node --rdzv-backend/--rdzv-endpoint (or --master-addr/--master-port), or use "
                              f"--nnodes 1")
        if args.standalone and (args.rdzv_backend != "static" or args.rdzv_endpoint or args.rdzv_id != "none"):
            log.warning("--standalone ignores --rdzv-backend, --rdzv-endpoint and --rdzv-id")
        if args.standalone and max_nodes > 1:
            log.warning("--standalone with --nnodes %s: no other node can join a standalone rendezvous",
                        args.nnodes)
        return (*STANDALONE_RENDEZVOUS, str(uuid.uuid4()))
    if args.rdzv_backend == "static" and not args.rdzv_endpoint:
        return "static", f"{args.master_addr}:{_master_port(args)}", args.rdzv_id
    check_rdzv_endpoint(args.rdzv_backend, args.rdzv_endpoint)
    return args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id


def standalone_reason(args: argparse.Namespace, max_nodes: int) -> str | None:
    """Why the rendezvous is standalone (c10d on localhost:0, fresh run id), or None if it is not."""
    if args.standalone:
        return "--standalone"
    if args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None and max_nodes == 1:
        return "implicit --standalone (one node, no endpoint, no --master-port)"
    return None


def _entrypoint(args: argparse.Namespace) -> tuple[str | Callable[..., Any], tuple[str, ...]]:
    """(entrypoint, args) as torch: ``python -u [-m] SCRIPT ARGS``, the binary, or ``run_script_path``."""
    script, script_args = args.training_script, tuple(args.training_script_args)
    if args.run_path:  # takes precedence over --no-python and -m, as in torch
        _require_script(script)
        return run_script_path, (script, *script_args)
    if args.no_python:
        if args.module:
            raise ConfigError("--no-python and -m/--module cannot be used together: "
                              "-m runs a Python module, --no-python runs a binary")
        _require_program(script)
        return script, script_args
    if args.module:
        return _python_exec(), ("-u", "-m", script, *script_args)
    _require_script(script)
    return _python_exec(), ("-u", script, *script_args)


def _require_program(script: str) -> None:
    """``--no-python``: ``script`` must be a program the OS can run (exec would fail in every worker)."""
    path = shutil.which(script)
    if path is None and os.path.isfile(script) and not os.access(script, os.X_OK):
        raise ConfigError(f"--no-python binary {script!r} is not executable: chmod +x it, "
                          f"or drop --no-python to run it with python")
    if path is None:
        here = f"; for the file in this directory, say ./{script}" if os.path.isfile(script) else ""
        raise ConfigError(f"--no-python binary {script!r} not found: not an executable file and not on PATH{here}")
    try:
        with open(path, "rb") as file:
            head = file.read(512)
    except OSError:
        return  # executable but not readable: only exec can tell
    if not head.startswith((b"#!", b"\x7fELF")) and b"\0" not in head:  # text without a '#!' line
        raise ConfigError(f"--no-python binary {script!r} has no '#!' line, so it cannot be executed: "
                          f"add one (e.g. #!/usr/bin/env python3), or drop --no-python to run it with python")


def _python_exec() -> str:
    return os.environ.get("PYTHON_EXEC", sys.executable)


def _require_script(script: str) -> None:
    if not os.path.exists(script):
        raise ConfigError(f"training script {script!r} not found: check the path "
                          f"(or use -m for a module, --no-python for a binary)")


def _shutdown_timeout(flag_value: float | None) -> float:
    """Seconds: the flag, else ``$TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, else 30."""
    if flag_value is not None:
        return flag_value
    raw = os.environ.get(SHUTDOWN_TIMEOUT_ENV, "")
    if not raw:
        return DEFAULT_SHUTDOWN_TIMEOUT_S
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"{SHUTDOWN_TIMEOUT_ENV}={raw!r}: not a number of seconds; fix or unset it") from None


def _default_omp_num_threads(nproc_per_node: int) -> None:
    """torch's default: one OpenMP thread per worker when several share the node and nobody chose."""
    if "OMP_NUM_THREADS" in os.environ or nproc_per_node <= 1:
        return
    os.environ["OMP_NUM_THREADS"] = "1"
    print("*****************************************\n"
          "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid "
          "your system being overloaded, please further tune the variable for optimal performance in "
          "your application as needed. \n"
          "*****************************************", file=sys.stderr)


def run_script_path(training_script: str, *training_script_args: str) -> None:
    """The ``--run-path`` entrypoint: run ``training_script`` as ``__main__`` in this interpreter (torch's)."""
    import runpy

    sys.argv = [training_script, *training_script_args]
    runpy.run_path(training_script, run_name="__main__")


# ------------------------------------------------------------------------------------------------
# Layering: command line > environment (FSM_AGENT_*, then PET_*) > config file > defaults.
# ------------------------------------------------------------------------------------------------


@attrs.frozen
class Source:
    """Where a configuration value came from.

    Attributes:
        kind: ``cli``, ``env``, ``file``, ``default`` or ``derived``.
        detail: the flag, the env var, the file, or what it was derived from.
    """

    kind: str
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.kind} {self.detail}".strip()


@attrs.frozen
class ResolvedRun:
    """``fsm-agent run``'s flags with the environment, the config file and plugin options merged in.

    Attributes:
        args: the namespace for ``config_from_args`` (file values filled in where no flag or env
            var set the key; plus ``rdzv_conf_file`` and ``plugin_options``).
        sources: ``{key: Source}`` for every file key that applies (``KEYS``, rendezvous options
            that are set, ``plugins.<plugin>.<name>``).
        config_file: the file that was read, or None.
        options: every plugin option declared by the loaded plugins.
        plugin_manager: the loaded plugins.
    """

    args: argparse.Namespace
    sources: dict[str, Source]
    config_file: ConfigFile | None
    options: OptionRegistry
    plugin_manager: Any = None


def resolve_run_args(argv: Sequence[str], prog: str = "fsm-agent run", *, for_config: bool = False,
                     load_entry_points: bool = True) -> ResolvedRun:
    """Parse ``argv`` and merge every source, highest precedence first: flags, env vars
    (``FSM_AGENT_<NAME>``, then ``PET_<NAME>``), the config file, defaults.

    Steps: find the config file (``--config``, ``$FSM_AGENT_CONFIG`` or ``./pyproject.toml``) and
    the disabled plugins (flags, env and file) from a pre-scan of the flags before the training
    script; load the other plugins and collect their options (``fsm_agent_addoption``); parse the
    flags (argparse applies the env vars); check the file (every error at once); fill in, per
    key, the file's value where neither a flag nor an env var set it.

    Raises:
        ConfigError: a bad flag, env var or file value (the file's errors all in one message).
        PluginError: a plugin failed to load or declared a clashing option.
    """
    from fsm_agent.plugins.manager import check_disabled, collect_options, disabled_from_env

    argv = list(argv)
    core = get_run_parser(prog, for_config=for_config)
    pre = _prescan(argv, core)
    explicit, origin = (pre["config"][-1], "--config") if pre["config"] else (
        os.environ.get("FSM_AGENT_CONFIG") or None, "FSM_AGENT_CONFIG")
    config_file = find_config_file(explicit, origin)
    file_disabled = raw_disabled_plugins(config_file.data) if config_file else ()
    cli_disabled = tuple(n for value in pre["disabled_plugins"] for n in parse_names(value))
    check_disabled(cli_disabled, file_disabled, config_file.label if config_file else "")
    disabled = tuple(dict.fromkeys((*file_disabled, *disabled_from_env(), *cli_disabled)))
    pm = _plugins_for(argv, core, disabled, load_entry_points)
    options = collect_options(pm)

    parser = get_run_parser(prog, options, for_config=for_config)
    parser.defer_env_errors = True  # type: ignore[attr-defined]
    args = parser.parse_args(argv)  # a bad flag raises here; bad env vars are collected
    errors: list[str] = list(parser.env_errors)  # type: ignore[attr-defined]
    details: list[str] = list(errors)  # one line per error, for the CLI when the config file has errors
    env_sources = dict(parser.env_sources)  # type: ignore[attr-defined]
    given = cli_given(argv, prog, options, for_config=for_config)
    flags = {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings}
    file_values = FileValues(values={}, plugins={})
    file_failed = False
    if config_file:
        try:
            file_values = load_file_values(config_file, options, disabled=disabled)
        except ConfigError as exc:
            errors.insert(0, str(exc))
            details[:0] = exc.details or [str(exc)]
            file_failed = True
    label = config_file.label if config_file else ""

    sources: dict[str, Source] = {}
    for key in KEYS:
        if key.dest is None:
            continue
        if key.dest in given:
            sources[key.key] = Source("cli", flags[key.dest])
        elif key.dest in env_sources:
            sources[key.key] = Source("env", env_sources[key.dest])
        elif key.dest == "shutdown_timeout" and os.environ.get(SHUTDOWN_TIMEOUT_ENV):
            sources[key.key] = Source("env", SHUTDOWN_TIMEOUT_ENV)  # torch's env var, above the file
        elif key.key in file_values.values and key.dest != "rdzv_conf":
            setattr(args, key.dest, file_values.values[key.key])
            sources[key.key] = Source("file", label)
        elif key.key in file_values.values:
            sources[key.key] = Source("file", label)
        else:
            sources[key.key] = Source("default")

    # Defaults the batch scheduler's job step gives (Slurm, ...): below flags, env vars and the file.
    apply_discovery(discover(pm, args.scheduler, os.environ), args, sources, KEYS_BY_KEY, Source)

    # Disabled plugins add up: the file's, the env var's, the flags'.
    from_file = file_values.values.get("disabled_plugins", ())
    args.disabled_plugins = tuple(dict.fromkeys((*from_file, *args.disabled_plugins)))
    parts = [str(Source("file", label))] if from_file else []
    parts += [str(Source("env", env_sources["disabled_plugins"]))] if "disabled_plugins" in env_sources else []
    parts += [str(Source("cli", flags["disabled_plugins"]))] if "disabled_plugins" in given else []
    sources["disabled_plugins"] = Source(" + ".join(parts) if parts else "default")

    # Rendezvous options: the file's table and typed keys, under --rdzv-conf (or its env var), per option.
    rdzv_file = dict(file_values.values.get("rendezvous.conf", {}))
    rdzv_file.update({k.name: v for name, v in file_values.values.items()
                      if (k := KEYS_BY_KEY[name]).dest is None})
    args.rdzv_conf_file = rdzv_file
    # Which values came from the environment, so a late check (--nproc-per-node names a device)
    # names the variable to fix rather than a flag the user never typed.
    args.from_env = {dest: var for dest, var in env_sources.items() if dest not in given}
    conf_source = sources["rendezvous.conf"]
    for name in rdzv_file:
        sources[f"rendezvous.{name}"] = Source("file", label)
    if conf_source.kind in ("cli", "env"):
        for name in parse_rdzv_conf(args.rdzv_conf):
            sources[f"rendezvous.{name}"] = conf_source

    # Plugin options: flag > env var > file > default.
    plugin_values: dict[str, dict[str, Any]] = {}
    for option in options:
        if option.plugin in disabled:
            continue
        values = plugin_values.setdefault(option.plugin, {})
        raw = os.environ.get(option.env, "")
        if hasattr(args, option.dest):
            values[option.name], source = getattr(args, option.dest), Source("cli", option.flag)
        elif raw:
            try:
                values[option.name] = option.from_string(raw)
            except ValueError as exc:
                errors.append(f"{option.env}={raw!r}: {exc}")
                details.append(errors[-1])
            source = Source("env", option.env)
        elif option.name in file_values.plugins.get(option.plugin, {}):
            values[option.name], source = file_values.plugins[option.plugin][option.name], Source("file", label)
        else:
            values[option.name], source = option.default, Source("default")
        sources[option.key] = source
    if errors:  # the file's, the env vars' and the plugin env vars' errors, all at once
        raise ConfigError("; ".join(errors), details=details if file_failed else ())
    args.plugin_options = plugin_values
    return ResolvedRun(args=args, sources=sources, config_file=config_file, options=options, plugin_manager=pm)


def check_rdzv_conf(resolved: ResolvedRun, config: LaunchConfig) -> None:
    """Rendezvous options (``--rdzv-conf``, its env vars, the file) against the loaded backends.

    Raises:
        ConfigError: an option that no loaded backend reads (a typo: torch ignores it silently).

    Logs a warning for an option that the chosen backend does not read but another one does.
    """
    from fsm_agent.plugins.manager import build_registry

    def where(key: str) -> str:
        source = resolved.sources.get(f"rendezvous.{key}", Source("default"))
        label = source.detail if source.kind in ("cli", "env") else f"{source.detail} rendezvous"
        return f"{label} {key}={config.rdzv_configs[key]}"

    registry = build_registry(resolved.plugin_manager)
    for warning in registry.check_rdzv_conf(config.rdzv_backend, config.rdzv_configs, where):
        log.warning("%s", warning)


KEYS_BY_KEY = {key.key: key for key in KEYS}


def _plugins_for(argv: Sequence[str], core: argparse.ArgumentParser, disabled: tuple[str, ...],
                 load_entry_points: bool) -> Any:
    """The plugin manager; for ``--help``, a plugin that fails to load is a warning, left out."""
    from fsm_agent.plugins.manager import get_plugin_manager

    asks_for_help = any(action is not None and action.dest == "help"
                        for action, _ in _launcher_flags(argv, core, unknown_takes_value=True)[0])
    while True:
        try:
            return get_plugin_manager(disabled=disabled, load_entry_points=load_entry_points)
        except PluginError as exc:
            if not asks_for_help or exc.plugin is None or exc.plugin in disabled:
                raise
            log.warning("%s; --help leaves its options out", exc)
            disabled = (*disabled, exc.plugin)


def cli_given(argv: Sequence[str], prog: str = "fsm-agent run", options: Iterable[PluginOption] = (), *,
              for_config: bool = False) -> set[str]:
    """The dests set on the command line itself: ``argv`` parsed without env vars or defaults."""
    parser = get_run_parser(prog, options, for_config=for_config)
    parser.read_env = False  # type: ignore[attr-defined]
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(list(argv))))


def _prescan(argv: Sequence[str], parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    """``--config`` and ``--disable-plugin`` values among the flags before the training script.

    Needed before the real parse: they decide which plugins load, hence which flags exist.
    An unknown flag is a plugin option's, which always takes one value.
    """
    found: dict[str, list[str]] = {"config": [], "disabled_plugins": []}
    flags, _ = _launcher_flags(argv, parser, unknown_takes_value=True)
    for action, value in flags:
        if action is not None and action.dest in found and value is not None:
            found[action.dest].append(value)
    return found


def _launcher_flags(argv: Sequence[str], parser: argparse.ArgumentParser, *, unknown_takes_value: bool,
                    ) -> tuple[list[tuple[argparse.Action | None, str | None]], int]:
    """Walk the launcher's flags as argparse does (known flags by their arity, abbreviations included).

    Returns:
        ([(action or None when unknown or ambiguous, value or None)], index of the training script
        in ``argv``, or ``len(argv)`` when there is none). What follows the script is the script's.
    """
    strings = parser._option_string_actions
    flags: list[tuple[argparse.Action | None, str | None]] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return flags, i + 1
        if not token.startswith("-") or token == "-":
            return flags, i  # the training script: what follows is its own
        name, eq, value = token.partition("=")
        if not name.startswith("--"):  # -r 3, -r3, -m
            action = strings.get(token[:2])
            takes_value = action is not None and action.nargs != 0 and len(token) == 2
            value = token[2:] or None
        else:
            matches = ({a for s, a in strings.items() if s == name}
                       or {a for s, a in strings.items() if s.startswith(name)})
            action = next(iter(matches)) if len(matches) == 1 else None
            takes_value = (unknown_takes_value if not matches else action is None or action.nargs != 0) and not eq
        if takes_value:
            value, i = (argv[i + 1] if i + 1 < len(argv) else None), i + 2
        else:
            value, i = (value if eq or not name.startswith("--") else None), i + 1
        flags.append((action, value))
    return flags, len(argv)


# ------------------------------------------------------------------------------------------------
# fsm-agent config: the effective configuration and where each value came from.
# ------------------------------------------------------------------------------------------------


def config_command(argv: list[str]) -> int:
    """``fsm-agent config [run flags] [SCRIPT ...] [--json] [--reference]``."""
    if "--reference" in argv:
        sys.stdout.write(configuration_reference())
        return 0
    resolved = resolve_run_args(argv, "fsm-agent config", for_config=True)
    config, _, _ = config_from_args(resolved.args, set_omp_num_threads=False)
    check_rdzv_conf(resolved, config)
    rows = effective_rows(resolved, config)
    if resolved.args.json:
        doc = {"config_file": resolved.config_file.label if resolved.config_file else None,
               "values": {key: {"value": value, "source": str(source)} for key, value, source in rows}}
        print(json.dumps(doc, indent=2, default=list))
        return 0
    _print_rows(rows, resolved.config_file)
    return 0


def effective_rows(resolved: ResolvedRun, config: LaunchConfig) -> list[tuple[str, Any, Source]]:
    """``(key, effective value, source)`` for every key: LaunchConfig's values (after torchrun's
    rules, such as standalone), the rendezvous options it passes on, and plugin options."""
    args, sources = resolved.args, resolved.sources
    reason = standalone_reason(args, config.max_nodes)
    rows: list[tuple[str, Any, Source]] = []
    for key in KEYS:
        if key.dest is None or key.key == "rendezvous.conf":
            continue
        source = sources[key.key]
        if key.key == "nnodes":
            value: Any = f"{config.min_nodes}:{config.max_nodes}"
        elif key.key == "rendezvous.run_id":
            value = config.run_id
        else:
            value = getattr(config, key.field.split(",")[0])
        if reason and key.key in ("rendezvous.backend", "rendezvous.endpoint", "rendezvous.run_id"):
            source = Source("derived", reason)
        if isinstance(value, (frozenset, set)):
            value = sorted(value)
        elif isinstance(value, tuple):
            value = list(value)
        rows.append((key.key, value, source))
    conf_rows = []
    for name, value in sorted(config.rdzv_configs.items()):
        default = Source("derived", "rendezvous.node_rank (static backend)") if name == "rank" else Source("default")
        conf_rows.append((f"rendezvous.{name}", value, sources.get(f"rendezvous.{name}", default)))
    after = max(i for i, row in enumerate(rows) if row[0].startswith("rendezvous.")) + 1
    rows[after:after] = conf_rows
    for option in resolved.options:
        if option.key in sources:
            rows.append((option.key, config.plugins.get(option.plugin, {}).get(option.name), sources[option.key]))
    return rows


def _print_rows(rows: list[tuple[str, Any, Source]], config_file: ConfigFile | None) -> None:
    def shown(value: Any) -> str:
        return "unset" if value is None else json.dumps(value) if not isinstance(value, str) else value

    title = f"config file: {config_file.label if config_file else 'none'}"
    try:
        if not sys.stdout.isatty():  # piped (grep, a file): whole lines, never a value wrapped mid-token
            raise ImportError
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # rich is optional: a plain aligned table
        width = max(len(key) for key, _, _ in rows)
        vwidth = max(len(shown(value)) for _, value, _ in rows)
        print(title)
        for key, value, source in rows:
            print(f"{key:<{width}}  {shown(value):<{vwidth}}  {source}")
        return
    table = Table(title="fsm-agent configuration", caption=title, caption_justify="left")
    table.add_column("key", no_wrap=True)
    table.add_column("value", overflow="fold")
    table.add_column("source")
    for key, value, source in rows:
        style = {"cli": "bold", "env": "cyan", "file": "green", "derived": "magenta"}.get(source.kind.split()[0], "dim")
        table.add_row(key, shown(value), str(source), style=style)
    Console().print(table)


def configuration_reference() -> str:
    """``docs/configuration.md``: precedence, the file, and every key with its flag, env vars and default.

    Generated from ``KEYS``, the run parser and the built-in plugins' options; regenerate with
    ``fsm-agent config --reference > docs/configuration.md`` (``tests/config`` checks it).
    """
    from fsm_agent.config import RENDEZVOUS_OPTIONS
    from fsm_agent.plugins.manager import BUILTIN_PLUGINS, collect_options, get_plugin_manager

    pm = get_plugin_manager(load_entry_points=False)
    options = [o for o in collect_options(pm) if o.plugin in BUILTIN_PLUGINS]
    parser = get_run_parser("fsm-agent run", options)
    actions = {a.dest: a for a in parser._actions}

    def code(text: Any) -> str:
        return f"`{text}`"

    def cell(text: str) -> str:
        return " ".join(text.split()).replace("|", "\\|")

    def help_of(action: argparse.Action) -> str:
        text = re.sub(r"\s*\[env [^\]]*\]$", "", action.help or "")
        return cell(text.removeprefix("fsm-agent: "))

    def default_of(key: Any, action: argparse.Action | None) -> str:
        if key.default is not None:
            return key.default
        value = action.default if action is not None else None
        if value is None:
            return "unset"
        if isinstance(value, (list, tuple)):
            value = list(value)
        return code(json.dumps(value))

    lines = [
        "# Configuration",
        "",
        "<!-- Generated by `fsm-agent config --reference > docs/configuration.md`; do not edit by hand.",
        "     tests/config/test_reference_doc.py fails when it is out of date. -->",
        "",
        "One typed configuration (`fsm_agent.config.LaunchConfig`, attrs, frozen) filled from, highest",
        "precedence first:",
        "",
        "1. **command-line flags** of `fsm-agent run` / `fsmrun` (torchrun's flags, unchanged);",
        "2. **the environment**: `FSM_AGENT_<NAME>`, then torchrun's `PET_<NAME>` (an empty variable",
        "   counts as unset);",
        "3. **a TOML file**: `--config FILE` (or `$FSM_AGENT_CONFIG`), else the `[tool.fsm_agent]` table of",
        "   a `pyproject.toml` in the current directory, if it has one;",
        "4. **the defaults** (torchrun's).",
        "",
        "Precedence is per key. Two keys combine instead: `disabled_plugins` (the file's list, the",
        "environment's and the flags' add up) and the rendezvous options (`--rdzv-conf` or its env var",
        "wins over the file option by option). `shutdown_timeout` also reads torch's",
        "`TORCH_ELASTIC_SHUTDOWN_TIMEOUT`, below `FSM_AGENT_SHUTDOWN_TIMEOUT`/`PET_SHUTDOWN_TIMEOUT`",
        "and above the file.",
        "",
        "Rendezvous options, wherever they come from, are checked against the `--rdzv-conf` keys the",
        "loaded backends declare: one that no backend reads is an error with the closest known key",
        "(`join_timout=5`: did you mean `join_timeout`?); one that only another backend reads (a job file",
        "that sets `PET_RDZV_CONF` for several backends) is a warning. A backend that declares no keys",
        "(a `torchrun.handlers` entry point) gets every option unchecked.",
        "",
        "`fsm-agent config [flags] [SCRIPT]` prints the effective configuration and where each value came",
        "from (`cli`, `env`, `file`, `default`, or `derived` for the rendezvous settings",
        "`--standalone` replaces); `--json` prints it as JSON.",
        "",
        "## The file",
        "",
        "Keys mirror the `LaunchConfig` fields and torchrun's flag names in snake_case. A `--config` file",
        "holds them at its top level; a `pyproject.toml` under `[tool.fsm_agent]` (so `[rendezvous]`",
        "becomes `[tool.fsm_agent.rendezvous]`). A `--config` file named `pyproject.toml` is read from",
        "its `[tool.fsm_agent]` table too. A table spelled otherwise (`[tool.fsm-agent]`) is an error,",
        "not ignored.",
        "",
        "```toml",
        "nnodes = \"1:4\"",
        "nproc_per_node = 8",
        "max_restarts = 3",
        "",
        "[rendezvous]",
        "backend = \"c10d\"",
        "endpoint = \"node0.example.com:29400\"",
        "run_id = \"llm-pretrain\"",
        "join_timeout = 900",
        "",
        "[logs]",
        "log_dir = \"/scratch/logs\"",
        "tee = 3",
        "",
        "[plugins.status-http]",
        "port = 8600",
        "```",
        "",
        "Loading is strict and complete. Types are checked exactly (`\"false\"` is not a boolean, `2.7` is",
        "not an integer, `\"3\"` is not a number), ranges and formats are checked (`monitor_interval > 0`,",
        "`nnodes` as `N` or `\"MIN:MAX\"` with `MIN <= MAX`, signal names, ...), unknown keys are errors",
        "(with a suggestion), and **every** error is reported at once, one per line with the file and",
        "its key path; the command exits with status 2:",
        "",
        "```text",
        "fsm-agent: error: 3 errors:",
        "  fsm.toml: max_restarts: expected an integer >= 0, got \"three\"",
        "  fsm.toml: rendezvous.join_timeout: expected seconds > 0, got \"abc\"",
        "  fsm.toml: logs.colour: unknown key in [logs] (see docs/configuration.md for the keys)",
        "```",
        "",
        "Environment variables are checked as strictly, and all bad ones are reported together with",
        "the file's. A single error is one line (`fsm-agent: error: fsm.toml: 1 error: ...`).",
        "",
        "## Keys",
        "",
        "\"Flag\" is the `fsm-agent run` flag (each long flag also has its `--snake_case` spelling, as",
        "in torchrun); \"Environment\" lists the variables read, first one winning.",
    ]
    titles = {"": "Top level", "rendezvous": "`[rendezvous]`", "logs": "`[logs]`"}
    for section, title in titles.items():
        lines += ["", f"### {title}", "",
                  "| Key | Type | Flag | Environment | Default | LaunchConfig | Description |",
                  "|---|---|---|---|---|---|---|"]
        for key in KEYS:
            if key.section != section:
                continue
            if key.dest is None:  # a typed rendezvous option: set through --rdzv-conf
                conf = actions["rdzv_conf"]
                flag = code(f"--rdzv-conf {key.name}=V")
                envs = ", ".join(code(f"{v} ({key.name}=V)") for v in env_vars(conf))
                default, description = "unset (the backend's)", cell(RENDEZVOUS_OPTIONS[key.name][1])
            else:
                action = actions[key.dest]
                flag = ", ".join(code(s) for s in action.option_strings if not s.startswith("--") or "_" not in s)
                names = env_vars(action)
                if key.dest == "shutdown_timeout":
                    names.append(SHUTDOWN_TIMEOUT_ENV)
                envs = ", ".join(code(v) for v in names)
                default, description = default_of(key, action), key.help or help_of(action)
            lines.append("| " + " | ".join([code(key.name), cell(key.kind.toml), flag, envs, default,
                                            code(key.field), description]) + " |")
    lines += [
        "",
        "### Not configurable in the file",
        "",
        "The entrypoint is per command: the training script and its arguments, `-m/--module`,",
        "`--no-python`, `--run-path` (these read `PET_MODULE`, `PET_NO_PYTHON`, `PET_RUN_PATH` as",
        "torchrun does). `--config` itself reads `FSM_AGENT_CONFIG`. torch's own variables keep their",
        "meaning: `TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE` (`LaunchConfig.log_line_prefix_template`),",
        "`PYTHON_EXEC`, `LOGLEVEL`, `OMP_NUM_THREADS`.",
        "",
        "## Plugin options",
        "",
        "A plugin declares its options in the `fsm_agent_addoption(options)` hook; each becomes a flag",
        "(`--<plugin>-<name>` unless the plugin names one; it always takes one value, booleans too:",
        "`--x true`), an environment variable (`FSM_AGENT_<PLUGIN>_<NAME>` unless named) and the key",
        "`<name>` of the `[plugins.<plugin>]` table, with the same precedence and the same strict checks.",
        "The plugin reads its values with `config.plugin_options(\"<plugin>\")` in `fsm_agent_configure`.",
        "A `[plugins.<plugin>]` table for a disabled plugin is ignored; for any other plugin that declares",
        "no options it is an error. `fsm-agent run --help` lists the options of the installed plugins.",
        "",
        "```python",
        "from fsm_agent.plugins import hookimpl",
        "",
        "@hookimpl",
        "def fsm_agent_addoption(options):",
        "    options.add(\"endpoint\", type=str, default=None, help=\"where to push metrics\")",
        "",
        "@hookimpl",
        "def fsm_agent_configure(config, agent):",
        "    endpoint = config.plugin_options(\"myplugin\").get(\"endpoint\")",
        "```",
        "",
        "Options of the built-in plugins:",
        "",
        "| Key | Type | Flag | Environment | Default | Description |",
        "|---|---|---|---|---|---|",
    ]
    for option in options:
        default = "unset" if option.default is None else code(json.dumps(option.default))
        lines.append("| " + " | ".join([code(option.key), option.kind.toml, code(option.flag), code(option.env),
                                        default, cell(option.help)]) + " |")
    lines += [
        "",
        "### `status-http`: live status",
        "",
        "With a port set, the agent serves on `127.0.0.1` only (port `0` picks a free one; the agent",
        "prints the URL on stderr): `GET /status` (JSON: state, seconds in it, `restart_count` and",
        "`remaining_restarts`, `rendezvous_round`, membership, per-worker pid/ranks/state/exit code, the",
        "last transitions, `?transitions=N`), `GET /statechart` (the Mermaid statechart with the current",
        "state in class `current`) and `GET /healthz`. `fsm-agent status URL [--watch] [--interval S]`",
        "prints `/status` as tables (`--json` for the raw document).",
    ]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------
# Entry points. Exceptions become exit codes here and nowhere else.
# ------------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Console script ``fsm-agent {run,config,statechart,plugins,status} ...``; exits with the command's exit code."""
    _exit(_exit_code(_dispatch, list(sys.argv[1:] if argv is None else argv)), from_console=argv is None)


def fsmrun_main(argv: Sequence[str] | None = None) -> NoReturn:
    """Console script ``fsmrun``: the torchrun drop-in, same as ``fsm-agent run ARGS``."""
    _exit(_exit_code(run_command, list(sys.argv[1:] if argv is None else argv), "fsmrun", name="fsmrun"),
          from_console=argv is None)


def _exit(code: int, from_console: bool) -> NoReturn:
    """Exit with ``code``. From the console, skip the interpreter's teardown once output is flushed:
    the agent's work (workers stopped, files closed, hooks unconfigured) is done by then, and
    unloading modules and joining daemon threads only delays the exit a shell or scheduler waits for.
    The ``atexit`` handlers still run first, as at a normal exit (multiprocessing removes its
    ``pymp-*`` directory there; a plugin's library may flush there).
    """
    if from_console:
        atexit._run_exitfuncs()  # the first step of a normal exit (logging.shutdown is one of them)
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BrokenPipeError:
            code = code or EXIT_BROKEN_PIPE
        os._exit(code)
    sys.exit(code)


def run_main(argv: Sequence[str] | None = None) -> None:
    """``torch.distributed.run.main(args)``: parse torchrun's arguments (``argv`` without a ``run``
    word; None: ``sys.argv[1:]``), launch this node's agent and return None once the workers succeeded.

    Raises:
        SystemExit: bad input (exit code 2, as torch's argparse), after one ``fsm-agent run: error:``
            line on stderr; ``--help`` (exit code 0).
        WorkerGroupFailedError: workers failed; it *is a* torch ``ChildFailedError``, as torch raises.
        AgentFailedError, SignalException, ConfigError, PluginError: as ``fsm_agent.launch_agent``.
    """
    try:
        config, entrypoint, entrypoint_args = _parse_run(list(sys.argv[1:] if argv is None else argv))
    except FsmAgentError as exc:
        raise SystemExit(_report(exc, "fsm-agent run")) from None
    from fsm_agent.launch import launch_agent  # lazy: the CLI must answer --help without the agent

    launch_agent(config, entrypoint, entrypoint_args)


def _parse_run(argv: list[str], prog: str = "fsm-agent run") -> tuple[LaunchConfig, str | Callable[..., Any],
                                                                      tuple[str, ...]]:
    """``argv`` parsed like torchrun (plus env vars, the config file and plugin options): the config,
    the entrypoint and its arguments. Raises ConfigError / PluginError for bad input."""
    resolved = resolve_run_args(argv, prog)
    config, entrypoint, entrypoint_args = config_from_args(resolved.args)
    check_rdzv_conf(resolved, config)
    return config, entrypoint, entrypoint_args


def run_command(argv: list[str], prog: str = "fsm-agent run") -> int:
    """Parse ``argv`` like torchrun (plus env vars, the config file and plugin options), launch
    this node's agent and return its exit code."""
    config, entrypoint, entrypoint_args = _parse_run(argv, prog)
    from fsm_agent.launch import run_agent  # lazy: the CLI must answer --help without the agent

    return run_agent(config, entrypoint, entrypoint_args).exit_code


def _dispatch(argv: list[str]) -> int:
    # Dispatch on the first word so each command sees its arguments verbatim (an argparse
    # subparser with REMAINDER would not keep leading options); the main parser handles the rest.
    if not (argv and (argv[0] in _LOCAL_COMMANDS or argv[0] in _DELEGATES)):
        namespace = _main_parser().parse_args(argv)  # --help/--version exit; bad input raises
        argv = [namespace.command, *namespace.args]
    command, rest = argv[0], argv[1:]
    if command == "run":
        return run_command(rest)
    if command == "config":
        return config_command(rest)
    return _delegate(_DELEGATES[command][0], rest)


def _main_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fsm-agent", description="An elastic launcher for PyTorch: torchrun as a statechart.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, help_text in _LOCAL_COMMANDS.items():
        commands.add_parser(name, add_help=False, help=help_text)
    for name, (_, help_text) in _DELEGATES.items():
        commands.add_parser(name, add_help=False, help=help_text)
    for subparser in commands.choices.values():
        subparser.add_argument("args", nargs=argparse.REMAINDER)
    return parser


def _delegate(module_name: str, argv: list[str]) -> int:
    """Run ``module_name.cli_main(argv)``; the module is imported only when its command is used."""
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if not exc.name or not (module_name + ".").startswith(exc.name + "."):
            raise
        raise FsmAgentError(f"this command is not available: module {module_name} is missing "
                            f"from this fsm-agent installation") from None
    return int(module.cli_main(argv) or 0)


def _exit_code(command: Callable[..., int], *args: Any, name: str = "fsm-agent") -> int:
    """Run ``command``; an FsmAgentError becomes one stderr line ``NAME: error: ...`` and its exit code,
    Ctrl-C 130."""
    try:
        return command(*args)
    except FsmAgentError as exc:
        return _report(exc, name)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # e.g. `fsm-agent status URL --json | head`: the reader is gone, say nothing
        _stdout_to_devnull()
        return EXIT_BROKEN_PIPE


def _report(exc: FsmAgentError, name: str) -> int:
    """Print ``exc`` as one stderr line ``NAME: error: ...`` (a headline and one line per detail
    when it holds several errors); return its exit code."""
    if len(exc.details) > 1:  # several errors at once (a config file's): one per line
        print(f"{name}: error: {exc.headline or f'{len(exc.details)} errors:'}", file=sys.stderr)
        for line in exc.details:
            print(f"  {line}", file=sys.stderr)
        return exc.exit_code
    message = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    print(f"{name}: error: {message}", file=sys.stderr)
    return exc.exit_code


def _stdout_to_devnull() -> None:
    """Point fd 1 at /dev/null, so the interpreter's last flush of stdout cannot fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("fsm-agent")
    except metadata.PackageNotFoundError:
        return "0.1.0"
