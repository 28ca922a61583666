"""Built-in rendezvous ``fsm``: fsm-agent's own rendezvous, on the JSON store of ``store.py`` beside it.

This package is the whole backend: the handler, its planner and its store. Nothing outside it
knows the state format below.

No torch, no pickle, no sleeps. Beside the torch-compatible ``c10d`` backend; the two cannot join
one rendezvous (different stores and state formats).

Store
    One agent hosts the store server in a daemon thread: the agent that can bind the
    ``--rdzv-endpoint`` address (an address of its machine; the first to bind wins when several
    agents share a machine). ``is_host=1|0`` in ``--rdzv-conf`` overrides the inference.
    ``--rdzv-endpoint host:0`` (``--standalone``) binds a free port. The server listens on the
    endpoint address only (``bind_addr=0.0.0.0`` to listen everywhere). ``python -m
    fsm_agent.store`` runs the same server outside any agent (give the agents ``is_host=0``).

State (one JSON document at ``fsm_rdzv/<run_id>/state``, changed only by compare_set)::

    {"schema": 1, "round": 3, "complete": true, "closed": false, "seq": 5,
     "nodes": {"<node id>": {"addr": "n1", "host": true, "node_rank": null, "seq": 0,
                             "port": 41234, "rounds": 2}},
     "participants": {"<node id>": 0},      # this round; ranks once complete, else null
     "previous": ["<node id>", ...],         # live participants of the last completed round
     "wait_list": {"<node id>": 12.5},       # server time the node started waiting
     "last_join": 12.1,                      # server time of the last join into this round
     "master": {"addr": "n1", "port": 41234}}

    ``nodes`` are the live nodes that joined this run; a node id is ``<addr>_<pid>_<random>``.
    All times are the store server's monotonic clock, so clock skew between machines is harmless.
    ``fsm_rdzv/<run_id>/event`` is bumped when a round opens or completes or the rendezvous
    closes: nodes waiting in ``next_rendezvous`` watch it (and the leases, and their own
    deadline), not the state, so N joins cause O(N) wake-ups in all, not O(N^2). Each round's store is
    ``PrefixStore("fsm_rdzv/<run_id>/round/<round>")``: every attempt starts with fresh keys.

Keep-alive
    Each node holds a lease key ``fsm_rdzv/<run_id>/alive/<node id>`` (ttl =
    ``keep_alive_interval * keep_alive_max_attempt``, renewed every ``keep_alive_interval`` by a
    daemon thread, and deleted by the server as soon as that thread's connection closes). When it
    expires or is deleted the server wakes every watcher: a killed agent is seen at once, a
    silent host (power off, partition) within ``keep_alive_timeout`` = 1.5 s by default.

Rounds
    A round completes when ``min <= n`` and one of: ``n == max``; no other live node can still
    join and either no participant is new to the run or ``last_call_timeout`` passed since the
    last join (the settle window); or ``rejoin_timeout`` passed since the last join (stragglers
    that are alive but do not come). A participant that calls ``next_rendezvous`` again opens the
    next round; live participants of the last round have reserved seats in it, so a new node
    never pushes one of them out. Ranks: by ``node_rank`` hint, then the store host, then join
    order (stable across rounds). A node that finds the round complete with ``max`` live
    participants leaves at once with ``RendezvousNotNeeded``.

Membership
    ``membership_fd()`` becomes readable (and stays so until the next ``next_rendezvous``) when a
    participant of this node's round is lost or left (``num_nodes_lost()``), when another node
    opened the next round, or when nodes have waited ``last_call_timeout`` to join a round that
    has room (``num_nodes_waiting()``). New nodes joining one by one within the settle window
    cause one restart.

``shutdown()`` leaves: it never closes the rendezvous for the others. The host's shutdown waits
up to ``linger_timeout`` for the other nodes to leave, since the store goes with its process.
"""

from __future__ import annotations

from dataclasses import fields

from fsm_agent.plugins import hookimpl
from fsm_agent.plugins.rendezvous_fsm.handler import FsmRendezvousHandler, RendezvousInfo, create_fsm_handler
from fsm_agent.plugins.rendezvous_fsm.params import (BACKEND, DEFAULT_PORT, FsmRendezvousParameters,
                                                     FsmRendezvousSettings, parse_endpoint)
from fsm_agent.plugins.rendezvous_fsm.planner import SCHEMA, fresh_state, plan, rank_order

__all__ = ["BACKEND", "DEFAULT_PORT", "SCHEMA", "FsmRendezvousHandler", "FsmRendezvousParameters",
           "FsmRendezvousSettings", "RendezvousInfo", "create_fsm_handler", "fresh_state", "parse_endpoint",
           "plan", "rank_order"]


@hookimpl
def fsm_agent_register_backends(registry):
    registry.add_rendezvous(BACKEND, create_fsm_handler,
                            conf_keys=(*(f.name for f in fields(FsmRendezvousSettings)), "rank"),
                            parameters=FsmRendezvousParameters.from_launch_config,  # torch-free
                            node_rank="hint")
