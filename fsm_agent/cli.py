"""The command line: ``fsm-agent run`` / ``fsmrun`` (a drop-in torchrun), ``fsm-agent config`` and
the subcommand dispatch.

The rooms behind it: ``fsm_agent.settings`` declares every setting once (flag, variables, file key,
check, help); ``fsm_agent.run_parser`` builds the argparse parser from it; ``fsm_agent.resolve``
merges flags, environment, file and scheduler discovery into a ``LaunchConfig``;
``fsm_agent.reference`` generates docs/configuration.md. The names tests and users reach through
this module (``get_run_parser``, ``resolve_run_args``, ``config_from_args``, ...) are re-exported.

This is the only module that turns exceptions into exit codes: an ``FsmAgentError`` (bad flags
included) prints one line ``fsm-agent: error: <message>`` on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from fsm_agent.config import ConfigFile, LaunchConfig
from fsm_agent.errors import FsmAgentError
from fsm_agent.reference import configuration_reference
from fsm_agent.resolve import (
    STANDALONE_RENDEZVOUS,
    ResolvedRun,
    Source,
    _cpu_count,
    check_rdzv_conf,
    check_rdzv_endpoint,
    cli_given,
    config_from_args,
    configure_logging,
    effective_rows,
    resolve_nproc_per_node,
    resolve_run_args,
    run_script_path,
    standalone_reason,
)
from fsm_agent.run_parser import _EnvAction, _Parser, env_vars, get_run_parser
from fsm_agent.settings import (
    DEFAULT_MASTER_PORT,
    DISABLE_PLUGINS_ENV,
    parse_local_ranks_filter,
    parse_nnodes,
    parse_rdzv_conf,
)

if TYPE_CHECKING:
    from fsm_agent.plugins.manager import LoadedPlugins

__all__ = [
    "DEFAULT_MASTER_PORT",
    "DISABLE_PLUGINS_ENV",
    "STANDALONE_RENDEZVOUS",
    "ResolvedRun",
    "Source",
    "_EnvAction",
    "_cpu_count",
    "check_rdzv_conf",
    "check_rdzv_endpoint",
    "cli_given",
    "config_command",
    "config_from_args",
    "configuration_reference",
    "configure_logging",
    "effective_rows",
    "env_vars",
    "fsmrun_main",
    "get_run_parser",
    "main",
    "parse_local_ranks_filter",
    "parse_nnodes",
    "parse_rdzv_conf",
    "resolve_nproc_per_node",
    "resolve_run_args",
    "run_main",
    "run_script_path",
    "standalone_reason",
]

log = logging.getLogger(__name__)

#: Exit code for Ctrl-C (128 + SIGINT), as a shell reports it.
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 128 + 13  # SIGPIPE, as a shell reports a writer its reader left

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
# fsm-agent config: the effective configuration and where each value came from.
# ------------------------------------------------------------------------------------------------


def config_command(argv: list[str]) -> int:
    """``fsm-agent config [run flags] [SCRIPT ...] [--json] [--reference]``."""
    if "--reference" in argv:
        sys.stdout.write(configuration_reference())
        return 0
    configure_logging()  # the parse's warnings at $LOGLEVEL, as run's
    resolved = resolve_run_args(argv, "fsm-agent config", for_config=True)
    config, _, _ = config_from_args(resolved.args, set_omp_num_threads=False, registry=resolved.plugins.registry)
    check_rdzv_conf(resolved, config)
    rows = effective_rows(resolved, config)
    if resolved.args.json:
        doc = {
            "config_file": resolved.config_file.label if resolved.config_file else None,
            "values": {key: {"value": value, "source": str(source)} for key, value, source in rows},
        }
        print(json.dumps(doc, indent=2, default=list))
        return 0
    _print_rows(rows, resolved.config_file)
    return 0


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


# ------------------------------------------------------------------------------------------------
# Entry points. Exceptions become exit codes here and nowhere else.
# ------------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Console script ``fsm-agent {run,config,statechart,plugins,status} ...``; exits with the command's exit code."""
    _exit(_exit_code(_dispatch, list(sys.argv[1:] if argv is None else argv)), from_console=argv is None)


def fsmrun_main(argv: Sequence[str] | None = None) -> NoReturn:
    """Console script ``fsmrun``: the torchrun drop-in, same as ``fsm-agent run ARGS``."""
    _exit(
        _exit_code(run_command, list(sys.argv[1:] if argv is None else argv), "fsmrun", name="fsmrun"),
        from_console=argv is None,
    )


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
        config, entrypoint, entrypoint_args, plugins = _parse_run(list(sys.argv[1:] if argv is None else argv))
    except FsmAgentError as exc:
        raise SystemExit(_report(exc, "fsm-agent run")) from None
    from fsm_agent.launch import launch_agent  # lazy: the CLI must answer --help without the agent

    launch_agent(config, entrypoint, entrypoint_args, plugins=plugins)


def _parse_run(
    argv: list[str], prog: str = "fsm-agent run"
) -> tuple[LaunchConfig, str | Callable[..., Any], tuple[str, ...], LoadedPlugins]:
    """``argv`` parsed like torchrun (plus env vars, the config file and plugin options): the config,
    the entrypoint, its arguments and the plugins that were loaded to read their options, with the
    backend registry built to check the rendezvous flags (handed down, so both are built once per
    process). Raises ConfigError / PluginError for bad input ($LOGLEVEL's included)."""
    configure_logging()  # before the parse: its warnings (the OMP_NUM_THREADS banner, ...) obey $LOGLEVEL
    resolved = resolve_run_args(argv, prog)
    config, entrypoint, entrypoint_args = config_from_args(resolved.args, registry=resolved.plugins.registry)
    check_rdzv_conf(resolved, config)
    return config, entrypoint, entrypoint_args, resolved.plugins


def run_command(argv: list[str], prog: str = "fsm-agent run") -> int:
    """Parse ``argv`` like torchrun (plus env vars, the config file and plugin options), launch
    this node's agent and return its exit code."""
    config, entrypoint, entrypoint_args, plugins = _parse_run(argv, prog)
    from fsm_agent.launch import run_agent  # lazy: the CLI must answer --help without the agent

    return run_agent(config, entrypoint, entrypoint_args, plugins=plugins).exit_code


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
        raise FsmAgentError(
            f"this command is not available: module {module_name} is missing from this fsm-agent installation"
        ) from None
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
