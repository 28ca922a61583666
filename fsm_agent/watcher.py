"""HealthyWatch: the HEALTHY state's invoked activity, which watches the running workers.

While the group is HEALTHY the run loop blocks in ``HealthyWatch.wait`` until something happens:
a stop signal, a drain request, a worker's exit, a lost or joining node (the backend's membership
fd, or asked every ``monitor_interval`` seconds as torch does), a hung worker or a failed health
check (periodic ticks). It returns the fact (``fsm_agent.states.facts``) whose trigger the agent
fires; it decides nothing. ``fsm_agent.testing.coverage`` reads the facts ``wait`` returns to know
which triggers HEALTHY can fire.
"""

from __future__ import annotations

import logging
import select
import time
from collections.abc import Callable
from typing import Any

import pluggy

from fsm_agent.drain import NodeDrain
from fsm_agent.finished_nodes import count_finished
from fsm_agent.hang import HangDetector
from fsm_agent.inprocess.recovery import InProcessRecovery
from fsm_agent.interrupts import Interrupts
from fsm_agent.plugins.protocols import RendezvousAdapter
from fsm_agent.states.facts import (
    DrainRequested,
    Fact,
    HealthCheckFailed,
    JobFailed,
    MembershipChanged,
    StopRequested,
    WorkersFailed,
    WorkersHung,
    WorkersSucceeded,
)
from fsm_agent.worker import FailureClass, NodeProblem, WorkerGroup

log = logging.getLogger(__name__)
#: Hang checks tick at least this often (seconds), whatever ``monitor_interval`` says.
HANG_TICK_S = 0.5


class HealthyWatch:
    """Turns what happens to one node's running workers into facts (HEALTHY's watch loop).

    Args:
        group: the worker group (its spec, workers and the round's store).
        launcher: the launcher that runs the workers (``wait_fds``, ``poll``, ``exit_times``,
            ``return_values``, ``pids``).
        rdzv: the rendezvous handler's adapter (``membership_fd``, ``num_nodes_lost``).
        num_nodes_waiting: the handler's ``num_nodes_waiting`` (torch's name).
        hang: the hang detector.
        drains: the node's drain service.
        interrupts: the signal and wake-up-pipe service.
        plugin_manager: asked ``fsm_agent_health_check`` at each tick.
        on_worker_exit: called once per worker exit seen, ``(local_rank, exitcode)``.
        inprocess: the in-process recovery this node's agent may be watching.
    """

    def __init__(
        self,
        group: WorkerGroup,
        launcher: Any,
        rdzv: RendezvousAdapter,
        num_nodes_waiting: Callable[[], int],
        hang: HangDetector,
        drains: NodeDrain,
        interrupts: Interrupts,
        plugin_manager: pluggy.PluginManager,
        on_worker_exit: Callable[[int, int], None],
        inprocess: InProcessRecovery,
    ) -> None:
        self._group = group
        self._launcher = launcher
        self._rdzv = rdzv
        self._num_nodes_waiting = num_nodes_waiting
        self._hang = hang
        self._drains = drains
        self._interrupts = interrupts
        self._plugin_manager = plugin_manager
        self._on_worker_exit = on_worker_exit
        self._inprocess = inprocess
        self._exits: dict[int, int] | None = None  # the launcher's last answer to poll()
        self._reported_exits: set[int] = set()
        self._next_tick = 0.0
        #: Lost peers of this round known to have finished (their loss is no membership change).
        self._finished_peers_seen = 0

    def new_round(self) -> None:
        """A rendezvous round completed: no peer of it has finished yet."""
        self._finished_peers_seen = 0

    def new_attempt(self) -> None:
        """The workers of a new attempt started: watch them from scratch, first tick one interval on."""
        self._exits, self._reported_exits = None, set()
        self._next_tick = time.monotonic() + (self.tick_interval or 0.0)

    def workers_replaced(self, local_ranks: set[int]) -> None:
        """New processes replaced these workers (in-process restart): watch them from scratch."""
        self._exits, self._reported_exits = None, self._reported_exits - local_ranks

    @property
    def tick_interval(self) -> float | None:
        """Seconds between periodic checks, or None when nothing needs polling.

        Worker exits and (for backends with ``membership_fd``) membership changes wake the loop by
        themselves; ticks remain for hang checks (at most ``HANG_TICK_S`` apart), health checks and
        backends that can only be asked (``num_nodes_waiting``, every ``monitor_interval`` as in torch).
        """
        monitor_interval = float(self._group.spec.monitor_interval)
        if self._hang.enabled:
            return min(monitor_interval, HANG_TICK_S)
        if self._has_health_checks or self._membership_fd is None:
            return monitor_interval
        return None

    def wait(self) -> Fact | None:
        """Block until something happens to the running workers; the fact it is, or None."""
        tick = self.tick_interval
        timeout = None if tick is None else max(0.0, self._next_tick - time.monotonic())
        watches_drain = self._drains.watches(self._group)
        if watches_drain:
            drain_wait = self._drains.seconds_to_next_look()
            timeout = drain_wait if timeout is None else min(timeout, drain_wait)
        if (recovery_wait := self._inprocess.seconds_to_next_look()) is not None:
            timeout = recovery_wait if timeout is None else min(timeout, recovery_wait)
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
            return StopRequested()
        if watches_drain:
            self._drains.look_if_due(self._group, healthy=True)
        if self._drains.peer_verdict is not None:
            return JobFailed(verdict=self._drains.peer_verdict)
        if self._drains.request is not None:
            return DrainRequested(**self._drains.request)
        if watches_drain and self._drains.peer_leaving(self._group):
            log.warning(
                "[%s] a peer announced that it leaves the round (a drain or a stop signal): a membership change",
                self._group.spec.role,
            )
            return MembershipChanged(change=FailureClass.NODE_LOST)
        self._hang.read_timer_requests()
        if membership and membership[0] in ready and (change := self._membership_change()):
            return self._membership_fact(change, watches_drain)
        # An in-process recovery that completed is reported before an exit seen at the same time
        # (a replacement that fails at once is then a fault after the recovery, not during it).
        if (recovery := self._inprocess.look()) is not None:
            return recovery
        exited = self._exited_workers(poll=self._exits is None or ticked or bool(set(ready) & set(launcher_fds)))
        if exited is not None:
            return exited
        if ticked and tick is not None:
            self._next_tick = time.monotonic() + tick
            return self._tick()
        return None

    def _membership_fact(self, change: str, watches_drain: bool) -> Fact:
        """A peer that drains the job leaves it at once: its announcement, not its leaving, is
        what happened, whenever the last look for it was."""
        if watches_drain:
            self._drains.look(self._group, healthy=True)
            if self._drains.peer_verdict is not None:  # the peer left because it gave the job up
                return JobFailed(verdict=self._drains.peer_verdict)
            if self._drains.request is not None:
                return DrainRequested(**self._drains.request)
        # A lost peer usually fails our workers too (their collectives break); the cause is the
        # membership change, which is not counted as a restart.
        return MembershipChanged(change=change)

    def _exited_workers(self, poll: bool) -> Fact | None:
        """The workers' exits as a fact (failed, or all succeeded), or None while some run."""
        if poll:  # else nothing can have exited since the last poll
            self._exits = self._launcher.poll()
        exits = self._exits or {}
        for local_rank in sorted(set(exits) - self._reported_exits):
            self._reported_exits.add(local_rank)
            self._on_worker_exit(local_rank, exits[local_rank])
        failed = {rank: code for rank, code in exits.items() if code != 0}
        if failed and self._drains.peer_left(self._group):
            log.warning(
                "[%s] workers failed after a peer left the job by a drain or a stop signal: a membership change, "
                "not counted",
                self._group.spec.role,
            )
            return MembershipChanged(change=FailureClass.NODE_LOST)
        if failed:
            times = self._launcher.exit_times()
            return WorkersFailed(exits=failed, exit_times={r: times[r] for r in failed if r in times})
        if len(exits) == self._group.spec.local_world_size:
            # Every worker has a return value, None for a program (torch's RunResult does the same).
            values = self._launcher.return_values()
            return WorkersSucceeded(
                return_values={w.global_rank: values.get(w.local_rank) for w in self._group.workers}
            )
        return None

    def _tick(self) -> Fact | None:
        """The periodic checks: hung workers, the health-check plugins, membership by asking."""
        if self._hang.enabled and (hung := self._hang.hung_workers(self._launcher.pids(), set(self._exits or {}))):
            return WorkersHung(hung=hung)
        if self._has_health_checks and (problem := self._check_health()) is not None:
            return HealthCheckFailed(
                problem=str(problem), failure_class=problem.failure_class, global_rank=problem.global_rank
            )
        if change := self._membership_change():
            return MembershipChanged(change=change)
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
        waiting = self._num_nodes_waiting()
        if lost or waiting:
            log.info("[%s] membership changed: %s node(s) lost, %s waiting", self._group.spec.role, lost, waiting)
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
            finished = count_finished(self._group.store)
        except Exception as exc:
            log.debug("could not read the finished nodes' count: %s", exc)
            finished = 0
        if lost <= finished:
            log.info(
                "[%s] %s node(s) of the round left after their workers succeeded: not a membership change",
                self._group.spec.role,
                lost,
            )
            self._finished_peers_seen = lost
            return 0
        return lost - finished

    @property
    def _has_health_checks(self) -> bool:
        return bool(self._plugin_manager.hook.fsm_agent_health_check.get_hookimpls())

    def _check_health(self) -> NodeProblem | None:
        """Ask every health-check plugin; their complaints joined, or None when all are content."""
        answers = self._plugin_manager.hook.fsm_agent_health_check(worker_group=self._group)
        problems = [answer for answer in answers if answer]
        if not problems:
            return None
        log.warning("[%s] health check failed: %s", self._group.spec.role, "; ".join(problems))
        # The first answer that names its class (a NodeProblem) decides the workers' failure class
        # and the worker it is about (the root cause).
        named = next((p for p in problems if isinstance(p, NodeProblem)), None)
        if named is None:
            return NodeProblem("; ".join(problems))
        return NodeProblem("; ".join(problems), named.failure_class, named.global_rank)
