"""The Python API: ``launch_agent(config, entrypoint, args)`` and ``elastic_launch(config, fn)(*args)``.

Mirrors ``torch.distributed.launcher.api``: build the WorkerSpec, the plugins and the agent from
a LaunchConfig, run it, print the summary and hand back the result.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Any, Callable

from fsm_agent.agent import ElasticAgent
from fsm_agent.config import LaunchConfig
from fsm_agent.errorfile import format_summary, propagate_to_parent
from fsm_agent.errors import ConfigError, FsmAgentError
from fsm_agent.logs import LogsLayout, TorchLogsSpecsLayout, load_logs_specs, parse_std
from fsm_agent.plugins.manager import build_registry, get_plugin_manager
from fsm_agent.worker import RendezvousSpec, RunResult, WorkerFailure, WorkerSpec

log = logging.getLogger(__name__)


def _configure_logging() -> None:
    level = os.environ.get("LOGLEVEL", "WARNING").upper()
    logging.basicConfig(level=level, format="[fsm-agent %(levelname).1s %(asctime)s] %(message)s",
                        stream=sys.stderr)
    logging.getLogger("transitions").setLevel(logging.WARNING)  # one line per callback is noise


def build_spec(config: LaunchConfig, entrypoint: str | Callable, args: tuple) -> WorkerSpec:
    rdzv = RendezvousSpec(backend=config.rdzv_backend, endpoint=config.rdzv_endpoint, run_id=config.run_id,
                          min_nodes=config.min_nodes, max_nodes=config.max_nodes,
                          config=dict(config.rdzv_configs), local_addr=config.local_addr,
                          node_rank=config.node_rank)
    return WorkerSpec(role=config.role, local_world_size=config.nproc_per_node, entrypoint=entrypoint,
                      args=tuple(args), rendezvous=rdzv, max_restarts=config.max_restarts,
                      monitor_interval=config.monitor_interval, shutdown_timeout=config.shutdown_timeout,
                      exit_barrier_timeout=config.exit_barrier_timeout, start_method=config.start_method,
                      virtual_local_rank=config.virtual_local_rank, numa_binding=config.numa_binding,
                      hang_timeout=config.hang_timeout,
                      duplicate_stdout_filters=tuple(config.duplicate_stdout_filters),
                      duplicate_stderr_filters=tuple(config.duplicate_stderr_filters))


def rendezvous_parameters(config: LaunchConfig):
    """torch ``RendezvousParameters`` for the configured backend (as ``launch_agent`` builds them).

    The torch-free ``fsm`` backend gets an equivalent object that does not import torch.
    """
    if config.rdzv_backend == "fsm":
        from fsm_agent.plugins.rendezvous_fsm import FsmRendezvousParameters

        return FsmRendezvousParameters.from_launch_config(config)
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    configs = dict(config.rdzv_configs)
    if config.rdzv_backend == "static":
        configs.setdefault("rank", config.node_rank)
    return RendezvousParameters(backend=config.rdzv_backend, endpoint=config.rdzv_endpoint,
                                run_id=config.run_id, min_nodes=config.min_nodes, max_nodes=config.max_nodes,
                                local_addr=config.local_addr, **configs)


def _logs_layout(config: LaunchConfig) -> LogsLayout | TorchLogsSpecsLayout:
    filters = frozenset(config.local_ranks_filter) if config.local_ranks_filter else None
    if config.logs_specs:
        specs = load_logs_specs(config.logs_specs, config.log_dir, config.redirects, config.tee, filters)
        return TorchLogsSpecsLayout(specs, config.run_id, config.log_line_prefix_template)
    return LogsLayout(log_dir=config.log_dir, run_id=config.run_id,
                      redirects=parse_std(config.redirects, "-r/--redirects"),
                      tee=parse_std(config.tee, "-t/--tee"), local_ranks_filter=filters,
                      prefix_template=config.log_line_prefix_template,
                      duplicate_stdout_filters=tuple(config.duplicate_stdout_filters),
                      duplicate_stderr_filters=tuple(config.duplicate_stderr_filters))


def create_agent(config: LaunchConfig, entrypoint: str | Callable, args: tuple) -> ElasticAgent:
    """Build (but do not run) the agent for ``config``.

    Raises:
        ConfigError: unknown backend name, bad log flags.
        PluginError: a plugin failed to load.
    """
    pm = get_plugin_manager(disabled=config.disabled_plugins)
    registry = build_registry(pm)
    rdzv_creator = registry.get("rendezvous", config.rdzv_backend)
    launcher_factory = registry.get("launcher", config.launcher)
    spec = build_spec(config, entrypoint, args)
    logs = _logs_layout(config)
    try:
        try:
            handler = rdzv_creator(rendezvous_parameters(config))
        except FsmAgentError:
            raise
        except Exception as exc:
            raise ConfigError(f"--rdzv-backend {config.rdzv_backend} at "
                              f"{config.rdzv_endpoint or '(default endpoint)'}: {type(exc).__name__}: {exc}") from None
        return ElasticAgent(spec, pm, handler, launcher_factory(None), logs, events_path=config.events_file,
                            signals_to_handle=config.signals_to_handle, forward_signals=config.forward_signals,
                            config=config)
    except BaseException:
        getattr(logs, "cleanup", lambda: None)()  # the temporary log directory of a run that never started
        raise


def launch_agent(config: LaunchConfig, entrypoint: str | Callable, args: tuple = ()) -> RunResult:
    """Run one agent to the end; print the summary on failure. Mirrors torch's ``launch_agent``.

    Returns:
        The RunResult (``result.exit_code`` is what the CLI exits with).

    Raises:
        ConfigError / PluginError: before any worker started (bad backend name, plugin import error).
    """
    _configure_logging()
    # Handle stop signals from the first instruction: until the agent installs its own handlers
    # (at the start of run(), before the first rendezvous) a signal ends the launch cleanly.
    # They stay until run() puts the agent's own in place, and are undone when the launch ends.
    original = {sig: signal.signal(sig, _exit_on_signal) for sig in _stop_signals(config.signals_to_handle)}
    # A signal to relay (--forward-signals) that comes before there are workers is dropped, not fatal.
    original.update({sig: signal.signal(sig, _drop_signal) for sig in _signals(config.forward_signals)
                     if sig not in original})
    try:
        return _launch(config, entrypoint, args)
    finally:
        for sig, handler in original.items():
            signal.signal(sig, handler)


def _launch(config: LaunchConfig, entrypoint: str | Callable, args: tuple) -> RunResult:
    agent = create_agent(config, entrypoint, args)
    if agent._logs.run_log_dir:
        log.info("logs in %s, events in %s", agent._logs.run_log_dir, agent.events_path)
    result = agent.run()
    name = agent.spec.get_entrypoint_name()
    if result.is_failed():
        print(format_summary(name, result), file=sys.stderr, flush=True)
        propagate_to_parent(result, name)
    return result


def _signals(names: str) -> list[int]:
    return [getattr(signal, n.strip()) for n in (names or "").split(",") if n.strip()]


def _stop_signals(names: str) -> list[int]:
    sigs = _signals(names)
    # Started under nohup: SIGHUP stays ignored.
    return [s for s in sigs if not (s == signal.SIGHUP and signal.getsignal(s) == signal.SIG_IGN)]


def _exit_on_signal(signum, frame):
    raise SystemExit(128 + signum)


def _drop_signal(signum, frame):
    log.info("%s before any worker started: not forwarded", signal.Signals(signum).name)


class WorkerGroupFailedError(FsmAgentError):
    """Raised by ``elastic_launch`` when the job failed; torch raises ``ChildFailedError`` here.

    Attributes:
        result: the RunResult; ``failures`` maps global rank to WorkerFailure.
    """

    def __init__(self, name: str, result: RunResult):
        super().__init__(format_summary(name, result))
        self.result = result
        self.failures: dict[int, WorkerFailure] = result.failures


class elastic_launch:
    """``elastic_launch(config, entrypoint)(*args)`` -> ``{global_rank: return value}`` of this node.

    Mirrors ``torch.distributed.launcher.api.elastic_launch``.

    Raises:
        WorkerGroupFailedError: the workers failed (torch: ChildFailedError).
    """

    def __init__(self, config: LaunchConfig, entrypoint: str | Callable):
        self._config, self._entrypoint = config, entrypoint

    def __call__(self, *args: Any) -> dict[int, Any]:
        result = launch_agent(self._config, self._entrypoint, args)
        if result.is_failed():
            name = self._entrypoint if isinstance(self._entrypoint, str) else self._entrypoint.__qualname__
            raise WorkerGroupFailedError(name, result)
        return result.return_values
