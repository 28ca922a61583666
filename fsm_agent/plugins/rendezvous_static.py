"""Built-in rendezvous ``static``: a fixed world of ``--nnodes`` agents at ``--master-addr/--master-port``.

Built on torch's ``StaticTCPRendezvous``: the TCPStore at master_addr:master_port, hosted by the
agent with group rank ``--node-rank`` 0, is the agents' rendezvous store. Unlike torchrun, it is
not the workers' store: each round, node rank 0 publishes a free port of its own host under the
round's prefix (``<run_id>/round_<N>/``, torch's ``RendezvousStoreInfo.build``, as its c10d handler
does with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), workers see ``MASTER_ADDR`` = ``--master-addr``
and ``MASTER_PORT`` = that port with ``TORCHELASTIC_USE_AGENT_STORE=False``, and the workers' rank 0
hosts a new store for each ``init_process_group``. A store shared with the agents outlives the
workers' process groups: a restarted group, or a worker that destroys and re-creates its process
group, would find the earlier group's keys (pytorch/pytorch#135712, #114585). The wait for all
nodes is ``rdzv_configs["timeout"]`` seconds, 900 by default (torchrun's: its ``LaunchConfig``
default; torch's handler alone: 600).

Also unlike torch, an agent never joins another job's store (two jobs on one ``--master-port``,
pytorch's 29500 by default): each agent claims its node rank under ``fsm_agent/static/``
with its run id, ``--nnodes`` and a token of its own; a node rank already claimed by another
agent, or a node rank 0 of another run id or ``--nnodes``, stops the agent with one line naming
both. The entrypoint is not compared: torchrun lets nodes run different programs or paths.
And a node other than rank 0 keeps one connection to the store, blocked in a wait for rank 0's
"finished" key (``fsm_agent.finished_nodes``): when the store's host closes it before its
workers all succeeded (its agent ended), ``membership_fd`` becomes readable and
``num_nodes_lost`` raises ``RendezvousFailed``, so the agent stops its workers with one line
instead of asking a gone store again and again. A host that finished first (its workers
succeeded, its agent in or past its exit barrier) is no loss: this node's workers run on and
its exit barrier says the store host left.
"""

from __future__ import annotations

import errno
import json
import os
import select
import socket
import threading
import uuid

from fsm_agent.errors import ConfigError, RendezvousFailed
from fsm_agent.finished_nodes import finished_key
from fsm_agent.plugins import hookimpl
from fsm_agent.plugins.registry import require_positive_seconds, torch_parameters
from fsm_agent.store_looks import look_interval

#: Seconds the static rendezvous waits for every node (torch's ``LaunchConfig`` default, so torchrun's).
DEFAULT_TIMEOUT_S = 900
#: Seconds between a non-host node's looks whether node rank 0 finished (one ``check`` each): at
#: least this, more in a large job (``fsm_agent.store_looks``: the job's looks stay 1,000 a second).
HOST_FINISHED_POLL_S = 0.5
#: ... and at most this: a host leaves only once every node checked in at its exit barrier (or its
#: ``--exit-barrier-timeout`` passed), so a late look still sees "finished" before the store goes.
HOST_FINISHED_LOOK_MAX_S = 10.0
#: Outside every run id's prefix, so that an agent of another job can read it; kept between rounds.
_CLAIMS = "fsm_agent/static/node_"


class StaticRendezvous:
    """torch's StaticTCPRendezvous, one store prefix per round, the workers' keys cleared between rounds."""

    #: torch's ``RendezvousHandler.use_agent_store``: the workers' rank 0 hosts their own store.
    use_agent_store = False

    def __init__(self, handler):
        self._handler = handler
        self._round = 0
        self._token = uuid.uuid4().hex  # this agent's, to tell its own claim from another agent's
        #: Readable end of a pipe the watch thread writes to when the store's host is gone.
        self._host_gone_r: int | None = None
        self._host_gone_reason = ""
        self._watch_generation = 0

    def next_rendezvous(self):
        """torch's round, prefixed; raises RendezvousTimeoutError when the nodes do not all come.

        torch's StaticTCPRendezvous lets the store's ``DistStoreError`` ("Timed out after N seconds
        waiting for clients") escape, which is no rendezvous error: the agent would call it an
        agent error. Here it becomes ``RendezvousTimeoutError`` naming the endpoint.
        """
        from torch.distributed import DistStoreError, PrefixStore
        from torch.distributed.elastic.rendezvous.api import (
            RendezvousInfo,
            RendezvousStoreInfo,
            RendezvousTimeoutError,
        )

        try:
            info = self._handler.next_rendezvous()
            if self._round == 0:
                self._claim_node_rank(info.rank)
            store = PrefixStore(f"round_{self._round}", info.store)
            self._watch_store(info.rank, info.world_size, f"round_{self._round}")
            # node rank 0 is the host at --master-addr: the workers' store goes on a free port there
            bootstrap = RendezvousStoreInfo.build(info.rank, store, local_addr=self._handler.master_addr)
            self._round += 1
        except DistStoreError as exc:
            handler = self._handler
            raise RendezvousTimeoutError(
                f"static rendezvous at {self._where()}: not all {getattr(handler, 'world_size', '?')} nodes came "
                f"within {self._timeout_s():g} s: {str(exc).splitlines()[0]}"
            ) from None
        return RendezvousInfo(store, info.rank, info.world_size, bootstrap)

    @property
    def hosts_store(self) -> bool:
        """Node rank 0 hosts the TCPStore at --master-addr:--master-port (torch's ``is_host``)."""
        return getattr(self._handler, "rank", None) == 0

    def _claim_node_rank(self, rank: int) -> None:
        """Claim ``rank`` in the store with this job's identity (run id, ``--nnodes``).

        Raises:
            RendezvousFailed: node rank 0 there has another run id or ``--nnodes`` (another job's
                store), or another agent already claimed ``rank`` (another job with the same
                identity, or two nodes given the same ``--node-rank``).
        """
        handler = self._handler
        raw = handler._store
        mine = {"run_id": handler.run_id, "nnodes": handler.world_size, "token": self._token}
        if rank != 0 and raw.check([f"{_CLAIMS}0"]):
            self._refuse_other_job(json.loads(raw.get(f"{_CLAIMS}0")), mine)
        claim = json.dumps(mine, sort_keys=True)
        held = raw.compare_set(f"{_CLAIMS}{rank}", "", claim)
        held = held.decode() if isinstance(held, bytes) else held
        if held == claim:
            return
        other = json.loads(held)
        self._refuse_other_job(other, mine)
        raise RendezvousFailed(
            f"static rendezvous at {self._where()}: node rank {rank} is already taken by another agent of "
            f"run id {other['run_id']!r} ({other['nnodes']} nodes): another job uses this --master-port "
            f"(give each job its own --master-port and --rdzv-id), or two nodes were given --node-rank {rank}"
        )

    def _refuse_other_job(self, other: dict, mine: dict) -> None:
        if (other["run_id"], other["nnodes"]) != (mine["run_id"], mine["nnodes"]):
            raise RendezvousFailed(
                f"static rendezvous at {self._where()}: the store there belongs to another job (run id "
                f"{other['run_id']!r}, {other['nnodes']} nodes), not to this node's (run id {mine['run_id']!r}, "
                f"{mine['nnodes']} nodes): give each job its own --master-port, or the same --rdzv-id and "
                f"--nnodes to every node of one job"
            )

    def _watch_store(self, rank: int, world_size: int, round_prefix: str) -> None:
        """Nodes other than rank 0: a thread that watches an idle TCP connection to the store and,
        every ``HOST_FINISHED_POLL_S`` or more (``look_interval``), whether rank 0 finished this round; it writes to
        ``membership_fd`` if the connection closes first (the host ended before its workers
        succeeded). An idle socket, not a blocked store wait: torch prints a C++ stack for a
        wait that the host's leaving breaks."""
        if rank == 0:
            return
        from torch.distributed import PrefixStore

        self._watch_generation += 1
        generation = self._watch_generation
        every_s = look_interval(world_size, HOST_FINISHED_POLL_S, HOST_FINISHED_LOOK_MAX_S)
        handler = self._handler
        try:
            idle = socket.create_connection((handler.master_addr, handler.master_port), timeout=10)
        except OSError:  # the store stopped meanwhile: the workers' first store call reports it
            return
        # A connection of its own: the agent's stays free. The keys: as in torch's handler, then the round.
        store = PrefixStore(round_prefix, PrefixStore(handler.run_id, handler._store.clone()))
        if self._host_gone_r is None:
            self._host_gone_r, self._host_gone_w = os.pipe()

        def watch() -> None:
            with idle:
                while generation == self._watch_generation:
                    readable, _, _ = select.select([idle], [], [], every_s)
                    if readable and not _still_open(idle):
                        if generation == self._watch_generation:
                            self._host_gone_reason = "closed the connection (its agent ended)"
                            os.write(self._host_gone_w, b"x")
                        return
                    try:
                        if store.check([finished_key(0)]):
                            return  # rank 0 finished: its store may go now, as torchrun's would
                    except Exception:
                        continue  # the host is leaving: the idle socket tells which way

        threading.Thread(target=watch, name="fsm-agent-static-store-watch", daemon=True).start()

    def membership_fd(self) -> int | None:
        """Readable once the store's host ended before its workers succeeded (fsm-agent's optional backend API)."""
        return self._host_gone_r

    def num_nodes_lost(self) -> int:
        """0 while the store is there (a static world loses no node it could go on without).

        Raises:
            RendezvousFailed: the store's host closed this node's connection (its agent ended)
                before its workers succeeded.
        """
        if not self._host_gone_reason:
            return 0
        raise RendezvousFailed(
            f"static rendezvous: the store at {self._where()}, hosted by node rank 0, {self._host_gone_reason}: "
            f"this node stops its workers; restart the job (every node)"
        )

    def _where(self) -> str:
        return f"{getattr(self._handler, 'master_addr', '?')}:{getattr(self._handler, 'master_port', '?')}"

    def _timeout_s(self) -> float:
        timeout = getattr(self._handler, "timeout", None)
        return timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(DEFAULT_TIMEOUT_S)

    def __getattr__(self, name):
        return getattr(self._handler, name)


def create_static_handler(params):
    """``RendezvousParameters -> RendezvousHandler`` for backend ``static`` (timeout 900 s unless set).

    Raises:
        ConfigError: ``timeout`` is not a whole number of seconds > 0; this node has rank 0, which hosts the store, and the port is already in use
            (torch's TCPStore would fail later with a 40-line ``DistNetworkError: EADDRINUSE``).
    """
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import create_rdzv_handler

    params.config.setdefault("timeout", DEFAULT_TIMEOUT_S)
    require_positive_seconds(params.config, {"timeout": DEFAULT_TIMEOUT_S})
    handler = create_rdzv_handler(params)
    if handler.rank == 0 and handler.master_port:
        _require_free_port(handler.master_port)
    return StaticRendezvous(handler)


def _require_free_port(port: int) -> None:
    """Raise ConfigError if something listens on TCP ``port`` of this host (any interface, as TCPStore binds)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore: a TIME_WAIT port is free
    try:
        probe.bind(("", port))
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        raise ConfigError(
            f"static rendezvous: port {port} (--master-port) is already in use on this host, "
            f"where node rank 0 hosts the store: choose a free --master-port, or stop what "
            f"listens on {port}"
        ) from None
    finally:
        probe.close()


@hookimpl
def fsm_agent_register_backends(registry):
    # torch's StaticTCPRendezvous: ``rank`` (--node-rank) and ``timeout`` (seconds, default 600).
    registry.add_rendezvous(
        "static",
        create_static_handler,
        conf_keys=("rank", "timeout"),
        parameters=static_parameters,
        node_rank="rank",
        host_port_endpoint=True,
    )


def static_parameters(config):
    """torch's ``RendezvousParameters``, this node's rank from ``--node-rank`` unless ``rank`` is set."""
    return torch_parameters(config, rank=config.node_rank)


def _still_open(sock: socket.socket) -> bool:
    """False once the peer closed or reset ``sock`` (a store never writes to an idle connection)."""
    try:
        return bool(sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except BlockingIOError:
        return True
    except OSError:
        return False
