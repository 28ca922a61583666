"""ElasticAgent: the model of the worker-group statechart, and its run loop.

The table in ``fsm_agent.states.table`` decides every state change; this class supplies the
steps the table names (``_rendezvous``, ``_start_workers``, ``_stop_workers``, ...), the deciders
(``DECIDERS``: ``_decide_on_failed_workers``, ...) and the guards (``has_restarts_left``) that read
what they decided. The run loop fires the auto triggers, or the fact (``fsm_agent.states.facts``)
that HEALTHY's watcher (``fsm_agent.watcher``) returns; every step reads the fact its trigger
carries. The rooms beside it: ``agent_surface`` (what plugins read and call), ``interrupts``,
``drain``, ``exit_barrier``, ``failures``, ``recording``, ``rendezvous_errors``. Hooks fire from
the steps and from ``_after_state_change``.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import pluggy
from transitions import EventData
from transitions.core import MachineError

from fsm_agent import job_verdict, rendezvous_errors
from fsm_agent._early_signals import take_early_drain, take_early_stop
from fsm_agent.agent_surface import PluginSurface
from fsm_agent.drain import NodeDrain
from fsm_agent.drain_steps import DrainSteps
from fsm_agent.env import worker_env
from fsm_agent.errors import FsmAgentError, PluginError
from fsm_agent.exit_barrier import ExitBarrier
from fsm_agent.failures import HANG_KILL_HOLD_S, dump_hung_stacks
from fsm_agent.hang import HangDetector
from fsm_agent.inprocess.recovery import InProcessRecovery
from fsm_agent.inprocess.steps import InProcessSteps
from fsm_agent.interrupts import DrainInterrupt, Interrupts, SignalStop
from fsm_agent.job_verdict import NodeVerdicts
from fsm_agent.logs import LogsLayout, TorchLogsSpecsLayout, WorkerLogs
from fsm_agent.node_check_steps import NodeCheckOutcome, NodeCheckSteps
from fsm_agent.plugins.listeners import reject_listener_wrappers
from fsm_agent.plugins.protocols import LauncherAdapter, RendezvousAdapter
from fsm_agent.progress import CycleLog
from fsm_agent.ranks import join_round
from fsm_agent.recording import Listeners, TransitionRecord, final_metrics, transition_event, transition_metrics
from fsm_agent.signal_names import signal_numbers
from fsm_agent.states import AUTO_TRIGGERS, WorkerState, build_machine
from fsm_agent.states.facts import (
    FACTS,
    AgentErrored,
    DrainRequested,
    Fact,
    HealthCheckFailed,
    JobFailed,
    MembershipChanged,
    Progress,
    RendezvousFailed,
    RendezvousNotNeeded,
    StopRequested,
    WorkersFailed,
    WorkersHung,
    WorkersSucceeded,
    fact_for,
    fact_of,
)
from fsm_agent.states.table import DECIDERS
from fsm_agent.verdict_steps import JobVerdictSteps
from fsm_agent.watcher import HealthyWatch
from fsm_agent.worker import (
    FailureClass,
    RestartDecision,
    RunResult,
    Worker,
    WorkerFailure,
    WorkerGroup,
    WorkerSpec,
)

log = logging.getLogger(__name__)
S = WorkerState
#: The facts that report an error; firing one must not fail, so when a step of theirs raises the
#: agent takes its last resort (see ``_fire_error``).
ERROR_FACTS = (RendezvousFailed, AgentErrored)


EXIT_BARRIER_RELEASE_WAIT_S = 5.0  # at most this long for a failing agent's exit-barrier check-in


class ElasticAgent(PluginSurface, JobVerdictSteps, NodeCheckSteps, DrainSteps, InProcessSteps):
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

    #: Set by the machine (``build_machine``): the current WorkerState, and ``trigger(name, **kwargs)``.
    state: WorkerState
    trigger: Callable[..., bool]

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
        self._worker_logs: dict[int, WorkerLogs] = {}
        self._hang = HangDetector(spec.hang_timeout)
        self._cycles = CycleLog()
        self._step_times: dict[str, Any] | None = None
        self._checkpoints: dict[str, Any] | None = None
        # What made the group UNHEALTHY (workers_hung / health_check_failed): its way out fails them.
        self._hung, self._hung_stacks = {}, {}  # {local_rank: why}, {local_rank: stacks}
        self._health_problem: HealthCheckFailed | None = None
        # The restart policy's decision, made once per event by the trigger's decider (DECIDERS), read by the guards.
        self._decision: RestartDecision | None = None
        self._decided_class: str | None = None
        self._job_verdict: dict[str, Any] | None = None  # when the job failed: decided here or adopted
        self._init_node_checks()
        self._closed = False
        self._barrier = ExitBarrier(self._hostname, spec.exit_barrier_timeout)
        self._error: str | None = None
        self._state_since = time.monotonic()
        self._listeners = Listeners(plugin_manager)
        # signals, the wake-up pipe, interruptible calls (fsm_agent/interrupts.py); the drain (drain.py)
        self._interrupts = Interrupts(self._signals, self._forwarded, launcher, self._rdzv.interruptible)
        self._drains = NodeDrain(spec.role, self._interrupts.wake_w)
        self._verdicts = NodeVerdicts(
            self._worker_group, self._hostname, spec.role, self._interrupts, self._bounded_call
        )
        self._interrupts.drains, self._inprocess = self._drains, InProcessRecovery()
        self._watch = HealthyWatch(
            self._worker_group,
            launcher,
            self._rdzv,
            rdzv_handler.num_nodes_waiting,
            self._hang,
            self._drains,
            self._interrupts,
            plugin_manager,
            self._on_worker_exit,
            self._inprocess,
        )
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
        decision = self._decision
        gave_up = self.state == S.FAILED and decision is not None and not decision.restart
        result = RunResult(
            state=self.state,
            return_values=dict(self._return_values),
            failures=dict(self._failures),
            error=self._error,
            signal=self._interrupts.signal,
            stopped_workers=self._interrupts.stopped_workers,
            restart_count=self.restart_count,
            verdict=(decision.reason or None) if decision is not None and gave_up else self._other_verdict(),
            verdict_exit_code=decision.exit_code if decision is not None and gave_up else None,
            drain=self.drain["scope"] if self.drain is not None and self.state == S.FAILED else None,
            job_verdict=self._job_verdict if self.state == S.FAILED else None,
        )
        for name, value in final_metrics(result, self.spec.max_restarts, self.restart_count).items():
            self.put_metric("torchelastic", f"workers.{self.spec.role}.{name}", value)
        self.record_event("run_end", state=result.state.value, exit_code=result.exit_code, error=result.error)
        self._listeners.broadcast("fsm_agent_unconfigure", result=result)
        self._logs.cleanup()  # a temporary log dir goes; --log-dir stays
        return result

    # -- the run loop: observations in, triggers out --------------------------------------------
    def _step(self) -> None:
        if self._interrupts.signal is not None:
            self._fire(StopRequested())
            return
        if self.state in (S.INIT, S.STOPPED):  # no workers to watch: look for a drain before going on
            self._drains.look(self._worker_group, healthy=False)
        if self._drains.peer_verdict is not None and "job_failed" in self.machine.get_triggers(self.state):
            self._fire(JobFailed(verdict=self._drains.peer_verdict))
            return
        if self._drains.request is not None and "drain_requested" in self.machine.get_triggers(self.state):
            self._fire(DrainRequested(**self._drains.request))
            return
        auto = AUTO_TRIGGERS.get(self.state)
        if auto is not None:
            self._fire(self.take_pending_node_check() or self._peer_verdict_first(FACTS[auto]()))
            return
        try:
            fact = self._watch.wait()  # HEALTHY's invoked activity
        except Exception as exc:  # launcher poll / num_nodes_waiting failed: same paths as a failing step
            if rendezvous_errors.classify(exc) == "failed":  # the rendezvous store went away mid-run
                self._fire_error(RendezvousFailed(error=self._describe_rendezvous_error(exc)))
                return
            error = f"watching the workers failed in state {self.state.value}: {type(exc).__name__}: {exc}"
            log.error("%s\n%s", error, traceback.format_exc())
            self._fire_error(AgentErrored(error=error))
            return
        if fact is not None:
            self._fire(self._peer_verdict_first(fact))

    def fire(self, trigger: str, **data: Any) -> None:
        """Fire ``trigger`` with its fact built from ``data``, as the run loop does, for replay and
        test harnesses (``fire_fact`` takes the fact itself).

        Args:
            trigger: a trigger of the table (``fsm_agent.states.table``).
            **data: the fields of the trigger's fact (``fsm_agent.states.facts``: ``exits=``,
                ``hung=``, ``problem=``, ``change=``, ``error=``, ``return_values=``, ``progress=``).

        Raises:
            ValueError: ``data`` does not fit the trigger's fact.
            transitions.MachineError: the current state does not accept the trigger.
        """
        self.fire_fact(fact_for(trigger, **data))

    def fire_fact(self, fact: Fact) -> None:
        """Fire ``fact``'s trigger with it, as the run loop does.

        A step that raises moves the group along the table's error rows (``rendezvous_failed``,
        ``agent_errored``), as in a run; an error trigger whose own steps raise takes the last
        resort (UNKNOWN, workers SIGKILLed). Never raises for a failing step; a trigger the
        current state does not accept raises ``transitions.MachineError``.
        """
        if fact.trigger not in self.machine.get_triggers(self.state):
            raise MachineError(f"{fact.trigger} cannot fire in state {self.state.value}")
        if isinstance(fact, ERROR_FACTS):
            self._fire_error(fact)
        else:
            self._fire(fact)

    def _fire(self, fact: Fact) -> None:
        """Fire a fact's trigger; turn whatever its steps raise into the table's error trigger."""
        try:
            self.trigger(fact.trigger, fact=fact)
        except SignalStop:
            pass  # self._interrupts.signal is set: the next step fires stop_requested
        except NodeCheckOutcome as outcome:
            self._pending_node_check = outcome.fact  # the next step fires it
        except DrainInterrupt:
            pass  # self._drains.request is set: the next step fires drain_requested
        except job_verdict.PeerVerdict:
            pass  # self._drains.peer_verdict is set: the next step fires job_failed
        except Exception as exc:
            kind = rendezvous_errors.classify(exc)
            if kind == "not_needed":
                self._fire(RendezvousNotNeeded())
            elif kind == "failed":
                self._fire_error(RendezvousFailed(error=self._describe_rendezvous_error(exc)))
            else:
                error = f"{fact.trigger} failed in state {self.state.value}: {type(exc).__name__}: {exc}"
                # fsm-agent's own errors (bad input found late, e.g. --preload-modules) need no traceback
                log.error("%s%s", error, "" if isinstance(exc, FsmAgentError) else "\n" + traceback.format_exc())
                self._fire_error(AgentErrored(error=error))

    def _fire_error(self, fact: RendezvousFailed | AgentErrored) -> None:
        """Fire an error fact; if that fails too, take the last resort."""
        try:
            self.trigger(fact.trigger, fact=fact)
        except BaseException as exc:  # the error path itself failed: land in UNKNOWN, keep both errors
            self._error = f"{fact.error}; then {fact.trigger} failed: {type(exc).__name__}: {exc}"
            try:  # a last attempt, without grace, to leave no worker running
                self._launcher.stop(signal.SIGKILL, 0.0)
            except Exception as stop_exc:
                log.error("could not stop the workers: %s", stop_exc)
            self._launcher.close()
            source = self.state
            # Recorded as agent_errored, the table's edge from every live state to UNKNOWN.
            self.machine.set_state(S.UNKNOWN, model=self)
            self._on_state_changed(source.value, S.UNKNOWN.value, AgentErrored.trigger)

    # -- guards: they read the decision the trigger's decider made ---------------------------------
    def has_restarts_left(self, event: EventData | None = None) -> bool:
        """The restart policy decided to restart the worker group (``RestartDecision.restart``)."""
        return self._decision is not None and self._decision.restart

    def excludes_this_node(self, event: EventData | None = None) -> bool:
        """The restart policy took this node out of the job (``RestartDecision.exclude_node``)."""
        return self._decision is not None and self._decision.exclude_node

    # -- the deciders (the table's DECIDERS, once per event): a fact becomes a decision -----------
    def _decide_on_failed_workers(self, event: EventData) -> None:
        """Turn the failed workers into WorkerFailures and ask the restart policy.

        The failures come from the fact (``WorkersFailed.exits``, ``exit_times``: error files are
        read here), or, when the group is UNHEALTHY, from what made it so (the hung workers, or
        every worker of a node a health check failed).

        Raises:
            ValueError: ``workers_failed`` fired from HEALTHY without any failed ``exits``.
        """
        fact = fact_of(event, WorkersFailed)
        self._decided_class = None
        self._failures = self._failures_of(fact)
        cause = self._verdicts.local_root_cause(self._failures, self.failure_classifier())
        if self._chooses_in_process(fact):  # only the failed workers are replaced (InProcessSteps)
            return
        why = "" if cause.failure_class in (FailureClass.EXIT_CODE, FailureClass.SIGNAL) else f", {cause.failure_class}"
        what = (
            f"workers failed (first: local_rank {cause.local_rank}, rank {cause.global_rank}, "
            f"exitcode {cause.exitcode_text}{why})"
        )
        self._end_cycle(fact.progress, cause.failure_class)
        self._ask_restart_policy(
            cause.failure_class, RestartDecision(self.restart_count < self.spec.max_restarts), what
        )
        self._verdicts.publish(self._failures, self._decision)

    def _decide_on_membership_change(self, event: EventData) -> None:
        """Ask the restart policy about a membership change (``MembershipChanged.change``:
        ``node_lost`` or ``membership_change``); by default re-rendezvous without counting."""
        fact = fact_of(event, MembershipChanged)
        self._decided_class = None
        self._end_cycle(fact.progress, fact.change)
        self._ask_restart_policy(
            fact.change, RestartDecision(True, reason="re-rendezvous (not counted)"), fact.change.replace("_", " ")
        )
        if self._decision is not None and not self._decision.restart:
            self._error = f"{fact.change}: {self._decision.reason or 'the restart policy gave up'}"

    def _end_cycle(self, progress: Progress | None, failure_class: str | None) -> None:
        """Record the attempt that just ended as a ``Cycle`` (``cycle`` event). The progress comes
        from the fact (replay), else from what the workers reported (heartbeat steps, the progress
        file), read now."""
        if progress is None:
            steps = self._hang.steps(self.spec.local_world_size)
            progress = Progress(
                last_step=max(steps.values()) if steps else None,
                checkpoint_step=self._cycles.checkpoint_step(),
            )
        fields = self._cycles.end(self.restart_count, failure_class, progress.last_step, progress.checkpoint_step)
        self.record_event("cycle", **fields)

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
    def _rendezvous(self, event: EventData | None = None) -> None:
        """Join the next rendezvous round, assign ranks, and set up this attempt's worker store."""
        started = time.monotonic()
        group = self._worker_group

        joined = self._interrupts.call(
            "rendezvous", lambda: join_round(self._rdzv, self.spec, self.restart_count), drainable=True
        )
        self._standby = None  # ranked: a standby's seat, or it never was one
        if joined.job_restart_count is not None:  # one job, one count: adopt the highest of the round
            self.restart_count = max(self.restart_count, joined.job_restart_count)
        info = joined.info
        group.store, group.group_rank, group.group_world_size = info.store, info.rank, info.world_size
        group.workers, group.store_host_ranks = joined.workers, joined.store_host_ranks
        self._watch.new_round()
        self._barrier.new_round(info.store, info.world_size)
        group.master_addr = self.spec.master_addr or info.bootstrap_store_info.master_addr
        group.master_port = self.spec.master_port or info.bootstrap_store_info.master_port
        self._inprocess.new_round(group.master_addr, group.master_port, is_host=group.group_rank == 0)
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
        self._listeners.broadcast(
            "fsm_agent_rendezvous_completed", worker_group=group, duration_s=time.monotonic() - started
        )

    def _on_standby(self, message: str) -> None:
        """The rendezvous made this node a hot spare (called from inside ``next_rendezvous``; the
        group stays in INIT, or STOPPED after a restart, running no workers): log it, record a
        ``standby`` event and show it in ``/status`` until the node takes a seat."""
        self._standby = message
        log.warning("[%s] %s", self.spec.role, message)
        self.record_event("standby", message=message)

    def _report_launcher_timings(self) -> None:
        """What the launcher spent outside the agent's own steps (e.g. the preload launcher's
        ``preload_import_s``), once: metrics ``fsm_agent.launcher.<name>`` and a ``launcher_timings`` event."""
        timings = self._launcher_extras.take_timings()
        for name, seconds in timings.items():
            self.put_metric("fsm_agent", f"launcher.{name}", seconds)
        if timings:
            self.record_event("launcher_timings", **timings)

    def _backoff(self, event: EventData | None = None) -> None:
        """Wait the restart policy's backoff delay; a stop signal cuts it short."""
        delay = self._decision.delay_s if self._decision is not None else 0.0
        if delay > 0:
            self._interrupts.sleep(delay)

    def _start_workers(self, event: EventData | None = None) -> None:
        """Spawn ``local_world_size`` workers with torchrun's environment."""
        group, spec = self._worker_group, self.spec
        self._hang.new_attempt(spec.local_world_size)
        self._cycles.attempt_started()
        self._hung, self._hung_stacks, self._health_problem = {}, {}, None
        self._worker_logs = self._logs.reify(
            self.restart_count, spec.local_world_size, spec.role, {w.local_rank: w.global_rank for w in group.workers}
        )
        world_size = group.workers[0].world_size if group.workers else 0
        self._inprocess.new_attempt(self.run_id, self.restart_count, world_size)
        envs = self._worker_envs(group.workers)
        self._failures, self._return_values = {}, {}
        pids = self._launcher.start(spec, envs, self._worker_logs, self._logs.filtered_paths(self.restart_count))
        for worker in group.workers:
            worker.id = pids[worker.local_rank]
        self._report_launcher_timings()
        self._watch.new_attempt()
        self._listeners.broadcast("fsm_agent_workers_started", worker_group=group, pids=dict(pids))

    def _worker_envs(self, workers: list[Worker], extra_env: dict[str, str] | None = None) -> dict[int, dict[str, str]]:
        """``{local_rank: environment}`` of ``workers``: torchrun's, the plugins' extras, ``extra_env``."""
        group = self._worker_group
        envs = {}
        for worker in workers:
            extra = [
                self._hang.worker_env(worker.local_rank),
                self._inprocess.worker_env(),
                *self.plugin_manager.hook.fsm_agent_worker_env(worker=worker, worker_group=group),
                extra_env,
            ]
            envs[worker.local_rank] = worker_env(
                worker,
                group,
                restart_count=self.restart_count,
                run_id=self.run_id,
                error_file=self._worker_logs[worker.local_rank].error_file,
                # torch's RendezvousHandler.use_agent_store; in-process restart's store is the agent's
                use_agent_store=self._rdzv.use_agent_store or self._inprocess.enabled,
                extra=extra,
            )
        return envs

    def _stop_workers(self, event: EventData | None = None) -> None:
        """Stop every live worker: the stop signal the agent received (torch's ``_shutdown(death_sig=
        e.sigval)``: SIGINT as SIGINT, SIGHUP as SIGHUP, ...), else SIGTERM (a restart, a failure);
        then SIGKILL after shutdown_timeout s. A second stop signal meanwhile SIGKILLs them at once."""
        death_sig = self._interrupts.signal if self._interrupts.signal is not None else signal.SIGTERM
        self._launcher.stop(death_sig, self.spec.shutdown_timeout)

    def _count_restart(self, event: EventData | None = None) -> None:
        self.restart_count += 1

    def _record_unhealthy(self, event: EventData) -> None:
        """Remember what made the group unhealthy (``WorkersHung`` or ``HealthCheckFailed``):
        UNHEALTHY's way out, ``workers_failed``, counts those workers as failed."""
        fact = event.kwargs.get("fact")
        self._hung = dict(fact.hung) if isinstance(fact, WorkersHung) else {}
        self._health_problem = fact if isinstance(fact, HealthCheckFailed) else None

    def _record_return_values(self, event: EventData) -> None:
        """Keep the callable entrypoints' results (``WorkersSucceeded.return_values``) and record
        the cycle that succeeded."""
        fact = fact_of(event, WorkersSucceeded)
        self._return_values = dict(fact.return_values)
        self._end_cycle(fact.progress, None)

    def _record_error(self, event: EventData) -> None:
        """Keep what failed (``RendezvousFailed.error``, ``AgentErrored.error``) for the transition
        record and the RunResult."""
        fact = event.kwargs.get("fact")
        if isinstance(fact, ERROR_FACTS):
            self._error = fact.error or self._error

    def _dump_worker_stacks(self, event: EventData | None = None) -> None:
        """Record where each hung worker is stuck (``failures.dump_hung_stacks``: py-spy, else a
        faulthandler dump) for the hang failures that follow."""
        # the other nodes see the hang within a monitor interval or two of this one
        multi_node = (self._worker_group.group_world_size or 1) > 1
        hold_s = max(HANG_KILL_HOLD_S, 2 * self.spec.monitor_interval) if multi_node else 0.0
        self._hung_stacks = dump_hung_stacks(self._launcher, self._worker_logs, self._hung, self.spec.role, hold_s)

    def _exit_barrier(self, event: EventData | None = None) -> None:
        """Wait (up to exit_barrier_timeout s) until every agent is done (``ExitBarrier.wait``, torch's
        ``_exit_barrier``); a stop signal cuts it short."""
        self._barrier.wait(self._worker_group, lambda name, call: self._interrupts.call(name, call, busies_store=False))
        self._verdicts.after_barrier(self._drains)

    def _release_exit_barrier(self, event: EventData | None = None) -> None:
        """A failing agent checks in at the exit barrier so its peers stop waiting for it."""
        self._barrier.release(self._worker_group, self._bounded_call, self._interrupts.abandoned_call)

    def _bounded_call(self, name: str, call: Callable[[], Any]) -> Any:
        """``call()`` on the way out: not cut short by a stop signal, at most
        ``EXIT_BARRIER_RELEASE_WAIT_S`` seconds (a store host that is gone must not hold the stop)."""
        return self._interrupts.call(name, call, interruptible=False, timeout=EXIT_BARRIER_RELEASE_WAIT_S)

    # -- observations -----------------------------------------------------------------------------
    def _on_worker_exit(self, local_rank: int, exitcode: int) -> None:
        worker = self._worker_group.workers[local_rank]
        self._listeners.broadcast(
            "fsm_agent_worker_exited", worker=worker, worker_group=self._worker_group, exitcode=exitcode
        )
        self.record_event(
            "worker_exit",
            local_rank=local_rank,
            global_rank=worker.global_rank,
            role_rank=worker.role_rank,
            pid=worker.id,
            exit_code=exitcode,
        )

    # -- hooks after every transition ------------------------------------------------------------
    def _after_state_change(self, event: EventData) -> None:
        # A trigger with a decider records what the policy decided about, and every transition
        # its fact (what ``fsm-agent replay`` fires again).
        decided = self._decided_class if event.event.name in DECIDERS else None
        fact = event.kwargs.get("fact")
        assert event.transition is not None
        self._on_state_changed(
            event.transition.source,
            str(event.transition.dest),
            event.event.name,
            decided,
            fact.record() if isinstance(fact, Fact) else None,
        )

    def _on_state_changed(
        self,
        source: str,
        dest: str,
        trigger: str,
        decided_class: str | None = None,
        fact: dict[str, Any] | None = None,
    ) -> None:
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
        self._listeners.broadcast("fsm_agent_state_changed", transition=record)
        self.record_event("transition", **transition_event(record, decided_class, self.drain, fact))
        for group, name, value in transition_metrics(
            self.spec.role, record.source, record.dest, trigger, self.remaining_restarts, record.duration_s
        ):
            self.put_metric(group, name, value)

    def close(self) -> None:
        """Release what an agent built but never run holds: what ``run()`` releases on its way out
        (see ``_release``) and its temporary log directory (a ``--log-dir`` stays). Idempotent."""
        self._release()
        self._logs.cleanup()

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
        self._inprocess.close()
        leaving_alone = (
            self._interrupts.signal is not None
            or self.excludes_this_node()
            or (self.drain is not None and not self.drains_whole_job())
        )
        self._rdzv.end(leaving_alone, self._interrupts.abandoned_call)
        self._interrupts.close()

    def _describe_rendezvous_error(self, exc: BaseException) -> str:
        return rendezvous_errors.describe(
            exc, self.spec.rendezvous, *self._rdzv.round_timeout(self.spec.rendezvous.config)
        )
