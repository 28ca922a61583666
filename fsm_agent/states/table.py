"""THE transition table of the worker-group statechart. Nothing else declares transitions.

Each row: trigger (a past-tense fact reported by a plugin, or the command ``start``/``restart``),
source state(s), destination, optional guard (``conditions``/``unless`` naming ``ElasticAgent``
predicates) and the agent steps that run on the way (``before``: before the state changes, so a
step that raises leaves the group in its source state; ``after``: once the state has changed).
Callback names are ``ElasticAgent`` methods; ``tests/states`` checks that each one exists.
"""

from __future__ import annotations

from fsm_agent.states.worker_state import WorkerState as S

#: States that are left only through the rows below, never by themselves.
STATES = list(S)
INITIAL = S.INIT
TERMINAL = (S.SUCCEEDED, S.FAILED, S.UNKNOWN)
_LIVE = [S.INIT, S.HEALTHY, S.UNHEALTHY, S.STOPPED]
_RUNNING = [S.HEALTHY, S.UNHEALTHY]

TRANSITIONS: list[dict] = [
    # -- starting: rendezvous, assign ranks, spawn the workers ----------------------------------
    dict(trigger="start", source=S.INIT, dest=S.HEALTHY,
         before=["_rendezvous", "_start_workers"]),
    dict(trigger="restart", source=S.STOPPED, dest=S.HEALTHY,
         before=["_backoff", "_rendezvous", "_start_workers"]),
    # -- while the workers run ------------------------------------------------------------------
    dict(trigger="workers_hung", source=S.HEALTHY, dest=S.UNHEALTHY,
         before="_dump_worker_stacks"),
    # A health-check plugin found the node unhealthy: its workers count as failed (class health_check).
    dict(trigger="health_check_failed", source=S.HEALTHY, dest=S.UNHEALTHY),
    dict(trigger="workers_succeeded", source=_RUNNING, dest=S.SUCCEEDED,
         before="_exit_barrier"),
    # The restart policy decides: restart; take only this node out (it leaves without releasing
    # the exit barrier, so the others re-rendezvous without it); or give up the job.
    dict(trigger="workers_failed", source=_RUNNING, dest=S.STOPPED,
         conditions="has_restarts_left", before="_stop_workers", after="_count_restart"),
    dict(trigger="workers_failed", source=_RUNNING, dest=S.FAILED,
         conditions="excludes_this_node", unless="has_restarts_left", before="_stop_workers"),
    dict(trigger="workers_failed", source=_RUNNING, dest=S.FAILED,
         unless=["has_restarts_left", "excludes_this_node"], before=["_stop_workers", "_release_exit_barrier"]),
    # A node lost or waiting to join: by default a restart that is not counted (torch semantics).
    dict(trigger="membership_changed", source=S.HEALTHY, dest=S.STOPPED,
         conditions="has_restarts_left", before="_stop_workers"),
    dict(trigger="membership_changed", source=S.HEALTHY, dest=S.FAILED,
         conditions="excludes_this_node", unless="has_restarts_left", before="_stop_workers"),
    dict(trigger="membership_changed", source=S.HEALTHY, dest=S.FAILED,
         unless=["has_restarts_left", "excludes_this_node"], before=["_stop_workers", "_release_exit_barrier"]),
    # -- the ways out that are not the workers' doing -------------------------------------------
    # The rendezvous or its store failed: while joining, or while checking membership.
    dict(trigger="rendezvous_failed", source=_LIVE, dest=S.FAILED,
         before="_stop_workers"),
    # A node beyond max_nodes whose rendezvous closed: nothing to do, a clean exit.
    dict(trigger="rendezvous_not_needed", source=[S.INIT, S.STOPPED], dest=S.SUCCEEDED),
    dict(trigger="stop_requested", source=_LIVE, dest=S.FAILED,
         before=["_stop_workers", "_release_exit_barrier"]),
    # An unexpected exception in the agent or a plugin: the agent can no longer vouch for its workers.
    dict(trigger="agent_errored", source=_LIVE, dest=S.UNKNOWN,
         before="_stop_workers"),
]

#: What the run loop does in a state that advances by itself (everything else waits for facts).
AUTO_TRIGGERS: dict[S, str] = {S.INIT: "start", S.STOPPED: "restart"}

#: Facts the run loop waits for while the workers run, mapped from the launcher's observations.
WAITING_STATES = tuple(_RUNNING)
