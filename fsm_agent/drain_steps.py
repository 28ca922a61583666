"""The agent's drain steps and guard (the table's ``drain_requested`` and ``stop_requested`` rows).

A mixin of ``ElasticAgent``, on the agent's own data; the service it drives is
``fsm_agent.drain.NodeDrain`` (the request, the announcement, the orderly stop).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from transitions import EventData

from fsm_agent.drain import ANNOUNCE_LEAVING_WAIT_S, NodeDrain
from fsm_agent.interrupts import Interrupts
from fsm_agent.node_check_steps import FIXED_WORLD_BACKENDS
from fsm_agent.states.facts import DrainRequested, fact_of
from fsm_agent.states.worker_state import WorkerState as S
from fsm_agent.worker import RestartDecision, WorkerGroup, WorkerSpec


class DrainSteps:
    """Drains and the leaving announcement, on the agent's own data (see ``fsm_agent.drain``)."""

    spec: WorkerSpec
    state: S
    _drains: NodeDrain
    _interrupts: Interrupts
    _worker_group: WorkerGroup
    _launcher: Any
    _decision: RestartDecision | None
    _decided_class: str | None
    _bounded_call: Callable[[str, Callable[[], Any]], Any]

    @property
    def hostname(self) -> str:
        raise NotImplementedError  # PluginSurface's

    def record_event(self, kind: str, **fields: Any) -> None:
        raise NotImplementedError  # PluginSurface's

    def _stop_workers(self, event: EventData | None = None) -> None:
        raise NotImplementedError  # ElasticAgent's

    def drains_whole_job(self, event: EventData | None = None) -> bool:
        """The drain ``_decide_on_drain`` took is job-wide (scope ``job``), not this node's alone."""
        return self._drains.whole_job

    def _decide_on_drain(self, event: EventData) -> None:
        """Take the drain request (``DrainRequested``: scope, source, by) as this run's drain."""
        fact = fact_of(event, DrainRequested)
        self._drains.take(fact.scope, fact.source, fact.by)
        # A drain decides nothing about restarts: no earlier verdict or failure class applies.
        self._decision, self._decided_class = None, None

    def _announce_drain(self, event: EventData | None = None) -> None:
        """Tell the round's other nodes of this drain before any worker stops (``NodeDrain.announce``),
        bounded as the exit-barrier check-in: a store host that is gone must not hold the drain."""
        if self._interrupts.abandoned_call is not None:  # the store client is still busy with it
            return
        self._drains.announce(self._worker_group, self.hostname, self._bounded_call)

    def _announce_leaving(self, event: EventData | None = None) -> None:
        """A stop signal (a preemption's SIGTERM) while workers run: tell the round's other nodes we
        leave before our workers stop (``NodeDrain.announce_leaving``), or theirs, failing with ours,
        count a restart. Not once ours all succeeded (nobody fails), nor on static (a fixed world)."""
        if self.state not in (S.HEALTHY, S.UNHEALTHY) or self._interrupts.abandoned_call is not None:
            return
        exits = self._launcher.poll()
        finished = len(exits) == self.spec.local_world_size and not any(exits.values())
        if finished or self.spec.rendezvous.backend in FIXED_WORLD_BACKENDS:
            return
        bounded = functools.partial(self._interrupts.call, interruptible=False, timeout=ANNOUNCE_LEAVING_WAIT_S)
        self._drains.announce_leaving(self._worker_group, bounded)

    def _drain_workers(self, event: EventData | None = None) -> None:
        """The orderly stop (``NodeDrain.stop_and_settle``: the checkpoint signal, up to
        ``timeout_s`` seconds, then ``_stop_workers``; a job-wide drain's announcer then waits for
        its peers to see it). A stop signal cuts both short. Records the ``drain`` event."""
        record = self._drains.stop_and_settle(self._worker_group, self._launcher, self._interrupts, self._stop_workers)
        if record is not None:
            self.record_event("drain", **record)
