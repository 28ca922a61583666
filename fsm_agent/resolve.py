"""The merge of every source into a launch: flags > environment > file > scheduler discovery > defaults.

``resolve_run_args`` parses ``fsm-agent run``'s argv (``fsm_agent.run_parser``, which reads the
environment), loads the configuration file (``fsm_agent.config``) and fills in, per key, the
file's value where neither a flag nor a variable set it, then the batch scheduler's discovered
defaults (``fsm_agent.scheduler``). ``config_from_args`` turns the merged namespace into a
``LaunchConfig`` and the worker entrypoint, mirroring torch's ``run.py:run`` +
``run.py:config_from_args``. Values are checked where they enter (the parser, the environment
reader, the file's kinds); here they are only converted, and the rules that tie several settings
together are applied (standalone, ``--node-rank`` within ``--nnodes``, ``--no-python`` with ``-m``).

torch is imported lazily, only to count devices for ``--nproc-per-node gpu|xpu|auto``.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import shutil
import sys
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, cast

import attrs

from fsm_agent.config import (
    ConfigFile,
    FileValues,
    LaunchConfig,
    find_config_file,
    load_file_values,
    raw_disabled_plugins,
)
from fsm_agent.errors import ConfigError, PluginError
from fsm_agent.plugins.registry import BackendRegistry
from fsm_agent.run_parser import cli_given, get_run_parser, launcher_flags, prescan
from fsm_agent.scheduler import apply_discovery, discover
from fsm_agent.settings import (
    BY_KEY,
    DEFAULT_MASTER_PORT,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    KEYS,
    SETTINGS,
    SHUTDOWN_TIMEOUT_ENV,
    Setting,
    nproc_as_int,
    nproc_hint,
    parse_local_ranks_filter,
    parse_names,
    parse_nnodes,
    parse_rdzv_conf,
    port_number,
)

if TYPE_CHECKING:
    from fsm_agent.plugins.manager import LoadedPlugins

log = logging.getLogger(__name__)

LOG_LINE_PREFIX_TEMPLATE_ENV = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"
#: torch's variables: the agent's log level, and the workers' Python interpreter.
LOGLEVEL_ENV = "LOGLEVEL"
PYTHON_EXEC_ENV = "PYTHON_EXEC"
#: The agent's log lines on stderr (``configure_logging``: the CLI's and the launch API's).
LOG_FORMAT = "[fsm-agent %(levelname).1s %(asctime)s] %(message)s"
#: The ``$LOGLEVEL`` values an error suggests (logging also takes NOTSET, WARN and FATAL).
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level() -> str:
    """``$LOGLEVEL``, upper-cased as torch reads it; WARNING when unset.

    Raises:
        ConfigError: it is no log level name (logging's ``ValueError: Unknown level`` traceback).
    """
    raw = os.environ.get(LOGLEVEL_ENV, "WARNING")
    level = raw.upper()
    if not isinstance(logging.getLevelName(level), int):  # a known name maps to its number
        raise ConfigError(
            f"{LOGLEVEL_ENV}={raw!r}: not a log level; use one of {', '.join(LOG_LEVELS)} (any case), or unset it"
        )
    return level


def configure_logging() -> None:
    """Log to stderr at ``$LOGLEVEL`` from the start of a command, so the warnings of the parse (the
    OMP_NUM_THREADS banner, ...) obey it as the agent's do. Does nothing more once logging is
    configured (``logging.basicConfig``'s rule), as the launch's own call then does not.

    Raises:
        ConfigError: ``$LOGLEVEL`` is no log level name.
    """
    logging.basicConfig(level=log_level(), format=LOG_FORMAT, stream=sys.stderr)


def resolve_nproc_per_node(value: str) -> int:
    """``--nproc-per-node`` -> workers on this node, as torch's ``run.py:determine_local_world_size``.

    An integer is used as is (torch is not imported). ``cpu`` counts the CPUs this process may run
    on; ``gpu``/``xpu`` count devices and fail when there are none; ``auto`` counts the current
    accelerator's devices, else the CPUs; torch's privateuse1 backend name counts that backend's devices.
    """
    count = nproc_as_int(value)
    if count is not None:
        return count
    if value == "cpu":
        return _cpu_count()
    import torch  # lazy: only device names need it

    if value == "gpu":
        if not torch.cuda.is_available():
            raise ConfigError(nproc_hint(value, "CUDA is not available on this node"))
        count = torch.cuda.device_count()
    elif value == "xpu":
        if not torch.xpu.is_available():
            raise ConfigError(nproc_hint(value, "XPU is not available on this node"))
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
            raise ConfigError(nproc_hint(value, f"the {value} backend is not available on this node"))
        count = backend.device_count()
    else:
        raise ConfigError(nproc_hint(value, "unknown value"))
    if count <= 0:
        raise ConfigError(nproc_hint(value, f"found no {value} devices on this node"))
    return count


def _cpu_count() -> int:
    """CPUs this process may run on (affinity-aware, as ``torch._utils.cpu_count``)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def check_rdzv_endpoint(endpoint: str) -> None:
    """Raise ConfigError for a ``--rdzv-endpoint HOST:PORT`` whose port is not 0..65535, for the
    backends that read it with torch's ``parse_rendezvous_endpoint`` (its ValueError, one line;
    a backend says so with ``registry.add_rendezvous(..., host_port_endpoint=True)``)."""
    text = endpoint.strip()
    if not text or (text.startswith("[") and text.endswith("]")):
        return
    host, sep, port = text.rpartition(":")
    if sep and port_number(port) is None:
        raise ConfigError(
            f"--rdzv-endpoint {endpoint!r}: the port {port!r} is not a TCP port; use HOST:PORT with "
            f"PORT an integer from 0 to 65535 (e.g. --rdzv-endpoint {host or 'localhost'}:29400)"
        )


def _warn_missing_local_ranks(shown: frozenset[int] | None, nproc_per_node: int) -> None:
    """Warn about ``--local-ranks-filter`` ranks that no worker of this node has (torch hides their
    output silently; when none exists, every worker's console output is hidden)."""
    missing = sorted(rank for rank in shown or () if rank >= nproc_per_node)
    if missing:
        hidden = "; no worker's output is shown" if len(missing) == len(shown or ()) else ""
        log.warning(
            "--local-ranks-filter %s: no local rank %s with --nproc-per-node %d (local ranks 0..%d)%s",
            ",".join(map(str, sorted(shown or ()))),
            ",".join(map(str, missing)),
            nproc_per_node,
            nproc_per_node - 1,
            hidden,
        )


@functools.cache
def _builtin_registry() -> BackendRegistry:
    """The built-in backends' registry, for a namespace parsed without ``resolve_run_args`` (a
    Python caller of ``config_from_args``; ``fsm-agent run`` hands down the run's own)."""
    from fsm_agent.plugins.manager import load_plugins

    return load_plugins(load_entry_points=False).registry


def config_from_args(
    args: argparse.Namespace,
    *,
    set_omp_num_threads: bool = True,
    registry: BackendRegistry | None = None,
) -> tuple[LaunchConfig, str | Callable[..., Any] | None, tuple[str, ...]]:
    """Build the launch from ``get_run_parser()``'s namespace, with torchrun's semantics.

    ``resolve_run_args`` adds what the file and plugins set: ``args.rdzv_conf_file`` (rendezvous
    options from the file; ``--rdzv-conf`` wins per option) and ``args.plugin_options``.
    ``set_omp_num_threads=False`` skips the OMP_NUM_THREADS side effect below (``fsm-agent config``).
    ``registry``: the loaded backends (``ResolvedRun.plugins.registry``), which declare what they do
    with ``--node-rank`` and their endpoint; None: the built-in backends.

    Returns:
        (config, entrypoint, entrypoint_args): the entrypoint is the Python interpreter
        (``$PYTHON_EXEC`` or ``sys.executable``), the binary (``--no-python``) or
        ``run_script_path`` (``--run-path``); None when no training script was given
        (``fsm-agent config``).

    Raises:
        ConfigError: a flag value is invalid or the training script does not exist.

    Side effect (as torch): sets ``OMP_NUM_THREADS=1`` in ``os.environ`` when it is unset and
    there is more than one worker, with torch's banner as a warning of the log. Nothing is changed
    when an error is raised.
    """
    min_nodes, max_nodes = parse_nnodes(args.nnodes)
    entrypoint, entrypoint_args = _entrypoint(args) if args.training_script is not None else (None, ())
    nproc_per_node = _nproc_per_node(args)
    registry = registry if registry is not None else _builtin_registry()
    rdzv_backend, rdzv_endpoint, run_id = _rendezvous(args, max_nodes, min_nodes)
    if rdzv_backend == args.rdzv_backend and registry.host_port_endpoint(rdzv_backend):
        check_rdzv_endpoint(args.rdzv_endpoint)  # not the standalone or MASTER_ADDR:MASTER_PORT one
    rdzv_configs: dict[str, Any] = {**getattr(args, "rdzv_conf_file", {}), **parse_rdzv_conf(args.rdzv_conf)}
    rdzv_configs.update(_node_rank_conf(args, registry, rdzv_backend, max_nodes))
    local_ranks_filter = parse_local_ranks_filter(args.local_ranks_filter)
    _warn_missing_local_ranks(local_ranks_filter, nproc_per_node)

    config = LaunchConfig(
        **_values_of_direct_settings(args),
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=nproc_per_node,
        run_id=run_id,
        rdzv_endpoint=rdzv_endpoint,
        rdzv_backend=rdzv_backend,
        rdzv_configs=rdzv_configs,
        local_ranks_filter=local_ranks_filter,
        log_line_prefix_template=os.environ.get(LOG_LINE_PREFIX_TEMPLATE_ENV),
        master_port=_master_port(args),
        duplicate_stdout_filters=tuple(args.duplicate_stdout_filters),
        duplicate_stderr_filters=tuple(args.duplicate_stderr_filters),
        shutdown_timeout=_shutdown_timeout(args.shutdown_timeout),
        disabled_plugins=tuple(dict.fromkeys(args.disabled_plugins)),
        standalone=args.standalone,
        plugins={plugin: dict(values) for plugin, values in getattr(args, "plugin_options", {}).items()},
    )
    if set_omp_num_threads:
        _default_omp_num_threads(nproc_per_node)
    return config, entrypoint, entrypoint_args


def _nproc_per_node(args: argparse.Namespace) -> int:
    """``resolve_nproc_per_node(args.nproc_per_node)``; when the value came from an env var, the
    error names that variable rather than a flag the user never typed."""
    try:
        return resolve_nproc_per_node(args.nproc_per_node)
    except ConfigError as exc:
        var = getattr(args, "from_env", {}).get("nproc_per_node")
        if var is None:
            raise
        flag = f"--nproc-per-node {args.nproc_per_node!r}: "
        raise ConfigError(f"{var}={args.nproc_per_node!r}: {str(exc).removeprefix(flag)}; fix or unset it") from None


def _node_rank_conf(
    args: argparse.Namespace, registry: BackendRegistry, backend: str, max_nodes: int
) -> dict[str, int]:
    """The rendezvous options ``--node-rank`` adds for ``backend``: ``{"rank": N}`` for one that
    takes it as this node's rank (torch's static backend), else none (a warning when the backend
    ignores a rank that was given).

    Raises:
        ConfigError: a rank the backend takes is outside ``0..max_nodes - 1``.
    """
    node_rank_use = registry.node_rank_use(backend)
    if node_rank_use == "rank":  # torch's static backend: this node's rank
        if not 0 <= args.node_rank < max_nodes:
            raise ConfigError(
                f"--node-rank {args.node_rank}: with --nnodes {args.nnodes} the node ranks are "
                f"0..{max_nodes - 1}; give each node its own rank in that range"
            )
        return {"rank": args.node_rank}  # an int, as torch's static handler expects
    if args.node_rank != 0 and node_rank_use is None:  # "hint": the fsm backend's (docs/schedulers.md)
        log.warning(
            "--node-rank %s is only used by the rendezvous backends %s; ignored for %s",
            args.node_rank,
            ", ".join(registry.node_rank_backends()),
            backend,
        )
    return {}


#: LaunchConfig fields that config_from_args computes from more than their setting's parsed value.
COMPUTED_FIELDS = frozenset(
    {
        "nproc_per_node",
        "rdzv_backend",
        "rdzv_endpoint",
        "local_ranks_filter",
        "master_port",
        "duplicate_stdout_filters",
        "duplicate_stderr_filters",
        "shutdown_timeout",
        "disabled_plugins",
    }
)


def _values_of_direct_settings(args: argparse.Namespace) -> dict[str, Any]:
    """``{field: value}`` for every setting whose ``LaunchConfig`` field is its parsed value as is
    (``Setting.field == Setting.dest``): a new setting of that kind needs no line here."""
    return {
        s.field: getattr(args, s.dest)
        for s in SETTINGS
        if s.dest and s.field == s.dest and s.field not in COMPUTED_FIELDS
    }


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
            raise ConfigError(
                f"--standalone with --nnodes {args.nnodes}: no other node can join a standalone "
                f"rendezvous, so {min_nodes} nodes never meet; drop --standalone and give every "
                f"node --rdzv-backend/--rdzv-endpoint (or --master-addr/--master-port), or use "
                f"--nnodes 1"
            )
        if args.standalone and (args.rdzv_backend != "static" or args.rdzv_endpoint or args.rdzv_id != "none"):
            log.warning("--standalone ignores --rdzv-backend, --rdzv-endpoint and --rdzv-id")
        if args.standalone and max_nodes > 1:
            log.warning("--standalone with --nnodes %s: no other node can join a standalone rendezvous", args.nnodes)
        return (*STANDALONE_RENDEZVOUS, str(uuid.uuid4()))
    if args.rdzv_backend == "static" and not args.rdzv_endpoint:
        return "static", f"{args.master_addr}:{_master_port(args)}", args.rdzv_id
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
            raise ConfigError(
                "--no-python and -m/--module cannot be used together: "
                "-m runs a Python module, --no-python runs a binary"
            )
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
        raise ConfigError(
            f"--no-python binary {script!r} is not executable: chmod +x it, or drop --no-python to run it with python"
        )
    if path is None:
        here = f"; for the file in this directory, say ./{script}" if os.path.isfile(script) else ""
        raise ConfigError(f"--no-python binary {script!r} not found: not an executable file and not on PATH{here}")
    try:
        with open(path, "rb") as file:
            head = file.read(512)
    except OSError:
        return  # executable but not readable: only exec can tell
    if not head.startswith((b"#!", b"\x7fELF")) and b"\0" not in head:  # text without a '#!' line
        raise ConfigError(
            f"--no-python binary {script!r} has no '#!' line, so it cannot be executed: "
            f"add one (e.g. #!/usr/bin/env python3), or drop --no-python to run it with python"
        )


def _python_exec() -> str:
    """The workers' interpreter: ``$PYTHON_EXEC`` (torch's; a path, or a name looked up on PATH as
    exec does), else this one.

    Raises:
        ConfigError: ``$PYTHON_EXEC`` names nothing exec can run: every worker would fail to start,
            each with exec's traceback.
    """
    value = os.environ.get(PYTHON_EXEC_ENV)
    if value is None:
        return sys.executable
    if shutil.which(value) is None:
        if not value:
            problem = "is empty"
        elif os.sep not in value:
            problem = "not found on PATH"
        elif os.path.isdir(value):
            problem = "is a directory"
        elif os.path.exists(value):
            problem = "is not executable"
        else:
            problem = "does not exist"
        raise ConfigError(
            f"{PYTHON_EXEC_ENV}={value!r}: {problem}; set it to the Python interpreter the workers run "
            f"(e.g. {sys.executable}), or unset it"
        )
    return value


def _require_script(script: str) -> None:
    if not os.path.exists(script):
        raise ConfigError(
            f"training script {script!r} not found: check the path (or use -m for a module, --no-python for a binary)"
        )


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
    # A warning of the log, as torchrun's: LOGLEVEL=ERROR hides it.
    log.warning(
        "*****************************************\n"
        "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid "
        "your system being overloaded, please further tune the variable for optimal performance in "
        "your application as needed. \n"
        "*****************************************"
    )


def run_script_path(training_script: str, *training_script_args: str) -> None:
    """The ``--run-path`` entrypoint: run ``training_script`` as ``__main__`` in this interpreter (torch's)."""
    import runpy

    sys.argv = [training_script, *training_script_args]
    runpy.run_path(training_script, run_name="__main__")


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
        plugins: the loaded plugins, their options and backends (handed down to the launch: they
            load once per process).
    """

    args: argparse.Namespace
    sources: dict[str, Source]
    config_file: ConfigFile | None
    plugins: LoadedPlugins


def resolve_run_args(
    argv: Sequence[str], prog: str = "fsm-agent run", *, for_config: bool = False, load_entry_points: bool = True
) -> ResolvedRun:
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
    argv = list(argv)
    core = get_run_parser(prog, for_config=for_config)
    config_file, disabled = _config_file_and_disabled(argv, core)
    plugins = _plugins_for(argv, core, disabled, load_entry_points)
    options = plugins.options

    parser = get_run_parser(prog, options, for_config=for_config)
    parser.defer_env_errors = True  # type: ignore[attr-defined]
    args = parser.parse_args(argv)  # a bad flag raises here; bad env vars are collected
    errors: list[str] = list(parser.env_errors)  # type: ignore[attr-defined]
    details: list[str] = list(errors)  # one line per error, for the CLI when the config file has errors
    origins = _Origins(
        given=cli_given(argv, prog, options, for_config=for_config),
        flags={a.dest: a.option_strings[0] for a in parser._actions if a.option_strings},
        env=dict(parser.env_sources),  # type: ignore[attr-defined]
        file_label=config_file.label if config_file else "",
    )
    file_values = FileValues(values={}, plugins={})
    file_failed = False
    if config_file:
        try:
            file_values = load_file_values(config_file, options, disabled=disabled)
        except ConfigError as exc:
            errors.insert(0, str(exc))
            details[:0] = exc.details or [str(exc)]
            file_failed = True

    sources = _merge_settings(args, (*KEYS, *options), file_values, origins)
    # Defaults the batch scheduler's job step gives (Slurm, ...): below flags, env vars and the file.
    registry = plugins.registry
    apply_discovery(
        discover(plugins.pm, args.scheduler, os.environ),
        args,
        sources,
        BY_KEY,
        Source,
        node_rank_backends=registry.node_rank_backends(),
    )
    _merge_disabled_plugins(args, sources, file_values, origins)
    _merge_rdzv_conf(args, sources, file_values, origins.file_label)
    # Which values came from the environment, so a late check (--nproc-per-node names a device)
    # names the variable to fix rather than a flag the user never typed.
    args.from_env = {dest: var for dest, var in origins.env.items() if dest not in origins.given}

    if errors:  # the file's and the env vars' errors, all at once
        raise ConfigError("; ".join(errors), details=details if file_failed else ())
    # What the plugins read back with config.plugin_options(NAME).
    args.plugin_options = _plugin_values(args, options)
    return ResolvedRun(args=args, sources=sources, config_file=config_file, plugins=plugins)


def _config_file_and_disabled(
    argv: Sequence[str], core: argparse.ArgumentParser
) -> tuple[ConfigFile | None, tuple[str, ...]]:
    """The config file (``--config``, ``$FSM_AGENT_CONFIG`` or ``./pyproject.toml``; None: none)
    and the plugins to disable (the file's, the env var's and the flags'), from a pre-scan of the
    flags before the training script: they decide which plugins load, hence which flags exist.

    Raises:
        ConfigError: the file named cannot be read, or a name to disable is no plugin's.
    """
    from fsm_agent.plugins.manager import check_disabled, disabled_from_env

    pre = prescan(argv, core)
    explicit, origin = (
        (pre["config"][-1], "--config")
        if pre["config"]
        else (os.environ.get("FSM_AGENT_CONFIG") or None, "FSM_AGENT_CONFIG")
    )
    config_file = find_config_file(explicit, origin)
    file_disabled = raw_disabled_plugins(config_file.data) if config_file else ()
    cli_disabled = tuple(n for value in pre["disabled_plugins"] for n in parse_names(value))
    check_disabled(cli_disabled, file_disabled, config_file.label if config_file else "")
    return config_file, tuple(dict.fromkeys((*file_disabled, *disabled_from_env(), *cli_disabled)))


@attrs.frozen
class _Origins:
    """Where the parse found each value, for ``Source``.

    Attributes:
        given: the dests set on the command line itself.
        flags: ``{dest: its first flag}``.
        env: ``{dest: the env var that set it}``.
        file_label: the config file's label ("" without a file).
    """

    given: set[str]
    flags: dict[str, str]
    env: dict[str, str]
    file_label: str


def _merge_settings(
    args: argparse.Namespace, settings: Iterable[Setting], file_values: FileValues, origins: _Origins
) -> dict[str, Source]:
    """Fill in ``args`` from the file per setting, fsm-agent's and the plugins' alike, with the
    precedence flag > variable > file > default; returns ``{key: Source}`` of each."""
    sources: dict[str, Source] = {}
    for setting in settings:
        if setting.dest is None:  # a typed rendezvous option: merged with --rdzv-conf (_merge_rdzv_conf)
            continue
        key = cast(str, setting.key)
        from_file = file_values.get(setting, _NOT_IN_FILE)
        if setting.dest in origins.given:
            sources[key] = Source("cli", origins.flags[setting.dest])
        elif setting.dest in origins.env:
            sources[key] = Source("env", origins.env[setting.dest])
        elif setting.fallback_env and os.environ.get(setting.fallback_env):
            sources[key] = Source("env", setting.fallback_env)  # torch's env var, above the file
        elif from_file is not _NOT_IN_FILE:
            if setting.dest != "rdzv_conf":  # merged per option (_merge_rdzv_conf)
                setattr(args, setting.dest, from_file)
            sources[key] = Source("file", origins.file_label)
        else:
            sources[key] = Source("default")
    return sources


def _merge_disabled_plugins(
    args: argparse.Namespace, sources: dict[str, Source], file_values: FileValues, origins: _Origins
) -> None:
    """Disabled plugins add up: the file's, the env var's, the flags' (``args.disabled_plugins``,
    and a source that names each of them)."""
    from_file = file_values.values.get("disabled_plugins", ())
    args.disabled_plugins = tuple(dict.fromkeys((*from_file, *args.disabled_plugins)))
    parts = [str(Source("file", origins.file_label))] if from_file else []
    parts += [str(Source("env", origins.env["disabled_plugins"]))] if "disabled_plugins" in origins.env else []
    parts += [str(Source("cli", origins.flags["disabled_plugins"]))] if "disabled_plugins" in origins.given else []
    sources["disabled_plugins"] = Source(" + ".join(parts) if parts else "default")


def _merge_rdzv_conf(
    args: argparse.Namespace, sources: dict[str, Source], file_values: FileValues, file_label: str
) -> None:
    """Rendezvous options: the file's table and typed keys (``args.rdzv_conf_file``), under
    ``--rdzv-conf`` (or its env var), per option; a ``rendezvous.<name>`` source for each."""
    rdzv_file = dict(file_values.values.get("rendezvous.conf", {}))
    rdzv_file.update({k.name: v for name, v in file_values.values.items() if (k := BY_KEY[name]).dest is None})
    args.rdzv_conf_file = rdzv_file
    conf_source = sources["rendezvous.conf"]
    for name in rdzv_file:
        sources[f"rendezvous.{name}"] = Source("file", file_label)
    if conf_source.kind in ("cli", "env"):
        for name in parse_rdzv_conf(args.rdzv_conf):
            sources[f"rendezvous.{name}"] = conf_source


def _plugin_values(args: argparse.Namespace, options: Iterable[Setting]) -> dict[str, dict[str, Any]]:
    """``{plugin: {option name: value}}`` of the plugins' options in ``args``."""
    plugin_values: dict[str, dict[str, Any]] = {}
    for option in options:
        plugin_values.setdefault(cast(str, option.plugin), {})[option.name] = getattr(args, cast(str, option.dest))
    return plugin_values


#: ``FileValues.get``'s answer for a setting the file does not set.
_NOT_IN_FILE = object()


def check_rdzv_conf(resolved: ResolvedRun, config: LaunchConfig) -> None:
    """Rendezvous options (``--rdzv-conf``, its env vars, the file) against the loaded backends.

    Raises:
        ConfigError: an option that no loaded backend reads (a typo: torch ignores it silently).

    Logs a warning for an option that the chosen backend does not read but another one does.
    """

    def where(key: str) -> str:
        source = resolved.sources.get(f"rendezvous.{key}", Source("default"))
        label = source.detail if source.kind in ("cli", "env") else f"{source.detail} rendezvous"
        return f"{label} {key}={config.rdzv_configs[key]}"

    for warning in resolved.plugins.registry.check_rdzv_conf(config.rdzv_backend, config.rdzv_configs, where):
        log.warning("%s", warning)


def _plugins_for(
    argv: Sequence[str], core: argparse.ArgumentParser, disabled: tuple[str, ...], load_entry_points: bool
) -> LoadedPlugins:
    """The run's plugins; for ``--help``, a plugin that fails to load is a warning, left out."""
    from fsm_agent.plugins.manager import load_plugins

    asks_for_help = any(
        action is not None and action.dest == "help"
        for action, _ in launcher_flags(argv, core, unknown_takes_value=True)[0]
    )
    while True:
        try:
            return load_plugins(disabled=disabled, load_entry_points=load_entry_points)
        except PluginError as exc:
            if not asks_for_help or exc.plugin is None or exc.plugin in disabled:
                raise
            log.warning("%s; --help leaves its options out", exc)
            disabled = (*disabled, exc.plugin)


def effective_rows(resolved: ResolvedRun, config: LaunchConfig) -> list[tuple[str, Any, Source]]:
    """``(key, effective value, source)`` for every key: LaunchConfig's values (after torchrun's
    rules, such as standalone), the rendezvous options it passes on, and plugin options."""
    args, sources = resolved.args, resolved.sources
    reason = standalone_reason(args, config.max_nodes)
    rows: list[tuple[str, Any, Source]] = []
    for key in KEYS:
        if key.dest is None or key.key is None or key.key == "rendezvous.conf":
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
    for option in resolved.plugins.options:
        if option.key is not None and option.key in sources:
            rows.append((option.key, config.plugins.get(option.plugin or "", {}).get(option.name), sources[option.key]))
    return rows
