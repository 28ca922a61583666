"""fsm-agent-etcd: rendezvous backend ``etcd-v3`` — torch's dynamic rendezvous through etcd's v3 API.

``fsm-agent run --rdzv-backend etcd-v3 --rdzv-endpoint HOST:2379[,HOST:2379...] --rdzv-id JOB ...`` runs torch's
own ``DynamicRendezvousHandler`` (the algorithm behind ``c10d`` and ``etcd-v2``) with

* ``EtcdV3RendezvousBackend``: the shared rendezvous state on one etcd key, compare-and-set on
  its ``mod_revision``;
* ``EtcdV3Store``: the round's ``torch.distributed.Store`` on etcd keys.

Unlike ``c10d`` no agent hosts the rendezvous: any agent may die without taking the rendezvous
with it. Unlike torch's ``etcd``/``etcd-v2`` it needs no v2 API (off by default since etcd 3.4,
gone in 3.6) and no ``python-etcd``. As with fsm-agent's ``c10d``, the group-rank-0 agent hosts a
fresh TCPStore for each attempt's workers.
"""

from __future__ import annotations

import os
from typing import Any

from fsm_agent.plugins import hookimpl
from fsm_agent.plugins.rendezvous_c10d import DYNAMIC_HANDLER_CONF_KEYS, FreshStoreHandler

BACKEND_NAME = "etcd-v3"
DEFAULT_PORT = 2379

__all__ = [
    "BACKEND_NAME",
    "EtcdV3RendezvousBackend",
    "EtcdV3Store",
    "create_backend",
    "create_etcd_v3_handler",
    "parse_endpoints",
    "read_options",
]


def __getattr__(name):  # torch is imported when a handler is built, not when fsm-agent loads plugins
    if name == "EtcdV3RendezvousBackend":
        from fsm_agent_etcd.backend import EtcdV3RendezvousBackend

        return EtcdV3RendezvousBackend
    if name == "EtcdV3Store":
        from fsm_agent_etcd.store import EtcdV3Store

        return EtcdV3Store
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: The ``--rdzv-conf`` keys ``read_options`` reads (torch's DynamicRendezvousHandler reads its own too).
OPTIONS = ("read_timeout", "protocol", "ca_cert", "ssl_cert", "ssl_cert_key", "key_prefix", "ttl", "poll_interval")


def read_options(params) -> dict[str, Any]:
    """This plugin's options: ``--rdzv-conf`` keys first, then ``FSM_AGENT_ETCD_<OPTION>``, then defaults.

    Options (``--rdzv-conf`` key / environment variable / default):

    * ``read_timeout`` / ``FSM_AGENT_ETCD_READ_TIMEOUT`` / 60: seconds per HTTP request to etcd.
    * ``protocol`` / ``FSM_AGENT_ETCD_PROTOCOL`` / ``http``: ``http`` or ``https``.
    * ``ca_cert``, ``ssl_cert``, ``ssl_cert_key`` / ``FSM_AGENT_ETCD_CA_CERT`` ... : TLS files
      (torch's etcd-v2 names).
    * ``key_prefix`` / ``FSM_AGENT_ETCD_KEY_PREFIX`` / ``/torch/elastic``: the state is at
      ``<key_prefix>/rendezvous/<run_id>``, the store under ``<key_prefix>/store/<run_id>/``.
    * ``ttl`` / ``FSM_AGENT_ETCD_TTL`` / 7200: seconds the job's keys outlive its last write
      (an etcd lease; 0 = never expire). torch's etcd-v2 uses 2 hours too.
    * ``poll_interval`` / ``FSM_AGENT_ETCD_POLL_INTERVAL`` / 0.2: longest pause, in seconds,
      between two reads while a store ``get``/``wait`` blocks.

    Raises:
        ValueError: a value is malformed (named with the fix).
    """

    def option(name: str, default: Any) -> Any:
        value = params.get(name, None) if params is not None else None
        if value in (None, ""):
            value = os.environ.get(f"FSM_AGENT_ETCD_{name.upper()}", "")
        return default if value in (None, "") else value

    options = {  # keep OPTIONS in step
        "read_timeout": float(option("read_timeout", 60)),
        "protocol": str(option("protocol", "http")).strip().lower(),
        "ca_cert": option("ca_cert", None),
        "ssl_cert": option("ssl_cert", None),
        "ssl_cert_key": option("ssl_cert_key", None),
        "key_prefix": str(option("key_prefix", "/torch/elastic")),
        "ttl": int(option("ttl", 7200)),
        "poll_interval": float(option("poll_interval", 0.2)),
    }
    if options["read_timeout"] <= 0:
        raise ValueError(
            f"read_timeout={options['read_timeout']}: must be > 0 seconds (e.g. --rdzv-conf read_timeout=60)"
        )
    if options["protocol"] not in ("http", "https"):
        raise ValueError(f"protocol={options['protocol']!r}: use http or https (e.g. --rdzv-conf protocol=https)")
    if options["ttl"] < 0:
        raise ValueError(f"ttl={options['ttl']}: must be >= 0 seconds (0 = keys never expire)")
    if not options["key_prefix"].startswith("/"):
        raise ValueError(
            f"key_prefix={options['key_prefix']!r}: must start with '/' (e.g. --rdzv-conf key_prefix=/torch/elastic)"
        )
    return options


def parse_endpoints(endpoint: str) -> list[tuple[str, int]]:
    """``--rdzv-endpoint HOST[:PORT][,HOST[:PORT]...]`` -> ``[(host, port), ...]``: the client URLs of
    one etcd cluster's members (port 2379 by default), each read with torch's
    ``parse_rendezvous_endpoint``; an empty endpoint is torch's default, ``localhost:2379``.

    Raises:
        ValueError: an empty member (``a:2379,,b:2379``) or a bad port (named, with the fix).
    """
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    if not endpoint.strip():
        return [parse_rendezvous_endpoint(endpoint, default_port=DEFAULT_PORT)]
    members = []
    for part in endpoint.split(","):
        if not part.strip():
            raise ValueError(
                f"--rdzv-endpoint {endpoint!r}: an empty etcd member; list the members as "
                "HOST:PORT,HOST:PORT (e.g. --rdzv-endpoint etcd1:2379,etcd2:2379,etcd3:2379)"
            )
        members.append(parse_rendezvous_endpoint(part.strip(), default_port=DEFAULT_PORT))
    return members


def create_backend(params):
    """``(EtcdV3RendezvousBackend, EtcdV3Store)`` for torch ``RendezvousParameters``; the endpoint may
    list several members of one etcd cluster (``a:2379,b:2379,c:2379``): requests go to the one that
    answered last, and to the next one when it cannot be reached.

    Mirrors torch: ``etcd_rendezvous_backend.create_backend`` (the etcd-v2 backend, one member).

    Raises:
        RendezvousConnectionError: no etcd member answers at the endpoint.
        ValueError: a malformed option or endpoint.
    """
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    from fsm_agent_etcd._client import CONNECTION_ERRORS, create_connection, describe
    from fsm_agent_etcd.backend import EtcdV3RendezvousBackend
    from fsm_agent_etcd.store import EtcdV3Store

    options = read_options(params)
    connection = create_connection(
        parse_endpoints(params.endpoint),
        protocol=options["protocol"],
        read_timeout=options["read_timeout"],
        ca_cert=options["ca_cert"],
        cert=options["ssl_cert"],
        cert_key=options["ssl_cert_key"],
        ttl=options["ttl"],
    )
    try:
        connection.check()  # asks etcd for its version: fail now, not in the middle of a round
    except CONNECTION_ERRORS as exc:
        raise RendezvousConnectionError(
            f"etcd at {', '.join(connection.urls)} does not answer: {describe(exc)}"
        ) from None
    prefix = options["key_prefix"].rstrip("/")
    backend = EtcdV3RendezvousBackend(connection, params.run_id, key_prefix=prefix)
    store = EtcdV3Store(connection, f"{prefix}/store/{params.run_id}", poll_interval=options["poll_interval"])
    return backend, store


def create_etcd_v3_handler(params):
    """``RendezvousParameters -> RendezvousHandler`` for ``--rdzv-backend etcd-v3``."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    backend, store = create_backend(params)
    return FreshStoreHandler(create_handler(store, backend, params), backend)


@hookimpl
def fsm_agent_register_backends(registry):
    registry.add_rendezvous(BACKEND_NAME, create_etcd_v3_handler, conf_keys=(*DYNAMIC_HANDLER_CONF_KEYS, *OPTIONS))
