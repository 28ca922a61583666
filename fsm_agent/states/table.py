"""THE transition table of the worker-group statechart. Nothing else declares transitions.

Each row: trigger (a past-tense fact reported by a plugin, or the command ``start``/``restart``),
source state(s), destination, optional guard (``conditions``/``unless`` naming ``ElasticAgent``
predicates) and the agent steps that run on the way (``before``: before the state changes, so a
step that raises leaves the group in its source state; ``after``: once the state has changed).
``DECIDERS`` names the one step per trigger that decides (transitions' ``prepare_event``: once per
event, before any row's guards are read). A trigger's data is its fact (``fsm_agent.states.facts``:
which workers exited how, which hung, what changed), which reaches every step as
``event.kwargs["fact"]``.
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

#: ``{trigger: the step that decides}``, run once per event before any row's guards are read
#: (transitions' ``prepare_event``). The restart policy's decision is what the guards
#: ``has_restarts_left`` and ``excludes_this_node`` read; the drain's scope, ``drains_whole_job``.
DECIDERS: dict[str, str] = {
    "workers_failed": "_decide_on_failed_workers",
    "inprocess_failed": "_decide_on_inprocess_failure",
    "membership_changed": "_decide_on_membership_change",
    "drain_requested": "_decide_on_drain",
}

TRANSITIONS: list[Row] = [
    # -- starting: rendezvous, assign ranks, check the nodes, spawn the workers -----------------
    dict(trigger="start", source=S.INIT, dest=S.HEALTHY, before=["_rendezvous", "_check_nodes", "_start_workers"]),
    dict(
        trigger="restart",
        source=S.STOPPED,
        dest=S.HEALTHY,
        before=["_backoff", "_rendezvous", "_check_nodes", "_start_workers"],
    ),
    # Node checks (fsm_agent.node_checks), before any worker starts: this node failed one, or a
    # peer's check blamed it: it leaves the job (class node_check). Fact: NodeCheckFailed.
    dict(trigger="node_check_failed", source=[S.INIT, S.STOPPED], dest=S.FAILED, before="_record_node_check"),
    # Other nodes failed theirs and leave: the next start/restart re-forms the round without them
    # (a hot spare takes a seat). Fact: NodesExcluded.
    dict(trigger="nodes_excluded", source=S.INIT, dest=S.INIT, before="_record_node_check"),
    dict(trigger="nodes_excluded", source=S.STOPPED, dest=S.STOPPED, before="_record_node_check"),
    # -- while the workers run ------------------------------------------------------------------
    # Fact: WorkersHung.
    dict(
        trigger="workers_hung", source=S.HEALTHY, dest=S.UNHEALTHY, before=["_record_unhealthy", "_dump_worker_stacks"]
    ),
    # A health-check plugin found the node unhealthy: its workers count as failed (class
    # health_check). Fact: HealthCheckFailed.
    dict(trigger="health_check_failed", source=S.HEALTHY, dest=S.UNHEALTHY, before="_record_unhealthy"),
    # Fact: WorkersSucceeded (the callable entrypoints' return values).
    dict(
        trigger="workers_succeeded",
        source=_RUNNING,
        dest=S.SUCCEEDED,
        before=["_record_return_values", "_exit_barrier"],
    ),
    # The restart policy decides: restart; take only this node out (it leaves without releasing
    # the exit barrier, so the others re-rendezvous without it); or give up the job.
    # Fact: WorkersFailed, its exits from HEALTHY; from UNHEALTHY (fired by the run loop itself)
    # none: the workers that made the group unhealthy are the failures. The facts of the rows that
    # end a cycle (WorkersFailed, MembershipChanged, WorkersSucceeded) may carry the attempt's
    # progress (replay); else the step reads what the workers reported (fsm_agent.progress).
    # In-process restart (--restart-mode inprocess, fsm_agent.inprocess): the decider found every
    # rank on the API and no recovery running: only the failed workers' processes are replaced, the
    # survivors (on every node) are interrupted and re-form their process group. Not counted
    # against max_restarts (budget: --restart-budgets inprocess=N).
    dict(
        trigger="workers_failed",
        source=S.HEALTHY,
        dest=S.HEALTHY,
        conditions="recovers_in_process",
        before="_replace_failed_workers",
    ),
    # The other decisions, from HEALTHY (when not in process) and UNHEALTHY alike:
    *(
        row
        for source, not_in_process in ((S.HEALTHY, ["recovers_in_process"]), (S.UNHEALTHY, []))
        for row in (
            dict(
                trigger="workers_failed",
                source=source,
                dest=S.STOPPED,
                conditions="has_restarts_left",
                unless=not_in_process,
                before="_stop_workers",
                after="_count_restart",
            ),
            dict(
                trigger="workers_failed",
                source=source,
                dest=S.FAILED,
                conditions="excludes_this_node",
                unless=["has_restarts_left", *not_in_process],
                before="_stop_workers",
            ),
            # Giving the job up decides the job's verdict (fsm_agent.job_verdict): the root cause
            # among every node's failed ranks, published so that the other nodes end with the same one.
            dict(
                trigger="workers_failed",
                source=source,
                dest=S.FAILED,
                unless=["has_restarts_left", "excludes_this_node", *not_in_process],
                before=["_stop_workers", "_decide_job_verdict", "_release_exit_barrier"],
            ),
        )
    ),
    # The in-process recovery this node began completed: every rank arrived at its generation's
    # barrier. Fact: InProcessRecovered (generation, replaced ranks, each phase's seconds).
    dict(trigger="inprocess_recovered", source=S.HEALTHY, dest=S.HEALTHY, before="_record_inprocess_recovery"),
    # It did not within --inprocess-timeout (a rank that never reached the barrier, e.g. hung in a
    # collective): the whole group restarts as for any failure, class inprocess_failed, or gives up.
    # Fact: InProcessFailed.
    dict(
        trigger="inprocess_failed",
        source=S.HEALTHY,
        dest=S.STOPPED,
        conditions="has_restarts_left",
        before="_stop_workers",
        after="_count_restart",
    ),
    dict(
        trigger="inprocess_failed",
        source=S.HEALTHY,
        dest=S.FAILED,
        unless="has_restarts_left",
        before=["_stop_workers", "_decide_job_verdict", "_release_exit_barrier"],
    ),
    # Another node gave the job up: end with its verdict, restarts left or not. Fact: JobFailed.
    dict(
        trigger="job_failed",
        source=_RUNNING,
        dest=S.FAILED,
        before=["_adopt_job_verdict", "_stop_workers", "_release_exit_barrier"],
    ),
    # A node lost or waiting to join: by default a restart that is not counted (torch semantics).
    # Fact: MembershipChanged (change: node_lost or membership_change).
    dict(
        trigger="membership_changed",
        source=S.HEALTHY,
        dest=S.STOPPED,
        conditions="has_restarts_left",
        before="_stop_workers",
    ),
    dict(
        trigger="membership_changed",
        source=S.HEALTHY,
        dest=S.FAILED,
        conditions="excludes_this_node",
        unless="has_restarts_left",
        before="_stop_workers",
    ),
    dict(
        trigger="membership_changed",
        source=S.HEALTHY,
        dest=S.FAILED,
        unless=["has_restarts_left", "excludes_this_node"],
        before=["_stop_workers", "_decide_job_verdict", "_release_exit_barrier"],
    ),
    # -- the ways out that are not the workers' doing -------------------------------------------
    # The rendezvous or its store failed: while joining, or while checking membership.
    # Fact: RendezvousFailed (error: what failed).
    # From HEALTHY/UNHEALTHY, a store that became unreachable went with the node hosting it: the
    # verdict names that node's ranks (each survivor decides alone, the same).
    dict(
        trigger="rendezvous_failed",
        source=_LIVE,
        dest=S.FAILED,
        before=["_record_error", "_stop_workers", "_name_the_lost_store_host"],
    ),
    # A node beyond max_nodes whose rendezvous closed: nothing to do, a clean exit.
    dict(trigger="rendezvous_not_needed", source=[S.INIT, S.STOPPED], dest=S.SUCCEEDED),
    # A stop signal (--signals-to-handle; a preemption's SIGTERM): this node leaves alone. It tells
    # the round first (as a node drain does), so that the others, whose workers fail as soon as
    # its workers stop, re-rendezvous without counting a restart. Fact: StopRequested.
    dict(
        trigger="stop_requested",
        source=_LIVE,
        dest=S.FAILED,
        before=["_announce_leaving", "_stop_workers", "_release_exit_barrier"],
    ),
    # A drain (preemption notice: a --drain-signals signal, the --drain-file, POST /drain, or a
    # peer's job-wide drain): an orderly stop that is neither a failure nor a restart. The workers
    # get their checkpoint signal and --drain-timeout s to exit, then the agent exits with the
    # requeue code. Both scopes tell the other nodes first, through the rendezvous store. Scope
    # "node": this node alone leaves (as an excluded node: no exit-barrier check-in, it leaves its
    # round) and the others re-rendezvous without counting; scope "job": the others drain too.
    # Fact: DrainRequested (scope, source, by).
    # UNHEALTHY's workers are failed already: a request waits for its workers_failed.
    dict(
        trigger="drain_requested",
        source=[S.INIT, S.HEALTHY, S.STOPPED],
        dest=S.FAILED,
        conditions="drains_whole_job",
        before=["_announce_drain", "_drain_workers", "_release_exit_barrier"],
    ),
    dict(
        trigger="drain_requested",
        source=[S.INIT, S.HEALTHY, S.STOPPED],
        dest=S.FAILED,
        unless="drains_whole_job",
        before=["_announce_drain", "_drain_workers"],
    ),
    # An unexpected exception in the agent or a plugin: the agent can no longer vouch for its workers.
    # Fact: AgentErrored (error: what raised).
    dict(trigger="agent_errored", source=_LIVE, dest=S.UNKNOWN, before=["_record_error", "_stop_workers"]),
]

#: What the run loop does in a state that advances by itself (everything else waits for facts).
#: UNHEALTHY's workers are failed already (hung, or their node unhealthy): the loop reports it.
AUTO_TRIGGERS: dict[S, str] = {S.INIT: "start", S.UNHEALTHY: "workers_failed", S.STOPPED: "restart"}
