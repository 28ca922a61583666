"""ElasticAgent: the model of the worker-group statechart, and its run loop.

The table in ``fsm_agent.states.table`` decides every state change; this class supplies the
steps the table names (``_rendezvous``, ``_start_workers``, ``_decide_on_failed_workers``,
``_stop_workers``, ...), the guards (``has_restarts_left``) that read what those steps decided, and a
run loop that only turns observations (worker exits, hung workers, health checks, signals,
membership, errors) into triggers with their data. Hooks fire from the steps and from
``_after_state_change``.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import select
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from datetime import timedelta
from types import MappingProxyType
from typing import Any

import attrs
import pluggy

from fsm_agent import errorfile
from fsm_agent._early_signals import note_stop, take_early_drain, take_early_stop
from fsm_agent.env import worker_env
from fsm_agent.errors import ConfigError, FsmAgentError, PluginError, RendezvousFailed, RendezvousNotNeeded
from fsm_agent.finished_nodes import count_finished, mark_finished
from fsm_agent.hang import HangDetector, announce_stack_dump, dump_stacks
from fsm_agent.logs import LogsLayout, TorchLogsSpecsLayout, WorkerLogs
from fsm_agent.plugins.listeners import reject_listener_wrappers
from fsm_agent.plugins.protocols import LauncherAdapter, RendezvousAdapter
from fsm_agent.progress import Cycle, next_cycle, read_progress_file
from fsm_agent.ranks import assign_ranks
from fsm_agent.signal_names import signal_numbers
from fsm_agent.states import AUTO_TRIGGERS, WorkerState, build_machine
from fsm_agent.store_looks import STORE_LOOKS_PER_S, look_interval
from fsm_agent.worker import (
    DRAIN_EXIT_CODE,
    DRAIN_SCOPES,
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
EXIT_BARRIER_PREFIX = "torchelastic/agent/terminal_state"  # torch's key: torchrun peers share it
#: Triggers that report an error (data: ``error="..."``); firing one must not fail, so when a step
#: of theirs raises the agent takes its last resort (see ``_fire_error``).
ERROR_TRIGGERS = ("rendezvous_failed", "agent_errored")
STACK_DUMP_WAIT_S = 5.0  # at most this long for an aborted hung worker to write its stacks and exit
EXIT_BARRIER_RELEASE_WAIT_S = 5.0  # at most this long for a failing agent's exit-barrier check-in
#: The rendezvous-store key (in the round's store, shared by its agents) of a job-wide drain.
JOB_DRAIN_KEY = "fsm_agent/drain/job"
#: The same store's count of nodes that left the round by a node drain: a peer's workers that
#: fail meanwhile (a collective with the departed node) are a membership change, not a failure.
NODE_DRAIN_KEY = "fsm_agent/drain/nodes"
#: Peers that saw the job-wide drain count themselves here, so its announcer (maybe the store's
#: host, c10d) waits for them before it leaves and takes the store along.
JOB_DRAIN_SEEN_KEY = "fsm_agent/drain/job_seen"
#: At most this long (seconds) the announcer of a job-wide drain waits for every peer to see it.
JOB_DRAIN_SEEN_WAIT_S = 30.0
#: Seconds between looks at the --drain-file (a local stat) while the workers run; also the
#: shortest time between two looks at the store for a peer's job-wide drain.
DRAIN_POLL_S = 0.5
#: Looks for a peer's job-wide drain that the whole job makes per second at its rendezvous store.
#: Every agent looks once per ``job_drain_look_interval`` seconds, so the store's load stays flat in
#: the number of nodes (10,000 nodes: 1,000 requests/s, not 20,000 at ``DRAIN_POLL_S``).
JOB_DRAIN_LOOKS_PER_S = STORE_LOOKS_PER_S
#: The longest time (seconds) between two looks: well within ``JOB_DRAIN_SEEN_WAIT_S``, so that an
#: announcer still sees every peer see its drain before it leaves.
JOB_DRAIN_LOOK_MAX_S = JOB_DRAIN_SEEN_WAIT_S / 3


def _own_connection(store: Any) -> Any:
    """``store.clone()`` (torch's Store API: the same store on a new connection), or ``store``
    itself for a store that cannot be cloned (a Python store, whose calls do not queue)."""
    try:
        return store.clone()
    except (AttributeError, NotImplementedError, RuntimeError):
        return store


def job_drain_look_interval(group_world_size: int) -> float:
    """Seconds between one agent's looks at the rendezvous store for a job-wide drain, in a job of
    ``group_world_size`` nodes: ``group_world_size / JOB_DRAIN_LOOKS_PER_S``, at least
    ``DRAIN_POLL_S`` and at most ``JOB_DRAIN_LOOK_MAX_S``. (torch has no job-wide drain.) A lost
    peer (the announcer leaving) still makes every agent look at once."""
    return look_interval(group_world_size, DRAIN_POLL_S, JOB_DRAIN_LOOK_MAX_S)


class SignalStop(BaseException):
    """Raised by the signal handler to interrupt a blocking rendezvous or exit barrier."""

    def __init__(self, signum: int):
        super().__init__(f"received signal {signal.Signals(signum).name}")
        self.signum = signum


class DrainInterrupt(BaseException):
    """Raised to cut a rendezvous wait short when a drain is requested; the run loop's next step
    fires ``drain_requested`` from the state the interrupted transition left the group in."""


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
        # A store call abandoned to a stop signal (``_interruptible_call``) still holds its client:
        # any other call on that client would block behind it, so the way out makes none.
        self._abandoned_call: str | None = None
        #: Lost peers of this round known to have finished (their loss is no membership change).
        self._finished_peers_seen = 0
        self._exit_barrier_store: Any = None
        self._checked_in_at_exit_barrier = False
        self._error: str | None = None
        self._signal: int | None = None
        self._signal_stopped_workers = False
        self._interruptible = False
        self._drain_settings = DrainSettings()
        self._drain_lock = threading.RLock()  # RLock: a drain signal may arrive while the loop holds it
        self._drain_interruptible = False  # the call running now may be cut short by a drain
        self._drain_request: dict[str, str] | None = None  # set by any thread, fired by the run loop
        self._next_drain_check = 0.0
        self._next_job_drain_look: float | None = None  # None: at a random phase of the first interval
        self._drain: dict[str, Any] | None = None
        self._state_since = time.monotonic()
        self._next_tick = 0.0
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.machine = build_machine(self)
        try:
            reject_listener_wrappers(plugin_manager)
            self._configure_plugins(config)
        except BaseException:  # no run() will release these: do it here
            self._hang.close()
            for fd in (self._wake_r, self._wake_w):
                os.close(fd)
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
        return None if self._drain is None else MappingProxyType(self._drain)

    def run(self) -> RunResult:
        """Drive the statechart from INIT to a terminal state and return the RunResult.

        Never raises for worker failures, rendezvous failures, plugin errors or signals: each of
        those ends in a terminal state whose RunResult says why.
        """
        previous = self._install_signal_handlers()
        # A stop signal the early handlers took before the agent ran, whose SystemExit some startup
        # code swallowed (seen under load): they ignore stop signals from then on, so act on it here.
        if self._signal is None and (stopped := take_early_stop()) is not None:
            self._signal = stopped
        early = take_early_drain()  # a preemption notice can come before the agent ran
        if early is not None and early in self._drain_settings.signals:
            self.request_drain(source="signal", by=signal.Signals(early).name)
        try:
            return self._run_to_the_end(previous)
        finally:  # the agent's handlers stay to the very end: a second stop signal never cuts the way out short
            self._restore_signal_handlers(previous)

    def _run_to_the_end(self, previous: dict[int, Any]) -> RunResult:
        try:
            while self.state not in (S.SUCCEEDED, S.FAILED, S.UNKNOWN):
                self._step()
        finally:
            self._restore_wakeup_fd(previous)  # before _release closes the wake-up pipe
            self._release()
        gave_up = self.state == S.FAILED and self._decision is not None and not self._decision.restart
        result = RunResult(
            state=self.state,
            return_values=dict(self._return_values),
            failures=dict(self._failures),
            error=self._error,
            signal=self._signal,
            stopped_workers=self._signal_stopped_workers,
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
        if self._signal is not None:
            self._fire("stop_requested")
            return
        if self.state in (S.INIT, S.STOPPED):  # no workers to watch: look for a drain before going on
            self._look_for_drain()
        if self._drain_request is not None and "drain_requested" in self.machine.get_triggers(self.state):
            self._fire("drain_requested", **self._drain_request)
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
            pass  # self._signal is set: the next step fires stop_requested
        except DrainInterrupt:
            pass  # self._drain_request is set: the next step fires drain_requested
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
        if self._watches_drain:
            drain_wait = max(0.0, self._next_drain_check - time.monotonic())
            timeout = drain_wait if timeout is None else min(timeout, drain_wait)
        # A backend's membership fd stays readable until the next rendezvous: watch it only here.
        membership = [self._membership_fd] if self._membership_fd is not None else []
        launcher_fds = list(self._launcher.wait_fds())
        ready, _, _ = select.select([self._wake_r, *launcher_fds, *self._hang.wait_fds(), *membership], [], [], timeout)
        ticked = tick is not None and time.monotonic() >= self._next_tick
        if self._wake_r in ready:
            self._empty_wake_pipe()
        if self._signal is not None:
            return "stop_requested", {}
        if self._watches_drain and (now := time.monotonic()) >= self._next_drain_check:
            self._next_drain_check = now + DRAIN_POLL_S
            self._look_for_drain(peers=self._job_drain_look_due(now))
        if self._drain_request is not None:
            return "drain_requested", dict(self._drain_request)
        self._hang.read_timer_requests()
        if membership and membership[0] in ready and (change := self._membership_change()):
            # A peer that drains the job leaves it at once: its announcement, not its leaving, is
            # what happened, whenever the last look for it was.
            if self._watches_drain:
                self._look_for_drain()
                if self._drain_request is not None:
                    return "drain_requested", dict(self._drain_request)
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
        if failed and self._peer_left_by_drain():
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
        return self.drain is not None and self.drain["scope"] == "job"

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
        scope = str(event.kwargs.get("scope") or self._drain_settings.scope)
        if scope not in DRAIN_SCOPES:
            raise ValueError(f"drain_requested: scope {scope!r} is not one of {', '.join(DRAIN_SCOPES)}")
        self._drain = {
            "scope": scope,
            "source": str(event.kwargs.get("source") or "api"),
            "by": str(event.kwargs.get("by") or ""),
            "ts": time.time(),
        }
        # A drain decides nothing about restarts: no earlier verdict or failure class applies.
        self._decision, self._decided_class = None, None
        log.warning(
            "[%s] draining (%s scope), requested by %s %s",
            self.spec.role,
            scope,
            self.drain["source"],
            self.drain["by"],
        )

    def drain_on(self, settings: DrainSettings) -> None:
        """Watch for drain requests as ``settings`` says (signals, the drain file) and drain that way.

        Called by the ``drain`` plugin's ``fsm_agent_configure``, before ``run()``.

        Raises:
            ConfigError: a drain signal is also a stop signal (``--signals-to-handle``) or forwarded
                (``--forward-signals``).
            ValueError: the scope is unknown.
        """
        if settings.scope not in DRAIN_SCOPES:
            raise ValueError(f"drain scope {settings.scope!r} is not one of {', '.join(DRAIN_SCOPES)}")
        for sig in settings.signals:
            for flag, taken in (("--signals-to-handle", self._signals), ("--forward-signals", self._forwarded)):
                if sig in taken:
                    name = signal.Signals(sig).name
                    meaning = (
                        "stops the job, torchrun's meaning" if flag == "--signals-to-handle" else "goes to the workers"
                    )
                    raise ConfigError(
                        f"--drain-signals {name}: {name} is both a drain signal and in {flag} (it {meaning}): "
                        f"give --drain-signals another signal (e.g. SIGUSR2), or leave {name} out of {flag}"
                    )
        self._drain_settings = settings

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
        scope = scope or self._drain_settings.scope
        if scope not in DRAIN_SCOPES:
            raise ValueError(f"drain scope {scope!r} is not one of {', '.join(DRAIN_SCOPES)}")
        with self._drain_lock:
            if self._drain_request is not None or self.drain is not None or self._closed:
                return False
            self._drain_request = {"scope": scope, "source": source, "by": by}
        try:
            os.write(self._wake_w, b"d")  # wake the run loop
        except OSError:  # the pipe is full (the loop wakes anyway) or closed (the run ended)
            pass
        return True

    @property
    def drain_request(self) -> dict[str, str] | None:
        """The drain request the run loop has not acted on yet (scope, source, by), or None."""
        return self._drain_request

    @property
    def _watches_drain(self) -> bool:
        """While the workers run: look for the drain file, and for a peer's job-wide drain in a job of
        several nodes."""
        group = self._worker_group
        return bool(self._drain_settings.file) or (group.store is not None and (group.group_world_size or 0) > 1)

    def _job_drain_look_due(self, now: float) -> bool:
        """Whether this check also looks at the store for a peer's job-wide drain; schedules the
        next look. Agents look at random phases (spread over the first interval, then jittered by
        +-50 %) so that nodes started together do not all ask at the same instant."""
        interval = job_drain_look_interval(self._worker_group.group_world_size or 1)
        if self._next_job_drain_look is None:
            self._next_job_drain_look = now + interval * random.random()
        if now < self._next_job_drain_look:
            return False
        self._next_job_drain_look = now + interval * random.uniform(0.5, 1.5)
        return True

    def _look_for_drain(self, peers: bool = True) -> None:
        """Request a drain if the drain file exists or (``peers``) a peer announced a job-wide drain."""
        if self._drain_request is not None:
            return
        path = self._drain_settings.file
        if path and os.path.exists(path):
            self.request_drain(source="file", by=path)
            return
        group = self._worker_group
        if not peers or self.state != S.HEALTHY or group.store is None or (group.group_world_size or 0) <= 1:
            return
        try:
            announced = group.store.check([JOB_DRAIN_KEY])
        except Exception as exc:  # the store is gone: the membership checks report that
            log.debug("could not look for a job-wide drain: %s", exc)
            return
        if announced:
            try:
                by = group.store.get(JOB_DRAIN_KEY)
                by = by.decode() if isinstance(by, bytes) else str(by)
            except Exception:
                by = "a peer"
            try:
                group.store.add(JOB_DRAIN_SEEN_KEY, 1)
            except Exception as exc:  # the announcer then waits out JOB_DRAIN_SEEN_WAIT_S
                log.debug("could not count this node as having seen the job-wide drain: %s", exc)
            self.request_drain(scope="job", source="peer", by=by)

    def _announce_drain(self, event=None) -> None:
        """Tell the other nodes of the round, through its rendezvous store, before any worker
        stops: a job-wide drain asked here (``JOB_DRAIN_KEY``: every agent looks for it while its
        workers run, ``_look_for_drain``), or this node's leaving (``NODE_DRAIN_KEY``: a peer whose
        workers fail meanwhile takes it as a membership change, ``_peer_left_by_drain``)."""
        group, drain = self._worker_group, self.drain
        if drain is None or drain["source"] == "peer" or group.store is None or (group.group_world_size or 0) <= 1:
            return
        if self._abandoned_call is not None:  # the store client is still busy with it
            return
        store = group.store
        if drain["scope"] == "job":
            who = f"{self.hostname} (group_rank {group.group_rank}): {drain['source']} {drain['by']}".strip()
            announce = functools.partial(store.set, JOB_DRAIN_KEY, who)
        else:
            announce = functools.partial(store.add, NODE_DRAIN_KEY, 1)
        try:  # bounded, as the exit-barrier check-in: a store host that is gone must not hold the drain
            self._interruptible_call(
                "announce-drain", announce, interruptible=False, timeout=EXIT_BARRIER_RELEASE_WAIT_S
            )
        except Exception as exc:  # the others then see this node leave, later
            log.warning("could not tell the other nodes of the drain: %s", exc)

    def _peer_left_by_drain(self) -> bool:
        """Whether another node of this round announced it leaves by a node drain."""
        group = self._worker_group
        if group.store is None or (group.group_world_size or 0) <= 1 or self.drain is not None:
            return False
        try:
            return bool(group.store.check([NODE_DRAIN_KEY]))
        except Exception as exc:  # the store is gone: the failure stands as it is
            log.debug("could not look for a peer's drain: %s", exc)
            return False

    def _drain_workers(self, event=None) -> None:
        """The orderly stop: the checkpoint signal to every live worker, up to ``timeout_s`` seconds
        for them to exit by themselves, then the usual stop (SIGTERM, SIGKILL after shutdown_timeout
        s). A stop signal meanwhile cuts the wait short. Records the ``drain`` event."""
        settings, drain = self._drain_settings, self._drain
        started = time.monotonic()
        exits = dict(self._launcher.poll())
        live = [r for r in self._launcher.pids() if r not in exits]
        for local_rank in live:
            self._launcher.signal_worker(local_rank, settings.checkpoint_signal)
        deadline = started + settings.timeout_s
        while live and self._signal is None and not set(live) <= set(exits):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            select.select([self._wake_r, *self._launcher.wait_fds()], [], [], min(remaining, 1.0))
            self._empty_wake_pipe()
            exits = dict(self._launcher.poll())
        by_themselves = {r: exits[r] for r in live if r in exits}
        if len(by_themselves) < len(live):
            log.warning(
                "[%s] drain: %d of %d workers still running after %gs: stopping them",
                self.spec.role,
                len(live) - len(by_themselves),
                len(live),
                settings.timeout_s,
            )
        self._stop_workers()
        self._wait_for_peers_to_see_the_drain()
        if drain is not None:
            drain.update(
                checkpoint_signal=signal.Signals(settings.checkpoint_signal).name,
                timeout_s=settings.timeout_s,
                exits={str(r): c for r, c in sorted(by_themselves.items())},
                checkpointed=bool(live)
                and len(by_themselves) == len(live)
                and all(c == 0 for c in by_themselves.values()),
                duration_s=round(time.monotonic() - started, 6),
            )
            self._broadcast("fsm_agent_record_event", event=self._event("drain", **drain))

    def _wait_for_peers_to_see_the_drain(self) -> None:
        """The announcer of a job-wide drain waits (at most ``JOB_DRAIN_SEEN_WAIT_S`` s, cut short
        by a stop signal) until every other node has counted itself as having seen it: leaving
        first would take the store (c10d's, on its host) with it before they look."""
        group, drain = self._worker_group, self.drain
        if (
            drain is None
            or drain["scope"] != "job"
            or drain["source"] == "peer"
            or group.store is None
            or (group.group_world_size or 0) <= 1
            or self._abandoned_call is not None
        ):
            return
        others = group.group_world_size - 1
        deadline = time.monotonic() + JOB_DRAIN_SEEN_WAIT_S
        while self._signal is None and time.monotonic() < deadline:
            try:
                if group.store.add(JOB_DRAIN_SEEN_KEY, 0) >= others:
                    return
            except Exception as exc:  # the store is gone: nobody left to wait for
                log.debug("could not read who saw the job-wide drain: %s", exc)
                return
            select.select([self._wake_r], [], [], 0.1)
            self._empty_wake_pipe()
        log.warning(
            "[%s] drain: not every node saw the job-wide drain within %gs", self.spec.role, JOB_DRAIN_SEEN_WAIT_S
        )

    def _drain_verdict(self) -> str | None:
        drain = self.drain
        if drain is None or self.state != S.FAILED or self._signal is not None:
            return None
        return (
            f"drained ({drain['scope']} scope, requested by {drain['source']} {drain['by']}".rstrip()
            + f"): requeue (exit code {DRAIN_EXIT_CODE})"
        )

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

        info, ((base_global, world, base_role, role_world), job_restart_count) = self._interruptible_call(
            "rendezvous", join, drainable=True
        )
        self._standby = None  # ranked: a standby's seat, or it never was one
        if job_restart_count is not None:  # one job, one count: adopt the highest of the round
            self.restart_count = max(self.restart_count, job_restart_count)
        group.store, group.group_rank, group.group_world_size = info.store, info.rank, info.world_size
        self._finished_peers_seen = 0  # of this round
        # The exit barrier's own connection, opened now while the store is surely there: a clone
        # made at the barrier would retry a gone store host for the store's whole timeout.
        self._exit_barrier_store = _own_connection(info.store) if info.world_size > 1 else None
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
            self._interruptible = True
            try:
                if self._signal is not None:
                    raise SignalStop(self._signal)
                select.select([], [], [], delay)
            finally:
                self._interruptible = False

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
        death_sig = self._signal if self._signal is not None else signal.SIGTERM
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
        """Wait (up to exit_barrier_timeout s) until every agent is done, as torch's ``_exit_barrier``.

        Same keys as torch (``torchelastic/agent/terminal_state/num_members`` and ``.../last_member``),
        so torchrun peers share it. A failed agent checks in too (``_check_in_at_exit_barrier``), so
        its peers stop waiting at once instead of for the whole timeout (torch waits 300 s).
        """
        group = self._worker_group
        if not group.group_world_size or group.group_world_size <= 1:
            return

        def barrier():
            # Its own connection: on one TCPStore connection a blocked wait holds every other call
            # (c10d's keep-alive among them, so the peers would take this finished node for lost).
            store = self._exit_barrier_store or group.store
            mark_finished(store, group.group_rank, self.hostname)
            store.wait([self._check_in_at_exit_barrier(store)], timedelta(seconds=self.spec.exit_barrier_timeout))

        try:
            self._interruptible_call("exit-barrier", barrier, busies_store=False)
        except SignalStop:
            raise
        except Exception as exc:  # torch swallows barrier errors too: the local result stands
            network_error = getattr(sys.modules.get("torch.distributed"), "DistNetworkError", ())
            if isinstance(exc, network_error):  # the connection broke: no timeout passed
                log.warning(
                    "the store host left before the exit barrier completed (%s); this node's result stands", exc
                )
            else:
                log.warning("exit barrier did not complete within %ss: %s", self.spec.exit_barrier_timeout, exc)

    def _release_exit_barrier(self, event=None) -> None:
        """A failing agent checks in at the exit barrier so its peers stop waiting for it."""
        group = self._worker_group
        if group.store is None or not group.group_world_size or group.group_world_size <= 1:
            return
        if self._checked_in_at_exit_barrier:
            return  # stopped while waiting in the barrier: this node is counted already
        if self._abandoned_call is not None:
            log.warning(
                "not releasing the exit barrier: the store is still busy with the abandoned %s; "
                "the other nodes wait for the barrier's timeout",
                self._abandoned_call,
            )
            return
        try:  # bounded: a store host that is gone without a reset would hold a stop for the store's timeout
            self._interruptible_call(
                "exit-barrier-release",
                self._check_in_at_exit_barrier,
                interruptible=False,
                timeout=EXIT_BARRIER_RELEASE_WAIT_S,
            )
        except Exception as exc:  # the store may be gone with the failure; peers then time out
            log.warning("could not release the exit barrier: %s", exc)

    def _check_in_at_exit_barrier(self, store=None) -> str:
        self._checked_in_at_exit_barrier = True
        store = store if store is not None else self._worker_group.store
        world = self._worker_group.group_world_size
        if store.add(f"{EXIT_BARRIER_PREFIX}/num_members", 1) == world:
            store.set(f"{EXIT_BARRIER_PREFIX}/last_member", "<val_ignored>")
        return f"{EXIT_BARRIER_PREFIX}/last_member"

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

    # -- signals and cleanup ---------------------------------------------------------------------
    def _on_signal(self, signum: int, frame) -> None:
        """A stop signal (``--signals-to-handle``): the first stops the job (its workers get the same
        signal, the agent exits 128+N); another while they stop SIGKILLs them at once (a second Ctrl-C)."""
        if self._signal is None:
            self._signal = signum
            note_stop(signum)  # the CLI's early handlers, back once run() ends, then ignore stop signals
            name = signal.Signals(signum).name
            self._signal_stopped_workers = bool(self._launcher.pids())
            if self._signal_stopped_workers:
                log.warning("received %s: stopping the workers with %s", name, name)
            else:
                log.warning("received %s: stopping (no workers running)", name)
            if self._interruptible:
                raise SignalStop(signum)
            return
        pids = self._launcher.pids()
        if pids:
            log.warning("received %s again: killing the workers (SIGKILL)", signal.Signals(signum).name)
        for local_rank in pids:
            self._launcher.signal_worker(local_rank, signal.SIGKILL)

    def _interruptible_call(
        self,
        name: str,
        call: Callable[[], Any],
        *,
        interruptible: bool = True,
        timeout: float | None = None,
        drainable: bool = False,
        busies_store: bool = True,
    ) -> Any:
        """``call()`` (a rendezvous or store call that may block), cut short by a stop signal.

        torch's store calls (TCPStore's connect and ``wait_for_workers`` in StaticTCPRendezvous,
        ``store.wait`` in the exit barrier, a plugin's network client) block in C++ and retry on EINTR: a
        Python signal handler runs only once they return, minutes later. So ``call`` runs in a
        daemon thread and this thread waits on the signal wakeup fd, which every signal makes
        readable whatever thread the kernel delivers it to. A stop signal then raises SignalStop at
        once; the abandoned call ends with the process (the CLI exits with ``os._exit``; the
        rendezvous ``shutdown()`` is skipped on a signal, as in torch). Short timeouts in a retry
        loop would not do: a store host that gives up after each short wait drops the clients that
        already joined it. A backend whose blocking calls are Python (``interruptible = True``, as
        the ``fsm`` backend's select-based waits) runs in this thread, where SignalStop interrupts
        it, so its ``shutdown()`` (called on a signal too) never races a join still running.

        Args:
            name: the helper thread's name (``fsm-agent-<name>``).
            interruptible: False: a stop signal does not cut the wait short (a check-in on the way out).
            timeout: seconds to wait at most (None: as long as ``call`` takes).
            busies_store: False: ``call`` uses a store connection of its own, so abandoning it
                leaves the rendezvous store free for the way out (leave, release).
            drainable: a drain request cuts the wait short too (a rendezvous: a node given notice
                while it waits for others leaves at once). A backend whose waits are Python is cut
                short only by a drain signal; a drain by file or HTTP then acts once the call returns.

        Returns:
            what ``call`` returned.

        Raises:
            SignalStop: a stop signal arrived first (``interruptible``), or had arrived before.
            DrainInterrupt: a drain was requested first (``drainable``), or had been before.
            TimeoutError: ``timeout`` passed first.
            whatever ``call`` raised.
        """
        if interruptible and self._signal is not None:
            raise SignalStop(self._signal)
        if drainable and self._drain_request is not None:
            raise DrainInterrupt()
        if self._rdzv.interruptible:
            self._interruptible = interruptible  # the handler raises SignalStop into call()
            self._drain_interruptible = drainable
            try:
                return call()
            finally:
                self._interruptible = self._drain_interruptible = False
        outcome: dict[str, Any] = {}
        done_r, done_w = os.pipe()

        def run_call() -> None:
            try:
                outcome["value"] = call()
            except BaseException as exc:  # re-raised in the agent's thread
                outcome["error"] = exc
            finally:
                try:
                    os.write(done_w, b"x")
                except OSError:  # the agent stopped waiting and closed its end
                    pass
                os.close(done_w)

        finished = False
        try:
            threading.Thread(target=run_call, name=f"fsm-agent-{name}", daemon=True).start()
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:  # the handler only records the signal here; the loop's next turn acts on it
                if interruptible and self._signal is not None:
                    raise SignalStop(self._signal)
                if drainable and self._drain_request is not None:
                    raise DrainInterrupt()
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                ready, _, _ = select.select([done_r, self._wake_r], [], [], remaining)
                if done_r in ready:
                    finished = True
                    break
                if not ready:
                    raise TimeoutError(f"{name} did not finish within {timeout:g}s")
                self._empty_wake_pipe()  # a signal woke us: its Python handler runs before the next turn
        finally:
            os.close(done_r)
            if not finished and busies_store:
                self._abandoned_call = name
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    def _on_drain_signal(self, signum: int, frame) -> None:
        """A drain signal (``--drain-signals``): request a drain of the configured scope."""
        self.request_drain(source="signal", by=signal.Signals(signum).name)
        if self._interruptible and self._drain_interruptible:  # a Python rendezvous wait: cut it short
            raise DrainInterrupt()

    def _empty_wake_pipe(self) -> None:
        """Read what signals and ``request_drain`` wrote to the wake-up pipe (non-blocking)."""
        try:
            while os.read(self._wake_r, 512):
                pass
        except BlockingIOError:
            pass

    def _forward_signal(self, signum: int, frame) -> None:
        """Relay ``signum`` to each running worker's process group; nothing is stopped."""
        for local_rank in self._launcher.pids():
            self._launcher.signal_worker(local_rank, signum)

    def _install_signal_handlers(self) -> dict[int, Any]:
        previous: dict[int, Any] = {}
        if threading.current_thread() is not threading.main_thread():
            log.warning("agent not in the main thread: signals are not handled")
            return previous
        for sig in self._signals:
            if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
                continue  # started under nohup: keep ignoring SIGHUP
            previous[sig] = signal.signal(sig, self._on_signal)
        for sig in self._forwarded:
            previous[sig] = signal.signal(sig, self._forward_signal)
        for sig in self._drain_settings.signals:
            previous[sig] = signal.signal(sig, self._on_drain_signal)
        previous[-1] = signal.set_wakeup_fd(self._wake_w)
        return previous

    def _restore_signal_handlers(self, previous: dict[int, Any]) -> None:
        self._restore_wakeup_fd(previous)
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    @staticmethod
    def _restore_wakeup_fd(previous: dict[int, Any]) -> None:
        wakeup = previous.pop(-1, None)
        if wakeup is not None:
            signal.set_wakeup_fd(wakeup)

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
        self._closed = True
        self._launcher.close()
        self._launcher_extras.shutdown()  # e.g. the preload launcher's zygote
        self._hang.close()
        # torch's shutdown() closes the rendezvous for everyone, so it is skipped on a signal (as
        # torch does) and when this node was excluded (the others carry on without it); a backend
        # whose shutdown only leaves says so and always gets it. A backend with ``leave()`` (c10d,
        # etcd-v3) leaves the round instead, so the others notice at once, not after a keep-alive.
        leaving_alone = (
            self._signal is not None
            or self.excludes_this_node()
            or (self.drain is not None and not self.drains_whole_job())
        )
        leave = self._rdzv.leave if leaving_alone else None
        if leave is not None and self._abandoned_call is not None:
            log.warning(
                "not leaving the rendezvous: its store is still busy with the abandoned %s; the other "
                "nodes notice this node after its keep-alive timeout",
                self._abandoned_call,
            )
        elif not leaving_alone or not self._rdzv.shutdown_closes_rendezvous or leave:
            try:
                (leave or self._rdzv_handler.shutdown)()
            except Exception as exc:
                log.warning("rendezvous %s failed: %s", "leave" if leave else "shutdown", exc)
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)

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
