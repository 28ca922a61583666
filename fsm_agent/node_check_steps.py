"""The agent's steps of the node checks (``fsm_agent.node_checks``): a mixin of ``ElasticAgent``,
which sets every attribute declared here. The table names ``_check_nodes`` (a step of ``start``
and ``restart``, between ``_rendezvous`` and ``_start_workers``) and ``_record_node_check``
(``node_check_failed``, ``nodes_excluded``); the run loop fires the fact ``_check_nodes`` left
(``pending_node_check``) as its next trigger.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import attrs
from transitions import EventData

from fsm_agent import node_checks
from fsm_agent.errors import RendezvousFailed
from fsm_agent.hosts import advertised_address
from fsm_agent.states.facts import Fact, NodeCheckFailed, NodesExcluded
from fsm_agent.worker import HEALTH_CHECK_EXIT_CODE, RestartDecision, WorkerGroup, WorkerSpec

log = logging.getLogger(__name__)

#: Backends whose rounds cannot re-form without a node (a fixed world): an excluded node ends the job.
FIXED_WORLD_BACKENDS = ("static",)
#: Rounds in a row that may exclude nodes before every node gives up (a node that never reports,
#: e.g. one without the checks' flags, would be excluded from every re-formed round).
MAX_REFORMS = 3


class NodeCheckOutcome(BaseException):
    """Raised by ``_check_nodes`` when the round's decision excludes nodes: the ``start``/``restart``
    in progress stops before any worker starts (its source state stays), and the run loop fires
    ``fact`` next. A BaseException, like the agent's other interrupts, so no ``except Exception``
    on the way swallows it."""

    def __init__(self, fact: Fact) -> None:
        super().__init__(fact.trigger)
        self.fact = fact


@attrs.frozen
class NodeCheckSettings:
    """``--node-check-timeout`` (seconds every node's checks may take together) and
    ``--node-check-every-round`` (check again in each new round, not only the first)."""

    timeout_s: float = 30.0
    every_round: bool = True


class NodeCheckSteps:
    """The node-check steps, on the agent's own data."""

    spec: WorkerSpec
    plugin_manager: Any
    _hostname: str
    _worker_group: WorkerGroup
    _node_check_settings: NodeCheckSettings
    _node_check_rounds: int  # check rounds run since workers last started (a re-formed round counts)
    _node_checks_done: int  # check rounds run in all
    _pending_node_check: Fact | None
    _error: str | None
    _decision: RestartDecision | None

    def record_event(self, kind: str, **fields: Any) -> None:
        raise NotImplementedError  # PluginSurface's

    def put_metric(self, metric_group: str, metric_name: str, metric_value: float) -> None:
        raise NotImplementedError  # PluginSurface's

    def _init_node_checks(self) -> None:
        self._node_check_settings, self._node_check_rounds, self._node_checks_done = NodeCheckSettings(), 0, 0
        self._pending_node_check = None  # node_check_failed / nodes_excluded, for the next step

    def configure_node_checks(self, timeout_s: float = 30.0, every_round: bool = True) -> None:
        """Set ``--node-check-timeout`` (seconds) and ``--node-check-every-round``. Called by the
        ``node-checks`` plugin's ``fsm_agent_configure``; the checks themselves are the
        ``fsm_agent_node_check`` plugins registered (none: ``_check_nodes`` does nothing)."""
        self._node_check_settings = NodeCheckSettings(float(timeout_s), bool(every_round))

    def take_pending_node_check(self) -> Fact | None:
        """The fact the last ``_check_nodes`` left for the run loop (once), or None."""
        fact, self._pending_node_check = self._pending_node_check, None
        return fact

    def _check_nodes(self, event: EventData | None = None) -> None:
        """Run this node's checks (``fsm_agent_node_check``), exchange the results through the
        round's store and read the round's decision (``node_checks.exchange``); records a
        ``node_check`` event. Nothing when no check is registered, or after the first round
        without ``--node-check-every-round``.

        Every node of the job must run the same checks (the same flags, as torchrun's): a node
        with results waits for every other node's, up to the timeout, and excludes one that sent none.

        Raises:
            NodeCheckOutcome: the decision excludes this node (``NodeCheckFailed``), or others
                (``NodesExcluded``; with a fixed-world backend, ``NodeCheckFailed`` too).
        """
        hook = self.plugin_manager.hook.fsm_agent_node_check
        if not hook.get_hookimpls():
            return
        settings, group = self._node_check_settings, self._worker_group
        started = time.monotonic()
        check_round = node_checks.CheckRound(
            store=group.store,
            key_prefix=node_checks.KEY_PREFIX,
            group_rank=group.group_rank or 0,
            group_world_size=group.group_world_size or 1,
            node_addr=self.spec.local_addr or advertised_address(self.spec.rendezvous.endpoint) or "127.0.0.1",
            hostname=self._hostname,
            timeout_s=settings.timeout_s,
            deadline=started + settings.timeout_s,
            check_round=self._node_check_rounds,
        )
        # A node that checked before skips its own checks (--node-check-every-round false), never the
        # exchange: a new node of the round (a spare) checks, and every node reads one decision.
        # An observer that answers nothing (the test kit's hook recorder) starts no exchange.
        if not settings.every_round and self._node_checks_done > 0 and self._node_check_rounds == 0:
            results = [node_checks.CheckResult(check="skipped", ok=True, reason="checked in an earlier round")]
        else:
            results = node_checks.run_checks(hook, check_round)
        if not results:  # no check answered: none is switched on (every node of the job alike)
            return
        mine = {w.global_rank for w in group.workers}
        try:
            decision = node_checks.exchange(check_round, results, hosts_store=bool(mine & set(group.store_host_ranks)))
        except Exception as exc:  # no decision (group rank 0 gone or stalled, the store gone): no round
            raise RendezvousFailed(f"node checks: no decision for the round: {type(exc).__name__}: {exc}") from None
        self._node_check_rounds += 1
        self._node_checks_done += 1
        seconds = time.monotonic() - started
        self.record_event(
            "node_check",
            check_round=check_round.check_round,
            seconds=round(seconds, 6),
            results=[r.record() for r in results],
            excluded={str(rank): why for rank, why in decision.excluded.items()},
            hosts={str(rank): host for rank, host in decision.hosts.items()},  # "hostname (address)"
        )
        self.put_metric("fsm_agent", "node_check.seconds", seconds)
        self.put_metric("fsm_agent", "node_check.excluded", float(len(decision.excluded)))
        if not decision.excluded:
            self._node_check_rounds = 0
            return
        raise NodeCheckOutcome(self._outcome_of(decision, check_round.group_rank))

    def _outcome_of(self, decision: node_checks.Decision, mine: int) -> Fact:
        """The fact a decision that excludes nodes makes here: ``NodeCheckFailed`` when this node
        is excluded, or when the round cannot re-form without the excluded ones (a fixed-world
        backend, the store's host excluded, ``MAX_REFORMS`` re-formed rounds in a row excluding
        again); else ``NodesExcluded``."""
        named = {rank: f"{decision.hosts.get(rank, '?')}: {why}" for rank, why in decision.excluded.items()}
        for rank, why in sorted(named.items()):
            log.warning("[%s] node check: group rank %s excluded from the round (%s)", self.spec.role, rank, why)
        if mine in named:
            return NodeCheckFailed(reason=named[mine], decision=decision.record())
        others = "; ".join(f"group rank {rank} ({why})" for rank, why in sorted(named.items()))
        cannot = None
        if self.spec.rendezvous.backend in FIXED_WORLD_BACKENDS:
            cannot = f"the {self.spec.rendezvous.backend} rendezvous cannot re-form the round without it"
        elif decision.store_host in named:
            cannot = f"group rank {decision.store_host} hosts the rendezvous store: the round cannot re-form without it"
        elif self._node_check_rounds >= MAX_REFORMS:
            cannot = f"{self._node_check_rounds} rounds in a row excluded nodes: giving up re-forming"
        if cannot is not None:
            return NodeCheckFailed(reason=f"{others}: {cannot}", decision=decision.record())
        return NodesExcluded(excluded={str(rank): why for rank, why in named.items()})

    def _record_node_check(self, event: EventData) -> None:
        """``node_check_failed``: this node leaves the job as an excluded node does (its own
        decision: ``exclude_node``, exit code 69 as a failed health check, EX_UNAVAILABLE: requeue
        on other nodes; it leaves the rendezvous alone, so a hot spare takes its seat); the reason
        is the run's error (class ``node_check``). ``nodes_excluded``: nothing to keep; the next
        start/restart re-forms the round."""
        fact = event.kwargs.get("fact")
        if isinstance(fact, NodeCheckFailed):
            why = f"node check failed ({node_checks.NODE_CHECK}): {fact.reason}"
            self._error = why
            self._decision = RestartDecision(False, reason=why, exclude_node=True, exit_code=HEALTH_CHECK_EXIT_CODE)
            log.error("[%s] %s: this node leaves the job", self.spec.role, why)
