"""Built-in rendezvous ``c10d``: torch's DynamicRendezvousHandler over a TCPStore (torch-compatible).

It is torch's own handler, so an fsm-agent node and a torchrun node can join the same rendezvous.
One change: MASTER_ADDR/MASTER_PORT are published afresh each round (torch's
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` path), and the group-rank-0 agent then hosts a new, empty
TCPStore for that attempt's workers; torch 2.13 reuses one store across attempts, so restarted
process groups find the previous attempt's keys (pytorch/pytorch#135712).
"""

from __future__ import annotations

import os

from fsm_agent.plugins import hookimpl


class FreshStoreHandler:
    """Wraps a torch ``RendezvousHandler``: every round publishes a new MASTER_PORT.

    All other calls go to the wrapped handler unchanged.
    """

    #: The agent with group_rank 0 hosts the workers' TCPStore at MASTER_ADDR:MASTER_PORT.
    agent_hosts_worker_store = True

    def __init__(self, handler):
        self._handler = handler

    def next_rendezvous(self):
        previous = os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        try:
            return self._handler.next_rendezvous()
        finally:
            if previous is None:
                del os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"]
            else:
                os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = previous

    def __getattr__(self, name):
        return getattr(self._handler, name)


def create_c10d_handler(params):
    """``RendezvousParameters -> RendezvousHandler`` for backend ``c10d`` (torch's creator, wrapped)."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    backend, store = create_backend(params)
    return FreshStoreHandler(create_handler(store, backend, params))


@hookimpl
def fsm_agent_register_backends(registry):
    registry.add_rendezvous("c10d", create_c10d_handler)
