"""THE transition table of the worker-group statechart. Nothing else declares transitions.

Each row: trigger (a past-tense fact reported by a plugin, or the command ``start``/``restart``),
source state(s), destination, optional guard (``conditions``/``unless`` naming ``ElasticAgent``
predicates) and the agent steps that run on the way (``prepare``: before the guards are read, the
step that decides; ``before``: before the state changes, so a step that raises leaves the group in
its source state; ``after``: once the state has changed). A trigger's data (the facts the run loop
observed: which workers exited how, which hung, what changed) reaches every step as the keyword
arguments of ``EventData.kwargs``.
Callback names are ``ElasticAgent`` methods; ``tests/states`` checks that each one exists.
"""

from __future__ import annotations

from typing import Any

from fsm_agent.states.worker_state import WorkerState as S

#: One row of the table: ``dict(trigger=..., source=..., dest=..., ...)``, transitions' own format.
Row = dict[str, Any]

#: States that are left only through the rows below, never by themselves.
STATES = list(S)
INITIAL = S.INIT
TERMINAL = (S.SUCCEEDED, S.FAILED, S.UNKNOWN)
_LIVE = [S.INIT, S.HEALTHY, S.UNHEALTHY, S.STOPPED]
_RUNNING = [S.HEALTHY, S.UNHEALTHY]

#: The steps that turn a fact into a restart decision (``prepare``: transitions runs it for each row
#: it tries, before the guards; the step decides once per event). The guards ``has_restarts_left``
#: and ``excludes_this_node`` read the decision it made; every row of one trigger decides alike.
_DECIDE_ON_FAILURE = "_decide_on_failed_workers"
_DECIDE_ON_MEMBERSHIP = "_decide_on_membership_change"
#: The step that takes a drain request (its scope) for the guard ``drains_whole_job``.
_DECIDE_ON_DRAIN = "_decide_on_drain"

TRANSITIONS: list[Row] = [
    # -- starting: rendezvous, assign ranks, spawn the workers ----------------------------------
    dict(trigger="start", source=S.INIT, dest=S.HEALTHY, before=["_rendezvous", "_start_workers"]),
    dict(trigger="restart", source=S.STOPPED, dest=S.HEALTHY, before=["_backoff", "_rendezvous", "_start_workers"]),
    # -- while the workers run ------------------------------------------------------------------
    # Data: hung={local_rank: why}.
    dict(
        trigger="workers_hung", source=S.HEALTHY, dest=S.UNHEALTHY, before=["_record_unhealthy", "_dump_worker_stacks"]
    ),
    # A health-check plugin found the node unhealthy: its workers count as failed (class
    # health_check). Data: problem="what the plugins said".
    dict(trigger="health_check_failed", source=S.HEALTHY, dest=S.UNHEALTHY, before="_record_unhealthy"),
    # Data: return_values={global_rank: value} (callable entrypoints).
    dict(
        trigger="workers_succeeded",
        source=_RUNNING,
        dest=S.SUCCEEDED,
        before=["_record_return_values", "_exit_barrier"],
    ),
    # The restart policy decides: restart; take only this node out (it leaves without releasing
    # the exit barrier, so the others re-rendezvous without it); or give up the job.
    # Data from HEALTHY: exits={local_rank: exitcode} of the failed workers, exit_times={local_rank:
    # seconds since the epoch}; from UNHEALTHY (fired by the run loop itself) none: the workers that
    # made the group unhealthy are the failures.
    # Rows that end a cycle (workers_failed, membership_changed, workers_succeeded) may also carry
    # progress={"last_step": N, "checkpoint_step": M} (replay); else the step reads what the
    # workers reported (fsm_agent.progress).
    dict(
        trigger="workers_failed",
        source=_RUNNING,
        dest=S.STOPPED,
        prepare=_DECIDE_ON_FAILURE,
        conditions="has_restarts_left",
        before="_stop_workers",
        after="_count_restart",
    ),
    dict(
        trigger="workers_failed",
        source=_RUNNING,
        dest=S.FAILED,
        prepare=_DECIDE_ON_FAILURE,
        conditions="excludes_this_node",
        unless="has_restarts_left",
        before="_stop_workers",
    ),
    dict(
        trigger="workers_failed",
        source=_RUNNING,
        dest=S.FAILED,
        prepare=_DECIDE_ON_FAILURE,
        unless=["has_restarts_left", "excludes_this_node"],
        before=["_stop_workers", "_release_exit_barrier"],
    ),
    # A node lost or waiting to join: by default a restart that is not counted (torch semantics).
    # Data: change="node_lost" | "membership_change".
    dict(
        trigger="membership_changed",
        source=S.HEALTHY,
        dest=S.STOPPED,
        prepare=_DECIDE_ON_MEMBERSHIP,
        conditions="has_restarts_left",
        before="_stop_workers",
    ),
    dict(
        trigger="membership_changed",
        source=S.HEALTHY,
        dest=S.FAILED,
        prepare=_DECIDE_ON_MEMBERSHIP,
        conditions="excludes_this_node",
        unless="has_restarts_left",
        before="_stop_workers",
    ),
    dict(
        trigger="membership_changed",
        source=S.HEALTHY,
        dest=S.FAILED,
        prepare=_DECIDE_ON_MEMBERSHIP,
        unless=["has_restarts_left", "excludes_this_node"],
        before=["_stop_workers", "_release_exit_barrier"],
    ),
    # -- the ways out that are not the workers' doing -------------------------------------------
    # The rendezvous or its store failed: while joining, or while checking membership.
    # Data: error="what failed".
    dict(trigger="rendezvous_failed", source=_LIVE, dest=S.FAILED, before=["_record_error", "_stop_workers"]),
    # A node beyond max_nodes whose rendezvous closed: nothing to do, a clean exit.
    dict(trigger="rendezvous_not_needed", source=[S.INIT, S.STOPPED], dest=S.SUCCEEDED),
    dict(trigger="stop_requested", source=_LIVE, dest=S.FAILED, before=["_stop_workers", "_release_exit_barrier"]),
    # A drain (preemption notice: a --drain-signals signal, the --drain-file, POST /drain, or a
    # peer's job-wide drain): an orderly stop that is neither a failure nor a restart. The workers
    # get their checkpoint signal and --drain-timeout s to exit, then the agent exits with the
    # requeue code. Both scopes tell the other nodes first, through the rendezvous store. Scope
    # "node": this node alone leaves (as an excluded node: no exit-barrier check-in, it leaves its
    # round) and the others re-rendezvous without counting; scope "job": the others drain too.
    # Data: scope="node" | "job", source="signal" | "file" | "http" | "peer", by="what asked".
    # UNHEALTHY's workers are failed already: a request waits for its workers_failed.
    dict(
        trigger="drain_requested",
        source=[S.INIT, S.HEALTHY, S.STOPPED],
        dest=S.FAILED,
        prepare=_DECIDE_ON_DRAIN,
        conditions="drains_whole_job",
        before=["_announce_drain", "_drain_workers", "_release_exit_barrier"],
    ),
    dict(
        trigger="drain_requested",
        source=[S.INIT, S.HEALTHY, S.STOPPED],
        dest=S.FAILED,
        prepare=_DECIDE_ON_DRAIN,
        unless="drains_whole_job",
        before=["_announce_drain", "_drain_workers"],
    ),
    # An unexpected exception in the agent or a plugin: the agent can no longer vouch for its workers.
    # Data: error="what raised".
    dict(trigger="agent_errored", source=_LIVE, dest=S.UNKNOWN, before=["_record_error", "_stop_workers"]),
]

#: What the run loop does in a state that advances by itself (everything else waits for facts).
#: UNHEALTHY's workers are failed already (hung, or their node unhealthy): the loop reports it.
AUTO_TRIGGERS: dict[S, str] = {S.INIT: "start", S.UNHEALTHY: "workers_failed", S.STOPPED: "restart"}
