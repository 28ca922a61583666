"""ElasticAgent: the model of the worker-group statechart, and its run loop.

The table in ``fsm_agent.states.table`` decides every state change; this class supplies the
steps the table names (``_rendezvous``, ``_start_workers``, ``_decide_on_failed_workers``,
``_stop_workers``, ...), the guards (``has_restarts_left``) that read what those steps decided, and a
run loop that only turns observations (worker exits, hung workers, health checks, signals,
membership, errors) into triggers with their data. Hooks fire from the steps and from
``_after_state_change``.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import attrs
import pluggy

from fsm_agent import errorfile
from fsm_agent._early_signals import take_early_drain, take_early_stop
from fsm_agent.drain import NodeDrain
from fsm_agent.env import worker_env
from fsm_agent.errors import FsmAgentError, PluginError, RendezvousFailed, RendezvousNotNeeded
from fsm_agent.exit_barrier import ExitBarrier
from fsm_agent.finished_nodes import count_finished
from fsm_agent.hang import HangDetector, announce_stack_dump, dump_stacks
from fsm_agent.interrupts import DrainInterrupt, Interrupts, SignalStop
from fsm_agent.logs import LogsLayout, TorchLogsSpecsLayout, WorkerLogs
from fsm_agent.plugins.listeners import reject_listener_wrappers
from fsm_agent.plugins.protocols import LauncherAdapter, RendezvousAdapter
from fsm_agent.progress import Cycle, next_cycle, read_progress_file
from fsm_agent.ranks import assign_ranks
from fsm_agent.signal_names import signal_numbers
from fsm_agent.states import AUTO_TRIGGERS, WorkerState, build_machine
from fsm_agent.worker import (
    HANG_EXIT_CODE,
    HEALTH_CHECK_EXIT_CODE,
    DrainSettings,
    FailureClass,
    NodeProblem,
    RestartDecision,
    RunResult,
    Worker,
    WorkerFailure,
    WorkerGroup,
    WorkerSpec,
    first_failure,
)

log = logging.getLogger(__name__)
S = WorkerState
#: Triggers that report an error (data: ``error="..."``); firing one must not fail, so when a step
#: of theirs raises the agent takes its last resort (see ``_fire_error``).
ERROR_TRIGGERS = ("rendezvous_failed", "agent_errored")
STACK_DUMP_WAIT_S = 5.0  # at most this long for an aborted hung worker to write its stacks and exit
EXIT_BARRIER_RELEASE_WAIT_S = 5.0  # at most this long for a failing agent's exit-barrier check-in


@attrs.frozen
class TransitionRecord:
    """One state change of the worker group.

    Attributes:
        source / dest: WorkerState names.
        trigger: the table trigger that fired.
        ts: wall-clock time of the change, seconds since the epoch.
        restart_count: restarts used, after the change.
        duration_s: seconds spent in ``source``.
        error: the agent error that caused the change, if any.
    """

    source: str
    dest: str
    trigger: str
    ts: float
    restart_count: int
    duration_s: float
    error: str | None = None


def _classify_rendezvous_error(exc: BaseException) -> str | None:
    """``"not_needed"``, ``"failed"`` or None (not a rendezvous error).

    torch's error classes are only consulted when torch is already loaded, so a backend that
    does not use torch never makes the agent import it.
    """
    if isinstance(exc, RendezvousNotNeeded):
        return "not_needed"
    if isinstance(exc, RendezvousFailed):
        return "failed"
    torch_api = sys.modules.get("torch.distributed.elastic.rendezvous.api")
    if torch_api is not None:
        if isinstance(exc, torch_api.RendezvousGracefulExitError):
            return "not_needed"
        if isinstance(exc, torch_api.RendezvousError):
            return "failed"
    return None


def _empty_rendezvous_error_detail(exc: BaseException, rdzv: Any, key: str, seconds: float) -> str:
    """What torch's message-less RendezvousTimeoutError / RendezvousClosedError mean, with the fix."""
    name = type(exc).__name__
    if name == "RendezvousTimeoutError":
        return (
            f"the round did not complete within {key}={seconds:g}s: fewer than {rdzv.min_nodes} agents "
            f"(--nnodes {rdzv.min_nodes}:{rdzv.max_nodes}) joined run id {rdzv.run_id!r} at "
            f"{rdzv.endpoint or '(default)'}; start the other nodes, or give them longer with "
            f"--rdzv-conf {key}=SECONDS"
        )
    if name == "RendezvousClosedError":
        return (
            f"the rendezvous of run id {rdzv.run_id!r} at {rdzv.endpoint or '(default)'} is closed: a job "
            f"with this id already ended there; start the job with a new --rdzv-id"
        )
    return "(no message)"


class ElasticAgent:
    """One node's agent: rendezvous, start, watch, restart and stop a worker group.

    Mirrors torch's ``LocalElasticAgent`` (``run() -> RunResult``, ``get_worker_group()``), with
    the control flow moved into the statechart.

    Args:
        spec: the WorkerSpec.
        plugin_manager: from ``fsm_agent.plugins.manager.get_plugin_manager``.
        rdzv_handler: a torch-style RendezvousHandler (from the backend registry).
        launcher: a launcher instance (from the backend registry).
        logs: the LogsLayout (or TorchLogsSpecsLayout, ``--logs-specs``) for this run.
        events_path: where the built-in recorder writes events (None: ``events.jsonl`` in the log dir).
        signals_to_handle: signal names that stop the workers and the agent (``--signals-to-handle``).
        forward_signals: signal names relayed to every live worker's process group (``--forward-signals``).
    """

    def __init__(
        self,
        spec: WorkerSpec,
        plugin_manager: pluggy.PluginManager,
        rdzv_handler: Any,
        launcher: Any,
        logs: LogsLayout | TorchLogsSpecsLayout,
        events_path: str | None = None,
        signals_to_handle: str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        config: Any = None,
        forward_signals: str = "",
    ):
        self.spec = spec
        self.plugin_manager = plugin_manager
        self.config = config
        self._hostname = socket.getfqdn()
        self._rdzv_handler = rdzv_handler
        #: the handler's and the launcher's optional members, read only through these (plugins/protocols.py)
        self._rdzv = RendezvousAdapter(rdzv_handler)
        self._launcher_extras = LauncherAdapter(launcher)
        self._standby: str | None = None
        self._rdzv.set_on_standby(self._on_standby)  # a backend that keeps nodes beyond MAX as standbys (fsm)
        self._launcher = launcher
        self._logs = logs
        self._events_path = events_path or (
            os.path.join(logs.run_log_dir, "events.jsonl") if logs.run_log_dir else None
        )
        self._signals = list(signal_numbers(signals_to_handle))
        self._forwarded = list(signal_numbers(forward_signals))
        self._worker_group = WorkerGroup(spec)
        self.restart_count = 0
        self.transitions: list[TransitionRecord] = []
        self._failures: dict[int, WorkerFailure] = {}
        self._return_values: dict[int, Any] = {}
        self._reported_exits: set[int] = set()
        self._worker_logs: dict[int, WorkerLogs] = {}
        self._hang = HangDetector(spec.hang_timeout)
        self._cycles: list[Cycle] = []
        self._cycle_start: float | None = None
        self._progress_file: str | None = None
        self._no_progress_limit = 0
        self._step_times: dict[str, Any] | None = None
        # What made the group UNHEALTHY (the data of workers_hung / health_check_failed): the
        # workers UNHEALTHY's way out counts as failed.
        self._hung: dict[int, str] = {}
        self._hung_stacks: dict[int, str] = {}
        self._health_problem: str | None = None
        self._exits: dict[int, int] | None = None  # the launcher's last answer to poll()
        # The restart policy's decision, made by a prepare step of the table once per event
        # (``_decided_event``) and read by the guards, ``_backoff`` and the verdict.
        self._decision: RestartDecision | None = None
        self._decided_class: str | None = None
        self._decided_event: Any = None
        self._closed = False
        #: Lost peers of this round known to have finished (their loss is no membership change).
        self._finished_peers_seen = 0
        self._barrier = ExitBarrier(self._hostname, spec.exit_barrier_timeout)
        self._error: str | None = None
        self._state_since = time.monotonic()
        self._next_tick = 0.0
        # signals, the wake-up pipe, interruptible calls (fsm_agent/interrupts.py); the drain (drain.py)
        self._interrupts = Interrupts(self._signals, self._forwarded, launcher, self._rdzv.interruptible)
        self._drains = NodeDrain(spec.role, self._interrupts.wake_w)
        self._interrupts.drains = self._drains
        self.machine = build_machine(self)
        try:
            reject_listener_wrappers(plugin_manager)
            self._configure_plugins(config)
        except BaseException:  # no run() will release these: do it here
            self._hang.close()
            self._interrupts.close()
            raise

    def _configure_plugins(self, config: Any) -> None:
        """Call every ``fsm_agent_configure``; a plugin that raises is named in a PluginError."""
        arguments = {"config": config, "agent": self}
        for impl in reversed(self.plugin_manager.hook.fsm_agent_configure.get_hookimpls()):
            try:
                impl.function(**{name: arguments[name] for name in impl.argnames})
            except FsmAgentError:
                raise
            except Exception as exc:
                raise PluginError(
                    f"plugin {impl.plugin_name!r} failed to configure: {type(exc).__name__}: {exc}; "
                    f"fix its settings or disable it with --disable-plugin {impl.plugin_name}"
                ) from None

    # -- public API (torch names) --------------------------------------------------------------
    def get_worker_group(self, role: str = "default") -> WorkerGroup:
        return self._worker_group

    @property
    def run_id(self) -> str:
        return self._rdzv_handler.get_run_id()

    @property
    def rdzv_endpoint(self) -> str:
        """Where the rendezvous is: the handler's ``endpoint`` if it has one (the port it bound for
        ``host:0``, as ``--standalone`` asks), else the configured ``--rdzv-endpoint``."""
        return self._rdzv.endpoint or self.spec.rendezvous.endpoint

    @property
    def run_log_dir(self) -> str | None:
        """The run's log directory (``--log-dir``'s ``<run_id>_<random>``, or a temporary one), or None."""
        return self._logs.run_log_dir

    @property
    def remaining_restarts(self) -> int:
        return self.spec.max_restarts - self.restart_count

    # -- what plugins read (read-only; the agent alone changes it) ------------------------------
    @property
    def hostname(self) -> str:
        """This node's name as its events, metrics and ``/status`` say it (``socket.getfqdn()``)."""
        return self._hostname

    @property
    def events_path(self) -> str | None:
        """The events file the built-in recorder writes (``--events-file``, else ``events.jsonl`` in
        the run's log directory), or None without a log directory."""
        return self._events_path

    @property
    def standby(self) -> str | None:
        """The rendezvous's message while this node waits as a hot spare (a node beyond
        ``max_nodes`` that the ``fsm`` backend keeps), or None: not a standby (any more)."""
        return self._standby

    @property
    def cycles(self) -> tuple[Cycle, ...]:
        """Every restart cycle so far, oldest first (``fsm_agent.progress.Cycle``): what the
        progress-aware restart policy decides on and ``/status`` shows."""
        return tuple(self._cycles)

    @property
    def step_times(self) -> Mapping[str, Any] | None:
        """The step-time view last reported with ``report_step_times`` (the ``straggler`` plugin's:
        window_s, factor, windows, basis, median_s, stragglers, ranks), for ``/status``; None while
        nobody reports one (no straggler detection, or no full window yet this attempt)."""
        return None if self._step_times is None else MappingProxyType(self._step_times)

    def report_step_times(self, view: Mapping[str, Any] | None) -> None:
        """Publish ``view`` as ``step_times`` (None clears it, as at each attempt's start)."""
        self._step_times = None if view is None else dict(view)

    @property
    def drain(self) -> Mapping[str, Any] | None:
        """The drain that ended (or is ending) the run: scope, source, by, ts, and once the workers
        are stopped checkpoint_signal, timeout_s (seconds), exits, checkpointed, duration_s
        (seconds); None when no drain was taken. ``drain_request`` is one not taken yet."""
        return None if self._drains.taken is None else MappingProxyType(self._drains.taken)

    def run(self) -> RunResult:
        """Drive the statechart from INIT to a terminal state and return the RunResult.

        Never raises for worker failures, rendezvous failures, plugin errors or signals: each of
        those ends in a terminal state whose RunResult says why.
        """
        previous = self._interrupts.install()
        # A stop signal the early handlers took before the agent ran, whose SystemExit some startup
        # code swallowed (seen under load): they ignore stop signals from then on, so act on it here.
        if self._interrupts.signal is None and (stopped := take_early_stop()) is not None:
            self._interrupts.signal = stopped
        early = take_early_drain()  # a preemption notice can come before the agent ran
        if early is not None and early in self._drains.settings.signals:
            self.request_drain(source="signal", by=signal.Signals(early).name)
        try:
            return self._run_to_the_end(previous)
        finally:  # the agent's handlers stay to the very end: a second stop signal never cuts the way out short
            self._interrupts.restore(previous)

    def _run_to_the_end(self, previous: dict[int, Any]) -> RunResult:
        try:
            while self.state not in (S.SUCCEEDED, S.FAILED, S.UNKNOWN):
                self._step()
        finally:
            self._interrupts.restore_wakeup_fd(previous)  # before _release closes the wake-up pipe
            self._release()
        gave_up = self.state == S.FAILED and self._decision is not None and not self._decision.restart
        result = RunResult(
            state=self.state,
            return_values=dict(self._return_values),
            failures=dict(self._failures),
            error=self._error,
            signal=self._interrupts.signal,
            stopped_workers=self._interrupts.stopped_workers,
            restart_count=self.restart_count,
            verdict=(self._decision.reason or None) if gave_up else self._drain_verdict(),
            verdict_exit_code=self._decision.exit_code if gave_up else None,
            drain=self.drain["scope"] if self.drain is not None and self.state == S.FAILED else None,
        )
        self._record_final_metrics(result)
        self._broadcast(
            "fsm_agent_record_event",
            event=self._event("run_end", state=result.state.value, exit_code=result.exit_code, error=result.error),
        )
        self._broadcast("fsm_agent_unconfigure", result=result)
        getattr(self._logs, "cleanup", lambda: None)()  # a temporary log dir goes; --log-dir stays
        return result

    # -- the run loop: observations in, triggers out --------------------------------------------
    def _step(self) -> None:
        if self._interrupts.signal is not None:
            self._fire("stop_requested")
            return
        if self.state in (S.INIT, S.STOPPED):  # no workers to watch: look for a drain before going on
            self._drains.look(self._worker_group, healthy=False)
        if self._drains.request is not None and "drain_requested" in self.machine.get_triggers(self.state):
            self._fire("drain_requested", **self._drains.request)
            return
        auto = AUTO_TRIGGERS.get(self.state)
        if auto is not None:
            self._fire(auto)
            return
        try:
            fact = self._wait_for_fact()
        except Exception as exc:  # launcher poll / num_nodes_waiting failed: same paths as a failing step
            if _classify_rendezvous_error(exc) == "failed":  # the rendezvous store went away mid-run
                self._fire_error("rendezvous_failed", self._describe_rendezvous_error(exc))
                return
            error = f"watching the workers failed in state {self.state.value}: {type(exc).__name__}: {exc}"
            log.error("%s\n%s", error, traceback.format_exc())
            self._fire_error("agent_errored", error)
            return
        if fact is not None:
            trigger, data = fact
            self._fire(trigger, **data)

    def fire(self, trigger: str, **data: Any) -> None:
        """Fire ``trigger`` with its data as the run loop does, for replay and test harnesses.

        Args:
            trigger: a trigger of the table (``fsm_agent.states.table``).
            **data: the trigger's data, as the table's comments name it (``exits=``, ``hung=``,
                ``problem=``, ``change=``, ``error=``, ``return_values=``, ``progress=``).

        A step that raises moves the group along the table's error rows (``rendezvous_failed``,
        ``agent_errored``), as in a run; an error trigger whose own steps raise takes the last
        resort (UNKNOWN, workers SIGKILLed). Never raises for a failing step; a trigger the
        current state does not accept raises ``transitions.MachineError``.
        """
        if trigger not in self.machine.get_triggers(self.state):
            from transitions.core import MachineError

            raise MachineError(f"{trigger} cannot fire in state {self.state.value}")
        if trigger in ERROR_TRIGGERS:
            self._fire_error(trigger, str(data.get("error") or f"{trigger} (no detail)"))
        else:
            self._fire(trigger, **data)

    def _fire(self, trigger: str, **data: Any) -> None:
        """Fire a trigger; turn whatever its steps raise into the table's error trigger."""
        try:
            self.trigger(trigger, **data)
        except SignalStop:
            pass  # self._interrupts.signal is set: the next step fires stop_requested
        except DrainInterrupt:
            pass  # self._drains.request is set: the next step fires drain_requested
        except Exception as exc:
            kind = _classify_rendezvous_error(exc)
            if kind == "not_needed":
                self._fire("rendezvous_not_needed")
            elif kind == "failed":
                self._fire_error("rendezvous_failed", self._describe_rendezvous_error(exc))
            else:
                error = f"{trigger} failed in state {self.state.value}: {type(exc).__name__}: {exc}"
                # fsm-agent's own errors (bad input found late, e.g. --preload-modules) need no traceback
                log.error("%s%s", error, "" if isinstance(exc, FsmAgentError) else "\n" + traceback.format_exc())
                self._fire_error("agent_errored", error)

    def _fire_error(self, trigger: str, error: str) -> None:
        """Fire an error trigger (its data: ``error``); if that fails too, take the last resort."""
        try:
            self.trigger(trigger, error=error)
        except BaseException as exc:  # the error path itself failed: land in UNKNOWN, keep both errors
            self._error = f"{error}; then {trigger} failed: {type(exc).__name__}: {exc}"
            try:  # a last attempt, without grace, to leave no worker running
                self._launcher.stop(signal.SIGKILL, 0.0)
            except Exception as stop_exc:
                log.error("could not stop the workers: %s", stop_exc)
            self._launcher.close()
            source = self.state
            # Recorded as agent_errored, the table's edge from every live state to UNKNOWN.
            self.machine.set_state(S.UNKNOWN, model=self)
            self._on_state_changed(source.value, S.UNKNOWN.value, "agent_errored")

    def _wait_for_fact(self) -> tuple[str, dict[str, Any]] | None:
        """Block until something happens to the running workers (HEALTHY); return the trigger it
        means with its data (see the table's comments), or None when nothing happened."""
        tick = self._tick_interval
        timeout = None if tick is None else max(0.0, self._next_tick - time.monotonic())
        watches_drain = self._drains.watches(self._worker_group)
        if watches_drain:
            drain_wait = self._drains.seconds_to_next_look()
            timeout = drain_wait if timeout is None else min(timeout, drain_wait)
        # A backend's membership fd stays readable until the next rendezvous: watch it only here.
        membership = [self._membership_fd] if self._membership_fd is not None else []
        launcher_fds = list(self._launcher.wait_fds())
        ready, _, _ = select.select(
            [self._interrupts.wake_r, *launcher_fds, *self._hang.wait_fds(), *membership], [], [], timeout
        )
        ticked = tick is not None and time.monotonic() >= self._next_tick
        if self._interrupts.wake_r in ready:
            self._interrupts.empty_wake_pipe()
        if self._interrupts.signal is not None:
            return "stop_requested", {}
        if watches_drain:
            self._drains.look_if_due(self._worker_group, healthy=self.state == S.HEALTHY)
        if self._drains.request is not None:
            return "drain_requested", dict(self._drains.request)
        self._hang.read_timer_requests()
        if membership and membership[0] in ready and (change := self._membership_change()):
            # A peer that drains the job leaves it at once: its announcement, not its leaving, is
            # what happened, whenever the last look for it was.
            if watches_drain:
                self._drains.look(self._worker_group, healthy=self.state == S.HEALTHY)
                if self._drains.request is not None:
                    return "drain_requested", dict(self._drains.request)
            # A lost peer usually fails our workers too (their collectives break); the cause is the
            # membership change, which is not counted as a restart.
            return "membership_changed", {"change": change}
        if self._exits is None or ticked or set(ready) & set(launcher_fds):  # else nothing can have exited
            self._exits = self._launcher.poll()
        exits = self._exits
        for local_rank in sorted(set(exits) - self._reported_exits):
            self._reported_exits.add(local_rank)
            self._on_worker_exit(local_rank, exits[local_rank])
        failed = {r: code for r, code in exits.items() if code != 0}
        if failed and self._drains.peer_left(self._worker_group):
            log.warning(
                "[%s] workers failed after a peer left the job by a drain: a membership change, not counted",
                self.spec.role,
            )
            return "membership_changed", {"change": FailureClass.NODE_LOST}
        if failed:
            times = self._launcher.exit_times()
            return "workers_failed", {"exits": failed, "exit_times": {r: times[r] for r in failed if r in times}}
        if len(exits) == self.spec.local_world_size:
            # Every worker has a return value, None for a program (torch's RunResult does the same).
            values = self._launcher.return_values()
            return "workers_succeeded", {
                "return_values": {w.global_rank: values.get(w.local_rank) for w in self._worker_group.workers}
            }
        if ticked:
            self._next_tick = time.monotonic() + tick
            if self._hang.enabled and (hung := self._hang.hung_workers(self._launcher.pids(), set(exits))):
                return "workers_hung", {"hung": hung}
            if self._has_health_checks and (problem := self._check_health()) is not None:
                return "health_check_failed", {"problem": problem}
            if change := self._membership_change():
                return "membership_changed", {"change": change}
        return None

    @property
    def _membership_fd(self) -> int | None:
        """An fd the backend makes readable when nodes are lost or wait to join (optional API)."""
        if self._finished_peers_seen:  # its fd stays readable for them: ask at each tick instead
            return None
        return self._rdzv.membership_fd()

    def _membership_change(self) -> str | None:
        """``node_lost`` (a peer stopped keeping the rendezvous alive, and did not finish),
        ``membership_change`` (nodes wait to join), or None."""
        lost = self._lost_beyond_finished(self._rdzv.num_nodes_lost())
        waiting = self._rdzv_handler.num_nodes_waiting()
        if lost or waiting:
            log.info("[%s] membership changed: %s node(s) lost, %s waiting", self.spec.role, lost, waiting)
        if lost:
            return FailureClass.NODE_LOST
        return FailureClass.MEMBERSHIP_CHANGE if waiting else None

    def _lost_beyond_finished(self, lost: int) -> int:
        """``lost`` less the peers that finished (``fsm_agent.finished_nodes``): a node whose
        workers all succeeded stops its keep-alive once it leaves, and is no loss to the round.

        The count is read from the round's store only when ``lost`` grew; a store that cannot be
        read counts no one finished (the loss stands)."""
        if lost <= self._finished_peers_seen:
            return 0
        try:
            finished = count_finished(self._worker_group.store)
        except Exception as exc:
            log.debug("could not read the finished nodes' count: %s", exc)
            finished = 0
        if lost <= finished:
            log.info(
                "[%s] %s node(s) of the round left after their workers succeeded: not a membership change",
                self.spec.role,
                lost,
            )
            self._finished_peers_seen = lost
            return 0
        return lost - finished

    @property
    def _has_health_checks(self) -> bool:
        return bool(self.plugin_manager.hook.fsm_agent_health_check.get_hookimpls())

    def _check_health(self) -> str | None:
        """Ask every health-check plugin; their complaints joined, or None when all are content."""
        answers = self.plugin_manager.hook.fsm_agent_health_check(worker_group=self._worker_group)
        problems = [answer for answer in answers if answer]
        if not problems:
            return None
        log.warning("[%s] health check failed: %s", self.spec.role, "; ".join(problems))
        # The first answer that names its class (a NodeProblem) decides the workers' failure class
        # and the worker it is about (the root cause).
        named = next((p for p in problems if isinstance(p, NodeProblem)), None)
        if named is None:
            return NodeProblem("; ".join(problems))
        return NodeProblem("; ".join(problems), named.failure_class, named.global_rank)

    # -- guards: they read the decision the row's prepare step made -------------------------------
    def has_restarts_left(self, event=None) -> bool:
        """The restart policy decided to restart the worker group (``RestartDecision.restart``)."""
        return self._decision is not None and self._decision.restart

    def excludes_this_node(self, event=None) -> bool:
        """The restart policy took this node out of the job (``RestartDecision.exclude_node``)."""
        return self._decision is not None and self._decision.exclude_node

    def drains_whole_job(self, event=None) -> bool:
        """The drain ``_decide_on_drain`` took is job-wide (scope ``job``), not this node's alone."""
        return self._drains.whole_job

    @property
    def _tick_interval(self) -> float | None:
        """Seconds between periodic checks, or None when nothing needs polling.

        Worker exits and (for backends with ``membership_fd``) membership changes wake the loop by
        themselves; ticks remain for hang checks (at most 0.5 s apart) and for backends that can
        only be asked (``num_nodes_waiting``, every ``monitor_interval`` as in torch).
        """
        if self._hang.enabled:
            return min(self.spec.monitor_interval, 0.5)
        if self._has_health_checks:
            return self.spec.monitor_interval
        if self._membership_fd is not None:
            return None
        return self.spec.monitor_interval

    # -- prepare steps named in the table: a fact becomes a restart decision ----------------------
    def _decide_on_failed_workers(self, event) -> None:
        """Turn the failed workers into WorkerFailures and ask the restart policy, once per event.

        The failures come from the event's data (``exits``, ``exit_times``: error files are read
        here), or, when the group is UNHEALTHY, from what made it so (the hung workers, or every
        worker of a node a health check failed).

        Raises:
            ValueError: ``workers_failed`` fired from HEALTHY without any failed ``exits``.
        """
        if self._decided_event is event:  # transitions runs prepare once for each row it tries
            return
        self._decided_event = event
        if self.state == S.UNHEALTHY:
            self._failures = self._health_failures() if self._health_problem is not None else self._hang_failures()
        else:
            exits = {r: c for r, c in (event.kwargs.get("exits") or {}).items() if c != 0}
            if not exits:
                raise ValueError("workers_failed needs the failed workers' exits={local_rank: exitcode}")
            self._failures = self._exit_failures(exits, event.kwargs.get("exit_times") or {})
        cause = first_failure(self._failures)
        why = "" if cause.failure_class in (FailureClass.EXIT_CODE, FailureClass.SIGNAL) else f", {cause.failure_class}"
        what = (
            f"workers failed (first: local_rank {cause.local_rank}, rank {cause.global_rank}, "
            f"exitcode {cause.exitcode_text}{why})"
        )
        self._end_cycle(event, cause.failure_class)
        self._ask_restart_policy(
            cause.failure_class, RestartDecision(self.restart_count < self.spec.max_restarts), what
        )

    def _decide_on_membership_change(self, event) -> None:
        """Ask the restart policy about a membership change (data ``change``: ``node_lost`` or
        ``membership_change``), once per event; by default re-rendezvous without counting."""
        if self._decided_event is event:
            return
        self._decided_event = event
        change = str(event.kwargs.get("change") or FailureClass.MEMBERSHIP_CHANGE)
        self._end_cycle(event, change)
        self._ask_restart_policy(
            change, RestartDecision(True, reason="re-rendezvous (not counted)"), change.replace("_", " ")
        )
        if not self._decision.restart:
            self._error = f"{change}: {self._decision.reason or 'the restart policy gave up'}"

    def _decide_on_drain(self, event) -> None:
        """Take the drain request (data ``scope``, ``source``, ``by``) as this run's drain, once.

        Raises:
            ValueError: ``scope`` is neither ``node`` nor ``job``.
        """
        if self._decided_event is event:
            return
        self._decided_event = event
        kwargs = event.kwargs
        self._drains.take(kwargs.get("scope"), kwargs.get("source"), kwargs.get("by"))
        # A drain decides nothing about restarts: no earlier verdict or failure class applies.
        self._decision, self._decided_class = None, None

    def drain_on(self, settings: DrainSettings) -> None:
        """Watch for drain requests as ``settings`` says (signals, the drain file) and drain that way.

        Called by the ``drain`` plugin's ``fsm_agent_configure``, before ``run()``.

        Raises:
            ConfigError: a drain signal is also a stop signal (``--signals-to-handle``) or forwarded
                (``--forward-signals``).
            ValueError: the scope is unknown.
        """
        self._drains.configure(settings, self._signals, self._forwarded)

    def request_drain(self, scope: str | None = None, source: str = "api", by: str = "") -> bool:
        """Ask for a drain; safe from any thread (the status endpoint's, a signal handler).

        Args:
            scope: ``"node"`` or ``"job"``; None: the configured ``--drain-scope``.
            source: what asked: ``signal``, ``file``, ``http``, ``peer`` or ``api``.
            by: which one (the signal's name, the file's path, the client's address).

        Returns:
            True if this request was taken; False when one is pending or the run is ending already.

        Raises:
            ValueError: ``scope`` is neither ``node`` nor ``job``.
        """
        return self._drains.ask(scope, source, by)

    @property
    def drain_request(self) -> dict[str, str] | None:
        """The drain request the run loop has not acted on yet (scope, source, by), or None."""
        return self._drains.request

    def _announce_drain(self, event=None) -> None:
        """Tell the round's other nodes of this drain before any worker stops (``NodeDrain.announce``),
        bounded as the exit-barrier check-in: a store host that is gone must not hold the drain."""
        if self._interrupts.abandoned_call is not None:  # the store client is still busy with it
            return

        self._drains.announce(self._worker_group, self.hostname, self._bounded_call)

    def _drain_workers(self, event=None) -> None:
        """The orderly stop (``NodeDrain.stop_workers``: the checkpoint signal, up to ``timeout_s``
        seconds, then ``_stop_workers``); a job-wide drain's announcer then waits for its peers to
        see it. A stop signal cuts both short. Records the ``drain`` event."""
        drains = self._drains
        outcome = drains.stop_workers(
            self._launcher, self._interrupts.wake_r, self._interrupts.signalled, self._stop_workers
        )
        if self._interrupts.abandoned_call is None:
            drains.wait_for_peers_to_see_it(self._worker_group, self._interrupts.wake_r, self._interrupts.signalled)
        if drains.taken is not None:
            started = outcome.pop("started")
            drains.taken.update(outcome, duration_s=round(time.monotonic() - started, 6))
            self._broadcast("fsm_agent_record_event", event=self._event("drain", **drains.taken))

    def _drain_verdict(self) -> str | None:
        if self.state != S.FAILED or self._interrupts.signal is not None:
            return None
        return self._drains.verdict()

    def track_progress(self, progress_file: str | None = None, max_no_progress_restarts: int = 0) -> None:
        """Read progress for the cycle records: every worker gets a heartbeat file (so
        ``fsm_agent.heartbeat(step=N)`` reports), ``progress_file`` is the iteration file the
        training writes at each checkpoint; ``max_no_progress_restarts`` (the restart limit a
        policy applies) goes into each ``cycle`` event, so ``fsm-agent replay`` applies it too.
        Called by the ``progress`` plugin's ``fsm_agent_configure``."""
        self.track_steps()
        self._progress_file = progress_file or None
        self._no_progress_limit = max_no_progress_restarts

    def track_steps(self) -> None:
        """Hand every worker a heartbeat file from the next attempt on, so ``worker_steps()`` reads
        what ``fsm_agent.heartbeat(step=N)`` reports. Called by plugins' ``fsm_agent_configure``."""
        self._hang.track_steps()

    def worker_steps(self) -> dict[int, int]:
        """{local_rank: the last step its worker reported this attempt}, for workers that did
        (``fsm_agent.heartbeat(step=N)``; empty unless ``track_steps()`` was called)."""
        return self._hang.steps(self.spec.local_world_size)

    def worker_compute(self) -> dict[int, float]:
        """{local_rank: its worker's total compute seconds this attempt}, for workers that
        reported compute time (``fsm_agent.heartbeat(compute_s=...)``/``fsm_agent.compute()``;
        empty unless ``track_steps()`` was called)."""
        return self._hang.compute(self.spec.local_world_size)

    def record_event(self, kind: str, **fields: Any) -> None:
        """Send one record of ``kind`` (docs/events.md) with the agent's common fields and ``fields``
        to every ``fsm_agent_record_event`` listener; for plugins' own records."""
        self._broadcast("fsm_agent_record_event", event=self._event(kind, **fields))

    def put_metric(self, group: str, name: str, value: float) -> None:
        """Send one metric to every ``fsm_agent_put_metric`` listener (torch's ``put_metric``)."""
        self._put_metric(group, name, value)

    def _end_cycle(self, event, failure_class: str | None) -> None:
        """Record the attempt that just ended as a ``Cycle`` (``cycle`` event). The progress comes
        from the event's data ``progress={"last_step": N, "checkpoint_step": M}`` (replay), else
        from what the workers reported (heartbeat steps, the progress file), read now."""
        progress = event.kwargs.get("progress")
        if progress is None:
            steps = self._hang.steps(self.spec.local_world_size)
            progress = {
                "last_step": max(steps.values()) if steps else None,
                "checkpoint_step": read_progress_file(self._progress_file),
            }
        now = time.time()
        cycle = next_cycle(
            self._cycles,
            attempt=self.restart_count,
            start=self._cycle_start if self._cycle_start is not None else now,
            end=now,
            last_step=progress.get("last_step"),
            checkpoint_step=progress.get("checkpoint_step"),
            failure_class=failure_class,
        )
        self._cycles.append(cycle)
        limit = {"max_no_progress_restarts": self._no_progress_limit} if self._no_progress_limit else {}
        self._broadcast("fsm_agent_record_event", event=self._event("cycle", **attrs.asdict(cycle), **limit))

    def _ask_restart_policy(self, failure_class: str, default: RestartDecision, what: str) -> None:
        """Hook ``fsm_agent_restart_policy``; ``default`` when no plugin answers."""
        decision = self.plugin_manager.hook.fsm_agent_restart_policy(
            failures=dict(self._failures),
            worker_group=self._worker_group,
            restart_count=self.restart_count,
            failure_class=failure_class,
        )
        self._decision, self._decided_class = decision or default, failure_class
        log.warning("[%s] %s: %s", self.spec.role, what, self._decision.reason or self._decision)

    # -- steps named in the table ---------------------------------------------------------------
    def _rendezvous(self, event=None) -> None:
        """Join the next rendezvous round, assign ranks, and set up this attempt's worker store."""
        started = time.monotonic()
        group = self._worker_group

        def join():
            info = self._rdzv_handler.next_rendezvous()
            return info, assign_ranks(
                info.store, info.rank, info.world_size, self.spec.role, self.spec.local_world_size, self.restart_count
            )

        info, ((base_global, world, base_role, role_world), job_restart_count) = self._interrupts.call(
            "rendezvous", join, drainable=True
        )
        self._standby = None  # ranked: a standby's seat, or it never was one
        if job_restart_count is not None:  # one job, one count: adopt the highest of the round
            self.restart_count = max(self.restart_count, job_restart_count)
        group.store, group.group_rank, group.group_world_size = info.store, info.rank, info.world_size
        self._finished_peers_seen = 0  # of this round
        self._barrier.new_round(info.store, info.world_size)
        group.workers = [
            Worker(
                local_rank=r,
                global_rank=base_global + r,
                role_rank=base_role + r,
                world_size=world,
                role_world_size=role_world,
            )
            for r in range(self.spec.local_world_size)
        ]
        group.master_addr = self.spec.master_addr or info.bootstrap_store_info.master_addr
        group.master_port = self.spec.master_port or info.bootstrap_store_info.master_port
        log.info(
            "[%s] rendezvous complete: restart_count=%s group_rank=%s group_world_size=%s master=%s:%s global_ranks=%s",
            self.spec.role,
            self.restart_count,
            group.group_rank,
            group.group_world_size,
            group.master_addr,
            group.master_port,
            [w.global_rank for w in group.workers],
        )
        self._broadcast("fsm_agent_rendezvous_completed", worker_group=group, duration_s=time.monotonic() - started)

    def _on_standby(self, message: str) -> None:
        """The rendezvous made this node a hot spare (called from inside ``next_rendezvous``; the
        group stays in INIT, or STOPPED after a restart, running no workers): log it, record a
        ``standby`` event and show it in ``/status`` until the node takes a seat."""
        self._standby = message
        log.warning("[%s] %s", self.spec.role, message)
        self._broadcast("fsm_agent_record_event", event=self._event("standby", message=message))

    @property
    def _use_agent_store(self) -> bool:
        """torch's ``RendezvousHandler.use_agent_store``: whether the workers' store at
        MASTER_ADDR:MASTER_PORT is one an agent (or the handler) hosts, so every rank is a client.
        Every built-in backend says no: the workers' rank 0 hosts their store, a new one for each
        ``init_process_group``, so a worker that destroys and re-creates its process group never
        meets the earlier group's keys (torch's ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` mode)."""
        return self._rdzv.use_agent_store

    def _report_launcher_timings(self) -> None:
        """What the launcher spent outside the agent's own steps (e.g. the preload launcher's
        ``preload_import_s``), once: metrics ``fsm_agent.launcher.<name>`` and a ``launcher_timings`` event."""
        timings = self._launcher_extras.take_timings()
        for name, seconds in timings.items():
            self._put_metric("fsm_agent", f"launcher.{name}", seconds)
        if timings:
            self._broadcast("fsm_agent_record_event", event=self._event("launcher_timings", **timings))

    def _backoff(self, event=None) -> None:
        """Wait the restart policy's backoff delay; a stop signal cuts it short."""
        delay = self._decision.delay_s if self._decision is not None else 0.0
        if delay > 0:
            self._interrupts.sleep(delay)

    def _start_workers(self, event=None) -> None:
        """Spawn ``local_world_size`` workers with torchrun's environment."""
        group, spec = self._worker_group, self.spec
        self._hang.new_attempt(spec.local_world_size)
        self._cycle_start = time.time()
        self._hung, self._hung_stacks, self._health_problem = {}, {}, None
        self._worker_logs = self._logs.reify(
            self.restart_count, spec.local_world_size, spec.role, {w.local_rank: w.global_rank for w in group.workers}
        )
        envs = {}
        for worker in group.workers:
            extra = [
                self._hang.worker_env(worker.local_rank),
                *self.plugin_manager.hook.fsm_agent_worker_env(worker=worker, worker_group=group),
            ]
            envs[worker.local_rank] = worker_env(
                worker,
                group,
                restart_count=self.restart_count,
                run_id=self.run_id,
                error_file=self._worker_logs[worker.local_rank].error_file,
                use_agent_store=self._use_agent_store,
                extra=extra,
            )
        self._failures, self._reported_exits, self._return_values, self._exits = {}, set(), {}, None
        pids = self._launcher.start(spec, envs, self._worker_logs, self._logs.filtered_paths(self.restart_count))
        for worker in group.workers:
            worker.id = pids[worker.local_rank]
        self._report_launcher_timings()
        self._next_tick = time.monotonic() + (self._tick_interval or 0.0)
        self._broadcast("fsm_agent_workers_started", worker_group=group, pids=dict(pids))

    def _stop_workers(self, event=None) -> None:
        """Stop every live worker: the stop signal the agent received (torch's ``_shutdown(death_sig=
        e.sigval)``: SIGINT as SIGINT, SIGHUP as SIGHUP, ...), else SIGTERM (a restart, a failure);
        then SIGKILL after shutdown_timeout s. A second stop signal meanwhile SIGKILLs them at once."""
        death_sig = self._interrupts.signal if self._interrupts.signal is not None else signal.SIGTERM
        self._launcher.stop(death_sig, self.spec.shutdown_timeout)

    def _count_restart(self, event=None) -> None:
        self.restart_count += 1

    def _record_unhealthy(self, event) -> None:
        """Remember what made the group unhealthy (data ``hung={local_rank: why}`` or ``problem``):
        UNHEALTHY's way out, ``workers_failed``, counts those workers as failed."""
        self._hung = dict(event.kwargs.get("hung") or {})
        self._health_problem = event.kwargs.get("problem")

    def _record_return_values(self, event) -> None:
        """Keep the callable entrypoints' results (data ``return_values={global_rank: value}``) and
        record the cycle that succeeded."""
        self._return_values = dict(event.kwargs.get("return_values") or {})
        self._end_cycle(event, None)

    def _record_error(self, event) -> None:
        """Keep what failed (data ``error``) for the transition record and the RunResult."""
        self._error = event.kwargs.get("error") or self._error

    def _dump_worker_stacks(self, event=None) -> None:
        """Record where each hung worker is stuck: py-spy if installed, else a faulthandler dump.

        The py-spy text goes to ``stacks.txt`` beside the worker's logs and into the summary. Without
        py-spy the worker gets SIGABRT, and ``PYTHONFAULTHANDLER=1`` (set for workers when hang
        detection is on) makes Python print every thread's stack to its stderr before it dies.
        """
        self._hung_stacks = {}
        for local_rank, why in self._hung.items():
            pid = self._launcher.pids()[local_rank]
            log.warning("[%s] local_rank %s (pid %s) is hung: %s", self.spec.role, local_rank, pid, why)
            stacks = dump_stacks(pid)
            if stacks:
                self._hung_stacks[local_rank] = stacks
                log.warning("stacks of local_rank %s:\n%s", local_rank, stacks)
                error_file = self._worker_logs[local_rank].error_file if local_rank in self._worker_logs else ""
                if error_file:
                    with open(os.path.join(os.path.dirname(error_file), "stacks.txt"), "w") as f:
                        f.write(stacks)
            else:
                wlogs = self._worker_logs.get(local_rank)
                announce_stack_dump(wlogs.stderr if wlogs else None, local_rank, pid)
                self._launcher.signal_worker(local_rank, signal.SIGABRT)
                # Let faulthandler finish writing before the group's SIGTERM can cut the dump short.
                exit_fds = [fd for fd, rank in self._launcher.wait_fds().items() if rank == local_rank]
                if exit_fds:
                    select.select(exit_fds, [], [], STACK_DUMP_WAIT_S)

    def _health_failures(self) -> dict[int, WorkerFailure]:
        """A node found unhealthy fails every local worker (class ``health_check``, or the class
        the health check's NodeProblem names, e.g. ``straggler``)."""
        kind = getattr(self._health_problem, "failure_class", FailureClass.HEALTH_CHECK)
        what = "health check" if kind == FailureClass.HEALTH_CHECK else kind
        cause, now = getattr(self._health_problem, "global_rank", None), time.time()
        # The named worker (a straggler) failed first: the others fail because of it, so the
        # verdict (first_failure: earliest, then lowest rank) names it, not the lowest local rank.
        return {
            worker.global_rank: WorkerFailure(
                local_rank=worker.local_rank,
                global_rank=worker.global_rank,
                role_rank=worker.role_rank,
                pid=worker.id,
                exitcode=HEALTH_CHECK_EXIT_CODE,
                timestamp=now if cause in (None, worker.global_rank) else now + 1e-3,
                message=f"{what}: {self._health_problem}",
                hostname=self.hostname,
                failure_class=kind,
            )
            for worker in self._worker_group.workers
        }

    def _hang_failures(self) -> dict[int, WorkerFailure]:
        """Each hung worker fails (class ``hang``), with the stacks ``_dump_worker_stacks`` found."""
        failures = {}
        for local_rank, why in self._hung.items():
            worker = self._worker_group.workers[local_rank]
            wlogs = self._worker_logs.get(local_rank)
            trace = self._hung_stacks.get(local_rank) or (
                f"(faulthandler stack dump in {wlogs.stderr})"
                if wlogs and wlogs.stderr
                else "(faulthandler stack dump on the worker's stderr)"
            )
            failures[worker.global_rank] = WorkerFailure(
                local_rank=local_rank,
                global_rank=worker.global_rank,
                role_rank=worker.role_rank,
                pid=worker.id,
                exitcode=HANG_EXIT_CODE,
                timestamp=time.time(),
                message=f"hang: {why}",
                traceback=trace,
                hostname=self.hostname,
                failure_class=FailureClass.HANG,
            )
        return failures

    def _exit_barrier(self, event=None) -> None:
        """Wait (up to exit_barrier_timeout s) until every agent is done (``ExitBarrier.wait``, torch's
        ``_exit_barrier``); a stop signal cuts it short."""
        self._barrier.wait(self._worker_group, lambda name, call: self._interrupts.call(name, call, busies_store=False))

    def _release_exit_barrier(self, event=None) -> None:
        """A failing agent checks in at the exit barrier so its peers stop waiting for it."""
        self._barrier.release(self._worker_group, self._bounded_call, self._interrupts.abandoned_call)

    def _bounded_call(self, name: str, call: Callable[[], Any]) -> Any:
        """``call()`` on the way out: not cut short by a stop signal, at most
        ``EXIT_BARRIER_RELEASE_WAIT_S`` seconds (a store host that is gone must not hold the stop)."""
        return self._interrupts.call(name, call, interruptible=False, timeout=EXIT_BARRIER_RELEASE_WAIT_S)

    # -- observations -----------------------------------------------------------------------------
    def _on_worker_exit(self, local_rank: int, exitcode: int) -> None:
        worker = self._worker_group.workers[local_rank]
        self._broadcast("fsm_agent_worker_exited", worker=worker, worker_group=self._worker_group, exitcode=exitcode)
        self._broadcast(
            "fsm_agent_record_event",
            event=self._event(
                "worker_exit",
                local_rank=local_rank,
                global_rank=worker.global_rank,
                role_rank=worker.role_rank,
                pid=worker.id,
                exit_code=exitcode,
            ),
        )

    def _exit_failures(self, failed: dict[int, int], times: dict[int, float]) -> dict[int, WorkerFailure]:
        """The failed workers (``{local_rank: exitcode}``, exit ``times`` in seconds since the
        epoch) as WorkerFailures, with what their ``@record`` error files say."""
        failures = {}
        for local_rank, code in failed.items():
            worker = self._worker_group.workers[local_rank]
            wlogs = self._worker_logs.get(local_rank)
            error_file = wlogs.error_file if wlogs else ""
            parsed = errorfile.read_error_file(error_file)
            if parsed is not None:
                message, trace, error_ts = parsed
            else:
                message = (
                    f"Signal {-code} ({signal.Signals(-code).name}) received by PID {worker.id}"
                    if code < 0
                    else f"exited with code {code}"
                )
                trace, error_ts = errorfile.tail(wlogs.stderr if wlogs else None), None
            failures[worker.global_rank] = WorkerFailure(
                local_rank=local_rank,
                global_rank=worker.global_rank,
                role_rank=worker.role_rank,
                pid=worker.id,
                exitcode=code,
                timestamp=times.get(local_rank, time.time()),
                error_file=error_file if parsed is not None else "<N/A>",
                message=message,
                traceback=trace,
                hostname=self.hostname,
                failure_class=FailureClass.SIGNAL if code < 0 else FailureClass.EXIT_CODE,
                error_timestamp=error_ts,
            )
        return failures

    # -- hooks after every transition ------------------------------------------------------------
    def _after_state_change(self, event) -> None:
        # A transition whose row decided (its prepare step) records what the policy decided about.
        decided = self._decided_class if event is self._decided_event else None
        self._on_state_changed(event.transition.source, event.transition.dest, event.event.name, decided)

    def _on_state_changed(self, source: str, dest: str, trigger: str, decided_class: str | None = None) -> None:
        now = time.monotonic()
        record = TransitionRecord(
            source=str(source),
            dest=str(dest),
            trigger=trigger,
            ts=time.time(),
            restart_count=self.restart_count,
            duration_s=now - self._state_since,
            error=self._error if dest in ("FAILED", "UNKNOWN") else None,
        )
        self._state_since = now
        self._worker_group.state = WorkerState(dest)
        self.transitions.append(record)
        role = self.spec.role
        self._broadcast("fsm_agent_state_changed", transition=record)
        decided: dict[str, Any] = {"failure_class": decided_class} if decided_class else {}
        if trigger == "drain_requested" and self.drain is not None:  # a drain, not a failure
            decided.update(drain_scope=self.drain["scope"], drain_source=self.drain["source"])
        self._broadcast(
            "fsm_agent_record_event",
            event=self._event(
                "transition",
                source=record.source,
                dest=record.dest,
                trigger=trigger,
                duration_s=round(record.duration_s, 6),
                error=record.error,
                **decided,
            ),
        )
        self._put_metric("torchelastic", f"workers.{role}.remaining_restarts", self.remaining_restarts)
        self._put_metric("torchelastic", f"workers.{role}.{dest.lower()}", 1)
        self._put_metric("fsm_agent", f"state.{source}.duration_s", record.duration_s)
        if trigger == "drain_requested":  # counted apart from failures and restarts
            self._put_metric("fsm_agent", "drains", 1)

    def _record_final_metrics(self, result: RunResult) -> None:
        """torch's ``_record_metrics`` names: run_total, flakiness, run_{success,failed}_{with,no}_retries."""
        role, spec = self.spec.role, self.spec
        drained, restarted = result.drain is not None, self.restart_count > 0
        failed = result.is_failed() and not drained  # a drain is counted apart (run_drained)
        flakiness = 100.0 if failed else 100.0 - 100.0 * (self.remaining_restarts + 1) / (spec.max_restarts + 1)
        values = {
            "run_total": 1,
            "flakiness": flakiness,
            "run_success_with_retries": int(not failed and restarted),
            "run_success_no_retries": int(not failed and not restarted),
            "run_failed_with_retries": int(failed and restarted),
            "run_failed_no_retries": int(failed and not restarted),
            **({"run_drained": 1} if drained else {}),  # only then: a run's metrics stay torch's otherwise
        }
        for name, value in values.items():
            self._put_metric("torchelastic", f"workers.{role}.{name}", value)

    def _put_metric(self, group: str, name: str, value: float) -> None:
        self._broadcast("fsm_agent_put_metric", metric_group=group, metric_name=name, metric_value=value)

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        group = self._worker_group
        try:
            run_id = self.run_id
        except Exception:
            run_id = self.spec.rendezvous.run_id
        return {
            "ts": time.time(),
            "kind": kind,
            "node": self.hostname,
            "pid": os.getpid(),
            "role": self.spec.role,
            "run_id": run_id,
            "restart_count": self.restart_count,
            "max_restarts": self.spec.max_restarts,
            "state": self.state.value if hasattr(self, "state") else None,
            "group_rank": group.group_rank,
            "group_world_size": group.group_world_size,
            "local_world_size": self.spec.local_world_size,
            "rdzv_backend": self.spec.rendezvous.backend,
            "master_addr": group.master_addr,
            "master_port": group.master_port,
            "entrypoint": self.spec.get_entrypoint_name(),
            "workers": [
                {
                    "local_rank": w.local_rank,
                    "global_rank": w.global_rank,
                    "role_rank": w.role_rank,
                    "world_size": w.world_size,
                    "role_world_size": w.role_world_size,
                    "pid": w.id,
                }
                for w in group.workers
            ],
            **fields,
        }

    def _broadcast(self, hook_name: str, **kwargs: Any) -> None:
        """Call every implementation of a listener hook; one failing listener does not stop the rest.

        pluggy aborts a hook call at the first exception, so listeners are called one by one.
        """
        for impl in reversed(getattr(self.plugin_manager.hook, hook_name).get_hookimpls()):
            try:
                impl.function(**{name: kwargs[name] for name in impl.argnames})
            except SignalStop:
                raise
            except Exception:
                log.exception("plugin %r failed in %s; continuing", impl.plugin_name, hook_name)

    def close(self) -> None:
        """Release what an agent built but never run holds: what ``run()`` releases on its way out
        (see ``_release``) and its temporary log directory (a ``--log-dir`` stays). Idempotent."""
        self._release()
        getattr(self._logs, "cleanup", lambda: None)()

    def _release(self) -> None:
        """Release the launcher (and its zygote), the hang detector, the
        rendezvous (torch's ``shutdown()``, unless this node leaves alone) and the wake-up pipe.
        Idempotent."""
        if self._closed:
            return
        self._closed = self._drains.closed = True
        self._launcher.close()
        self._launcher_extras.shutdown()  # e.g. the preload launcher's zygote
        self._hang.close()
        # torch's shutdown() closes the rendezvous for everyone, so it is skipped on a signal (as
        # torch does) and when this node was excluded (the others carry on without it); a backend
        # whose shutdown only leaves says so and always gets it. A backend with ``leave()`` (c10d,
        # etcd-v3) leaves the round instead, so the others notice at once, not after a keep-alive.
        leaving_alone = (
            self._interrupts.signal is not None
            or self.excludes_this_node()
            or (self.drain is not None and not self.drains_whole_job())
        )
        leave = self._rdzv.leave if leaving_alone else None
        if leave is not None and self._interrupts.abandoned_call is not None:
            log.warning(
                "not leaving the rendezvous: its store is still busy with the abandoned %s; the other "
                "nodes notice this node after its keep-alive timeout",
                self._interrupts.abandoned_call,
            )
        elif not leaving_alone or not self._rdzv.shutdown_closes_rendezvous or leave:
            try:
                (leave or self._rdzv_handler.shutdown)()
            except Exception as exc:
                log.warning("rendezvous %s failed: %s", "leave" if leave else "shutdown", exc)
        self._interrupts.close()

    def _describe_rendezvous_error(self, exc: BaseException) -> str:
        rdzv = self.spec.rendezvous
        key, seconds = self._rdzv.round_timeout(rdzv.config)
        where = (
            f"backend={rdzv.backend} endpoint={rdzv.endpoint or '(default)'} run_id={rdzv.run_id} {key}={seconds:g}s"
        )
        if "is_host" in (rdzv.conf_keys or ()):  # a backend that does not read is_host: it means nothing
            where += f" is_host={rdzv.config.get('is_host', 'inferred from the endpoint')}"
        detail = str(exc) or _empty_rendezvous_error_detail(exc, rdzv, key, seconds)
        own_prefix = f"{rdzv.backend} rendezvous failed: "
        if isinstance(exc, FsmAgentError) and detail.startswith(own_prefix) and "endpoint=" in detail:
            # The backend named where itself (fsm's handler): say it once, not twice.
            return f"rendezvous failed: {detail[len(own_prefix) :]}"
        return f"rendezvous failed: {where}: {type(exc).__name__}: {detail}"
