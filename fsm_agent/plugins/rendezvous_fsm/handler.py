"""The ``fsm`` rendezvous handler: torch's ``RendezvousHandler`` interface on the store beside it,
driven by the planner (see the package docstring for the protocol)."""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import attrs

from fsm_agent.errors import ConfigError, RendezvousFailed, RendezvousNotNeeded
from fsm_agent.plugins.rendezvous_fsm.params import (
    BACKEND,
    FsmRendezvousSettings,
    free_port,
    is_loopback,
    parse_endpoint,
)
from fsm_agent.plugins.rendezvous_fsm.store import (
    PrefixStore,
    StoreBindError,
    StoreClient,
    StoreError,
    StoreServer,
    format_endpoint,
)

log = logging.getLogger(__name__)


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


@dataclass
class _Round:
    round: int


@attrs.define
class _WatchedKeys:
    """Keys of the round's store that the membership watch carries (``subscribe``), under the
    handler's ``_cv``."""

    #: a key of this node's own: setting it answers the watch held now, so the next carries a new key
    poke_key: str
    poke_version: int = 0
    #: round-relative keys subscribed to in some round: every later round's watch carries them
    sticky: set[str] = attrs.Factory(set)
    #: this round's watched keys (full names) -> the version the store last reported (0: missing)
    versions: dict[str, int] = attrs.Factory(dict)
    callbacks: dict[str, list[Callable[[], None]]] = attrs.Factory(dict)
    #: the keys of the watch held now (None: none is)
    in_flight: frozenset[str] | None = None


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
    #: next_rendezvous and the store's waits are select-based Python: the agent calls them in its own
    #: thread, where a stop signal interrupts them (so shutdown() never races a join still running).
    interruptible = True

    def __init__(
        self,
        run_id: str,
        endpoint: str,
        min_nodes: int,
        max_nodes: int,
        local_addr: str | None = None,
        settings: FsmRendezvousSettings | None = None,
    ):
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
            raise ConfigError(
                f"--rdzv-endpoint {endpoint!r}: port 0 (a free port) only works on the node that hosts "
                f"the store; this node {self._hosting_note}"
            )
        loopback = is_loopback(self._connect_host)
        self.addr = local_addr or ("127.0.0.1" if loopback else socket.getfqdn())
        self.node_id = f"{self.addr}_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        base = f"fsm_rdzv/{run_id}"
        self._base = base
        self._alive_key = f"{base}/alive/{self.node_id}"
        self._keep_alive_interval, self._keep_alive_timeout = s.keep_alive_for(max_nodes)
        self._renewed_at: float | None = None  # monotonic time of the last keep-alive answer
        self._keep_alive_hold = s.keep_alive_hold_for(max_nodes)
        fast = self._port_taken
        # A busy store makes a joining node wait, never fail: until the join timeout, a slow
        # hello counts as load. Only after finding the endpoint port taken (by a store or by some
        # other program) does the short handshake_timeout tell the two apart.
        patience = s.handshake_timeout if fast else max(s.join_timeout, s.handshake_timeout)
        # Two connections per node, whatever N: the join's (also the round store's, and the lease's
        # owner, so a killed agent is lost at once), and one for the keep-alive thread, whose
        # renewals ride on its blocked membership watch. Replies wait join_timeout: a busy store
        # is load, and a reply given up on would reset the connection and so drop the lease.
        timeouts = dict(
            timeout=s.read_timeout,
            connect_timeout=patience,
            handshake_timeout=patience,
            reply_timeout=max(s.join_timeout, s.handshake_timeout),
        )
        self._client = StoreClient(self._connect_host, self.port, fail_fast_refused=fast, **timeouts)
        # The keep-alive starts once the join's client shook hands: it sends no hello of its own.
        self._alive_client = StoreClient(self._connect_host, self.port, handshake=False, **timeouts)
        self._started = False
        self._shut = False
        self._returned_round: int | None = None
        self._stop = threading.Event()
        self._cv = threading.Condition()
        self._round: _Round | None = None
        self._gen = 0
        self._lost = 0
        self._self_lost = False
        self._waiting = 0
        self._store_error: str | None = None
        self._fd_r, self._fd_w = os.pipe()
        os.set_blocking(self._fd_r, False)
        os.set_blocking(self._fd_w, False)
        self._signalled = False
        self._threads: list[threading.Thread] = []
        self._keys = _WatchedKeys(f"{base}/poke/{self.node_id}")
        #: called with a one-line message when this node becomes a standby (the agent logs it,
        #: records a ``standby`` event and shows it in ``fsm-agent status``); None: log only
        self.on_standby: Callable[[str], None] | None = None
        #: this node waits as a hot spare (its join found no seat); False once ranked
        self.standby = False

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
                raise ConfigError(
                    f"--rdzv-endpoint {self.endpoint}: port 0 means 'host the store on a free port', "
                    f"which is_host=0 forbids; give the store's port"
                )
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
                self._hosting_note = (
                    f"found {format_endpoint(target, self.port)} taken when it started, so joined the "
                    f"store there as a client (another agent on this machine hosts it)"
                )
                return
            raise RendezvousFailed(
                self._describe(
                    f"could not host the store at {format_endpoint(target, self.port)}: {exc}"
                    + ("; is_host=1 was given" if explicit else "")
                    + (
                        "; the port is taken by another program: free it or pick another --rdzv-endpoint port"
                        if exc.errno == errno.EADDRINUSE
                        else ""
                    )
                    + (
                        "; is_host=1 but the endpoint host is not an address of this machine"
                        if exc.errno == errno.EADDRNOTAVAIL
                        else ""
                    ),
                    note=f"tried to host the store: {exc}",
                )
            ) from None
        if s.bind_addr and s.bind_addr != target:
            port = server.port
            server.close()
            server = StoreServer(s.bind_addr, port)
            try:
                server.bind()
            except StoreBindError as exc:
                server.close()
                raise RendezvousFailed(
                    self._describe(
                        f"could not host the store on bind_addr={s.bind_addr}: {exc}", note="tried to host the store"
                    )
                ) from None
        bound = server._listener.getsockname()[0]
        if not s.bind_addr and not is_loopback(self._endpoint_host) and is_loopback(bound):
            log.warning(
                "fsm rendezvous: --rdzv-endpoint host %s resolves to %s on this machine, so the store is "
                "reachable from this machine only; use an IP address in --rdzv-endpoint or "
                "--rdzv-conf bind_addr=0.0.0.0 for other nodes",
                self._endpoint_host,
                bound,
            )
        server.start()
        self._server = server
        self.port = server.port
        self._hosting_note = f"hosts the store (listening on {server.endpoint})"

    def _describe(self, message: str, note: str | None = None) -> str:
        s = self.settings
        return (
            f"fsm rendezvous failed: backend={BACKEND} endpoint={format_endpoint(self._connect_host, self.port)} "
            f"run_id={self.run_id} nnodes={self.min_nodes}:{self.max_nodes} join_timeout={s.join_timeout:g}s; "
            f"this node {note or self._hosting_note}: {message}"
        )

    # -- torch's RendezvousHandler interface -------------------------------------------------------------
    def get_backend(self) -> str:
        return BACKEND

    def get_run_id(self) -> str:
        return self.run_id

    def next_rendezvous(self) -> RendezvousInfo:
        """Join the next round; blocks until it completes (at most ``join_timeout``).

        A node that finds the round full (``max`` live nodes) waits as a standby (``on_standby``
        is called once) until a seat frees up, without ``join_timeout``.

        Raises:
            RendezvousNotNeeded: a standby's job ended (its nodes have all left).
            RendezvousFailed: closed, timed out, or the store is unreachable (the message says which).
        """
        if self._shut:
            raise RendezvousFailed(self._describe("next_rendezvous after shutdown()"))
        with self._cv:
            self._round = None
            self._gen += 1
            self._lost, self._self_lost, self._waiting, self._store_error = 0, False, 0, None
            self._keys.versions, self._keys.callbacks = {}, {}
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
        self._client.handshake_timeout = s.handshake_timeout
        # A one-node job has no peer to lose or admit: its lease lives as long as its connection,
        # and no keep-alive or membership thread wakes the idle agent.
        single = self.max_nodes == 1
        #: the lease's ttl, sent with each join, which (re)creates the lease on the join's connection
        #: (no round trip before the join); None: it lives as long as that connection
        self._lease_ttl = None if single else self._keep_alive_timeout
        self._started = True
        if not single:
            t = threading.Thread(target=self._keep_alive_loop, name=f"fsm-rdzv-keep-alive-{self.run_id}", daemon=True)
            t.start()
            self._threads.append(t)

    def _join(self) -> RendezvousInfo:
        s = self.settings
        deadline = time.monotonic() + s.join_timeout
        info = {"addr": self.addr, "host": self.hosts_store, "node_rank": s.node_rank, "port": free_port()}
        self.standby = False
        while True:
            # A standby waits for a seat as long as the job runs (torch's redundancy list: no join_timeout).
            remaining = s.join_timeout if self.standby else deadline - time.monotonic()
            reply = self._client.rendezvous(
                "join",
                max(0.0, remaining),
                run=self.run_id,
                node=self.node_id,
                lease=self._alive_key,
                lease_ttl=self._lease_ttl,
                info=info,
                min=self.min_nodes,
                max=self.max_nodes,
                last_call_timeout=s.last_call_timeout,
                rejoin_timeout=s.rejoin_timeout,
                returned_round=self._returned_round,
                standby=self.standby,
                probe=self._keep_alive_interval,
            )
            status = reply.get("status")
            if status == "ranked":
                if self.standby:
                    log.info("fsm rendezvous %s: this standby takes a seat in round %s", self.run_id, reply["round"])
                self.standby = False
                return self._finish(reply)
            if status in ("standby", "done") or (status == "timeout" and self.standby):
                self._standby_reply(reply)
                continue
            if status == "no_lease":  # this node's lease lapsed while it waited (a long stall): join again
                continue
            if status == "not_needed":
                raise RendezvousNotNeeded(
                    f"fsm rendezvous {self.run_id} at {self.endpoint}: round {reply['round']} is complete with "
                    f"max_nodes={self.max_nodes} nodes; this node is not needed and leaves"
                )
            if status == "closed":
                raise RendezvousFailed(
                    self._describe(
                        "the rendezvous is closed (set_closed() was called); start a new job with another --rdzv-id"
                    )
                )
            if status == "timeout":
                raise RendezvousFailed(
                    self._describe(
                        f"timed out after {s.join_timeout:g}s in round {reply['round']}: {reply['joined']} node(s) "
                        f"joined, {reply['waiting']} waiting; need {self.min_nodes} "
                        f"(raise join_timeout or start more nodes)"
                    )
                )
            raise RendezvousFailed(self._describe(f"the store answered the join with {str(reply)[:120]!r}"))

    def _standby_reply(self, reply: dict) -> None:
        """A hot spare's answers: ``standby`` (tell the agent, then wait), ``done`` (the job's
        nodes have all left: leave as not needed, torch's graceful exit of its redundancy list),
        ``timeout`` (a standby's wait ran ``join_timeout``: wait again).

        Raises:
            RendezvousNotNeeded: ``done``.
        """
        status = reply["status"]
        if status == "done":
            raise RendezvousNotNeeded(
                f"fsm rendezvous {self.run_id} at {self.endpoint}: standby: the job's nodes have all left "
                f"(round {reply['round']}); this standby is not needed and leaves"
            )
        if status == "standby":
            self.standby = True
            message = (
                f"standby: the job has {self.max_nodes} nodes (fsm rendezvous {self.run_id} round "
                f"{reply['round']}); this node waits, running no workers, to take the seat of a lost node"
            )
            (self.on_standby or log.warning)(message)

    def _finish(self, reply: dict) -> RendezvousInfo:
        rnd, rank, world, master = int(reply["round"]), int(reply["rank"]), int(reply["world"]), reply["master"]
        self._returned_round = rnd
        with self._cv:
            self._gen += 1
            self._round = _Round(rnd)
            self._lost, self._self_lost, self._waiting, self._store_error = 0, False, 0, None
            self._keys.versions = {f"{self._base}/round/{rnd}/{rel}": 0 for rel in self._keys.sticky}
            self._keys.callbacks = {}
            self._drain()
            self._cv.notify_all()
        store = PrefixStore(f"{self._base}/round/{rnd}", self._client, functools.partial(self._subscribe, rnd))
        log.info(
            "fsm rendezvous %s round %s complete: rank %s of %s, master %s:%s",
            self.run_id,
            rnd,
            rank,
            world,
            master["addr"],
            master["port"],
        )
        return RendezvousInfo(store, rank, world, RendezvousStoreInfo(master["addr"], int(master["port"])))

    def _leave(self, forget: bool = True) -> None:
        """Leave the wait list and an incomplete round; ``forget``: the run too (the store's ``leave``)."""
        self._client.rendezvous("leave", run=self.run_id, node=self.node_id, forget=forget)

    def num_nodes_waiting(self) -> int:
        """Nodes waiting for a new round: another participant opened one, or nodes have waited
        ``last_call_timeout`` to join. 0 while this node is not in a completed round."""
        with self._cv:
            return self._waiting

    def num_nodes_lost(self) -> int:
        """Participants of this node's round that are gone (lease expired or left); this node
        counts itself when its own lease lapsed, and the store counts when it became unreachable.

        Non-zero as soon as the first is lost; the count itself is brought up to date every
        ``keep_alive_hold`` (the store wakes watchers once per round, not once per lost node)."""
        with self._cv:
            lost = self._lost + (1 if self._self_lost else 0)
            return max(lost, 1) if self._store_error else lost

    def membership_fd(self) -> int:
        """A file descriptor that is readable while ``num_nodes_lost() or num_nodes_waiting()``
        says the round should be redone; cleared by the next ``next_rendezvous()``."""
        return self._fd_r

    def is_closed(self) -> bool:
        try:
            return bool(self._client.rendezvous("status", run=self.run_id)["closed"])
        except StoreError as exc:
            raise RendezvousFailed(self._describe(str(exc))) from None

    def set_closed(self) -> None:
        """Close the rendezvous for every node of this run (no one can join it again)."""
        try:
            self._client.rendezvous("close", run=self.run_id)
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
        self._alive_client.abort()  # wakes the keep-alive thread from its watch
        # On the way out a store that does not answer (its network gone with the pod, as Kubernetes
        # stops one) must not hold the stop past a short wait: the join's patience is for load.
        self._client.connect_timeout = min(self._client.connect_timeout, self.settings.handshake_timeout)
        self._client.reply_timeout = min(self._client.reply_timeout, self.settings.handshake_timeout)
        ok = True
        try:
            if self._started:
                self._leave(forget=True)
                for t in self._threads:
                    if t.name.startswith("fsm-rdzv-keep-alive"):
                        t.join(timeout=self.settings.handshake_timeout)
                with contextlib.suppress(StoreError):
                    self._client.delete_key(self._alive_key)
                if self._server is not None:
                    self._linger()
        except (StoreError, RendezvousFailed) as exc:
            log.warning("fsm rendezvous %s: could not leave cleanly: %s", self.run_id, exc)
            ok = False
        finally:
            for c in (self._client, self._alive_client):
                c.close()
            if self._server is not None:
                self._server.close()
            for fd in (self._fd_r, self._fd_w):
                with contextlib.suppress(OSError):
                    os.close(fd)
        return ok

    def _linger(self) -> None:
        others = self._client.rendezvous("linger", self.settings.linger_timeout, run=self.run_id, node=self.node_id)[
            "others"
        ]
        if others:
            log.warning(
                "fsm rendezvous %s: the store host exits while %d node(s) still use the store", self.run_id, others
            )

    # -- background threads ---------------------------------------------------------------------------
    def _signal(self) -> None:  # holds self._cv
        if not self._signalled:
            self._signalled = True
            with contextlib.suppress(OSError):
                os.write(self._fd_w, b"!")

    def _drain(self) -> None:  # holds self._cv
        self._signalled = False
        try:
            while os.read(self._fd_r, 512):
                pass
        except (BlockingIOError, OSError):
            pass

    def _subscribe(self, rnd: int, rel: str, callback: Callable[[], None]) -> bool:
        """``PrefixStore.subscribe`` of round ``rnd``'s store: the membership watch carries the key
        ``rel`` from now on (and in every later round from its start) and ``callback()`` is called
        on the keep-alive thread when the store answers that it changed. A watch held now without
        it is answered by setting this node's poke key (one request), so the next one carries it.
        False: no keep-alive watch (a one-node job, shut down, or not in round ``rnd``)."""
        full = f"{self._base}/round/{rnd}/{rel}"
        with self._cv:
            if self._shut or self.max_nodes == 1 or self._round is None or self._round.round != rnd:
                return False
            keys = self._keys
            keys.sticky.add(rel)
            keys.versions.setdefault(full, 0)
            keys.callbacks.setdefault(full, []).append(callback)
            seen = keys.versions[full] != 0
            poke = keys.in_flight is not None and full not in keys.in_flight
        if seen:  # the store reported it set already
            callback()
        if poke:
            try:
                self._client.set(self._keys.poke_key, uuid.uuid4().hex[:8], ephemeral=True)
            except StoreError as exc:  # the keep-alive reports a store that is gone
                log.debug("fsm rendezvous %s: could not renew the watch's keys: %s", self.run_id, exc)
                return False
        return True

    def _keep_alive_loop(self) -> None:
        """Keep this node's lease and watch its round's membership, on one connection: between
        rounds a ``touch`` every ``keep_alive_interval``; in a completed round one ``rdzv_watch``
        at a time, which the store holds up to ``keep_alive_hold`` while it keeps the lease alive,
        and answers at once when this node's round lost a participant, another round opened, nodes
        waited ``last_call_timeout`` to join (each event answers each watcher once), or a
        subscribed key changed (``_subscribe``). An idle node makes one request per hold."""
        due = time.monotonic() + self._keep_alive_interval
        while True:
            with self._cv:
                while self._round is None and not self._stop.is_set() and time.monotonic() < due:
                    self._cv.wait(max(0.0, due - time.monotonic()))
                if self._stop.is_set():
                    return
                rnd, gen, lost, waiting = self._round, self._gen, self._lost, self._waiting
                keys = self._keys
                versions = None if rnd is None else {keys.poke_key: keys.poke_version, **keys.versions}
                keys.in_flight = None if versions is None else frozenset(versions)
            try:
                reply, leased = self._renew(rnd, lost, waiting, versions)
            except Exception as exc:  # store gone, or a reply this code cannot read
                if self._stop.is_set():
                    return
                self._keep_alive_failed(exc, rnd, gen)
                due = time.monotonic() + self._keep_alive_interval
                continue
            finally:
                with self._cv:
                    self._keys.in_flight = None
            due = time.monotonic() + self._keep_alive_interval
            for callback in self._heard(reply, leased, gen):
                try:
                    callback()
                except Exception:  # a subscriber's bug must not stop the keep-alive
                    log.exception("fsm rendezvous %s: a key subscriber failed", self.run_id)

    def _renew(self, rnd: _Round | None, lost: int, waiting: int, versions: dict | None) -> tuple[dict | None, bool]:
        """One keep-alive exchange: a ``touch`` while joining (``rnd`` None), else the membership
        watch carrying ``versions`` (key -> version last seen). Returns ``(reply, leased)``:
        the watch's reply (None for a touch), and False when the lease had lapsed (it is set again)."""
        c, key, ttl = self._alive_client, self._alive_key, self._keep_alive_timeout
        sent, previous = time.monotonic(), self._renewed_at
        if rnd is None:
            # Joining: a lease not there yet (the join not read yet) or lapsed (the store then
            # answers the join no_lease) is (re)created by the join itself.
            c.touch([key], ttl)
            self._renewed_at = time.monotonic()
            return None, True
        reply = c.rendezvous(
            "watch",
            self._keep_alive_hold,
            run=self.run_id,
            node=self.node_id,
            round=rnd.round,
            lost=lost,
            waiting=waiting,
            lease=key,
            ttl=ttl,
            versions=versions,
        )
        self._renewed_at = time.monotonic()
        leased = reply.get("leased", True)
        if not leased and not self._stop.is_set():
            c.set(key, self.node_id, ttl=ttl, ephemeral=True)
            # Which side was late: this node (a long gap before it sent) or the store.
            gap = "unknown" if previous is None else f"{sent - previous:.2f} s"
            log.warning(
                "fsm rendezvous %s: this node's keep-alive lapsed (ttl %.2f s; this renewal was sent %s "
                "after the previous one was answered); the others may count it lost",
                self.run_id,
                ttl,
                gap,
            )
        return reply, leased

    def _keep_alive_failed(self, exc: Exception, rnd: _Round | None, gen: int) -> None:
        """The keep-alive could not reach the store: while joining the join reports it; in a
        round, the membership fd says so (redo the round) and this waits for the next one."""
        log.warning("fsm rendezvous %s: keep-alive to %s failed: %s", self.run_id, self.endpoint, exc)
        if rnd is None:
            return
        with self._cv:
            if gen == self._gen:
                self._store_error = str(exc)
                self._signal()
            while self._gen == gen and not self._stop.is_set():
                self._cv.wait()

    def _heard(self, reply: dict | None, leased: bool, gen: int) -> list[Callable[[], None]]:
        """Take a keep-alive reply of generation ``gen`` in: the counts, the membership fd, the
        watched keys' versions. Returns the subscribers to call (outside the lock)."""
        changed = dict((reply or {}).get("changed") or {})
        with self._cv:
            keys = self._keys
            if keys.poke_key in changed:
                keys.poke_version = int(changed.pop(keys.poke_key))
            if gen != self._gen:
                return []
            if not leased and self._round is not None:
                self._self_lost = True
            if reply is not None:
                self._lost = max(self._lost, int(reply["lost"]))
                self._waiting = int(reply["waiting"])
            if self._lost or self._waiting or self._self_lost:
                self._signal()
            callbacks = []
            for key, version in changed.items():
                if key in keys.versions:
                    keys.versions[key] = int(version)
                    callbacks += keys.callbacks.get(key, [])
            return callbacks

    def __repr__(self) -> str:
        return (
            f"FsmRendezvousHandler(run_id={self.run_id!r}, endpoint={self.endpoint!r}, "
            f"nnodes={self.min_nodes}:{self.max_nodes}, node={self.node_id!r}, hosts_store={self.hosts_store})"
        )


def create_fsm_handler(params: Any) -> FsmRendezvousHandler:
    """``RendezvousParameters -> handler`` for backend ``fsm``.

    ``params`` is any object with ``endpoint``, ``run_id``, ``min_nodes``, ``max_nodes``,
    ``local_addr`` and ``config`` (a dict of ``--rdzv-conf`` values, plus ``node_rank``) and/or
    ``get(key, default)``: torch's ``RendezvousParameters`` qualifies, and needs no torch here.
    """
    settings = FsmRendezvousSettings.from_params(params)
    return FsmRendezvousHandler(
        run_id=str(params.run_id),
        endpoint=params.endpoint or "",
        min_nodes=int(params.min_nodes),
        max_nodes=int(params.max_nodes),
        local_addr=getattr(params, "local_addr", None),
        settings=settings,
    )
