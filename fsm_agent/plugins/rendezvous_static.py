"""Built-in rendezvous ``static``: a fixed world of ``--nnodes`` agents at ``--master-addr/--master-port``.

Built on torch's ``StaticTCPRendezvous`` (the TCPStore at master_addr:master_port, group rank =
``--node-rank``). Unlike torch, each call returns a store prefixed with the round number and
publishes a fresh MASTER_PORT, so each attempt's workers meet in an empty store.
"""

from __future__ import annotations

import errno
import socket

from fsm_agent.errors import ConfigError
from fsm_agent.plugins import hookimpl


class StaticRendezvous:
    """torch's StaticTCPRendezvous with one store prefix and one worker store per round."""

    agent_hosts_worker_store = True

    def __init__(self, handler, local_addr: str | None):
        self._handler = handler
        self._local_addr = local_addr
        self._round = 0

    def next_rendezvous(self):
        """torch's round, prefixed; raises RendezvousTimeoutError when the nodes do not all come.

        torch's StaticTCPRendezvous lets the store's ``DistStoreError`` ("Timed out after N seconds
        waiting for clients") escape, which is no rendezvous error: the agent would call it an
        agent error. Here it becomes ``RendezvousTimeoutError`` naming the endpoint.
        """
        from torch.distributed import DistStoreError, PrefixStore
        from torch.distributed.elastic.rendezvous.api import (RendezvousInfo, RendezvousStoreInfo,
                                                              RendezvousTimeoutError)

        try:
            info = self._handler.next_rendezvous()
            store = PrefixStore(f"round_{self._round}", info.store)
            self._round += 1
            addr = self._local_addr or info.bootstrap_store_info.master_addr
            bootstrap = RendezvousStoreInfo.build(info.rank, store, local_addr=addr)
        except DistStoreError as exc:
            handler = self._handler
            where = f"{getattr(handler, 'master_addr', '?')}:{getattr(handler, 'master_port', '?')}"
            timeout = getattr(handler, "timeout", None)
            within = f"{timeout.total_seconds():g} s" if hasattr(timeout, "total_seconds") else "the timeout"
            raise RendezvousTimeoutError(
                f"static rendezvous at {where}: not all {getattr(handler, 'world_size', '?')} nodes came "
                f"within {within}: {str(exc).splitlines()[0]}") from None
        return RendezvousInfo(store, info.rank, info.world_size, bootstrap)

    def __getattr__(self, name):
        return getattr(self._handler, name)


def create_static_handler(params):
    """``RendezvousParameters -> RendezvousHandler`` for backend ``static``.

    Raises:
        ConfigError: this node has rank 0, which hosts the store, and the port is already in use
            (torch's TCPStore would fail later with a 40-line ``DistNetworkError: EADDRINUSE``).
    """
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import create_rdzv_handler

    handler = create_rdzv_handler(params)
    if handler.rank == 0 and handler.master_port:
        _require_free_port(handler.master_port)
    return StaticRendezvous(handler, params.local_addr)


def _require_free_port(port: int) -> None:
    """Raise ConfigError if something listens on TCP ``port`` of this host (any interface, as TCPStore binds)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore: a TIME_WAIT port is free
    try:
        probe.bind(("", port))
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        raise ConfigError(f"static rendezvous: port {port} (--master-port) is already in use on this host, "
                          f"where node rank 0 hosts the store: choose a free --master-port, or stop what "
                          f"listens on {port}") from None
    finally:
        probe.close()


@hookimpl
def fsm_agent_register_backends(registry):
    # torch's StaticTCPRendezvous: ``rank`` (--node-rank) and ``timeout`` (seconds, default 600).
    registry.add_rendezvous("static", create_static_handler, conf_keys=("rank", "timeout"))
