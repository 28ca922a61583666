"""Built-in rendezvous ``static``: a fixed world of ``--nnodes`` agents at ``--master-addr/--master-port``.

Built on torch's ``StaticTCPRendezvous``: the TCPStore at master_addr:master_port, hosted by the
agent with group rank ``--node-rank`` 0, is the agents' rendezvous store and, as under torchrun,
the workers' store: workers see ``MASTER_ADDR``/``MASTER_PORT`` = ``--master-addr``/``--master-port``
and ``TORCHELASTIC_USE_AGENT_STORE=True`` (clusters that open one port between nodes keep working).

Unlike torch, a restarted group never sees the previous attempt's keys (pytorch/pytorch#135712):
from the second round on, every agent first meets the others in a barrier (so every node's
workers have stopped), then the group-rank-0 agent deletes every key the workers wrote, and
only then does any agent go on to start workers. The agents' own keys live under
``<run_id>/round_<N>/`` and are kept. The wait for all nodes is ``rdzv_configs["timeout"]``
seconds, 900 by default (torchrun's: its ``LaunchConfig`` default; torch's handler alone: 600).
"""

from __future__ import annotations

import errno
import socket

from fsm_agent.errors import ConfigError
from fsm_agent.plugins.registry import require_positive_seconds
from fsm_agent.plugins import hookimpl
from fsm_agent.plugins.registry import torch_parameters

#: Seconds the static rendezvous waits for every node (torch's ``LaunchConfig`` default, so torchrun's).
DEFAULT_TIMEOUT_S = 900
_ARRIVED, _CLEARED = "fsm_agent/arrived", "fsm_agent/workers_keys_cleared"


class StaticRendezvous:
    """torch's StaticTCPRendezvous, one store prefix per round, the workers' keys cleared between rounds."""

    #: The workers use the rendezvous store itself (torchrun's static behaviour), no second store.
    agent_hosts_worker_store = False
    use_agent_store = True

    def __init__(self, handler):
        self._handler = handler
        self._round = 0

    def next_rendezvous(self):
        """torch's round, prefixed; raises RendezvousTimeoutError when the nodes do not all come.

        torch's StaticTCPRendezvous lets the store's ``DistStoreError`` ("Timed out after N seconds
        waiting for clients") escape, which is no rendezvous error: the agent would call it an
        agent error. Here it becomes ``RendezvousTimeoutError`` naming the endpoint.
        """
        from torch.distributed import DistStoreError, PrefixStore
        from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousTimeoutError

        try:
            info = self._handler.next_rendezvous()
            store = PrefixStore(f"round_{self._round}", info.store)
            if self._round > 0:
                self._clear_workers_keys(store, info.rank, info.world_size)
            self._round += 1
        except DistStoreError as exc:
            handler = self._handler
            where = f"{getattr(handler, 'master_addr', '?')}:{getattr(handler, 'master_port', '?')}"
            raise RendezvousTimeoutError(
                f"static rendezvous at {where}: not all {getattr(handler, 'world_size', '?')} nodes came "
                f"within {self._timeout_s():g} s: {str(exc).splitlines()[0]}"
            ) from None
        return RendezvousInfo(store, info.rank, info.world_size, info.bootstrap_store_info)

    def _clear_workers_keys(self, store, rank: int, world_size: int) -> None:
        """Once every agent is here (its workers stopped), rank 0 deletes every key outside
        ``<run_id>/``; the others wait for it. Raises DistStoreError after the timeout."""
        from torch.distributed.elastic.utils.store import barrier, store_timeout

        timeout = self._timeout_s()
        barrier(store, world_size, key_prefix=_ARRIVED, barrier_timeout=timeout)
        if rank == 0:
            raw = self._handler._store  # the TCPStore itself: the workers' keys have no prefix
            ours = f"{self._handler.run_id}/"
            for key in raw.list_keys():
                if not key.startswith(ours):
                    raw.delete_key(key)
            store.set(_CLEARED, "1")
        with store_timeout(store, timeout):
            store.wait([_CLEARED])

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
