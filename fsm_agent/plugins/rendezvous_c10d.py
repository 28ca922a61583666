"""Built-in rendezvous ``c10d``: torch's DynamicRendezvousHandler over a TCPStore (torch-compatible).

It is torch's own handler, so an fsm-agent node and a torchrun node can join the same rendezvous.
One change: MASTER_ADDR/MASTER_PORT are published afresh each round (torch's
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` path), and the group-rank-0 agent then hosts a new, empty
TCPStore for that attempt's workers; torch 2.13 reuses one store across attempts, so restarted
process groups find the previous attempt's keys (pytorch/pytorch#135712).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from datetime import timedelta

from fsm_agent.errors import RendezvousFailed
from fsm_agent.plugins import hookimpl


#: The ``--rdzv-conf`` keys torch's DynamicRendezvousHandler reads (``dynamic_rendezvous.create_handler``);
#: public for backends built on it (the etcd-v3 plugin).
DYNAMIC_HANDLER_CONF_KEYS = ("join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout",
                             "keep_alive_interval", "keep_alive_max_attempt")
#: ... and those torch's c10d backend adds (``c10d_rendezvous_backend.create_backend``).
C10D_CONF_KEYS = (*DYNAMIC_HANDLER_CONF_KEYS, "is_host", "read_timeout", "store_type")

#: torch reads this switch from the environment at the end of ``next_rendezvous``, after a
#: blocking join. Handlers running at once in one process (tests, several agents) share one
#: setting: the first to enter sets it, the last to leave restores it.
_SHARE_SWITCH = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
_switch_lock = threading.Lock()
_switch_users = 0
_switch_previous: str | None = None


@contextlib.contextmanager
def _fresh_store_per_round():
    global _switch_users, _switch_previous
    with _switch_lock:
        if _switch_users == 0:
            _switch_previous = os.environ.get(_SHARE_SWITCH)
            os.environ[_SHARE_SWITCH] = "1"
        _switch_users += 1
    try:
        yield
    finally:
        with _switch_lock:
            _switch_users -= 1
            if _switch_users == 0:
                if _switch_previous is None:
                    os.environ.pop(_SHARE_SWITCH, None)
                else:
                    os.environ[_SHARE_SWITCH] = _switch_previous


class FreshStoreHandler:
    """Wraps a torch ``RendezvousHandler``: every round publishes a new MASTER_PORT.

    Public for third-party backends built on torch's ``DynamicRendezvousHandler`` (the
    ``fsm-agent-etcd`` package wraps its handler with it): with ``agent_hosts_worker_store``
    the group-rank-0 agent hosts a new, empty TCPStore for every attempt's workers. All other
    calls go to the wrapped handler unchanged.
    """

    #: The agent with group_rank 0 hosts the workers' TCPStore at MASTER_ADDR:MASTER_PORT.
    agent_hosts_worker_store = True

    def __init__(self, handler):
        self._handler = handler

    def next_rendezvous(self):
        with _fresh_store_per_round():
            return self._handler.next_rendezvous()

    def __getattr__(self, name):
        return getattr(self._handler, name)


def create_c10d_handler(params):
    """``RendezvousParameters -> RendezvousHandler`` for backend ``c10d`` (torch's creator, wrapped).

    Raises:
        RendezvousFailed: the endpoint is held by something that does not answer as a TCPStore
            (within PROBE_TIMEOUT seconds), or no store came up within ``read_timeout``.
    """
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
    read_timeout = float(params.get("read_timeout", 60))
    # Something already listens: a real TCPStore answers in milliseconds, so a silent peer is an
    # unrelated program (torch would block in its client handshake, then retry until join_timeout).
    # Nothing listens yet: wait as torch does for a store host that starts later.
    deadline = min(PROBE_TIMEOUT, read_timeout) if port and _listening(host, port) else read_timeout + 5
    outcome: dict = {}

    def connect():
        try:
            backend, store = create_backend(params)
            _probe(store, read_timeout)
            outcome["value"] = (backend, store)
        except BaseException as exc:  # reported in the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=connect, name="c10d-connect", daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(deadline)
    if "value" in outcome:
        backend, store = outcome["value"]
        return FreshStoreHandler(create_handler(store, backend, params))
    waited = time.monotonic() - started
    try:  # torch retries a name that does not resolve as if the store were not up yet
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:  # UnicodeError: not a valid host name at all
        raise RendezvousFailed(f"rendezvous endpoint {params.endpoint} (backend c10d): the host {host!r} does not "
                               f"resolve ({getattr(exc, 'strerror', None) or exc}; tried for {waited:.0f}s): check "
                               f"the host name in --rdzv-endpoint") from None
    error = outcome.get("error") or TimeoutError(f"no answer within {deadline:.0f}s")
    raise RendezvousFailed(_unreachable(params, error, waited))


#: Seconds a store that accepts connections gets to answer before the endpoint is declared wrong.
PROBE_TIMEOUT = 10.0


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def _probe(store, read_timeout: float) -> None:
    """One round trip through the store."""
    previous = store.timeout
    store.set_timeout(timedelta(seconds=min(PROBE_TIMEOUT, read_timeout)))
    try:
        store.add("fsm_agent/probe", 0)
    finally:
        store.set_timeout(previous)


def _unreachable(params, exc: BaseException, waited: float) -> str:
    is_host = params.get("is_host", "inferred from the endpoint")
    detail = str(exc).splitlines()[0] if str(exc) else ""
    return (f"rendezvous endpoint {params.endpoint or '(default)'} (backend c10d) did not answer as a TCPStore "
            f"(gave up after {waited:.0f}s; is_host={is_host}): {type(exc).__name__}: {detail}. If another program "
            f"holds that port, pick a free port for --rdzv-endpoint")


@hookimpl
def fsm_agent_register_backends(registry):
    registry.add_rendezvous("c10d", create_c10d_handler, conf_keys=C10D_CONF_KEYS)
