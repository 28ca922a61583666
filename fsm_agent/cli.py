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
import importlib
import logging
import os
import re
import signal
import sys
import uuid
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from fsm_agent.config import LaunchConfig
from fsm_agent.errors import ConfigError, FsmAgentError

log = logging.getLogger(__name__)

DEFAULT_MASTER_PORT = 29500
#: Seconds between the death signal and SIGKILL when neither the flag nor the env var says.
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
LOG_LINE_PREFIX_TEMPLATE_ENV = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"
DISABLE_PLUGINS_ENV = "FSM_AGENT_DISABLE_PLUGINS"
#: Exit code for Ctrl-C (128 + SIGINT), as a shell reports it.
EXIT_INTERRUPTED = 130

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


def parse_filters(value: str) -> list[str]:
    """``--duplicate-std*-filters``: comma-separated substrings, ``,,`` escaping a comma (as torch).

    Empty items are dropped (torch keeps them, and an empty substring matches every line).
    """
    placeholder = "\0"
    items = value.replace(",,", placeholder).split(",")
    return [item.replace(placeholder, ",") for item in items if item]


def parse_signals(value: str) -> tuple[str, ...]:
    """``--signals-to-handle SIGTERM,SIGINT`` -> the names; each must be a signal the agent can trap."""
    names = tuple(name.strip() for name in value.split(",")) if value.strip() else ()
    for name in names:
        if name not in signal.Signals.__members__ or name in _UNHANDLEABLE_SIGNALS:
            problem = "cannot be trapped" if name in _UNHANDLEABLE_SIGNALS else "is not a signal on this platform"
            raise ConfigError(f"--signals-to-handle {value!r}: {name!r} {problem}; use names such as "
                              f"SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")
    return names


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


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors are ConfigErrors (one line) and whose env fallbacks apply at parse time."""

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        # A value set on the namespace beforehand is kept by argparse unless the flag is given,
        # so the command line wins over the env var, which wins over the default.
        namespace = argparse.Namespace() if namespace is None else namespace
        for action in self._actions:
            if isinstance(action, _EnvAction) and not hasattr(namespace, action.dest):
                raw = os.environ.get(action.env_var, "")
                if raw:  # set but empty counts as unset
                    setattr(namespace, action.dest, action.from_env(raw))
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message} (see {self.prog} --help)")


class _EnvAction(argparse.Action):
    """A flag whose default can come from an environment variable (torch's ``argparse_util.env``)."""

    def __init__(self, option_strings, dest, env_var: str | None = None, **kwargs):
        self.env_var = env_var or f"PET_{dest.upper()}"
        kwargs["help"] = f"{kwargs.get('help', '')} [env {self.env_var}]"
        super().__init__(option_strings, dest, **kwargs)

    def from_env(self, raw: str) -> Any:
        """The flag's value for env value ``raw``; raises ConfigError naming the env var."""
        raise NotImplementedError

    def _convert(self, raw: str) -> Any:
        try:
            return self.type(raw) if self.type else raw
        except FsmAgentError as exc:
            raise ConfigError(f"{self.env_var}={raw!r}: {exc}") from None
        except (TypeError, ValueError, argparse.ArgumentTypeError):
            type_name = getattr(self.type, "__name__", "value")
            raise ConfigError(f"{self.env_var}={raw!r}: not a valid {type_name} for "
                              f"{self.option_strings[0]}; fix or unset it") from None


class _EnvStore(_EnvAction):
    """``store`` with a ``PET_<DEST>`` fallback, converted and checked like the command-line value."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)

    def from_env(self, raw: str) -> Any:
        value = self._convert(raw)
        if self.choices is not None and value not in self.choices:
            raise ConfigError(f"{self.env_var}={raw!r}: choose from {', '.join(map(str, self.choices))}")
        return value


class _EnvFlag(_EnvAction):
    """``store_true`` with a boolean env fallback (torch's ``check_env``, without its crash on ``true``)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=False, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, True)

    def from_env(self, raw: str) -> bool:
        return parse_bool(raw, self.env_var)


class _EnvExtend(_EnvAction):
    """Repeatable, comma-splitting flag; the command line adds to the env var's list."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, (*(getattr(namespace, self.dest, None) or ()), *values))

    def from_env(self, raw: str) -> tuple[str, ...]:
        return self._convert(raw)


def _spellings(*names: str) -> list[str]:
    """Every long flag also under its underscored spelling, as torchrun (``--nproc-per-node``/``--nproc_per_node``)."""
    underscored = ["--" + name[2:].replace("-", "_") for name in names if name.startswith("--") and "-" in name[2:]]
    return [*names, *underscored]


def get_run_parser(prog: str = "fsm-agent run") -> argparse.ArgumentParser:
    """The ``fsm-agent run`` / ``fsmrun`` parser: torchrun 2.13's flags, then fsm-agent's own.

    Flag names, dests, defaults and ``PET_<DEST>`` fallbacks equal torchrun's. Values stay
    torchrun-shaped strings (checked here, converted by ``config_from_args``).
    """
    parser = _Parser(
        prog=prog,
        description="Launch and supervise this node's workers: a drop-in replacement for torchrun.",
        epilog="Every flag except --logs-specs and --numa-binding also reads the environment variable "
               "shown in [env ...]; the command line wins (--disable-plugin adds to the env list). "
               "fsm-agent's own flags are marked 'fsm-agent:'.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
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
        help="single-node job: c10d rendezvous on a free local port with a fresh id "
             "(--rdzv-backend/--rdzv-endpoint/--rdzv-id are ignored)")
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
    add("--master-port", default=None, type=int,
        help=f"port on the rank-0 node (static rendezvous only; {DEFAULT_MASTER_PORT} when unset). "
             "Giving it turns off the implicit single-node c10d rendezvous")
    add("--local-addr", default=None, help="this node's address (default: its FQDN)")
    add("--logs-specs", action="store", default=None,
        help="name of a torchrun.logs_specs entry point that lays out the log files")
    add("--numa-binding", action="store", default=None, choices=NUMA_BINDING_MODES,
        help="bind each worker to the CPUs near its GPU")
    add("--signals-to-handle", default="SIGTERM,SIGINT,SIGHUP,SIGQUIT", type=_returning(parse_signals),
        help="comma-separated signals the agent traps and forwards to the workers")
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
            help="fsm-agent: comma-separated signals (e.g. SIGUSR1) passed on to every worker's process group "
                 "without stopping anything, e.g. for checkpoint-on-preemption")
    add_own("--events-file", env="FSM_AGENT_EVENTS_FILE", default=None, metavar="PATH",
            help="fsm-agent: JSON-lines file of agent events (default: events.jsonl in the log directory)")
    add_own("--launcher", env="FSM_AGENT_LAUNCHER", default="subprocess", metavar="NAME",
            help="fsm-agent: name of the launcher backend that starts the workers")
    add_own("--disable-plugin", env=DISABLE_PLUGINS_ENV, action=_EnvExtend, dest="disabled_plugins",
            default=(), type=parse_names, metavar="NAME",
            help="fsm-agent: do not load this plugin (repeatable, or comma-separated; adds to the env list)")

    # Entrypoint, then everything after it verbatim, even words that look like launcher flags.
    parser.add_argument("training_script", help="the training script (or module with -m, binary with --no-python)")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser


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

def config_from_args(args: argparse.Namespace) -> tuple[LaunchConfig, str | Callable[..., Any], tuple[str, ...]]:
    """Build the launch from ``get_run_parser()``'s namespace, with torchrun's semantics.

    Returns:
        (config, entrypoint, entrypoint_args): the entrypoint is the Python interpreter
        (``$PYTHON_EXEC`` or ``sys.executable``), the binary (``--no-python``) or
        ``run_script_path`` (``--run-path``).

    Raises:
        ConfigError: a flag value is invalid or the training script does not exist.

    Side effect (as torch): sets ``OMP_NUM_THREADS=1`` in ``os.environ`` when it is unset and
    there is more than one worker, with torch's warning banner on stderr. Nothing is changed
    when an error is raised.
    """
    min_nodes, max_nodes = parse_nnodes(args.nnodes)
    entrypoint, entrypoint_args = _entrypoint(args)
    nproc_per_node = resolve_nproc_per_node(args.nproc_per_node)
    rdzv_backend, rdzv_endpoint, run_id = _rendezvous(args, max_nodes)
    rdzv_configs: dict[str, Any] = parse_rdzv_conf(args.rdzv_conf)
    if rdzv_backend == "static":
        rdzv_configs["rank"] = args.node_rank  # an int, as torch's static handler expects
    elif args.node_rank != 0:
        log.warning("--node-rank %s is only used by the static rendezvous backend; ignored for %s",
                    args.node_rank, rdzv_backend)
    check_std(args.redirects, "--redirects")
    check_std(args.tee, "--tee")
    parse_signals(args.signals_to_handle)

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
    )
    _default_omp_num_threads(nproc_per_node)
    return config, entrypoint, entrypoint_args


def _master_port(args: argparse.Namespace) -> int:
    return DEFAULT_MASTER_PORT if args.master_port is None else args.master_port


def _rendezvous(args: argparse.Namespace, max_nodes: int) -> tuple[str, str, str]:
    """(backend, endpoint, run_id) after torch's standalone rules (``run.py:run``, ``get_rdzv_endpoint``).

    ``--standalone``, or implicitly a single-node static job with no endpoint and no
    ``--master-port``, becomes c10d on ``localhost:0`` (an OS-chosen port) with a uuid4 run id.
    A static job without an endpoint uses ``MASTER_ADDR:MASTER_PORT``.
    """
    implicit_standalone = (args.rdzv_backend == "static" and not args.rdzv_endpoint
                           and args.master_port is None and max_nodes == 1)
    if args.standalone or implicit_standalone:
        if args.standalone and (args.rdzv_backend != "static" or args.rdzv_endpoint or args.rdzv_id != "none"):
            log.warning("--standalone ignores --rdzv-backend, --rdzv-endpoint and --rdzv-id")
        if args.standalone and max_nodes > 1:
            log.warning("--standalone with --nnodes %s: no other node can join a standalone rendezvous",
                        args.nnodes)
        return "c10d", "localhost:0", str(uuid.uuid4())
    if args.rdzv_backend == "static" and not args.rdzv_endpoint:
        return "static", f"{args.master_addr}:{_master_port(args)}", args.rdzv_id
    return args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id


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
        return script, script_args
    if args.module:
        return _python_exec(), ("-u", "-m", script, *script_args)
    _require_script(script)
    return _python_exec(), ("-u", script, *script_args)


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
# Entry points. Exceptions become exit codes here and nowhere else.
# ------------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Console script ``fsm-agent {run,statechart,plugins} ...``; exits with the command's exit code."""
    sys.exit(_exit_code(_dispatch, list(sys.argv[1:] if argv is None else argv)))


def fsmrun_main(argv: Sequence[str] | None = None) -> NoReturn:
    """Console script ``fsmrun``: the torchrun drop-in, same as ``fsm-agent run ARGS``."""
    sys.exit(_exit_code(run_command, list(sys.argv[1:] if argv is None else argv), "fsmrun"))


def run_command(argv: list[str], prog: str = "fsm-agent run") -> int:
    """Parse ``argv`` like torchrun, launch this node's agent and return its exit code."""
    config, entrypoint, entrypoint_args = config_from_args(get_run_parser(prog).parse_args(argv))
    from fsm_agent.launch import launch_agent  # lazy: the CLI must answer --help without the agent

    return launch_agent(config, entrypoint, entrypoint_args).exit_code


def _dispatch(argv: list[str]) -> int:
    # Dispatch on the first word so each command sees its arguments verbatim (an argparse
    # subparser with REMAINDER would not keep leading options); the main parser handles the rest.
    if not (argv and (argv[0] == "run" or argv[0] in _DELEGATES)):
        namespace = _main_parser().parse_args(argv)  # --help/--version exit; bad input raises
        argv = [namespace.command, *namespace.args]
    command, rest = argv[0], argv[1:]
    if command == "run":
        return run_command(rest)
    return _delegate(_DELEGATES[command][0], rest)


def _main_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fsm-agent", description="An elastic launcher for PyTorch: torchrun as a statechart.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    commands.add_parser("run", add_help=False, help="launch workers; takes torchrun's flags (see run --help)")
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


def _exit_code(command: Callable[..., int], *args: Any) -> int:
    """Run ``command``; an FsmAgentError becomes one stderr line and its exit code, Ctrl-C 130."""
    try:
        return command(*args)
    except FsmAgentError as exc:
        message = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        print(f"fsm-agent: error: {message}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("fsm-agent")
    except metadata.PackageNotFoundError:
        return "0.1.0"
