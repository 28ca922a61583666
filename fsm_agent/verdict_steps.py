"""The agent's steps of the job's verdict (``fsm_agent.job_verdict``): a mixin of ``ElasticAgent``,
which sets every attribute declared here. The table names ``_decide_job_verdict`` (the row of
``workers_failed`` that gives the job up) and ``_adopt_job_verdict`` (``job_failed``); the run loop
asks ``_peer_verdict_first`` before it fires ``workers_failed``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from transitions import EventData

from fsm_agent import job_verdict
from fsm_agent.attribution import FailureReport
from fsm_agent.drain import NodeDrain
from fsm_agent.failures import exit_failures, failures_of
from fsm_agent.interrupts import Interrupts
from fsm_agent.logs import WorkerLogs
from fsm_agent.states import WorkerState
from fsm_agent.states.facts import Fact, HealthCheckFailed, InProcessFailed, JobFailed, MembershipChanged, WorkersFailed
from fsm_agent.worker import RestartDecision, WorkerFailure, WorkerGroup, WorkerSpec

log = logging.getLogger(__name__)
S = WorkerState


class JobVerdictSteps:
    """The steps of the job's verdict, on the agent's own data."""

    spec: WorkerSpec
    state: WorkerState
    _hostname: str
    _worker_group: WorkerGroup
    _worker_logs: dict[int, WorkerLogs]
    _failures: dict[int, WorkerFailure]
    _decision: RestartDecision | None
    _decided_class: str | None
    _job_verdict: dict[str, Any] | None
    _verdicts: job_verdict.NodeVerdicts
    _interrupts: Interrupts
    _drains: NodeDrain
    _health_problem: HealthCheckFailed | None
    _hung: dict[int, str]
    _hung_stacks: dict[int, str]
    transitions: list[Any]

    def failure_classifier(self) -> Callable[[FailureReport], str | None]:
        raise NotImplementedError  # PluginSurface's

    def record_event(self, kind: str, **fields: Any) -> None:
        raise NotImplementedError  # PluginSurface's

    def _peer_verdict_first(self, fact: Fact) -> Fact:
        """Failed workers in a job of several nodes: when a peer gave the job up, or gives it up
        while every failure here was collateral, its verdict is what happened (``JobFailed``)."""
        if not isinstance(fact, WorkersFailed):
            return fact
        verdict = self._verdicts.before_deciding(lambda: self._failures_of(fact), self.failure_classifier())
        return fact if verdict is None else JobFailed(verdict=verdict, exits=dict(fact.exits))

    def _failures_of(self, fact: WorkersFailed) -> dict[int, WorkerFailure]:
        """The failed workers of ``fact`` (``failures.failures_of``); in UNHEALTHY, what made it so."""
        unhealthy = (self._health_problem, self._hung, self._hung_stacks) if self.state == S.UNHEALTHY else None
        return failures_of(
            self._worker_group, self._worker_logs, self._hostname, fact.exits, fact.exit_times, unhealthy
        )

    def _other_verdict(self) -> str | None:
        """The verdict of a run its own restart policy did not end: a peer's job verdict, a drain's."""
        if self.state != S.FAILED or self._interrupts.signal is not None:
            return None
        if self._job_verdict is not None and self._decision is None:
            return job_verdict.verdict_line(self._job_verdict)
        return self._drains.verdict()

    def _decide_job_verdict(self, event: EventData | None = None) -> None:
        """The job is given up here: its verdict (``NodeVerdicts.decide_and_share``: every node's
        reports, attributed, published once, seen by the peers), or the recorded one (replay).
        Records the ``verdict`` event."""
        fact = event.kwargs.get("fact") if event is not None else None
        recorded = fact.job_verdict if isinstance(fact, (WorkersFailed, InProcessFailed, MembershipChanged)) else None
        record = dict(recorded) if recorded else None
        if record is None:
            exit_code = self._decision.exit_code if self._decision is not None else None
            # a node lost (not nodes waiting to join), and the policy gave the job up
            lost = isinstance(fact, MembershipChanged) and fact.change == "node_lost"
            failures = {} if lost else self._failures
            record = self._verdicts.decide_and_share(failures, exit_code, self.failure_classifier(), lost=lost)
        self._job_verdict = record
        self.record_event("verdict", adopted=record.get("decided_by") != self._verdicts.who, **record)

    def _name_the_lost_store_host(self, event: EventData) -> None:
        """The rendezvous failed while workers ran (``rendezvous_failed`` from HEALTHY or UNHEALTHY,
        or from STOPPED re-joining after a lost node, which the store's host was):
        when another node hosted the round's store, now unreachable, the job's verdict names that
        node's ranks, lost with it (``NodeVerdicts.store_host_lost``); records the ``verdict`` event.
        Otherwise (a node in a rendezvous, this node the host, the host not known) nothing."""
        source = event.transition.source if event.transition is not None else None
        # STOPPED: a lost node (the store's keep-alive failed) made this node re-rendezvous, and
        # the store is not there to re-join
        after_loss = (
            source == S.STOPPED.value
            and bool(self.transitions)
            and self.transitions[-1].trigger == MembershipChanged.trigger
        )
        if source not in (S.HEALTHY.value, S.UNHEALTHY.value) and not after_loss:
            return
        record = self._verdicts.store_host_lost(self._failures, self.failure_classifier())
        if record is not None:
            self._job_verdict = record
            log.warning("[%s] %s", self.spec.role, job_verdict.verdict_line(record))
            self.record_event("verdict", adopted=False, **record)

    def _adopt_job_verdict(self, event: EventData) -> None:
        """A peer gave the job up (``JobFailed``): its verdict is this node's; workers that had failed
        here already stay failures. Records the ``verdict`` event."""
        fact = event.kwargs.get("fact")
        assert isinstance(fact, JobFailed), fact
        self._decision, self._decided_class = None, None
        exits = {r: c for r, c in fact.exits.items() if c != 0}
        self._failures = (
            exit_failures(self._worker_group, self._worker_logs, self._hostname, exits, {}) if exits else {}
        )
        self._job_verdict = dict(fact.verdict)
        log.warning("[%s] %s", self.spec.role, job_verdict.verdict_line(self._job_verdict))
        self.record_event("verdict", adopted=True, **self._job_verdict)
