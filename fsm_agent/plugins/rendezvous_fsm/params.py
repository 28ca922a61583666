"""The ``fsm`` rendezvous's parameters and settings: torch's ``RendezvousParameters`` without torch,
the ``--rdzv-conf`` keys the backend reads, and endpoint parsing."""

from __future__ import annotations

import math
import socket
from dataclasses import dataclass, fields
from typing import Any

from fsm_agent.errors import ConfigError
from fsm_agent.hosts import is_loopback  # noqa: F401  (the handler's, re-exported)
from fsm_agent.plugins.rendezvous_fsm.planner import DEFAULT_LAST_CALL_TIMEOUT_S
from fsm_agent.settings import bool_word

BACKEND = "fsm"
DEFAULT_PORT = 29400
#: Keep-alive renewals per second one store is asked for at most: with more than
#: ``KEEP_ALIVE_RATE * keep_alive_interval`` nodes the interval (and the timeout) grow with
#: ``max_nodes``, so keep-alive traffic stays bounded. A killed node is still seen at once (its
#: lease ends with its connection); only a silent host takes the longer timeout.
KEEP_ALIVE_RATE = 2000.0
#: Held membership watches the whole job renews per second at most, idle: above
#: ``HELD_WATCH_RATE * keep_alive_hold`` nodes (5,000 by default) the hold grows with ``max_nodes``.
HELD_WATCH_RATE = 500.0


# -- parameters (torch's RendezvousParameters, without torch) -----------------------------------------
class FsmRendezvousParameters:
    """What a rendezvous creator receives: torch's ``RendezvousParameters`` API without importing torch.

    ``config`` holds the ``--rdzv-conf`` values (strings) plus ``node_rank``.
    """

    def __init__(
        self,
        backend: str,
        endpoint: str,
        run_id: str,
        min_nodes: int,
        max_nodes: int,
        local_addr: str | None = None,
        **config: Any,
    ):
        if not backend:
            raise ValueError("The rendezvous backend name must be a non-empty string.")
        if min_nodes < 1 or max_nodes < min_nodes:
            raise ValueError(f"need 1 <= min_nodes <= max_nodes, got {min_nodes}:{max_nodes}")
        self.backend, self.endpoint, self.run_id = backend, endpoint, run_id
        self.min_nodes, self.max_nodes, self.local_addr = min_nodes, max_nodes, local_addr
        self.config = config

    @classmethod
    def from_launch_config(cls, config: Any) -> FsmRendezvousParameters:
        """From a ``LaunchConfig`` (``rdzv_*`` fields, ``local_addr``, ``node_rank``)."""
        configs = dict(config.rdzv_configs)
        configs.setdefault("node_rank", config.node_rank)
        return cls(
            backend=config.rdzv_backend,
            endpoint=config.rdzv_endpoint,
            run_id=config.run_id,
            min_nodes=config.min_nodes,
            max_nodes=config.max_nodes,
            local_addr=config.local_addr,
            **configs,
        )

    def get(self, key: str, default: Any = None) -> Any:
        return self.config.get(key, default)

    def get_as_bool(self, key: str, default: bool | None = None) -> bool | None:
        value = self.get(key, default)
        if value is None or isinstance(value, bool):
            return value
        answer = bool_word(value)
        if answer is None:
            raise ValueError(f"The rendezvous configuration option '{key}' does not represent a valid boolean value.")
        return answer

    def get_as_int(self, key: str, default: int | None = None) -> int | None:
        value = self.get(key, default)
        return None if value is None else int(value)

    def __repr__(self) -> str:
        return (
            f"FsmRendezvousParameters(backend={self.backend!r}, endpoint={self.endpoint!r}, "
            f"run_id={self.run_id!r}, "
            f"min_nodes={self.min_nodes}, max_nodes={self.max_nodes}, local_addr={self.local_addr!r}, "
            f"config={self.config!r})"
        )


# -- settings ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FsmRendezvousSettings:
    """``--rdzv-conf`` keys of the ``fsm`` backend (seconds unless noted).

    Attributes:
        join_timeout: how long ``next_rendezvous`` may take (torch's key; 600).
        last_call_timeout: settle window (30, torch's c10d default): a round with nodes new to
            the run and fewer than max_nodes completes this long after its last join, so a
            staggered ``--nnodes MIN:MAX`` start waits for the late nodes instead of restarting
            for them; nodes waiting to join a running round are reported after waiting this long
            (at once when they fill every seat), and are not waited for again in the next round.
        rejoin_timeout: how long a round waits for live nodes of the previous round before it
            completes without them (60; above the default ``--shutdown-timeout`` of 30).
        keep_alive_interval / keep_alive_max_attempt: lease renewal period while joining and
            how many may be missed; their product (0.5 x 3 = 1.5) is ``keep_alive_timeout``, the
            lease's ttl: a node not heard from for that long is lost. In a round the lease is
            renewed by the store while it holds the node's membership watch, and a host that goes
            silent (power off, partition) is found by TCP keep-alive probes every
            ``keep_alive_interval`` (whole seconds, at least 1) on the store host: lost about
            ``keep_alive_timeout`` + 1 s after it was last heard. Above 1,000 nodes the period
            grows with max_nodes (``keep_alive_for``; ``KEEP_ALIVE_RATE``).
        keep_alive_hold: how long the store may hold a node's membership watch, in a round (10;
            at least ``keep_alive_interval``): an idle node makes one request per hold, and a
            hung agent (stopped, its host up, its connections open) is lost within
            ``keep_alive_hold + keep_alive_timeout``. A killed agent is lost at once (its
            connection closes). Above 5,000 nodes it grows with max_nodes (``HELD_WATCH_RATE``).
        read_timeout: the round store's timeout for get/wait (torch's c10d key; 60).
        handshake_timeout: how long a peer on the endpoint gets to answer the store hello (3).
        linger_timeout: how long the store host's ``shutdown`` waits for other nodes to leave (5).
        is_host: host the store (True), never (False), or infer from the endpoint (None).
        bind_addr: the address the store listens on (default: the endpoint host).
        node_rank: rank hint (``--node-rank``); lower hints get lower ranks.
    """

    join_timeout: float = 600.0
    last_call_timeout: float = DEFAULT_LAST_CALL_TIMEOUT_S
    rejoin_timeout: float = 60.0
    keep_alive_interval: float = 0.5
    keep_alive_max_attempt: int = 3
    keep_alive_hold: float = 10.0
    read_timeout: float = 60.0
    handshake_timeout: float = 3.0
    linger_timeout: float = 5.0
    is_host: bool | None = None
    bind_addr: str | None = None
    node_rank: int | None = None

    @property
    def keep_alive_timeout(self) -> float:
        return self.keep_alive_interval * self.keep_alive_max_attempt

    def keep_alive_for(self, max_nodes: int) -> tuple[float, float]:
        """``(interval, timeout)`` in seconds for a job of ``max_nodes``: ``keep_alive_interval``
        and ``keep_alive_timeout``, stretched so that all nodes together renew at most
        ``KEEP_ALIVE_RATE`` leases per second."""
        interval = max(self.keep_alive_interval, max_nodes / KEEP_ALIVE_RATE)
        return interval, interval * self.keep_alive_max_attempt

    def keep_alive_hold_for(self, max_nodes: int) -> float:
        """Seconds the store may hold a node's membership watch in a job of ``max_nodes``:
        ``keep_alive_hold``, at least the keep-alive interval, stretched so that all idle nodes
        together renew at most ``HELD_WATCH_RATE`` watches per second."""
        return max(self.keep_alive_hold, self.keep_alive_for(max_nodes)[0], max_nodes / HELD_WATCH_RATE)

    @classmethod
    def from_params(cls, params: Any) -> FsmRendezvousSettings:
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = _param(params, f.name)
            if f.name == "node_rank":
                raw = raw if raw is not None else _param(params, "rank")
                if raw is None:
                    raw = getattr(params, "node_rank", None)
            if raw is None:
                continue
            values[f.name] = _convert(f.name, raw, f.default)
        settings = cls(**values)
        for name in ("join_timeout", "keep_alive_interval", "keep_alive_hold", "read_timeout", "handshake_timeout"):
            if getattr(settings, name) <= 0:
                raise ConfigError(f"--rdzv-conf {name}={getattr(settings, name)!r}: must be > 0 seconds")
        for name in ("last_call_timeout", "rejoin_timeout", "linger_timeout"):
            if getattr(settings, name) < 0:
                raise ConfigError(f"--rdzv-conf {name}={getattr(settings, name)!r}: must be >= 0 seconds")
        if settings.keep_alive_max_attempt < 1:
            raise ConfigError(f"--rdzv-conf keep_alive_max_attempt={settings.keep_alive_max_attempt}: must be >= 1")
        return settings


def _param(params: Any, key: str) -> Any:
    getter = getattr(params, "get", None)
    value = None
    if callable(getter):
        try:
            value = getter(key, None)
        except TypeError:
            value = None
    if value is None:
        value = (getattr(params, "config", None) or {}).get(key)
    return value


def _convert(name: str, raw: Any, default: Any) -> Any:
    if name == "is_host":
        answer = raw if isinstance(raw, bool) else bool_word(raw)
        if answer is None:
            raise ConfigError(f"--rdzv-conf is_host={raw!r}: use 1/true/yes or 0/false/no")
        return answer
    if name == "bind_addr":
        return str(raw)
    if name in ("node_rank", "keep_alive_max_attempt"):
        try:
            return int(raw)
        except (TypeError, ValueError):
            raise ConfigError(f"--rdzv-conf {name}={raw!r}: must be an integer") from None
    try:
        value = float(raw)
    except (TypeError, ValueError, OverflowError):
        value = math.nan
    if not math.isfinite(value):
        raise ConfigError(f"--rdzv-conf {name}={raw!r}: must be a finite number of seconds (e.g. {name}={default})")
    return value


def parse_endpoint(endpoint: str | None, default_port: int = DEFAULT_PORT) -> tuple[str, int]:
    """``host[:port]`` (``[v6]:port`` for IPv6) -> (host, port); empty -> ``localhost:29400``."""
    text = (endpoint or "").strip()
    if not text:
        return "localhost", default_port
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif text.count(":") == 1:
        host, _, port = text.partition(":")
    else:
        host, port = text, ""
    if not host:
        host = "localhost"
    try:
        return host, int(port) if port else default_port
    except ValueError:
        raise ConfigError(
            f"--rdzv-endpoint {endpoint!r}: port {port!r} is not a number (use host:port, e.g. node0:{default_port})"
        ) from None


def free_port() -> int:
    """A port that is free on this machine now (racy, as torch's ``get_free_port``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]
