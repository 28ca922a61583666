"""Built-in rendezvous ``fsm``: fsm-agent's own rendezvous on an ``fsm_agent.store`` server.

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

import copy
import errno
import ipaddress
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, fields
from typing import Any

from fsm_agent.errors import ConfigError, RendezvousFailed, RendezvousNotNeeded
from fsm_agent.plugins import hookimpl
from fsm_agent.store import PrefixStore, StoreBindError, StoreClient, StoreError, StoreServer, format_endpoint

log = logging.getLogger(__name__)

BACKEND = "fsm"
DEFAULT_PORT = 29400
SCHEMA = 1
_INF = float("inf")
_TRUE = {"1", "true", "t", "yes", "y", "on"}
_FALSE = {"0", "false", "f", "no", "n", "off"}


# -- parameters (torch's RendezvousParameters, without torch) -----------------------------------------
class FsmRendezvousParameters:
    """What a rendezvous creator receives: torch's ``RendezvousParameters`` API without importing torch.

    ``config`` holds the ``--rdzv-conf`` values (strings) plus ``node_rank``.
    """

    def __init__(self, backend: str, endpoint: str, run_id: str, min_nodes: int, max_nodes: int,
                 local_addr: str | None = None, **config: Any):
        if not backend:
            raise ValueError("The rendezvous backend name must be a non-empty string.")
        if min_nodes < 1 or max_nodes < min_nodes:
            raise ValueError(f"need 1 <= min_nodes <= max_nodes, got {min_nodes}:{max_nodes}")
        self.backend, self.endpoint, self.run_id = backend, endpoint, run_id
        self.min_nodes, self.max_nodes, self.local_addr = min_nodes, max_nodes, local_addr
        self.config = config

    @classmethod
    def from_launch_config(cls, config: Any) -> "FsmRendezvousParameters":
        """From a ``LaunchConfig`` (``rdzv_*`` fields, ``local_addr``, ``node_rank``)."""
        configs = dict(config.rdzv_configs)
        configs.setdefault("node_rank", config.node_rank)
        return cls(backend=config.rdzv_backend, endpoint=config.rdzv_endpoint, run_id=config.run_id,
                   min_nodes=config.min_nodes, max_nodes=config.max_nodes, local_addr=config.local_addr, **configs)

    def get(self, key: str, default: Any = None) -> Any:
        return self.config.get(key, default)

    def get_as_bool(self, key: str, default: bool | None = None) -> bool | None:
        value = self.get(key, default)
        if value is None or isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise ValueError(f"The rendezvous configuration option '{key}' does not represent a valid boolean value.")

    def get_as_int(self, key: str, default: int | None = None) -> int | None:
        value = self.get(key, default)
        return None if value is None else int(value)

    def __repr__(self) -> str:
        return (f"FsmRendezvousParameters(backend={self.backend!r}, endpoint={self.endpoint!r}, "
                f"run_id={self.run_id!r}, "
                f"min_nodes={self.min_nodes}, max_nodes={self.max_nodes}, local_addr={self.local_addr!r}, "
                f"config={self.config!r})")


# -- settings ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FsmRendezvousSettings:
    """``--rdzv-conf`` keys of the ``fsm`` backend (seconds unless noted).

    Attributes:
        join_timeout: how long ``next_rendezvous`` may take (torch's key; 600).
        last_call_timeout: settle window: a round with nodes new to the run completes this long
            after its last join; nodes waiting to join a running round are reported after waiting
            this long (0.5).
        rejoin_timeout: how long a round waits for live nodes of the previous round before it
            completes without them (60; above the default ``--shutdown-timeout`` of 30).
        keep_alive_interval / keep_alive_max_attempt: lease renewal period and how many may be
            missed; a silent node is lost after their product (0.5 x 3 = 1.5).
        read_timeout: the round store's timeout for get/wait (torch's c10d key; 60).
        handshake_timeout: how long a peer on the endpoint gets to answer the store hello (3).
        linger_timeout: how long the store host's ``shutdown`` waits for other nodes to leave (5).
        is_host: host the store (True), never (False), or infer from the endpoint (None).
        bind_addr: the address the store listens on (default: the endpoint host).
        node_rank: rank hint (``--node-rank``); lower hints get lower ranks.
    """

    join_timeout: float = 600.0
    last_call_timeout: float = 0.5
    rejoin_timeout: float = 60.0
    keep_alive_interval: float = 0.5
    keep_alive_max_attempt: int = 3
    read_timeout: float = 60.0
    handshake_timeout: float = 3.0
    linger_timeout: float = 5.0
    is_host: bool | None = None
    bind_addr: str | None = None
    node_rank: int | None = None

    @property
    def keep_alive_timeout(self) -> float:
        return self.keep_alive_interval * self.keep_alive_max_attempt

    @classmethod
    def from_params(cls, params: Any) -> "FsmRendezvousSettings":
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
        for name in ("join_timeout", "keep_alive_interval", "read_timeout", "handshake_timeout"):
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
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise ConfigError(f"--rdzv-conf is_host={raw!r}: use 1/true/yes or 0/false/no")
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
        raise ConfigError(f"--rdzv-endpoint {endpoint!r}: port {port!r} is not a number "
                          f"(use host:port, e.g. node0:{default_port})") from None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _free_port() -> int:
    """A port that is free on this machine now (racy, as torch's ``get_free_port``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


# -- the state machine of one node, as a pure function ------------------------------------------------
def fresh_state() -> dict:
    return {"schema": SCHEMA, "round": 0, "complete": False, "closed": False, "seq": 0, "nodes": {},
            "participants": {}, "previous": [], "wait_list": {}, "last_join": 0.0, "master": None}


def rank_order(state: dict, participants) -> list[str]:
    """Participants in rank order: node_rank hint, then the store host, then join order."""
    nodes = state["nodes"]

    def key(p: str):
        n = nodes[p]
        hint = n.get("node_rank")
        return (hint if hint is not None else _INF, 0 if n.get("host") else 1, n.get("seq", 0), p)

    return sorted(participants, key=key)


def plan(state: dict, alive: set[str], me: str, me_info: dict, now: float, *, min_nodes: int, max_nodes: int,
         last_call_timeout: float, rejoin_timeout: float, returned_round: int | None
         ) -> tuple[dict | None, str, float | None]:
    """One step of node ``me`` on the shared state: ``(new_state or None, action, wait_s)``.

    ``new_state`` (when not None) is to be written with compare_set; then the caller re-reads and
    calls again, except after ``not_needed`` (it raises once the write succeeded). Without a write,
    ``action`` is ``finish`` (this round is ours), ``closed`` or ``wait`` (watch the state for at
    most ``wait_s`` seconds; None: until it changes).
    """
    st = copy.deepcopy(state)
    nodes, wl = st["nodes"], st["wait_list"]
    changed = False
    for n in list(nodes):  # nodes whose lease is gone have left or died
        if n not in alive and n != me:
            del nodes[n]
            changed = True
    for n in list(wl):
        if n not in nodes:
            del wl[n]
            changed = True
    if not st["complete"]:
        for n in list(st["participants"]):
            if n not in nodes:
                del st["participants"][n]
                changed = True
    if st["closed"]:
        return (st if changed else None), "closed", None
    if me not in nodes:
        nodes[me] = {**me_info, "seq": st["seq"], "rounds": 0}
        st["seq"] += 1
        changed = True
    parts = st["participants"]

    if st["complete"]:
        live = [p for p in parts if p in nodes]
        if me in parts:
            if st["round"] != returned_round:
                return (st if changed else None), "finish", None
            # this node wants a new round (restart, lost node, joiners): open it
            st["round"] += 1
            st["complete"] = False
            st["previous"] = sorted(live)
            st["participants"] = {me: None}
            st["master"] = None
            nodes[me]["port"] = me_info["port"]
            wl.pop(me, None)
            st["last_join"] = now
            return st, "wait", 0.0
        if len(live) >= max_nodes:
            del nodes[me]
            wl.pop(me, None)
            return st, "not_needed", None
        if me not in wl:
            wl[me] = now
            changed = True
        return (st if changed else None), "wait", None

    if me not in parts:
        reserved = [n for n in st["previous"] if n in nodes and n not in parts and n != me]
        seats = max_nodes - len(parts) - (0 if me in st["previous"] else len(reserved))
        if seats <= 0:
            if me not in wl:
                wl[me] = now
                changed = True
            return (st if changed else None), "wait", None
        parts[me] = None
        wl.pop(me, None)
        nodes[me]["port"] = me_info["port"]
        st["last_join"] = now
        return st, "wait", 0.0

    n = len(parts)
    if n < min_nodes:
        return (st if changed else None), "wait", None
    pending = [x for x in nodes if x not in parts]
    joinable = min(len(pending), max_nodes - n)
    new_in_round = any(nodes[p].get("rounds", 0) == 0 for p in parts)
    settle_at = st["last_join"] + (last_call_timeout if new_in_round else 0.0)
    rejoin_at = st["last_join"] + rejoin_timeout
    if n >= max_nodes or (joinable == 0 and now >= settle_at) or now >= rejoin_at:
        order = rank_order(st, parts)
        st["participants"] = {p: i for i, p in enumerate(order)}
        st["complete"] = True
        for p in order:
            nodes[p]["rounds"] = nodes[p].get("rounds", 0) + 1
            wl.pop(p, None)
        st["master"] = {"addr": nodes[order[0]]["addr"], "port": nodes[order[0]]["port"]}
        return st, "wait", 0.0
    wake = settle_at if joinable == 0 else rejoin_at
    return (st if changed else None), "wait", max(0.0, wake - now)


# -- what next_rendezvous returns (torch's RendezvousInfo shape, without torch) ---------------------------
@dataclass(frozen=True)
class RendezvousStoreInfo:
    master_addr: str
    master_port: int


@dataclass(frozen=True)
class RendezvousInfo:
    store: Any
    rank: int
    world_size: int
    bootstrap_store_info: RendezvousStoreInfo


@dataclass(frozen=True)
class _Snapshot:
    raw: bytes | None
    state: dict
    state_version: int
    event_version: int
    listing: dict[str, int]
    now: float


@dataclass
class _Round:
    round: int
    participants: list[str]


# -- the handler -------------------------------------------------------------------------------------------
class FsmRendezvousHandler:
    """torch's ``RendezvousHandler`` interface over an fsm store (see the module docstring).

    Args:
        run_id: the job id; the state lives under ``fsm_rdzv/<run_id>/``.
        endpoint: ``host:port`` of the store.
        min_nodes / max_nodes: ``--nnodes MIN:MAX``.
        local_addr: this node's address for MASTER_ADDR (``--local-addr``); None: the FQDN, or
            127.0.0.1 when the endpoint is a loopback address.
        settings: the ``--rdzv-conf`` values.

    Raises:
        RendezvousFailed: the store could not be hosted where it had to be (``is_host=1``, or the
            endpoint is this machine but cannot be bound for a reason other than "in use").
    """

    #: Workers' rank 0 hosts their TCPStore at MASTER_ADDR:MASTER_PORT (torch's non-shared path).
    use_agent_store = False
    #: shutdown() only leaves this round; the agent may call it on every exit (torch's closes the job).
    shutdown_closes_rendezvous = False
    agent_hosts_worker_store = False
    #: next_rendezvous and the store's waits are select-based Python: the agent calls them in its own
    #: thread, where a stop signal interrupts them (so shutdown() never races a join still running).
    interruptible = True

    def __init__(self, run_id: str, endpoint: str, min_nodes: int, max_nodes: int, local_addr: str | None = None,
                 settings: FsmRendezvousSettings | None = None):
        if not 0 < min_nodes <= max_nodes:
            raise ConfigError(f"--nnodes {min_nodes}:{max_nodes}: need 0 < MIN <= MAX")
        self.settings = s = settings or FsmRendezvousSettings()
        self.run_id, self.min_nodes, self.max_nodes = run_id, min_nodes, max_nodes
        self._endpoint_host, port = parse_endpoint(endpoint)
        self._connect_host = "127.0.0.1" if self._endpoint_host == "localhost" else self._endpoint_host
        self.port = port
        self._server: StoreServer | None = None
        self._hosting_note = "did not try to host the store (is_host=0)"
        self._port_taken = False
        self._setup_hosting()
        if self.port == 0:
            raise ConfigError(f"--rdzv-endpoint {endpoint!r}: port 0 (a free port) only works on the node that hosts "
                              f"the store; this node {self._hosting_note}")
        loopback = _is_loopback(self._connect_host)
        self.addr = local_addr or ("127.0.0.1" if loopback else socket.getfqdn())
        self.node_id = f"{self.addr}_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        base = f"fsm_rdzv/{run_id}"
        self._base = base
        self._state_key = f"{base}/state"
        self._event_key = f"{base}/event"
        self._alive_prefix = f"{base}/alive/"
        self._alive_key = self._alive_prefix + self.node_id
        self._wake_key = f"{base}/wake/{self.node_id}"
        fast = self._port_taken
        self._client = StoreClient(self._connect_host, self.port, timeout=s.read_timeout,
                                   connect_timeout=s.handshake_timeout if fast else s.join_timeout,
                                   handshake_timeout=s.handshake_timeout, fail_fast_refused=fast)
        side = dict(timeout=s.read_timeout, connect_timeout=max(s.keep_alive_timeout, s.handshake_timeout),
                    handshake_timeout=s.handshake_timeout)
        self._hb_client = StoreClient(self._connect_host, self.port, **side)
        self._watch_client = StoreClient(self._connect_host, self.port, **side)
        self._started = False
        self._shut = False
        self._returned_round: int | None = None
        self._stop = threading.Event()
        self._cv = threading.Condition()
        self._round: _Round | None = None
        self._gen = 0
        self._lost: set[str] = set()
        self._self_lost = False
        self._waiting = 0
        self._store_error: str | None = None
        self._fd_r, self._fd_w = os.pipe()
        os.set_blocking(self._fd_r, False)
        os.set_blocking(self._fd_w, False)
        self._signalled = False
        self._threads: list[threading.Thread] = []

    # -- hosting -------------------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        return format_endpoint(self._connect_host, self.port)

    @property
    def hosts_store(self) -> bool:
        return self._server is not None

    def _setup_hosting(self) -> None:
        s = self.settings
        target = self._connect_host
        if s.is_host is False:
            if self.port == 0:
                raise ConfigError(f"--rdzv-endpoint {self.endpoint}: port 0 means 'host the store on a free port', "
                                  f"which is_host=0 forbids; give the store's port")
            return
        server = StoreServer(target, self.port)
        try:
            server.bind()
        except StoreBindError as exc:
            server.close()
            explicit = s.is_host is True
            if exc.errno == errno.EADDRNOTAVAIL and not explicit:
                self._hosting_note = f"did not host the store ({self._endpoint_host} is not an address of this machine)"
                return
            if exc.errno == errno.EADDRINUSE and not explicit:
                # Another agent on this machine may host it: join as a client, but fail fast if the
                # holder is not an fsm store.
                self._port_taken = True
                self._hosting_note = (f"tried to host the store but {format_endpoint(target, self.port)} is taken "
                                      f"(joining the program that holds it as a client)")
                return
            raise RendezvousFailed(self._describe(
                f"could not host the store at {format_endpoint(target, self.port)}: {exc}"
                + ("; is_host=1 was given" if explicit else "")
                + ("; the port is taken by another program: free it or pick another --rdzv-endpoint port"
                   if exc.errno == errno.EADDRINUSE else "")
                + ("; is_host=1 but the endpoint host is not an address of this machine"
                   if exc.errno == errno.EADDRNOTAVAIL else ""),
                note=f"tried to host the store: {exc}")) from None
        if s.bind_addr and s.bind_addr != target:
            port = server.port
            server.close()
            server = StoreServer(s.bind_addr, port)
            try:
                server.bind()
            except StoreBindError as exc:
                server.close()
                raise RendezvousFailed(self._describe(f"could not host the store on bind_addr={s.bind_addr}: {exc}",
                                                      note="tried to host the store")) from None
        bound = server._listener.getsockname()[0]
        if not s.bind_addr and not _is_loopback(self._endpoint_host) and _is_loopback(bound):
            log.warning("fsm rendezvous: --rdzv-endpoint host %s resolves to %s on this machine, so the store is "
                        "reachable from this machine only; use an IP address in --rdzv-endpoint or "
                        "--rdzv-conf bind_addr=0.0.0.0 for other nodes", self._endpoint_host, bound)
        server.start()
        self._server = server
        self.port = server.port
        self._hosting_note = f"hosts the store (listening on {server.endpoint})"

    def _describe(self, message: str, note: str | None = None) -> str:
        s = self.settings
        return (f"fsm rendezvous failed: backend={BACKEND} endpoint={format_endpoint(self._connect_host, self.port)} "
                f"run_id={self.run_id} nnodes={self.min_nodes}:{self.max_nodes} join_timeout={s.join_timeout:g}s; "
                f"this node {note or self._hosting_note}: {message}")

    # -- torch's RendezvousHandler interface -------------------------------------------------------------
    def get_backend(self) -> str:
        return BACKEND

    def get_run_id(self) -> str:
        return self.run_id

    def next_rendezvous(self) -> RendezvousInfo:
        """Join the next round; blocks until it completes (at most ``join_timeout``).

        Raises:
            RendezvousNotNeeded: the round is full (``max`` live nodes) and this node is not in it.
            RendezvousFailed: closed, timed out, or the store is unreachable (the message says which).
        """
        if self._shut:
            raise RendezvousFailed(self._describe("next_rendezvous after shutdown()"))
        with self._cv:
            self._round = None
            self._gen += 1
            self._lost, self._self_lost, self._waiting, self._store_error = set(), False, 0, None
        try:
            self._ensure_started()
            return self._join()
        except StoreError as exc:
            raise RendezvousFailed(self._describe(str(exc))) from None

    def _ensure_started(self) -> None:
        if self._started:
            return
        self._client.connect()
        s = self.settings
        # The first connection may wait join_timeout for a host that starts later; once the store
        # was reached, losing it for read_timeout fails the rendezvous.
        self._client.connect_timeout = min(self._client.connect_timeout, s.read_timeout)
        # A one-node job has no peer to lose or admit: its lease lives as long as its connection,
        # and no keep-alive or membership thread wakes the idle agent.
        single = self.max_nodes == 1
        self._hb_client.set(self._alive_key, self.node_id, ttl=None if single else s.keep_alive_timeout,
                            ephemeral=True)
        self._started = True
        for name, target in () if single else (("keep-alive", self._heartbeat_loop), ("membership", self._watch_loop)):
            t = threading.Thread(target=target, name=f"fsm-rdzv-{name}-{self.run_id}", daemon=True)
            t.start()
            self._threads.append(t)

    def _read(self) -> "_Snapshot":
        values, versions, listing, now = self._client.get_versioned([self._state_key, self._event_key],
                                                                    prefix=self._alive_prefix)
        raw = values[0]
        return _Snapshot(raw, self._decode(raw), versions[0], versions[1], listing, now)

    def _decode(self, raw: bytes | None) -> dict:
        if raw is None:
            return fresh_state()
        try:
            st = json.loads(raw)
        except ValueError:
            st = None
        if not isinstance(st, dict) or st.get("schema") != SCHEMA:
            raise RendezvousFailed(self._describe(f"the key {self._state_key} does not hold fsm rendezvous state "
                                                  f"(schema {SCHEMA}); another program writes to this store?"))
        return st

    def _cas(self, snap: "_Snapshot", new: dict) -> tuple[bool, "_Snapshot | None"]:
        """Write ``new`` over ``snap``; ``(ok, the snapshot to retry from or None to re-read)``.

        A lost race hands back the winner's state, reused when it names no node missing from the
        lease listing (a node unknown to the listing must not look dead). Changes that waiting
        nodes must see (round opened or completed, closed) also bump the event key they watch.
        """
        desired = json.dumps(new, sort_keys=True, separators=(",", ":")).encode()
        value, version, now = self._client.compare_set_versioned(self._state_key, snap.raw or b"", desired)
        if value == desired:
            old = snap.state
            if (new["round"], new["complete"], new["closed"]) != (old["round"], old["complete"], old["closed"]):
                self._client.add(self._event_key, 1)
            return True, None
        try:
            st = self._decode(value)
        except RendezvousFailed:
            return False, None
        listed = {k[len(self._alive_prefix):] for k in snap.listing}
        if not set(st.get("nodes", ())) <= listed | {self.node_id}:
            return False, None
        return False, _Snapshot(value, st, version, snap.event_version, snap.listing, now)

    def _join(self) -> RendezvousInfo:
        s = self.settings
        deadline = time.monotonic() + s.join_timeout
        me_info = {"addr": self.addr, "host": self.hosts_store, "node_rank": s.node_rank, "port": _free_port()}
        snap: _Snapshot | None = None
        while True:
            snap = snap or self._read()
            st, listing, now = snap.state, snap.listing, snap.now
            alive = {k[len(self._alive_prefix):] for k in listing}
            try:
                new, action, wait_s = plan(st, alive, self.node_id, me_info, now, min_nodes=self.min_nodes,
                                           max_nodes=self.max_nodes, last_call_timeout=s.last_call_timeout,
                                           rejoin_timeout=s.rejoin_timeout, returned_round=self._returned_round)
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise RendezvousFailed(self._describe(f"the state at {self._state_key} is corrupt "
                                                      f"({type(exc).__name__}: {exc})")) from None
            if new is not None:
                ok, snap = self._cas(snap, new)
                if ok and action == "not_needed":
                    raise RendezvousNotNeeded(
                        f"fsm rendezvous {self.run_id} at {self.endpoint}: round {st['round']} is complete with "
                        f"max_nodes={self.max_nodes} nodes; this node is not needed and leaves")
                continue
            snap_event, snap = snap.event_version, None
            if action == "finish":
                return self._finish(st)
            if action == "closed":
                raise RendezvousFailed(self._describe("the rendezvous is closed (set_closed() was called); "
                                                      "start a new job with another --rdzv-id"))
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._leave(remove_node=False)
                joined = len(st["participants"]) if not st["complete"] else 0
                raise RendezvousFailed(self._describe(
                    f"timed out after {s.join_timeout:g}s in round {st['round']}: {joined} node(s) joined, "
                    f"{len(st['wait_list'])} waiting; need {self.min_nodes} (raise join_timeout or start more nodes)"))
            # Joins do not wake waiting nodes (the joiner itself checks for completion next); the
            # event key (round opened/completed, closed), a lease that ends, or the deadline do.
            versions = {self._event_key: snap_event}
            for n in st["nodes"]:
                key = self._alive_prefix + n
                versions[key] = listing.get(key, 0)
            timeout = remaining if wait_s is None else min(wait_s, remaining)
            if timeout > 0:
                self._client.watch(versions, timeout)

    def _finish(self, st: dict) -> RendezvousInfo:
        parts = st["participants"]
        rnd = st["round"]
        master = st["master"]
        self._returned_round = rnd
        with self._cv:
            self._gen += 1
            self._round = _Round(rnd, list(parts))
            self._lost, self._self_lost, self._waiting, self._store_error = set(), False, 0, None
            self._drain()
            self._cv.notify_all()
        try:
            self._client.add(self._wake_key, 1)  # wakes the membership thread if it watches an older round
        except StoreError:
            pass
        store = PrefixStore(f"{self._base}/round/{rnd}", self._client)
        log.info("fsm rendezvous %s round %s complete: rank %s of %s, master %s:%s", self.run_id, rnd,
                 parts[self.node_id], len(parts), master["addr"], master["port"])
        return RendezvousInfo(store, parts[self.node_id], len(parts),
                              RendezvousStoreInfo(master["addr"], int(master["port"])))

    def _leave(self, remove_node: bool = True) -> None:
        """Remove this node from the state (wait list, an incomplete round; ``remove_node``: everything)."""
        while True:
            snap = self._read()
            st = snap.state
            if snap.raw is None:
                return
            new = copy.deepcopy(st)
            new["wait_list"].pop(self.node_id, None)
            if not new["complete"]:
                new["participants"].pop(self.node_id, None)
            if remove_node:
                new["nodes"].pop(self.node_id, None)
                new["previous"] = [n for n in new["previous"] if n != self.node_id]
            if new == st or self._cas(snap, new)[0]:
                return

    def num_nodes_waiting(self) -> int:
        """Nodes waiting for a new round: another participant opened one, or nodes have waited
        ``last_call_timeout`` to join. 0 while this node is not in a completed round."""
        with self._cv:
            return self._waiting

    def num_nodes_lost(self) -> int:
        """Participants of this node's round that are gone (lease expired or left); this node
        counts itself when its own lease lapsed, and the store counts when it became unreachable."""
        with self._cv:
            lost = len(self._lost) + (1 if self._self_lost else 0)
            return max(lost, 1) if self._store_error else lost

    def membership_fd(self) -> int:
        """A file descriptor that is readable while ``num_nodes_lost() or num_nodes_waiting()``
        says the round should be redone; cleared by the next ``next_rendezvous()``."""
        return self._fd_r

    def is_closed(self) -> bool:
        try:
            st = self._read().state
        except StoreError as exc:
            raise RendezvousFailed(self._describe(str(exc))) from None
        return bool(st["closed"])

    def set_closed(self) -> None:
        """Close the rendezvous for every node of this run (no one can join it again)."""
        try:
            while True:
                snap = self._read()
                if snap.state["closed"]:
                    return
                new = copy.deepcopy(snap.state)
                new["closed"] = True
                if self._cas(snap, new)[0]:
                    return
        except StoreError as exc:
            raise RendezvousFailed(self._describe(str(exc))) from None

    def shutdown(self) -> bool:
        """Leave the rendezvous (never closes it for the others) and release the connections.

        The store host waits up to ``linger_timeout`` for the other nodes to leave first.
        Returns False when the store could not be reached to leave cleanly.
        """
        if self._shut:
            return True
        self._shut = True
        self._stop.set()
        with self._cv:
            self._cv.notify_all()
        self._watch_client.abort()
        self._client.connect_timeout = min(self._client.connect_timeout, self.settings.handshake_timeout)
        ok = True
        try:
            if self._started:
                self._leave()
                for t in self._threads:
                    if t.name.startswith("fsm-rdzv-keep-alive"):
                        t.join(timeout=self.settings.handshake_timeout)
                try:
                    self._hb_client.delete_key(self._alive_key)
                except StoreError:
                    pass
                if self._server is not None:
                    self._linger()
        except (StoreError, RendezvousFailed) as exc:
            log.warning("fsm rendezvous %s: could not leave cleanly: %s", self.run_id, exc)
            ok = False
        finally:
            for c in (self._client, self._hb_client, self._watch_client):
                c.close()
            if self._server is not None:
                self._server.close()
            for fd in (self._fd_r, self._fd_w):
                try:
                    os.close(fd)
                except OSError:
                    pass
        return ok

    def _linger(self) -> None:
        deadline = time.monotonic() + self.settings.linger_timeout
        while True:
            snap = self._read()
            st, version, listing = snap.state, snap.state_version, snap.listing
            others = [n for n in st["nodes"] if n != self.node_id and self._alive_prefix + n in listing]
            remaining = deadline - time.monotonic()
            if not others or remaining <= 0:
                if others:
                    log.warning("fsm rendezvous %s: the store host exits while %d node(s) still use the store",
                                self.run_id, len(others))
                return
            versions = {self._state_key: version, **{self._alive_prefix + n: listing[self._alive_prefix + n]
                                                      for n in others}}
            self._client.watch(versions, remaining)

    # -- background threads ---------------------------------------------------------------------------
    def _signal(self) -> None:  # holds self._cv
        if not self._signalled:
            self._signalled = True
            try:
                os.write(self._fd_w, b"!")
            except OSError:
                pass

    def _drain(self) -> None:  # holds self._cv
        self._signalled = False
        try:
            while os.read(self._fd_r, 512):
                pass
        except (BlockingIOError, OSError):
            pass

    def _heartbeat_loop(self) -> None:
        s = self.settings
        c = self._hb_client
        while not self._stop.wait(s.keep_alive_interval):
            try:
                if not c.touch([self._alive_key], s.keep_alive_timeout)[0]:
                    if self._stop.is_set():
                        return
                    c.set(self._alive_key, self.node_id, ttl=s.keep_alive_timeout, ephemeral=True)
                    log.warning("fsm rendezvous %s: this node's keep-alive lapsed; the others may count it lost",
                                self.run_id)
                    with self._cv:
                        if self._round is not None:
                            self._self_lost = True
                            self._signal()
            except StoreError as exc:
                if self._stop.is_set():
                    return
                log.warning("fsm rendezvous %s: keep-alive to %s failed: %s", self.run_id, self.endpoint, exc)

    def _watch_loop(self) -> None:
        c = self._watch_client
        s = self.settings
        while not self._stop.is_set():
            with self._cv:
                while self._round is None and not self._stop.is_set():
                    self._cv.wait()
                if self._stop.is_set():
                    return
                rnd, gen = self._round, self._gen
            try:
                values, versions, listing, now = c.get_versioned([self._state_key, self._wake_key],
                                                                 prefix=self._alive_prefix)
                st = json.loads(values[0]) if values[0] is not None else None
                alive = {k[len(self._alive_prefix):] for k in listing}
                lost = {p for p in rnd.participants if p != self.node_id and p not in alive}
                waiting, timeout, watch_nodes = 0, 3600.0, list(rnd.participants)
                if not isinstance(st, dict) or st.get("round") != rnd.round:
                    others = set((st or {}).get("participants", {})) | set((st or {}).get("wait_list", {}))
                    waiting = max(1, len(others - {self.node_id}))
                elif not st.get("closed"):
                    live_parts = [p for p in st["participants"] if p in alive]
                    waiters = {n: t for n, t in st["wait_list"].items() if n in alive}
                    watch_nodes += list(waiters)
                    if waiters and len(live_parts) < self.max_nodes:
                        oldest = min(waiters.values())
                        if now - oldest >= s.last_call_timeout:
                            waiting = len(waiters)
                        else:
                            timeout = oldest + s.last_call_timeout - now
                with self._cv:
                    if gen != self._gen:
                        continue
                    self._lost |= lost
                    self._waiting = waiting
                    if self._lost or self._waiting or self._self_lost:
                        self._signal()
                watch = {self._state_key: versions[0], self._wake_key: versions[1]}
                for n in watch_nodes:
                    key = self._alive_prefix + n
                    watch[key] = listing.get(key, 0)
                c.watch(watch, timeout)
            except Exception as exc:  # store gone, or state this code cannot read: redo the round
                if self._stop.is_set():
                    return
                log.warning("fsm rendezvous %s: lost the store at %s: %s", self.run_id, self.endpoint, exc)
                with self._cv:
                    if gen == self._gen:
                        self._store_error = str(exc)
                        self._signal()
                    while self._gen == gen and not self._stop.is_set():
                        self._cv.wait()

    def __repr__(self) -> str:
        return (f"FsmRendezvousHandler(run_id={self.run_id!r}, endpoint={self.endpoint!r}, "
                f"nnodes={self.min_nodes}:{self.max_nodes}, node={self.node_id!r}, hosts_store={self.hosts_store})")


def create_fsm_handler(params: Any) -> FsmRendezvousHandler:
    """``RendezvousParameters -> handler`` for backend ``fsm``.

    ``params`` is any object with ``endpoint``, ``run_id``, ``min_nodes``, ``max_nodes``,
    ``local_addr`` and ``config`` (a dict of ``--rdzv-conf`` values, plus ``node_rank``) and/or
    ``get(key, default)``: torch's ``RendezvousParameters`` qualifies, and needs no torch here.
    """
    settings = FsmRendezvousSettings.from_params(params)
    return FsmRendezvousHandler(run_id=str(params.run_id), endpoint=params.endpoint or "",
                                min_nodes=int(params.min_nodes), max_nodes=int(params.max_nodes),
                                local_addr=getattr(params, "local_addr", None), settings=settings)


@hookimpl
def fsm_agent_register_backends(registry):
    registry.add_rendezvous(BACKEND, create_fsm_handler,
                            conf_keys=(*(f.name for f in fields(FsmRendezvousSettings)), "rank"))
