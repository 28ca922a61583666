"""The Python API: ``launch_agent(config, entrypoint, args)`` and ``elastic_launch(config, fn)(*args)``.

Mirrors ``torch.distributed.launcher.api``: both take fsm-agent's or torch's ``LaunchConfig``,
return ``{global_rank: return value}`` and raise ``WorkerGroupFailedError`` (a torch
``ChildFailedError``) when workers failed. ``run_agent`` is what the CLI runs: it prints the
summary and returns the richer ``RunResult`` instead of raising.

``WorkerGroupFailedError`` derives from torch's class, so it is created on first use (module
``__getattr__``): an agent that never imports torch (the ``fsm`` backend) still never does.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import attrs

from fsm_agent._early_signals import held, note_stop
from fsm_agent.agent import ElasticAgent
from fsm_agent.config import LaunchConfig
from fsm_agent.errorfile import format_summary, propagate_to_parent
from fsm_agent.errors import ConfigError, FsmAgentError
from fsm_agent.logs import LogsLayout, TorchLogsSpecsLayout, load_logs_specs, parse_std
from fsm_agent.plugins.manager import LoadedPlugins, load_plugins
from fsm_agent.signal_names import signal_numbers
from fsm_agent.states.worker_state import WorkerState
from fsm_agent.worker import RendezvousSpec, RunResult, WorkerFailure, WorkerSpec

log = logging.getLogger(__name__)


def _configure_logging() -> None:
    """As the CLI does (``resolve.configure_logging``); a bad ``$LOGLEVEL`` is a ConfigError here too."""
    from fsm_agent.resolve import configure_logging

    configure_logging()
    logging.getLogger("transitions").setLevel(logging.WARNING)  # one line per callback is noise


def build_spec(
    config: LaunchConfig,
    entrypoint: str | Callable[..., Any],
    args: tuple[Any, ...],
    conf_keys: frozenset[str] | None = None,
) -> WorkerSpec:
    """The ``WorkerSpec`` for ``config``; ``conf_keys``: the ``--rdzv-conf`` keys the rendezvous backend
    declared in the registry (None: not declared)."""
    rdzv = RendezvousSpec(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        config=dict(config.rdzv_configs),
        local_addr=config.local_addr,
        node_rank=config.node_rank,
        conf_keys=conf_keys,
    )
    return WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=entrypoint,
        args=tuple(args),
        rendezvous=rdzv,
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        shutdown_timeout=config.shutdown_timeout,
        exit_barrier_timeout=config.exit_barrier_timeout,
        start_method=config.start_method,
        virtual_local_rank=config.virtual_local_rank,
        numa_binding=config.numa_binding,
        hang_timeout=config.hang_timeout,
        duplicate_stdout_filters=tuple(config.duplicate_stdout_filters),
        duplicate_stderr_filters=tuple(config.duplicate_stderr_filters),
    )


def _logs_layout(config: LaunchConfig) -> LogsLayout | TorchLogsSpecsLayout:
    filters = frozenset(config.local_ranks_filter) if config.local_ranks_filter else None
    if config.logs_specs:
        specs = config.logs_specs
        if isinstance(specs, str):  # a torchrun.logs_specs entry point name (--logs-specs)
            specs = load_logs_specs(specs, config.log_dir, config.redirects, config.tee, filters)
        return TorchLogsSpecsLayout(specs, config.run_id, config.log_line_prefix_template)
    return LogsLayout(
        log_dir=config.log_dir,
        run_id=config.run_id,
        redirects=parse_std(config.redirects, "-r/--redirects"),
        tee=parse_std(config.tee, "-t/--tee"),
        local_ranks_filter=filters,
        prefix_template=config.log_line_prefix_template,
        duplicate_stdout_filters=tuple(config.duplicate_stdout_filters),
        duplicate_stderr_filters=tuple(config.duplicate_stderr_filters),
    )


def create_agent(
    config: LaunchConfig,
    entrypoint: str | Callable[..., Any],
    args: tuple[Any, ...],
    *,
    plugins: LoadedPlugins | None = None,
) -> ElasticAgent:
    """Build (but do not run) the agent for ``config``.

    ``plugins``: the process's loaded plugins when the caller loaded them already (the CLI did, to
    read their options; their backend registry comes with them); None loads them here, leaving
    out ``config.disabled_plugins``.

    Raises:
        ConfigError: unknown backend name, bad log flags.
        PluginError: a plugin failed to load or to register its backends.
    """
    if plugins is None:
        plugins = load_plugins(disabled=config.disabled_plugins)
    registry = plugins.registry
    rdzv_creator = registry.get("rendezvous", config.rdzv_backend)
    launcher_factory = registry.get("launcher", config.launcher)
    spec = build_spec(config, entrypoint, args, registry.conf_keys(config.rdzv_backend))
    logs = _logs_layout(config)
    try:
        try:
            handler = rdzv_creator(registry.rendezvous_parameters(config.rdzv_backend, config))
        except FsmAgentError:
            raise
        except Exception as exc:
            raise ConfigError(
                f"--rdzv-backend {config.rdzv_backend} at "
                f"{config.rdzv_endpoint or '(default endpoint)'}: {type(exc).__name__}: {exc}"
            ) from None
        return ElasticAgent(
            spec,
            plugins.pm,
            handler,
            launcher_factory(_LauncherOwner(config)),
            logs,
            events_path=config.events_file,
            signals_to_handle=config.signals_to_handle,
            forward_signals=config.forward_signals,
            config=config,
        )
    except BaseException:
        getattr(logs, "cleanup", lambda: None)()  # the temporary log directory of a run that never started
        raise


@attrs.frozen
class _LauncherOwner:
    """What a launcher factory (``factory(agent)``) gets: the agent is built after its launcher, so
    a stand-in with the agent's ``config`` (its ``plugin_options(name)`` hold the launcher's options)."""

    config: LaunchConfig


def run_agent(
    config: LaunchConfig,
    entrypoint: str | Callable[..., Any],
    args: tuple[Any, ...] = (),
    *,
    plugins: LoadedPlugins | None = None,
) -> RunResult:
    """Run one agent to the end; on failure print the summary and copy the root cause's error file
    to an outer launcher's ``TORCHELASTIC_ERROR_FILE``. What ``fsm-agent run`` does.

    Args:
        config: fsm-agent's ``LaunchConfig`` or torch's (``LaunchConfig.coerce``).
        entrypoint: a program path (``sys.executable`` for Python) or a picklable callable.
        args: the entrypoint's arguments (``${local_rank}`` is substituted).
        plugins: the plugins already loaded for this run (the CLI's: ``resolve_run_args(...).plugins``),
            or None to load them.

    Returns:
        The RunResult (``result.exit_code`` is what the CLI exits with); never raises for worker,
        rendezvous or signal failures.

    Raises:
        ConfigError / PluginError: before any worker started (bad backend name, plugin import error).
    """
    result, name = _launch_in_scope(config, entrypoint, args, plugins)
    if result.is_failed():
        print(format_summary(name, result), file=sys.stderr, flush=True)
        propagate_to_parent(result, name)
    return result


def launch_agent(
    config: LaunchConfig,
    entrypoint: str | Callable[..., Any],
    args: tuple[Any, ...] | list[Any] = (),
    health_check_server: Any = None,
    *,
    plugins: LoadedPlugins | None = None,
) -> dict[int, Any]:
    """Run one agent to the end. Mirrors ``torch.distributed.launcher.api.launch_agent``.

    Args:
        config: fsm-agent's ``LaunchConfig`` or torch's (its field names and defaults are kept).
        entrypoint: a program path (``sys.executable`` for Python) or a picklable callable.
        args: the entrypoint's arguments.
        health_check_server: accepted for torch's signature and not used (torch's open-source
            ``HealthCheckServer`` starts nothing; fsm-agent's liveness is ``--status-port``'s ``/healthz``).
        plugins: the plugins already loaded for this run (``run_main``'s), or None to load them.

    Returns:
        ``{global_rank: return value}`` of this node's workers (callable entrypoints; ``{}``
        for programs), as torch.

    Raises:
        WorkerGroupFailedError: workers failed; it *is a* torch ``ChildFailedError`` (so
            ``except ChildFailedError`` and ``@record`` handle it), with fsm-agent's ``result``.
        AgentFailedError: the run failed without a worker failure (rendezvous, agent error).
        SignalException: torch's, when a stop signal ended the run (torch raises it too).
        ConfigError / PluginError: before any worker started.
    """
    result, name = _launch_in_scope(config, entrypoint, tuple(args), plugins)
    if not result.is_failed():
        return result.return_values
    if result.failures:
        raise _worker_group_failed_error()(name, result)
    if result.signal is not None:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        # torch annotates sigval as signal.Signals; fsm-agent has always passed the plain signal
        # number (an int, equal to the Signals member), kept as it is.
        raise SignalException(f"Process {os.getpid()} got signal: {result.signal}", sigval=result.signal)  # type: ignore[arg-type]
    raise AgentFailedError(name, result)


def _launch_in_scope(
    config: LaunchConfig,
    entrypoint: str | Callable[..., Any],
    args: tuple[Any, ...],
    plugins: LoadedPlugins | None = None,
) -> tuple[RunResult, str]:
    config = LaunchConfig.coerce(config)
    _configure_logging()
    _initialize_metrics(config.metrics_cfg)
    # Handle stop signals from the first instruction: until the agent installs its own handlers
    # (at the start of run(), before the first rendezvous) a signal ends the launch cleanly, as the
    # agent's would (a stopped RunResult, its summary, the temporary log directory removed).
    # They stay until run() puts the agent's own in place, and are undone when the launch ends.
    stop = _StopBeforeRun()
    original = {sig: signal.signal(sig, stop) for sig in _stop_signals(config.signals_to_handle)}
    # A signal to relay (--forward-signals) that comes before there are workers is dropped, not fatal.
    original.update(
        {sig: signal.signal(sig, _drop_signal) for sig in _signals(config.forward_signals) if sig not in original}
    )
    try:
        return _launch(config, entrypoint, args, stop, plugins)
    except _SignalBeforeRun as exc:
        return RunResult(state=WorkerState.FAILED, signal=exc.signum), build_spec(
            config, entrypoint, args
        ).get_entrypoint_name()
    finally:
        for sig, handler in original.items():
            signal.signal(sig, handler)


def _initialize_metrics(metrics_cfg: dict[str, str]) -> None:
    """torch's ``metrics.initialize_metrics(MetricsConfig(cfg))``, only when a config was given."""
    if metrics_cfg:
        from torch.distributed.elastic import metrics
        from torch.distributed.elastic.metrics.api import MetricsConfig  # what metrics re-exports

        metrics.initialize_metrics(MetricsConfig(dict(metrics_cfg)))


def _launch(
    config: LaunchConfig,
    entrypoint: str | Callable[..., Any],
    args: tuple[Any, ...],
    stop: _StopBeforeRun,
    plugins: LoadedPlugins | None = None,
) -> tuple[RunResult, str]:
    agent = create_agent(config, entrypoint, args, plugins=plugins)
    try:
        if agent.run_log_dir:
            log.info("logs in %s, events in %s", agent.run_log_dir, agent.events_path)
        result = agent.run()
        stop.done = True  # the agent took (or missed) its signals: later ones must not cut the way out short
        return result, agent.spec.get_entrypoint_name()
    finally:
        agent.close()  # a signal before run() began: its temporary log directory goes too (idempotent)


def _signals(names: str) -> list[int]:
    return list(signal_numbers(names or ""))


def _stop_signals(names: str) -> list[int]:
    sigs = _signals(names)
    # Started under nohup: SIGHUP stays ignored.
    return [s for s in sigs if not (s == signal.SIGHUP and signal.getsignal(s) == signal.SIG_IGN)]


class _SignalBeforeRun(BaseException):
    """A stop signal before the agent's own handlers were in place (building the agent)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class _StopBeforeRun:
    """The stop-signal handler of one launch until the agent's run() takes over: the first signal
    raises ``_SignalBeforeRun`` (the launch ends as a stopped run); a second one of the same kill
    (a process group signalled twice), or any once the run is over, does nothing, so the cleanup
    and the summary on the way out are never cut short."""

    def __init__(self) -> None:
        self.done = False

    def __call__(self, signum: int, frame: Any) -> None:
        if self.done or held(signum):
            return
        self.done = True
        note_stop(signum)
        raise _SignalBeforeRun(signum)


def _drop_signal(signum: int, frame: Any) -> None:
    log.info("%s before any worker started: not forwarded", signal.Signals(signum).name)


class AgentFailedError(FsmAgentError):
    """Raised by ``launch_agent``/``elastic_launch`` when the run failed with no worker failure to
    report (the rendezvous failed or timed out, the agent itself failed); torch lets the
    rendezvous or agent exception through here.

    Attributes:
        name: the entrypoint's name.
        result: the RunResult (``result.error`` says what failed).
    """

    def __init__(self, name: str, result: RunResult):
        super().__init__(f"{name} FAILED: {result.error or result.verdict or result.state.value}")
        self.name, self.result = name, result

    def __reduce__(self) -> tuple[type[AgentFailedError], tuple[str, RunResult]]:
        return (type(self), (self.name, self.result))


_WORKER_GROUP_FAILED_ERROR: type | None = None


def _worker_group_failed_error() -> type:
    """The ``WorkerGroupFailedError`` class, made on first use (it derives from torch's ChildFailedError)."""
    global _WORKER_GROUP_FAILED_ERROR
    if _WORKER_GROUP_FAILED_ERROR is not None:
        return _WORKER_GROUP_FAILED_ERROR
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    class WorkerGroupFailedError(ChildFailedError, FsmAgentError):
        """Workers failed. *Is a* torch ``ChildFailedError``, as torch's launcher raises.

        The message is fsm-agent's summary (root cause first). Attributes:

        - ``name``: the entrypoint's name; ``failures``: ``{global_rank: torch ProcessFailure}``
          (what torch's ``@record`` and ``get_first_failure()`` read; the root cause first);
        - ``result``: fsm-agent's RunResult; ``worker_failures``: ``{global_rank: WorkerFailure}``
          (exit code, message, traceback, hostname, failure class); ``root_cause``: the first
          WorkerFailure.
        """

        def __init__(self, name: str, result: RunResult):
            self.result = result
            self.worker_failures: dict[int, WorkerFailure] = dict(result.failures)
            ChildFailedError.__init__(self, name, _process_failures(result))
            self.args = (format_summary(name, result),)

        @property
        def root_cause(self) -> WorkerFailure | None:
            return self.result.root_cause

        def __reduce__(self) -> tuple[type[ChildFailedError], tuple[str, RunResult]]:
            return (type(self), (self.name, self.result))

    WorkerGroupFailedError.__module__ = __name__
    WorkerGroupFailedError.__qualname__ = "WorkerGroupFailedError"
    _WORKER_GROUP_FAILED_ERROR = WorkerGroupFailedError
    return WorkerGroupFailedError


def _process_failures(result: RunResult) -> dict[int, Any]:
    """``{global_rank: torch ProcessFailure}``, root cause first; each timestamp is fsm-agent's
    (error.json time, else exit time), so torch's ``get_first_failure`` names the same root cause."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    root = result.root_cause
    failures = {}
    for rank, failure in sorted(result.failures.items(), key=lambda item: item[1] is not root):
        try:
            process = ProcessFailure(
                local_rank=failure.local_rank, pid=failure.pid, exitcode=failure.exitcode, error_file=failure.error_file
            )
        except Exception:  # an error.json torch cannot parse: described without it
            process = ProcessFailure(
                local_rank=failure.local_rank, pid=failure.pid, exitcode=failure.exitcode, error_file="<N/A>"
            )
        process.timestamp = int(failure.error_timestamp or failure.timestamp)
        failures[rank] = process
    return failures


def __getattr__(name: str) -> Any:
    if name == "WorkerGroupFailedError":
        return _worker_group_failed_error()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class elastic_launch:
    """``elastic_launch(config, entrypoint)(*args)`` -> ``{global_rank: return value}`` of this node.

    Mirrors ``torch.distributed.launcher.api.elastic_launch``; ``config`` may be torch's LaunchConfig.

    Raises:
        WorkerGroupFailedError: the workers failed; *is a* torch ``ChildFailedError``.
        AgentFailedError / SignalException: as ``launch_agent``.
    """

    def __init__(self, config: LaunchConfig, entrypoint: str | Callable[..., Any], health_check_server: Any = None):
        self._config, self._entrypoint, self._health_check_server = config, entrypoint, health_check_server

    def __call__(self, *args: Any) -> dict[int, Any]:
        return launch_agent(self._config, self._entrypoint, args, health_check_server=self._health_check_server)
