"""Built-in rendezvous ``fsm``: fsm-agent's own rendezvous, planned inside the store of ``store.py`` beside it.

This package is the whole backend: the handler, its planner and its store. Nothing outside it
knows the protocol below.

No torch, no pickle, no polling, no sleeps. Beside the torch-compatible ``c10d`` backend; the two
cannot join one rendezvous (different stores and protocols).

Store
    One agent hosts the store server in a daemon thread: the agent that can bind the
    ``--rdzv-endpoint`` address (an address of its machine; the first to bind wins when several
    agents share a machine). ``is_host=1|0`` in ``--rdzv-conf`` overrides the inference.
    ``--rdzv-endpoint host:0`` (``--standalone``) binds a free port. The server listens on the
    endpoint address only (``bind_addr=0.0.0.0`` to listen everywhere). ``python -m
    fsm_agent.store`` runs the same server outside any agent (give the agents ``is_host=0``).

Protocol (O(1) requests and bytes per node per join, keep-alive and round completion)
    The store keeps one ``planner.Rendezvous`` per run_id in memory and applies the nodes'
    requests to it in its one serving thread, so each is atomic without any compare-and-set
    retry. A node sends ``rdzv_join`` (its address, rank hint, MASTER_PORT candidate, lease key)
    and the store answers when the round completes, with the node's rank, the world size and the
    master address; it answers ``closed`` at once when so, ``standby`` once to a hot spare. ``rdzv_watch``
    blocks until this node's round lost a participant, another round opened, or nodes waited
    ``last_call_timeout`` to join (each watcher is answered once per change of "some lost / some
    waiting", so K lost nodes cost O(N) replies, not O(N*K)). ``rdzv_leave``,
    ``rdzv_close``, ``rdzv_status`` and ``rdzv_linger`` do what they say. All times are the store
    server's monotonic clock, so clock skew between machines is harmless. Each round's store is
    ``PrefixStore("fsm_rdzv/<run_id>/round/<round>")``: every attempt starts with fresh keys.
    Before, every join read and compare-and-set one JSON document that grew with N: O(N^2).

Keep-alive
    Each node holds a lease key ``fsm_rdzv/<run_id>/alive/<node id>`` (ttl =
    ``keep_alive_interval * keep_alive_max_attempt`` = ``keep_alive_timeout``), created by its
    ``rdzv_join`` itself and deleted by the server as soon as the join's connection closes. One
    daemon thread keeps it on a second connection: while joining with a ``touch`` every
    ``keep_alive_interval``; in a round with its ``rdzv_watch``, which the store holds up to
    ``keep_alive_hold`` (10 s) and during which the store keeps the lease alive itself (the lease
    then lasts ``keep_alive_timeout`` past the watch's answer); a node's join answers its held
    watch of the round it leaves, so that its touches renew the lease while the next round
    forms, however long that takes. So an idle node makes one request
    per ``keep_alive_hold``, and holds two store connections and one thread whatever N (10k
    nodes: 20k sockets on the store host). Replies may take ``join_timeout``: a busy store is
    load, never a dropped lease. When the lease ends the store counts the node lost at once.
    Bounds: a killed agent is lost at once (its connection closes); a silent host (power off,
    partition: no FIN, no RST) once the store host's kernel gave up on the lease's connection
    (TCP keep-alive probes every ``keep_alive_interval``, whole seconds, and
    ``TCP_USER_TIMEOUT`` = ``keep_alive_timeout``: about 2 s by default, no request made); a hung
    agent (its process stopped, its host answering) within ``keep_alive_hold +
    keep_alive_timeout`` (11.5 s by default). Above ``KEEP_ALIVE_RATE * keep_alive_interval``
    nodes the interval grows with ``max_nodes``, above ``HELD_WATCH_RATE * keep_alive_hold`` the
    hold does, so the store renews at most ``KEEP_ALIVE_RATE`` leases per second while joining
    and ``HELD_WATCH_RATE`` watches per second while idle.

Watched keys
    The membership watch also carries keys of the round's store that the agent subscribed to
    (``PrefixStore.subscribe``: a peer's job-wide drain, ``fsm_agent.drain``): the store answers
    it when one changes, and the handler calls the subscriber on its keep-alive thread, so the
    agent asks the store for such a key only when it changed. A watch already held when a key is
    subscribed to is answered by setting the node's own ``fsm_rdzv/<run_id>/poke/<node id>``
    (ephemeral: it goes with the join's connection); later rounds' watches carry the key from
    their start.

Rounds
    A round completes when ``min <= n`` and one of: ``n == max``; no other live node can still
    join and either no participant is new to the run or ``last_call_timeout`` passed since the
    last join (the settle window); or ``rejoin_timeout`` passed since the last join (stragglers
    that are alive but do not come). A participant that calls ``next_rendezvous`` again opens the
    next round; live participants of the last round have reserved seats in it, so a new node
    never pushes one of them out. Ranks: by ``node_rank`` hint, then the store host, then join
    order (stable across rounds).

Hot spares
    A node that finds no seat (the round complete with ``max`` live participants, or every seat
    taken or reserved) waits as a standby (torch's redundancy list): the store answers its join
    ``standby`` once (the handler calls ``on_standby``: the agent logs "standby: the job has MAX
    nodes", records a ``standby`` event, ``/status`` shows it), then the node joins again with
    ``standby`` set and blocks, without ``join_timeout``. A standby never counts towards a round
    and never makes the participants re-rendezvous. When a participant is lost or leaves, the
    survivors' next round seats the standby (world size kept at ``max``, a membership change for
    them). Reserved seats of the last round's live participants come first, for at most
    ``rejoin_timeout`` (a slow survivor keeps its seat, a hung one loses it). When every
    participant has left the job is over: the store answers the standbys ``done`` and they
    leave with ``RendezvousNotNeeded`` (exit 0; torch ends its redundancy list on a closed
    rendezvous the same way).

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
from fsm_agent.plugins.rendezvous_fsm.params import (
    BACKEND,
    DEFAULT_PORT,
    FsmRendezvousParameters,
    FsmRendezvousSettings,
    parse_endpoint,
)
from fsm_agent.plugins.rendezvous_fsm.planner import Joined, Node, Rendezvous, rank_order

__all__ = [
    "BACKEND",
    "DEFAULT_PORT",
    "FsmRendezvousHandler",
    "FsmRendezvousParameters",
    "FsmRendezvousSettings",
    "Joined",
    "Node",
    "Rendezvous",
    "RendezvousInfo",
    "create_fsm_handler",
    "parse_endpoint",
    "rank_order",
]


@hookimpl
def fsm_agent_register_backends(registry):
    registry.add_rendezvous(
        BACKEND,
        create_fsm_handler,
        conf_keys=(*(f.name for f in fields(FsmRendezvousSettings)), "rank"),
        parameters=FsmRendezvousParameters.from_launch_config,  # torch-free
        node_rank="hint",
    )
