"""A small key-value store for fsm-agent's own rendezvous: a TCP server and a client, no torch.

Why not torch's TCPStore: it needs torch in the agent, and torch's dynamic rendezvous keeps its
state pickled in it. This store speaks line-delimited JSON only; nothing a peer sends is ever
unpickled or evaluated.

Protocol (one JSON object per line, UTF-8, in both directions; one reply per request, in order):

* The client opens with ``{"op": "hello", "proto": "fsm-store/1"}``; the server answers
  ``{"ok": true, "proto": "fsm-store/1", "now": T}``. A peer that does not answer that way is not
  an fsm store (a port held by an unrelated program fails fast, see ``StoreProtocolError``).
  A client that another one in its process already shook hands with (``handshake=False``: the
  rendezvous keep-alive's) sends no hello: its first request on each connection carries
  ``"proto"`` instead, and the server refuses a request whose ``proto`` is not its own
  (``"error": "bad_proto"``, and it closes the connection). One request fewer per connection: a
  quarter of a node's requests in a rendezvous.
* Requests are ``{"op": NAME, ...}``; replies are ``{"ok": true, ...}`` or
  ``{"ok": false, "error": "timeout" | "bad_request" | "bad_proto", "message": "..."}``.
* Keys are strings; values are bytes, sent base64-encoded.
* ``now`` is the server's monotonic clock in seconds. Rendezvous deadlines and key leases use
  this one clock, so clock skew between machines does not matter.

Operations (``StoreClient`` method in brackets): set, get (blocks until the key exists), add
(atomic counter), compare_set, multi_get (blocks until all exist), multi_set, check, wait,
delete_key, num_keys, stats, and for the rendezvous: get_versioned (values, versions, a prefix listing
and ``now`` in one round trip), watch (block until a key's version changes), touch (extend
leases), and the ``rdzv_*`` operations (``StoreServer._rdzv_handle``). Every mutation gives the key
a new version (a server-wide counter); a missing key has version 0.

Blocking operations (get, multi_get, wait, watch) wait on the server: the server answers when a
mutation satisfies them or their timeout passes. Clients never poll and never sleep, except
between attempts to connect to a server that is not listening yet (a short backoff).

Leases: ``set(key, value, ttl=s)`` makes the key expire ``s`` seconds after its last ``set`` or
``touch``; ``ephemeral=True`` also deletes it when the connection that set it closes (the
process died). Deletion by expiry is a mutation: watchers wake at once. A rendezvous node's
lease is also renewed by its held membership watch (``rdzv_watch`` with ``lease``/``ttl``): the
store keeps the lease while it holds the watch, and ``ttl`` seconds after it answered it, so an
idle node renews its lease with one request per watch, not one per ``ttl``; the node's
``rdzv_join`` answers its held watch (and a watch from a node that is joining is answered at
once), so that its keep-alive's ``touch`` renews the lease while it joins. The connection that
owns a node's lease (its ``rdzv_join``'s) gets TCP keep-alive probes every ``probe`` seconds
(whole seconds, at least 1) and ``TCP_USER_TIMEOUT`` = ``ttl``: a host that goes silent (power
off, partition) has its connection closed by this host's kernel, and so its lease ended, about
``ttl`` (+ up to one probe) seconds after it was last heard; probes cost no request.

The server (``StoreServer``) is one ``selectors`` loop in a daemon thread, so every operation is
atomic without locks. ``python -m fsm_agent.store --host H --port P`` (a stable name for ``main`` below) runs one on its own.
"""

from __future__ import annotations

import array
import base64
import contextlib
import fcntl
import heapq
import itertools
import json
import logging
import os
import selectors
import socket
import termios
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import Any, ClassVar

from fsm_agent.errors import RendezvousFailed
from fsm_agent.plugins.rendezvous_fsm.planner import Node, Rendezvous

log = logging.getLogger(__name__)

PROTO = "fsm-store/1"
#: Largest request or reply line, in bytes; a longer line closes the connection.
MAX_LINE = 64 * 1024 * 1024
DEFAULT_TIMEOUT = timedelta(seconds=300)
#: How long a connected peer gets to answer the hello (and a reply gets beyond its op's timeout).
DEFAULT_HANDSHAKE_TIMEOUT = 3.0
_RECV = 256 * 1024


# -- errors ------------------------------------------------------------------------------------------
class StoreError(RendezvousFailed):
    """A store operation failed; the message names the endpoint."""


class StoreTimeout(StoreError, TimeoutError):
    """A blocking get/multi_get/wait did not complete within its timeout."""


class StoreConnectionError(StoreError, ConnectionError):
    """The server could not be reached, or the connection broke during a request."""


class StoreProtocolError(StoreError):
    """The peer at the endpoint does not speak the fsm-store protocol (or sent a malformed reply)."""


class StoreBindError(StoreError):
    """The server could not listen at the requested address. ``errno`` is the OSError's errno."""

    def __init__(self, message: str, errno_: int | None = None):
        super().__init__(message)
        self.errno = errno_


def _b64(value: bytes) -> str:
    return base64.b64encode(value).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"), validate=True)


def _to_bytes(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"store values must be str or bytes, not {type(value).__name__}")


def _seconds(timeout: timedelta | float | None) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        return timeout.total_seconds()
    return float(timeout)


def format_endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _reject_constant(name: str):
    raise ValueError(f"{name} is not allowed")  # NaN/Infinity would break deadlines and leases


def _unread(sock: socket.socket) -> bool:
    """True when ``sock`` holds received bytes not read yet."""
    buf = array.array("i", [0])
    try:
        fcntl.ioctl(sock.fileno(), termios.FIONREAD, buf, True)
    except OSError:
        return False
    return buf[0] > 0


def _probe_silent_peer(sock: socket.socket, ttl: float, probe: float) -> None:
    """Have this host's kernel close ``sock`` once its peer went silent for about ``ttl`` seconds
    (power off, partition: no FIN, no RST ever comes): TCP keep-alive probes every ``probe``
    seconds (whole seconds, at least 1) while it is idle, and ``TCP_USER_TIMEOUT`` = ``ttl`` (an
    unanswered probe or unacknowledged data for that long resets it). Answered by the peer's kernel,
    so a live but busy agent is never dropped; no request is made. Best effort: a platform
    without these options keeps the lease's ``ttl`` alone."""
    step = max(1, round(probe))
    options = [
        (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
        (socket.IPPROTO_TCP, getattr(socket, "TCP_KEEPIDLE", None), step),
        (socket.IPPROTO_TCP, getattr(socket, "TCP_KEEPINTVL", None), step),
        (socket.IPPROTO_TCP, getattr(socket, "TCP_KEEPCNT", None), max(1, -(-round(ttl) // step))),
        (socket.IPPROTO_TCP, getattr(socket, "TCP_USER_TIMEOUT", None), max(1, round(ttl * 1000))),
    ]
    for level, option, value in options:
        if option is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(level, option, value)


def _encode(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode("utf-8") + b"\n"


# -- server ------------------------------------------------------------------------------------------
class _Entry:
    __slots__ = ("value", "version", "expiry", "owner", "renewer")

    def __init__(self, value: bytes, version: int):
        self.value, self.version = value, version
        self.expiry: float | None = None
        self.owner: _Conn | None = None
        self.renewer: _Conn | None = None  # the connection its lease was last renewed on


class _Conn:
    __slots__ = ("sock", "inbuf", "outbuf", "lines", "waiter", "owned", "closed", "name", "close_after_flush")

    def __init__(self, sock: socket.socket, name: str):
        self.sock, self.name = sock, name
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.lines: deque[bytes] = deque()
        self.waiter: _Waiter | None = None
        self.owned: set[str] = set()
        self.closed = False
        self.close_after_flush = False


class _Waiter:
    __slots__ = ("conn", "kind", "keys", "versions", "deadline", "done", "run", "req")

    def __init__(self, conn: _Conn, kind: str, keys: list[str], versions: dict[str, int] | None, deadline: float):
        self.conn, self.kind, self.keys, self.versions, self.deadline = conn, kind, keys, versions, deadline
        self.done = False
        self.run: _Run | None = None  # rdzv_* waiters: their run, and the request they answer
        self.req: dict = {}


class _Run:
    """One rendezvous run in the server: the planner's state and the requests blocked on it."""

    __slots__ = ("run_id", "rdzv", "joins", "watchers", "lingers", "timer_at")

    def __init__(self, run_id: str, rdzv: Rendezvous):
        self.run_id, self.rdzv = run_id, rdzv
        self.joins: dict[str, _Waiter] = {}  # node -> its blocked rdzv_join
        self.watchers: dict[str, _Waiter] = {}  # node -> its blocked rdzv_watch
        self.lingers: set[_Waiter] = set()
        self.timer_at = float("inf")  # the earliest timer pushed for this run


class StoreServer:
    """The store server: listens on ``host:port`` (127.0.0.1, any free port by default).

    ``start()`` binds and listens in the caller's thread (so a busy port raises at once) and then
    serves from a daemon thread; ``close()`` stops it. Everything lives in memory.

    Raises:
        StoreBindError: from ``start()``, when the address cannot be bound (``.errno`` tells why:
            EADDRINUSE, EADDRNOTAVAIL, ...).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, backlog: int = 4096):
        self._host, self._req_port, self._backlog = host, port, backlog
        self._listener: socket.socket | None = None
        self._sel: selectors.BaseSelector | None = None
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._stopping = False
        self._data: dict[str, _Entry] = {}
        self._clock = itertools.count(1)
        self._waiting: dict[str, set[_Waiter]] = {}
        self._deadlines: list[tuple[float, int, _Waiter]] = []
        self._expiries: list[tuple[float, int, str]] = []
        self._seq = itertools.count()
        self._conns: set[_Conn] = set()
        self._runs: dict[str, _Run] = {}
        self._leases: dict[str, tuple[str, str]] = {}  # lease key -> (run, node) it keeps alive
        self._timers: list[tuple[float, int, str]] = []  # (when, seq, run): a round may complete then
        self._traffic = {"bytes_in": 0, "bytes_out": 0, "requests": 0}  # for the "stats" op (benchmarks)
        self._ops: dict[str, int] = {}  # requests by op, and rendezvous answers by status (benchmarks)
        self.port = port

    # -- lifecycle -------------------------------------------------------------------------------
    def bind(self) -> StoreServer:
        """Bind and listen (no serving yet). Raises StoreBindError."""
        try:
            infos = socket.getaddrinfo(
                self._host or None, self._req_port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )
        except socket.gaierror as exc:
            raise StoreBindError(f"fsm store: cannot resolve {self._host!r}: {exc}", None) from None
        family, _, _, _, addr = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT only; a listener still wins
            sock.bind(addr)
            sock.listen(self._backlog)
        except OSError as exc:
            sock.close()
            raise StoreBindError(
                f"fsm store: cannot listen on {format_endpoint(self._host, self._req_port)}: {exc.strerror or exc}",
                exc.errno,
            ) from None
        sock.setblocking(False)
        self._listener = sock
        self.port = sock.getsockname()[1]
        return self

    def start(self) -> StoreServer:
        """Bind (if not yet) and serve from a daemon thread."""
        if self._listener is None:
            self.bind()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._wake_r.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._serve, name=f"fsm-store-{self.port}", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Bind (if not yet) and serve in this thread until ``close()``."""
        self.start()
        self._thread.join()

    @property
    def host(self) -> str:
        return self._host

    @property
    def endpoint(self) -> str:
        return format_endpoint(self._host, self.port)

    def close(self) -> None:
        """Stop serving and close every connection (peers see their connection close)."""
        if self._stopping:
            return
        self._stopping = True
        if self._thread is not None and self._thread.is_alive():
            with contextlib.suppress(OSError):
                self._wake_w.send(b"x")
            if self._thread is not threading.current_thread():
                self._thread.join(timeout=10)
        else:
            self._cleanup()

    def __enter__(self):
        return self.start() if self._thread is None else self

    def __exit__(self, *exc):
        self.close()

    def _cleanup(self) -> None:
        for conn in list(self._conns):
            with contextlib.suppress(OSError):
                conn.sock.close()
        self._conns.clear()
        for s in (self._listener, self._wake_r, self._wake_w):
            if s is not None:
                with contextlib.suppress(OSError):
                    s.close()
        if self._sel is not None:
            self._sel.close()

    # -- the loop ----------------------------------------------------------------------------------
    def _serve(self) -> None:
        sel = self._sel
        try:
            while not self._stopping:
                now = time.monotonic()
                self._expire(now)
                self._time_out_waiters(now)
                self._run_timers(now)
                nxt = min(
                    self._deadlines[0][0] if self._deadlines else float("inf"),
                    self._expiries[0][0] if self._expiries else float("inf"),
                    self._timers[0][0] if self._timers else float("inf"),
                )
                timeout = 3600.0 if nxt == float("inf") else min(3600.0, max(0.0, nxt - time.monotonic()))
                for key, mask in sel.select(timeout):
                    if key.data == "wake":
                        with contextlib.suppress(OSError):
                            key.fileobj.recv(64)
                    elif key.data is None:
                        self._accept()
                    else:
                        conn: _Conn = key.data
                        if mask & selectors.EVENT_READ:
                            self._read(conn)
                        if mask & selectors.EVENT_WRITE and not conn.closed:
                            self._flush(conn)
        except Exception:  # a bug in the server: log it, do not leave clients hanging
            log.exception("fsm store server at %s crashed", self.endpoint)
        finally:
            self._cleanup()

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("fsm store: accept failed: %s", exc)
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock, f"{addr[0]}:{addr[1]}")
            self._conns.add(conn)
            self._sel.register(sock, selectors.EVENT_READ, conn)

    def _read(self, conn: _Conn) -> None:
        try:
            chunk = conn.sock.recv(_RECV)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(conn)
            return
        self._traffic["bytes_in"] += len(chunk)
        conn.inbuf += chunk
        while True:
            i = conn.inbuf.find(b"\n")
            if i < 0:
                break
            conn.lines.append(bytes(conn.inbuf[:i]))
            del conn.inbuf[: i + 1]
        if len(conn.inbuf) > MAX_LINE:
            conn.close_after_flush = True
            conn.lines.clear()
            self._reply(conn, {"ok": False, "error": "bad_request", "message": f"line longer than {MAX_LINE} bytes"})
            return
        self._process(conn)

    def _process(self, conn: _Conn) -> None:
        while conn.lines and conn.waiter is None and not conn.closed and not conn.close_after_flush:
            line = conn.lines.popleft()
            if not line.strip():
                continue
            try:
                req = json.loads(line, parse_constant=_reject_constant)
                if not isinstance(req, dict):
                    raise ValueError("a request must be a JSON object")
            except (ValueError, UnicodeDecodeError) as exc:
                conn.close_after_flush = True
                self._reply(
                    conn,
                    {
                        "ok": False,
                        "error": "bad_request",
                        "message": f"not an fsm-store request ({PROTO}, JSON lines): {exc}",
                    },
                )
                break
            try:
                self._handle(conn, req)
            except Exception as exc:  # one bad request never takes the server down
                self._reply(
                    conn,
                    {
                        "ok": False,
                        "error": "bad_request",
                        "message": f"bad {req.get('op')!r} request: {type(exc).__name__}: {exc}",
                    },
                )

    def _reply(self, conn: _Conn, obj: dict) -> None:
        if conn.closed:
            return
        status = obj.get("status") if obj.get("ok") else obj.get("error")
        if status is not None:
            self._ops[f"status:{status}"] = self._ops.get(f"status:{status}", 0) + 1
        conn.outbuf += _encode(obj)
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        while conn.outbuf:
            try:
                n = conn.sock.send(conn.outbuf)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._drop(conn)
                return
            del conn.outbuf[:n]
            self._traffic["bytes_out"] += n
        if conn.outbuf:
            self._sel.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)
        else:
            if conn.close_after_flush:
                self._drop(conn)
                return
            with contextlib.suppress(KeyError, ValueError):
                self._sel.modify(conn.sock, selectors.EVENT_READ, conn)

    def _drop(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._conns.discard(conn)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(conn.sock)
        with contextlib.suppress(OSError):
            conn.sock.close()
        if conn.waiter is not None:
            self._unregister(conn.waiter)
        for key in list(conn.owned):
            entry = self._data.get(key)
            if entry is not None and entry.owner is conn:
                self._delete(key)

    # -- data ------------------------------------------------------------------------------------
    def _put(self, key: str, value: bytes) -> _Entry:
        entry = self._data.get(key)
        if entry is None:
            entry = self._data[key] = _Entry(value, next(self._clock))
        else:
            entry.value, entry.version = value, next(self._clock)
            if entry.owner is not None:
                entry.owner.owned.discard(key)
            entry.owner, entry.expiry = None, None
        self._notify(key)
        return entry

    def _delete(self, key: str) -> bool:
        entry = self._data.pop(key, None)
        if entry is None:
            return False
        if entry.owner is not None:
            entry.owner.owned.discard(key)
        next(self._clock)
        self._notify(key)
        lease = self._leases.pop(key, None)
        if lease is not None:  # a rendezvous node's lease ended: it is lost, at once
            run_id, node = lease
            self._rdzv_apply(run_id, lambda rdzv, now: rdzv.lose(node, now))
            w = self._runs[run_id].joins.get(node) if run_id in self._runs else None
            if w is not None:  # still alive and joining (its lease lapsed): it renews and joins again
                self._finish(w, {"ok": True, "status": "no_lease"})
        return True

    def _version(self, key: str) -> int:
        entry = self._data.get(key)
        return entry.version if entry is not None else 0

    def _lease(self, key: str, entry: _Entry, ttl: float | None, now: float, conn: _Conn | None = None) -> None:
        if ttl is None:
            return
        entry.renewer = conn
        entry.expiry = now + min(max(0.0, float(ttl)), 1e6)
        heapq.heappush(self._expiries, (entry.expiry, next(self._seq), key))

    def _expire(self, now: float) -> None:
        deferred = []
        while self._expiries and self._expiries[0][0] <= now:
            when, _, key = heapq.heappop(self._expiries)
            entry = self._data.get(key)
            if entry is not None and entry.expiry is not None and entry.expiry <= now:
                if any(c is not None and not c.closed and _unread(c.sock) for c in (entry.owner, entry.renewer)):
                    # A busy store, not a silent node: its renewal may be in the socket, unread.
                    # Read first (select answers at once), then decide.
                    deferred.append((when, next(self._seq), key))
                    continue
                self._delete(key)
        for item in deferred:
            heapq.heappush(self._expiries, item)

    # -- waiting ---------------------------------------------------------------------------------
    def _satisfied(self, w: _Waiter) -> bool:
        if w.kind in ("watch", "rdzv_watch"):
            return any(self._version(k) != v for k, v in (w.versions or {}).items())
        return all(k in self._data for k in w.keys)

    def _answer(self, w: _Waiter) -> dict:
        if w.kind == "rdzv_watch":
            return self._rdzv_watch_reply(w.run, w.req["node"], w.req, time.monotonic(), w.versions)
        if w.kind == "get":
            return {"ok": True, "value": _b64(self._data[w.keys[0]].value)}
        if w.kind == "multi_get":
            return {"ok": True, "values": [_b64(self._data[k].value) for k in w.keys]}
        if w.kind == "watch":
            return {
                "ok": True,
                "now": time.monotonic(),
                "changed": {k: self._version(k) for k, v in w.versions.items() if self._version(k) != v},
            }
        return {"ok": True}

    def _block(
        self, conn: _Conn, kind: str, keys: list[str], timeout: Any, versions: dict[str, int] | None = None
    ) -> None:
        w = _Waiter(conn, kind, keys, versions, 0.0)
        if self._satisfied(w):
            self._reply(conn, self._answer(w))
            return
        seconds = min(float(timeout), 1e6) if timeout is not None else 300.0
        if seconds <= 0:
            self._reply(conn, self._timed_out(w))
            return
        w.deadline = time.monotonic() + seconds
        conn.waiter = w
        for k in keys:
            self._waiting.setdefault(k, set()).add(w)
        heapq.heappush(self._deadlines, (w.deadline, next(self._seq), w))

    def _timed_out(self, w: _Waiter) -> dict:
        if w.run is not None:
            return self._rdzv_timed_out(w)
        if w.kind == "watch":
            return {"ok": True, "now": time.monotonic(), "changed": {}}
        missing = [k for k in w.keys if k not in self._data]
        return {"ok": False, "error": "timeout", "message": f"keys not set: {missing[:5]}"}

    def _unregister(self, w: _Waiter) -> None:
        w.done = True
        if w.kind == "rdzv_watch":
            self._rdzv_watch_ended(w)
        if w.run is not None:
            node = w.req.get("node")
            for table in (w.run.joins, w.run.watchers):
                if table.get(node) is w:
                    del table[node]
            w.run.lingers.discard(w)
        for k in w.keys:
            s = self._waiting.get(k)
            if s is not None:
                s.discard(w)
                if not s:
                    del self._waiting[k]
        if w.conn.waiter is w:
            w.conn.waiter = None

    def _finish(self, w: _Waiter, reply: dict) -> None:
        self._unregister(w)
        self._reply(w.conn, reply)
        self._process(w.conn)  # requests that arrived while this one blocked

    def _notify(self, key: str) -> None:
        waiters = self._waiting.get(key)
        if not waiters:
            return
        for w in list(waiters):
            if not w.done and self._satisfied(w):
                self._finish(w, self._answer(w))

    def _time_out_waiters(self, now: float) -> None:
        while self._deadlines and (self._deadlines[0][2].done or self._deadlines[0][0] <= now):
            _, _, w = heapq.heappop(self._deadlines)
            if not w.done:
                self._finish(w, self._timed_out(w))

    # -- operations ------------------------------------------------------------------------------
    def _handle(self, conn: _Conn, req: dict) -> None:
        op = req.get("op")
        now = time.monotonic()
        self._traffic["requests"] += 1
        proto = req.get("proto")
        if proto is not None and proto != PROTO and op != "hello":  # hello answers with the server's own
            conn.close_after_flush = True
            message = f"protocol {str(proto)[:40]!r} is not this server's {PROTO}: run the same fsm-agent version"
            self._reply(conn, {"ok": False, "error": "bad_proto", "message": message})
            return
        if isinstance(op, str):
            self._ops[op] = self._ops.get(op, 0) + 1
            handler = self._HANDLERS.get(op)
            if handler is not None:
                handler(self, conn, req, now)
                return
            if op.startswith("rdzv_"):
                self._rdzv_handle(conn, op, req, now)
                return
        self._reply(conn, {"ok": False, "error": "bad_request", "message": f"unknown op {op!r}"})

    # One handler per op, ``handler(self, conn, req, now)`` with ``now`` the server's monotonic
    # clock (seconds); each replies on ``conn`` or blocks it (``_block``) until it can.
    def _op_hello(self, conn: _Conn, req: dict, now: float) -> None:
        self._reply(conn, {"ok": True, "proto": PROTO, "now": now})

    def _op_set(self, conn: _Conn, req: dict, now: float) -> None:
        key = str(req["key"])
        entry = self._put(key, _unb64(req["value"]))
        self._lease(key, entry, req.get("ttl"), now, conn)
        if req.get("ephemeral"):  # deleted when this connection closes
            entry.owner = conn
            conn.owned.add(key)
        self._reply(conn, {"ok": True, "version": entry.version})

    def _op_multi_set(self, conn: _Conn, req: dict, now: float) -> None:
        keys, values = [str(k) for k in req["keys"]], req["values"]
        if len(keys) != len(values):
            raise ValueError("keys and values differ in length")
        for k, v in zip(keys, values):
            self._put(k, _unb64(v))
        self._reply(conn, {"ok": True})

    def _op_get(self, conn: _Conn, req: dict, now: float) -> None:
        self._block(conn, "get", [str(req["key"])], req.get("timeout"))

    def _op_multi_get(self, conn: _Conn, req: dict, now: float) -> None:
        self._block(conn, "multi_get", [str(k) for k in req["keys"]], req.get("timeout"))

    def _op_wait(self, conn: _Conn, req: dict, now: float) -> None:
        self._block(conn, "wait", [str(k) for k in req["keys"]], req.get("timeout"))

    def _op_watch(self, conn: _Conn, req: dict, now: float) -> None:
        versions = {str(k): int(v) for k, v in dict(req["versions"]).items()}
        self._block(conn, "watch", list(versions), req.get("timeout"), versions)

    def _op_add(self, conn: _Conn, req: dict, now: float) -> None:
        key, amount = str(req["key"]), int(req["amount"])
        entry = self._data.get(key)
        current = int(entry.value) if entry is not None else 0
        value = current + amount
        self._put(key, str(value).encode())
        self._reply(conn, {"ok": True, "value": value})

    def _op_compare_set(self, conn: _Conn, req: dict, now: float) -> None:
        key, expected, desired = str(req["key"]), _unb64(req["expected"]), _unb64(req["desired"])
        entry = self._data.get(key)
        if entry is None:
            if expected == b"":
                self._put(key, desired)
                result = desired
            else:
                result = expected  # torch's TCPStore answers so too: "not swapped"
        elif entry.value == expected:
            result = self._put(key, desired).value
        else:
            result = entry.value
        self._reply(conn, {"ok": True, "value": _b64(result), "version": self._version(key), "now": now})

    def _op_check(self, conn: _Conn, req: dict, now: float) -> None:
        self._reply(conn, {"ok": True, "value": all(str(k) in self._data for k in req["keys"])})

    def _op_exists(self, conn: _Conn, req: dict, now: float) -> None:
        self._reply(conn, {"ok": True, "values": [str(k) in self._data for k in req["keys"]]})

    def _op_delete(self, conn: _Conn, req: dict, now: float) -> None:
        self._reply(conn, {"ok": True, "value": self._delete(str(req["key"]))})

    def _op_num_keys(self, conn: _Conn, req: dict, now: float) -> None:
        self._reply(conn, {"ok": True, "value": len(self._data)})

    def _op_get_versioned(self, conn: _Conn, req: dict, now: float) -> None:
        keys = [str(k) for k in req.get("keys", ())]
        entries = [self._data.get(k) for k in keys]
        reply = {
            "ok": True,
            "now": now,
            "values": [_b64(e.value) if e is not None else None for e in entries],
            "versions": [e.version if e is not None else 0 for e in entries],
        }
        prefix = req.get("prefix")
        if prefix is not None:
            prefix = str(prefix)
            reply["listing"] = {k: e.version for k, e in self._data.items() if k.startswith(prefix)}
        self._reply(conn, reply)

    def _op_touch(self, conn: _Conn, req: dict, now: float) -> None:
        ttl = float(req["ttl"])
        found = []
        for k in req["keys"]:
            entry = self._data.get(str(k))
            if entry is not None:
                self._lease(str(k), entry, ttl, now, conn)
            found.append(entry is not None)
        self._reply(conn, {"ok": True, "values": found})

    def _op_time(self, conn: _Conn, req: dict, now: float) -> None:
        self._reply(conn, {"ok": True, "now": now})

    def _op_stats(self, conn: _Conn, req: dict, now: float) -> None:
        self._reply(
            conn,
            {
                "ok": True,
                **self._traffic,
                "connections": len(self._conns),
                "keys": len(self._data),
                "ops": self._ops,
            },
        )

    #: op -> its handler: one dict lookup per request, whatever the op (functions, not bound methods).
    _HANDLERS: ClassVar[dict[str, Callable[[StoreServer, _Conn, dict, float], None]]] = {
        "hello": _op_hello,
        "set": _op_set,
        "multi_set": _op_multi_set,
        "get": _op_get,
        "multi_get": _op_multi_get,
        "wait": _op_wait,
        "watch": _op_watch,
        "add": _op_add,
        "compare_set": _op_compare_set,
        "check": _op_check,
        "exists": _op_exists,
        "delete": _op_delete,
        "num_keys": _op_num_keys,
        "get_versioned": _op_get_versioned,
        "touch": _op_touch,
        "time": _op_time,
        "stats": _op_stats,
    }

    # -- the rendezvous: planner.Rendezvous per run, applied in this thread (the handler is the client) --
    def _rdzv_handle(self, conn: _Conn, op: str, req: dict, now: float) -> None:
        run_id, node = str(req["run"]), str(req.get("node", ""))
        run = self._runs.get(run_id)
        if op == "rdzv_join":
            self._op_rdzv_join(conn, run, run_id, node, req, now)
            return
        if run is None:  # nothing joined this run yet (or the store restarted)
            self._reply(conn, self._rdzv_no_run_reply(op))
            return
        handler = self._RDZV_HANDLERS.get(op)
        if handler is None:
            self._reply(conn, {"ok": False, "error": "bad_request", "message": f"unknown op {op!r}"})
        else:
            handler(self, conn, run, node, req, now)

    @staticmethod
    def _rdzv_no_run_reply(op: str) -> dict:
        """The answer to a request about a run that nobody joined: an empty, open run."""
        return {
            "ok": True,
            "closed": False,
            "round": -1,
            "complete": False,
            "nodes": 0,
            "lost": 0,
            "waiting": 1 if op == "rdzv_watch" else 0,
            "others": 0,
        }

    def _op_rdzv_join(self, conn: _Conn, run: _Run | None, run_id: str, node: str, req: dict, now: float) -> None:
        """``node`` joins the run (made here on its first join): answered at once with its rank,
        or blocked in ``run.joins`` until a round decides (``_rdzv_apply``)."""
        lease = str(req["lease"])
        if "lease_ttl" in req:  # the join (re)creates the node's lease, owned by this connection
            entry = self._put(lease, node.encode())
            self._lease(lease, entry, req["lease_ttl"], now, conn)
            entry.owner = conn
            conn.owned.add(lease)
            if req["lease_ttl"] is not None:
                _probe_silent_peer(conn.sock, float(req["lease_ttl"]), float(req.get("probe") or req["lease_ttl"]))
        if lease not in self._data:  # the lease lapsed before this join: the node renews it first
            self._reply(conn, {"ok": True, "status": "no_lease"})
            return
        lo, hi = int(req["min"]), int(req["max"])
        if run is None:
            run = self._runs[run_id] = _Run(run_id, Rendezvous(lo, hi))
        watch = run.watchers.get(node)
        if watch is not None and not watch.done:
            # Its watch of the round it leaves ends here: held on, it would keep the node's
            # keep-alive from renewing the lease while the next round forms (the join renews it
            # once), and the node would be lost if that takes longer than the lease's ttl.
            self._finish(watch, self._answer(watch))
        rdzv = run.rdzv
        rdzv.min_nodes, rdzv.max_nodes = lo, hi
        rdzv.last_call_timeout, rdzv.rejoin_timeout = float(req["last_call_timeout"]), float(req["rejoin_timeout"])
        self._leases[lease] = (run_id, node)
        me = self._rdzv_node(req["info"])
        returned = req.get("returned_round")

        def join(rdzv: Rendezvous, now: float) -> None:
            res = rdzv.join(node, me, now, None if returned is None else int(returned))
            status = self._rdzv_spare_status(rdzv, node, req) if res.status == "wait" else res.status
            if status == "wait":
                self._rdzv_block(conn, run, "rdzv_join", req, run.joins)
            else:
                self._reply(conn, self._rdzv_joined(rdzv, status, node))

        self._rdzv_apply(run_id, join)

    @staticmethod
    def _rdzv_node(info: dict) -> Node:
        """A join's ``info`` (its address, port, whether it hosts, its node rank hint) as a ``Node``."""
        return Node(
            str(info["addr"]),
            int(info["port"]),
            bool(info.get("host")),
            None if info.get("node_rank") is None else int(info["node_rank"]),
        )

    def _op_rdzv_leave(self, conn: _Conn, run: _Run, node: str, req: dict, now: float) -> None:
        self._rdzv_apply(run.run_id, lambda rdzv, now: rdzv.leave(node, now, forget=bool(req.get("forget", True))))
        self._reply(conn, {"ok": True})

    def _op_rdzv_close(self, conn: _Conn, run: _Run, node: str, req: dict, now: float) -> None:
        self._rdzv_apply(run.run_id, lambda rdzv, now: rdzv.close())
        self._reply(conn, {"ok": True})

    def _op_rdzv_status(self, conn: _Conn, run: _Run, node: str, req: dict, now: float) -> None:
        r = run.rdzv
        self._reply(
            conn,
            {
                "ok": True,
                "closed": r.closed,
                "round": r.round,
                "complete": r.complete,
                "nodes": len(r.nodes),
                "participants": len(r.participants),
                "waiting": len(r.wait_list),
            },
        )

    def _op_rdzv_watch(self, conn: _Conn, run: _Run, node: str, req: dict, now: float) -> None:
        """The node's membership watch, which also renews its lease (``lease``, ``ttl``: keep-alive
        and membership on one connection) for as long as it is held, and (``versions``: key ->
        version) is answered when one of those keys changes (a peer's job-wide drain)."""
        versions = {str(k): int(v) for k, v in dict(req.get("versions") or {}).items()}
        lease, entry = req.get("lease"), None
        if lease is not None:
            lease = str(lease)
            entry = self._data.get(lease)
            if entry is not None:
                self._lease(lease, entry, float(req["ttl"]), now, conn)
        reply = self._rdzv_watch_reply(run, node, req, now, versions)
        if lease is not None and entry is None:  # it lapsed: the node renews it at once, then watches again
            self._reply(conn, {**reply, "leased": False})
        elif self._rdzv_news(reply["lost"], reply["waiting"], req) or reply["changed"] or node in run.joins:
            self._reply(conn, reply)  # (a node that joins a new round no longer watches this one)
        else:
            w = self._rdzv_block(conn, run, "rdzv_watch", req, run.watchers, versions)
            if entry is not None:  # held: the store keeps the lease while it holds the watch
                self._lease(lease, entry, w.deadline - now + float(req["ttl"]), now, conn)

    def _rdzv_watch_reply(self, run: _Run, node: str, req: dict, now: float, versions: dict[str, int] | None) -> dict:
        """A membership watch's answer: the counts of its round, and the watched keys that changed
        (their new versions)."""
        lost, waiting, _ = run.rdzv.membership(node, int(req["round"]), now)
        changed = {k: self._version(k) for k, v in (versions or {}).items() if self._version(k) != v}
        return {"ok": True, "lost": lost, "waiting": waiting, "changed": changed}

    def _rdzv_watch_ended(self, w: _Waiter) -> None:
        """A held watch was answered, timed out or lost its connection: its node's lease now
        lasts ``ttl`` from here (it renews it with its next watch), no longer the hold's end."""
        lease = w.req.get("lease")
        entry = self._data.get(str(lease)) if lease is not None else None
        if entry is None or entry.renewer is not w.conn or entry.expiry is None:
            return
        now = time.monotonic()
        ttl = float(w.req["ttl"])
        if now + ttl < entry.expiry:
            self._lease(str(lease), entry, ttl, now, w.conn)

    def _op_rdzv_linger(self, conn: _Conn, run: _Run, node: str, req: dict, now: float) -> None:
        others = len(run.rdzv.nodes) - (node in run.rdzv.nodes)
        if others == 0:
            self._reply(conn, {"ok": True, "others": 0})
        else:
            self._rdzv_block(conn, run, "rdzv_linger", req, None)

    #: rdzv_<op> -> its handler, for a run that exists (``rdzv_join`` makes one: ``_op_rdzv_join``).
    _RDZV_HANDLERS: ClassVar[dict[str, Callable[[StoreServer, _Conn, _Run, str, dict, float], None]]] = {
        "rdzv_leave": _op_rdzv_leave,
        "rdzv_close": _op_rdzv_close,
        "rdzv_status": _op_rdzv_status,
        "rdzv_watch": _op_rdzv_watch,
        "rdzv_linger": _op_rdzv_linger,
    }

    @staticmethod
    def _rdzv_news(lost: int, waiting: int, req: dict) -> bool:
        """A watch is answered when whether nodes are lost or waiting differs from what it saw
        (the counts ride along; a watch that times out brings them up to date)."""
        return (lost > 0, waiting > 0) != (int(req["lost"]) > 0, int(req["waiting"]) > 0)

    def _rdzv_block(
        self, conn: _Conn, run: _Run, kind: str, req: dict, table: dict | None, versions: dict[str, int] | None = None
    ) -> _Waiter:
        """Block ``req`` on ``conn`` until its run answers it or its timeout; ``versions``: keys
        whose change (``_notify``) answers it too."""
        keys = list(versions or ())
        w = _Waiter(conn, kind, keys, versions, time.monotonic() + min(max(0.0, float(req["timeout"])), 1e6))
        w.run, w.req = run, req
        conn.waiter = w
        for k in keys:
            self._waiting.setdefault(k, set()).add(w)
        if table is None:
            run.lingers.add(w)
        else:
            old = table.get(req["node"])
            if old is not None and not old.done:  # the same node asked again on another connection
                self._finish(old, {"ok": False, "error": "bad_request", "message": "superseded by a later request"})
            table[req["node"]] = w
        heapq.heappush(self._deadlines, (w.deadline, next(self._seq), w))
        return w

    @staticmethod
    def _rdzv_joined(rdzv: Rendezvous, status: str, node: str) -> dict:
        reply = {"ok": True, "status": status, "round": rdzv.round}
        if status == "ranked":
            reply.update(
                rank=rdzv.participants[node],
                world=len(rdzv.participants),
                master={"addr": rdzv.master[0], "port": rdzv.master[1]},
            )
        return reply

    # -- hot spares (planner.Rendezvous.is_standby): told once, then their join blocks ----------------
    @staticmethod
    def _rdzv_spare_status(rdzv: Rendezvous, node: str, req: dict) -> str:
        """What a waiting join answers: ``standby`` once to a node that became a standby (it logs
        that and joins again with ``standby`` set, which blocks); to such a node ``done`` once the
        job ``ended`` (no participant left to open a round); else ``wait`` (block)."""
        if not req.get("standby"):
            return "standby" if rdzv.is_standby(node) else "wait"
        return "done" if rdzv.ended() else "wait"

    def _rdzv_tell_spares(self, run: _Run) -> None:
        """After a round completed (or the job ended): answer the blocked joins of the waiting
        nodes that this made standbys (or not needed). O(waiting nodes), once per round."""
        rdzv = run.rdzv
        for p in list(rdzv.wait_list):
            w = run.joins.get(p)
            if w is not None and not w.done:
                status = self._rdzv_spare_status(rdzv, p, w.req)
                if status != "wait":
                    self._finish(w, self._rdzv_joined(rdzv, status, p))

    def _rdzv_timed_out(self, w: _Waiter) -> dict:
        rdzv, node = w.run.rdzv, w.req["node"]
        if w.kind == "rdzv_watch":
            return self._rdzv_watch_reply(w.run, node, w.req, time.monotonic(), w.versions)
        if w.kind == "rdzv_linger":
            return {"ok": True, "others": len(rdzv.nodes) - (node in rdzv.nodes)}
        reply = {
            "ok": True,
            "status": "timeout",
            "round": rdzv.round,
            "waiting": len(rdzv.wait_list),
            "joined": 0 if rdzv.complete else len(rdzv.participants),
        }
        self._unregister(w)  # a node that gave up leaves the round it waited for (not the run)
        self._rdzv_apply(w.run.run_id, lambda r, now: r.leave(node, now, forget=False))
        return reply

    def _rdzv_apply(self, run_id: str, change, timer: bool = False) -> None:
        """Apply ``change(rdzv, now)`` to the run, then answer what it decided: ranks when the
        round completed, membership changes to the watchers, and schedule the next deadline."""
        run = self._runs.get(run_id)
        if run is None:
            return
        rdzv, now = run.rdzv, time.monotonic()
        before = (rdzv.round, rdzv.closed, len(rdzv.lost), len(rdzv.nodes), now >= rdzv.waiting_due_at())
        change(rdzv, now)
        ranked, away = rdzv.tick(now)
        for p in ranked:
            w = run.joins.get(p)
            if w is not None:
                self._finish(w, self._rdzv_joined(rdzv, "ranked", p))
        if ranked or rdzv.ended():
            self._rdzv_tell_spares(run)
        for p in away:
            w = run.joins.get(p)
            if w is not None:
                self._finish(w, self._rdzv_joined(rdzv, "not_needed", p))
        if rdzv.closed and not before[1]:
            for w in list(run.joins.values()):
                self._finish(w, self._rdzv_joined(rdzv, "closed", w.req["node"]))
        # Watchers hear whether nodes are lost or waiting, not each count: a loss storm wakes each
        # watcher once per round (O(N)), not once per lost node (O(N^2)). Waiting nodes are due at
        # a timer, or at once when they fill every seat (this change made them due): held watches
        # are not answered by their own timeouts soon enough to tell.
        reported = now >= rdzv.waiting_due_at()
        if (rdzv.round, len(rdzv.lost) > 0, reported) != (before[0], before[2] > 0, before[4]) or (timer and reported):
            for w in list(run.watchers.values()):
                reply = self._rdzv_watch_reply(run, w.req["node"], w.req, now, w.versions)
                if self._rdzv_news(reply["lost"], reply["waiting"], w.req):
                    self._finish(w, reply)
        if len(rdzv.nodes) != before[3]:
            for w in list(run.lingers):
                if len(rdzv.nodes) - (w.req["node"] in rdzv.nodes) == 0:
                    self._finish(w, {"ok": True, "others": 0})
        due = rdzv.waiting_due_at()
        at = min(rdzv.deadline(), due if due > now else float("inf"))
        if at < run.timer_at:
            run.timer_at = at
            heapq.heappush(self._timers, (at, next(self._seq), run_id))

    def _run_timers(self, now: float) -> None:
        while self._timers and self._timers[0][0] <= now:
            when, _, run_id = heapq.heappop(self._timers)
            run = self._runs.get(run_id)
            if run is not None and when >= run.timer_at:
                run.timer_at = float("inf")
                self._rdzv_apply(run_id, lambda rdzv, now: None, timer=True)


# -- client ------------------------------------------------------------------------------------------
class StoreClient:
    """A connection to a ``StoreServer``, with the method names of ``torch.distributed.Store``.

    One request at a time per client (a lock serialises threads); give each thread that blocks in
    ``watch``/``wait`` its own client. The connection is opened on first use and reopened on the
    next request after it broke.

    Args:
        host / port: the server.
        timeout: default timeout of get, multi_get and wait (torch's store timeout; 300 s).
        connect_timeout: how long to keep trying to connect while the server is not listening yet.
        handshake_timeout: how long a peer that accepted the connection gets to answer the hello.
        reply_timeout: how long past its op's own timeout a reply may take before the server counts
            as dead (seconds; at least ``handshake_timeout``).
        fail_fast_refused: give up at the first refused connection (used after this process found
            the port taken: a refusal then means the holder is not a store server).
        handshake: open each connection with a hello (default). False: send no hello; the first
            request on a connection carries ``proto`` for the server to check. For a second client
            of an endpoint another client already shook hands with: a peer that is not an fsm
            store then shows only when that request fails (a malformed reply, a closed connection,
            or no reply within its own timeout plus ``reply_timeout``), not within
            ``handshake_timeout``.

    Raises (every method): StoreTimeout, StoreConnectionError, StoreProtocolError; all are
    ``fsm_agent.errors.RendezvousFailed`` and name the endpoint.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        timeout: timedelta | float = DEFAULT_TIMEOUT,
        connect_timeout: float = 60.0,
        handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
        reply_timeout: float = 30.0,
        fail_fast_refused: bool = False,
        handshake: bool = True,
    ):
        self.host, self.port = host, int(port)
        self.reply_timeout = float(reply_timeout)
        self._timeout = timedelta(seconds=_seconds(timeout))
        self.connect_timeout = float(connect_timeout)
        self.handshake_timeout = float(handshake_timeout)
        self.fail_fast_refused = fail_fast_refused
        self.handshake = handshake
        self._proto_pending = False  # handshake=False: this connection's first request is still to send
        self._sock: socket.socket | None = None
        self._buf = bytearray()
        self._lock = threading.RLock()
        # Guards only _sock and _closed, so abort() (which must not wait for a request in flight)
        # and _open() agree: a socket opened after abort() is closed at once, never used.
        self._sock_guard = threading.Lock()
        self._closed = False
        self._was_connected = False  # a handshake succeeded once: a refusal now means the server is gone
        self.server_now: float | None = None  # the server clock at the last reply that carried it

    @property
    def endpoint(self) -> str:
        return format_endpoint(self.host, self.port)

    # torch's Store API: timeout
    @property
    def timeout(self) -> timedelta:
        return self._timeout

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timedelta(seconds=_seconds(timeout))

    def __repr__(self) -> str:
        return f"StoreClient({self.endpoint})"

    # -- connection ------------------------------------------------------------------------------
    def connect(self) -> StoreClient:
        """Open the connection now (retrying refused connects for ``connect_timeout``) and shake hands."""
        with self._lock:
            if self._sock is None:
                self._open()
        return self

    def _refused_after_taken(self) -> str:
        """Why a port that was taken when this node tried to host the store now refuses connections."""
        probe = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((self.host, self.port))
        except OSError:
            return "the port is taken but nothing accepts connections on it (another program holds it)"
        finally:
            probe.close()
        return (
            "nothing listens there any more: what held the port when this node tried to host the store "
            "(an agent hosting it, shutting down?) has exited; start this node again and it hosts the store"
        )

    def _open(self) -> None:
        if self._closed:
            raise StoreConnectionError(f"fsm store client for {self.endpoint} is closed")
        deadline = time.monotonic() + self.connect_timeout
        delay, last = 0.01, None
        while True:
            remaining = deadline - time.monotonic()
            try:
                sock = socket.create_connection(
                    (self.host, self.port), timeout=max(0.05, min(self.handshake_timeout, remaining))
                )
                break
            except socket.gaierror as exc:
                raise StoreConnectionError(
                    f"fsm store at {self.endpoint}: cannot resolve {self.host!r}: {exc}"
                ) from None
            except OSError as exc:
                last = exc
                if self._was_connected and isinstance(exc, ConnectionRefusedError):
                    raise StoreConnectionError(
                        f"fsm store at {self.endpoint}: connection refused: the store this client used is "
                        f"gone (the agent hosting it exited?)"
                    ) from None
                if self.fail_fast_refused and isinstance(exc, ConnectionRefusedError) and remaining <= 0:
                    raise StoreProtocolError(f"fsm store at {self.endpoint}: {self._refused_after_taken()}") from None
                if remaining <= 0:
                    raise StoreConnectionError(
                        f"fsm store at {self.endpoint}: could not connect within {self.connect_timeout:g} s: "
                        f"{exc.strerror or exc}"
                    ) from None
            if self._closed:  # abort() while the server is not up yet: stop retrying
                raise StoreConnectionError(f"fsm store client for {self.endpoint} is closed")
            # The server is not listening yet (its host starts later): the one wait outside the server.
            time.sleep(min(delay, max(0.0, remaining)))
            delay = min(delay * 2, 0.25)
        del last
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._sock_guard:
            if self._closed:  # aborted while connecting: do not hand a live socket to a dying client
                sock.close()
                raise StoreConnectionError(f"fsm store client for {self.endpoint} is closed")
            self._sock, self._buf = sock, bytearray()
        if not self.handshake:
            # The first request carries "proto" (_request). Another client shook hands with this
            # endpoint, so a connection accepted here is the server's: a refused one later means
            # it is gone (not retried for connect_timeout, 600 s for a rendezvous's patience).
            self._proto_pending, self._was_connected = True, True
            return
        try:
            self._send({"op": "hello", "proto": PROTO})
            reply = self._recv(time.monotonic() + self.handshake_timeout, handshake=True)
        except StoreTimeout:
            self._reset()
            raise StoreProtocolError(
                f"fsm store at {self.endpoint}: the peer accepted the connection but did not answer the "
                f"{PROTO} hello within {self.handshake_timeout:g} s: the port is held by another program, "
                f"not an fsm-agent store"
            ) from None
        except StoreError:
            self._reset()
            raise
        if reply.get("proto") != PROTO or not reply.get("ok"):
            self._reset()
            raise StoreProtocolError(
                f"fsm store at {self.endpoint}: the peer is not an {PROTO} server "
                f"(hello answered with {str(reply)[:120]!r})"
            )
        self.server_now = reply.get("now")
        self._was_connected = True

    def _reset(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
        self._sock, self._buf = None, bytearray()

    def close(self) -> None:
        """Close the connection; the server drops this client's ephemeral keys."""
        self.abort()  # a request in flight on another thread ends now instead of holding the lock
        with self._lock:
            self._reset()

    def abort(self) -> None:
        """Shut the socket down without waiting for a request in flight: wakes a thread blocked on it.

        The client stays closed: no later request reconnects.
        """
        with self._sock_guard:
            self._closed = True
            sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _send(self, obj: dict) -> None:
        try:
            self._sock.sendall(_encode(obj))
        except OSError as exc:
            self._reset()
            raise StoreConnectionError(
                f"fsm store at {self.endpoint}: connection lost while sending {obj.get('op')!r}: {exc}"
            ) from None

    def _recv(self, deadline: float, handshake: bool = False) -> dict:
        while True:
            i = self._buf.find(b"\n")
            if i >= 0:
                line = bytes(self._buf[:i])
                del self._buf[: i + 1]
                try:
                    reply = json.loads(line)
                    if not isinstance(reply, dict):
                        raise ValueError("not an object")
                except (ValueError, UnicodeDecodeError):
                    self._reset()
                    raise StoreProtocolError(
                        f"fsm store at {self.endpoint}: malformed reply {line[:80]!r} "
                        f"(is the port held by another program?)"
                    ) from None
                return reply
            if len(self._buf) > MAX_LINE:
                self._reset()
                raise StoreProtocolError(f"fsm store at {self.endpoint}: reply longer than {MAX_LINE} bytes")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StoreTimeout(f"fsm store at {self.endpoint}: no reply")
            self._sock.settimeout(remaining)
            try:
                chunk = self._sock.recv(_RECV)
            except TimeoutError:
                continue
            except OSError as exc:
                self._reset()
                raise StoreConnectionError(f"fsm store at {self.endpoint}: connection lost: {exc}") from None
            if not chunk:
                self._reset()
                what = (
                    "closed the connection during the handshake (not an fsm-agent store?)"
                    if handshake
                    else "closed the connection (the agent hosting the store exited?)"
                )
                raise (StoreProtocolError if handshake else StoreConnectionError)(
                    f"fsm store at {self.endpoint}: {what}"
                )
            self._buf += chunk

    def _request(self, req: dict, wait: float | None = None) -> dict:
        with self._lock:
            if self._sock is None:
                self._open()
            first, self._proto_pending = self._proto_pending, False
            try:
                self._send({**req, "proto": PROTO} if first else req)
                deadline = time.monotonic() + (wait or 0.0) + max(self.handshake_timeout, self.reply_timeout)
                try:
                    reply = self._recv(deadline)
                except StoreTimeout:
                    self._reset()
                    raise StoreConnectionError(
                        f"fsm store at {self.endpoint}: no reply to {req.get('op')!r} in time: the server "
                        f"is unresponsive"
                    ) from None
                if first:
                    self._check_first_reply(reply)
            except BaseException:
                # interrupted mid-request (a signal, an error): the stream is out of step, start over
                self._reset()
                raise
        if "now" in reply:
            self.server_now = reply["now"]
        if not reply.get("ok"):
            if reply.get("error") == "timeout":
                raise StoreTimeout(
                    f"fsm store at {self.endpoint}: {req.get('op')} timed out after "
                    f"{wait:g} s ({reply.get('message', '')})"
                )
            raise StoreError(
                f"fsm store at {self.endpoint}: {req.get('op')} failed: "
                f"{reply.get('error')}: {reply.get('message', '')}"
            )
        return reply

    def _check_first_reply(self, reply: dict) -> None:
        """The reply to a connection's first request when it carried ``proto`` (no hello): it must
        be an fsm store's, of the same protocol version."""
        if "ok" not in reply or reply.get("error") == "bad_proto":
            raise StoreProtocolError(
                f"fsm store at {self.endpoint}: the peer is not an {PROTO} server (answered with {str(reply)[:120]!r})"
            )

    def _wait_s(self, timeout: timedelta | float | None) -> float:
        s = _seconds(timeout)
        return self._timeout.total_seconds() if s is None else s

    # -- torch.distributed.Store API -------------------------------------------------------------
    def set(self, key: str, value: str | bytes, *, ttl: float | None = None, ephemeral: bool = False) -> int:
        """Set ``key``; returns its new version. ``ttl``/``ephemeral``: see the module docstring."""
        req = {"op": "set", "key": key, "value": _b64(_to_bytes(value))}
        if ttl is not None:
            req["ttl"] = float(ttl)
        if ephemeral:
            req["ephemeral"] = True
        return self._request(req)["version"]

    def get(self, key: str, timeout: timedelta | float | None = None) -> bytes:
        """The value of ``key``, waiting (up to ``timeout``, default the store timeout) until it is set."""
        wait = self._wait_s(timeout)
        return _unb64(self._request({"op": "get", "key": key, "timeout": wait}, wait)["value"])

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer at ``key`` (missing: 0); returns the new value."""
        return int(self._request({"op": "add", "key": key, "amount": int(amount)})["value"])

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        """Set ``key`` to ``desired_value`` if it holds ``expected_value`` (missing counts as ``b""``).

        Returns the value after the call: ``desired_value`` if swapped, else the current value
        (or ``expected_value`` when the key is missing and ``expected_value`` is not empty, as torch).
        """
        req = {
            "op": "compare_set",
            "key": key,
            "expected": _b64(_to_bytes(expected_value)),
            "desired": _b64(_to_bytes(desired_value)),
        }
        return _unb64(self._request(req)["value"])

    def compare_set_versioned(
        self, key: str, expected_value: str | bytes, desired_value: str | bytes
    ) -> tuple[bytes, int, float]:
        """``compare_set`` that also returns the key's version and the server time: ``(value, version, now)``."""
        req = {
            "op": "compare_set",
            "key": key,
            "expected": _b64(_to_bytes(expected_value)),
            "desired": _b64(_to_bytes(desired_value)),
        }
        reply = self._request(req)
        return _unb64(reply["value"]), int(reply["version"]), float(reply["now"])

    def multi_get(self, keys: Sequence[str], timeout: timedelta | float | None = None) -> list[bytes]:
        """Values of ``keys``, waiting until all are set (as torch's TCPStore)."""
        wait = self._wait_s(timeout)
        reply = self._request({"op": "multi_get", "keys": list(keys), "timeout": wait}, wait)
        return [_unb64(v) for v in reply["values"]]

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        self._request({"op": "multi_set", "keys": list(keys), "values": [_b64(_to_bytes(v)) for v in values]})

    def check(self, keys: Sequence[str]) -> bool:
        """True if every key is set (never blocks)."""
        return bool(self._request({"op": "check", "keys": list(keys)})["value"])

    def wait(self, keys: Sequence[str], timeout: timedelta | float | None = None) -> None:
        """Block until every key is set; StoreTimeout after ``timeout`` (default: the store timeout)."""
        wait = self._wait_s(timeout)
        self._request({"op": "wait", "keys": list(keys), "timeout": wait}, wait)

    def delete_key(self, key: str) -> bool:
        return bool(self._request({"op": "delete", "key": key})["value"])

    def num_keys(self) -> int:
        return int(self._request({"op": "num_keys"})["value"])

    # -- extensions for the rendezvous -----------------------------------------------------------
    def exists(self, keys: Sequence[str]) -> list[bool]:
        return list(self._request({"op": "exists", "keys": list(keys)})["values"])

    def get_versioned(
        self, keys: Sequence[str], prefix: str | None = None
    ) -> tuple[list[bytes | None], list[int], dict[str, int], float]:
        """``(values, versions, listing, now)``: never blocks. Missing keys: value None, version 0.

        ``listing`` maps every key that starts with ``prefix`` to its version (empty without a prefix).
        """
        req: dict[str, Any] = {"op": "get_versioned", "keys": list(keys)}
        if prefix is not None:
            req["prefix"] = prefix
        reply = self._request(req)
        values = [None if v is None else _unb64(v) for v in reply["values"]]
        return values, list(reply["versions"]), dict(reply.get("listing", {})), float(reply["now"])

    def watch(self, versions: dict[str, int], timeout: timedelta | float) -> tuple[dict[str, int], float]:
        """Block until one of ``versions``' keys has another version (0 = missing), or ``timeout``.

        Returns ``(changed, now)``: the new versions of the keys that changed (empty on timeout).
        """
        wait = max(0.0, _seconds(timeout))
        reply = self._request({"op": "watch", "versions": dict(versions), "timeout": wait}, wait)
        return dict(reply["changed"]), float(reply["now"])

    def touch(self, keys: Sequence[str], ttl: float) -> list[bool]:
        """Extend the leases of ``keys`` to ``ttl`` s from now; False for keys that no longer exist."""
        return list(self._request({"op": "touch", "keys": list(keys), "ttl": float(ttl)})["values"])

    def server_time(self) -> float:
        return float(self._request({"op": "time"})["now"])

    def stats(self) -> dict[str, Any]:
        """The server's traffic since it started: ``bytes_in``, ``bytes_out``, ``requests``, ``ops``
        (requests by op, and rendezvous answers as ``status:<status>``), and its ``connections`` and
        ``keys`` now (what ``benchmarks/rendezvous_scale.py`` reports)."""
        reply = self._request({"op": "stats"})
        out: dict[str, Any] = {k: int(reply[k]) for k in ("bytes_in", "bytes_out", "requests", "connections", "keys")}
        out["ops"] = dict(reply.get("ops", {}))
        return out

    def rendezvous(self, op: str, wait: float | None = None, **fields: Any) -> dict:
        """One ``rdzv_<op>`` request of the ``fsm`` rendezvous (see ``StoreServer._rdzv_handle``);
        ``wait``: how long the server may block it (seconds). Returns the reply object."""
        req = {"op": f"rdzv_{op}", **fields}
        if wait is not None:
            req["timeout"] = max(0.0, float(wait))
        return self._request(req, wait)


class PrefixStore:
    """``torch.distributed.PrefixStore`` for fsm stores: every key becomes ``<prefix>/<key>``.

    ``subscribe``: how ``subscribe()`` asks to be told of a key's changes (the ``fsm`` handler's,
    for its round's store: its membership watch carries the key); None: ``subscribe()`` says poll.
    """

    def __init__(self, prefix: str, store: Any, subscribe: Callable[[str, Callable[[], None]], bool] | None = None):
        self.prefix, self.underlying_store = prefix, store
        self._subscribe = subscribe

    def _k(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    def subscribe(self, key: str, callback: Callable[[], None]) -> bool:
        """Have ``callback()`` called, from another thread, whenever ``key`` may have been set or
        changed (at once when it is set already), instead of polling it. It must not block: it is
        called on the thread that keeps this node alive. Returns False when this store cannot do
        that (the caller polls); spurious calls are possible, missed changes are not while the
        rendezvous round this store belongs to lasts."""
        return self._subscribe is not None and self._subscribe(key, callback)

    @property
    def timeout(self) -> timedelta:
        return self.underlying_store.timeout

    def set_timeout(self, timeout: timedelta) -> None:
        self.underlying_store.set_timeout(timeout)

    def set(self, key: str, value: str | bytes, **kw: Any) -> Any:
        return self.underlying_store.set(self._k(key), value, **kw)

    def get(self, key: str, timeout: timedelta | float | None = None) -> bytes:
        return self.underlying_store.get(self._k(key), timeout)

    def add(self, key: str, amount: int) -> int:
        return self.underlying_store.add(self._k(key), amount)

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        return self.underlying_store.compare_set(self._k(key), expected_value, desired_value)

    def multi_get(self, keys: Sequence[str], timeout: timedelta | float | None = None) -> list[bytes]:
        return self.underlying_store.multi_get([self._k(k) for k in keys], timeout)

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        self.underlying_store.multi_set([self._k(k) for k in keys], values)

    def check(self, keys: Sequence[str]) -> bool:
        return self.underlying_store.check([self._k(k) for k in keys])

    def wait(self, keys: Sequence[str], timeout: timedelta | float | None = None) -> None:
        self.underlying_store.wait([self._k(k) for k in keys], timeout)

    def delete_key(self, key: str) -> bool:
        return self.underlying_store.delete_key(self._k(key))

    def num_keys(self) -> int:
        return self.underlying_store.num_keys()

    def __repr__(self) -> str:
        return f"PrefixStore({self.prefix!r}, {self.underlying_store!r})"


def main(argv: Iterable[str] | None = None) -> int:
    """``python -m fsm_agent.store --host 0.0.0.0 --port 29400``: a store outside any agent."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m fsm_agent.store", description=main.__doc__)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=29400)
    args = parser.parse_args(list(argv) if argv is not None else None)
    server = StoreServer(args.host, args.port)
    try:
        server.bind()
    except StoreBindError as exc:
        print(exc, flush=True)
        return 1
    print(f"fsm store listening on {server.endpoint} (pid {os.getpid()})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        server.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
