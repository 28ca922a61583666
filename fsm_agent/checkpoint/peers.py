"""Checkpoint replicas between agents: each node's agent copies every new complete checkpoint of its
local workers to one other node's agent, and an agent that must restore a rank it does not hold
fetches it from the agent that does.

Who sends to whom is the ``checkpoint`` plugin's choice (the successor in a ring over the round's
group ranks); this module moves the bytes. Standard library only: the agent never imports torch,
and a checkpoint is opaque bytes here. Received bytes go straight from the socket into the shared
memory of a slot (``recv_into``), and sent bytes straight from it (``sendall`` of views of the
mapped slot): there is no copy of a whole checkpoint in the agent's own memory.

Each agent runs one ``ReplicaServer``. A node receives from one predecessor and serves rare
fetches, so one thread per connection is enough. It keeps the replicas it receives in its
``shm_dir`` as one ``SlotPair`` per global rank, ``<shm_dir>/replica-<global_rank>-a`` / ``-b``
(made on first use, ``capacity`` bytes each): double buffered like the workers' own pairs, so a
transfer that fails leaves the previous replica of that rank intact.

Frames (one TCP connection per request; the client opens it and sends first):

* JSON frame: a 4-byte big-endian length (at most ``MAX_JSON`` bytes), then a UTF-8 JSON object.
* data: pieces, each an 8-byte big-endian length ``n > 0`` then ``n`` raw payload bytes (at most
  ``PIECE`` each), ended by a piece of length 0. The sender may end early (its source slot was
  rewritten while it read: a torn read); the trailer then says so.

PUT (``send_replica``: a replica arriving)::

    client: {"op": "put", "token", "global_rank", "world_size", "step", "length",
             "recorded": the checksum stored in the sender's slot header, or null}
    server: {"status": "ready"}  or  {"status": "error", "reason": "..."} (and closes)
    client: data pieces (the payload, computing its checksum as it reads)
    client: trailer {"consistent": true/false, "checksum": what it computed while reading, "reason"}
    server: {"status": "ok" | "bad" | "torn" | "error", "reason": "..."}

The server writes into ``pair.begin_write(step, global_rank, world_size)`` (the slot that is not
the newest complete one), computes the checksum of what it receives (``slots.ChunkSums``) and
commits it with that checksum only when the trailer says the sender's read was consistent, the
byte count is ``length``, and its checksum equals the sender's (and the recorded one, when there
was one): "ok". A checksum that does not match marks the slot BAD ("bad"); a torn read leaves it
WRITING ("torn"). A connection that drops (or stalls past the timeout) mid-transfer leaves it
WRITING too. In every failure the previous replica of the rank stays its newest COMPLETE one.

GET (``fetch``)::

    client: {"op": "get", "token", "global_rank", "world_size", "step"}
    server: {"status": "found", "length", "recorded": the checksum stored in the slot header, or null}
            or {"status": "not found" | "error", "reason": "..."} (and closes)
    server: data pieces, then trailer {"consistent", "checksum": computed while sending, "reason"}

The server looks in its replica pairs, then in this node's own workers' slots (``local_lookup``).
"consistent" is the seqlock check (``slots.read_consistent``: the slot's seq and state unchanged
from before the first byte to after the last). The client receives into ``pair.begin_write`` and
commits only when the read was consistent, the byte count is right, and the checksum of what it
received equals the server's and the recorded one (a slot damaged in memory since it was written
fails here); otherwise it marks its slot BAD and says why.

Every request carries ``token`` (the run id): a wrong one is refused before any byte of payload.

What survives what: the ranks of node i live in node i's memory and in node i+1's replica pairs.
Losing one node loses nothing held in memory (its successor serves its ranks). Losing two
neighbours, i and i+1, loses both copies of node i's ranks: only their copy in
``--checkpoint-dir``, if any, is left (the restore plan falls back to the disk, or to an older
step every rank still holds).
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import os
import queue
import re
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from fsm_agent.checkpoint.slots import (
    COMPLETE,
    STATE_NAMES,
    ChunkSums,
    Header,
    Slot,
    SlotPair,
    read_consistent,
    slot_paths,
)

log = logging.getLogger(__name__)

#: The most bytes one data piece carries (and one ``sendall`` sends).
PIECE = 8 << 20
#: The most bytes a JSON frame may have.
MAX_JSON = 64 << 10
#: The server's socket timeout on an accepted connection, seconds (a stalled peer is dropped).
SERVER_TIMEOUT_S = 60.0

_JSON_LEN = struct.Struct(">I")
_PIECE_LEN = struct.Struct(">Q")
_REPLICA_NAME = re.compile(r"^replica-(\d+)-a$")


class PeerError(OSError):
    """A transfer with a peer agent failed (cannot connect, timed out, dropped, refused, or the
    peer spoke out of protocol). ``str()`` is one line naming the peer's address."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = " ".join(message.splitlines())

    def __str__(self) -> str:
        return self.message


class _Dropped(Exception):
    """The other end closed the connection before the frame was complete."""


class _ProtocolError(Exception):
    """A frame that does not follow the protocol."""


class _Torn(Exception):
    """The source slot was rewritten while it was being sent."""


class Sent(NamedTuple):
    """A replica ``send_replica`` streamed to a peer.

    Attributes:
        step / global_rank / world_size: the checkpoint's, as its slot's header said.
        seq: the source slot's write sequence number the bytes were of.
        bytes: payload bytes sent.
        seconds: the whole call, connection included.
        checksum: ``slots.checksum`` of the payload, computed while reading it (record it with
            ``slot.set_checksum(seq, checksum)``).
        reply: the peer's verdict: "ok" (committed), "bad" (checksums differ: not committed) or
            "error" (it failed on its side: not committed).
        reason: the peer's one-line reason ("" when ok).
    """

    step: int
    global_rank: int
    world_size: int
    seq: int
    bytes: int
    seconds: float
    checksum: int
    reply: str
    reason: str = ""

    @property
    def ok(self) -> bool:
        """Whether the peer committed the replica."""
        return self.reply == "ok"


class Fetched(NamedTuple):
    """What ``fetch`` got.

    Attributes:
        header: the header of the slot of ``pair`` now holding the checkpoint (COMPLETE, checksum
            recorded); None when it was not fetched.
        reason: why not (one line naming the peer); "" when fetched.
        bytes: payload bytes received.
        seconds: the whole call, connection included.
    """

    header: Header | None
    reason: str = ""
    bytes: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """Whether the checkpoint was fetched and committed."""
        return self.header is not None


class Holding(NamedTuple):
    """A COMPLETE replica a ``ReplicaServer`` holds: its rank, world size, step, the slot's write
    ``seq``, and its recorded checksum (None when none is recorded)."""

    global_rank: int
    world_size: int
    step: int
    seq: int
    checksum: int | None


class _Streamed(NamedTuple):
    consistent: bool
    checksum: int
    bytes: int
    reason: str


# -- framing ------------------------------------------------------------------------------------
def _send_json(sock: socket.socket, obj: dict[str, Any]) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode()
    sock.sendall(_JSON_LEN.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        r = sock.recv_into(view[got:], n - got)
        if r == 0:
            raise _Dropped(f"connection closed after {got} of {n} bytes")
        got += r
    return bytes(buf)


def _recv_json(sock: socket.socket) -> dict[str, Any]:
    (n,) = _JSON_LEN.unpack(_recv_exact(sock, _JSON_LEN.size))
    if n > MAX_JSON:
        raise _ProtocolError(f"a frame of {n} bytes (at most {MAX_JSON}): not an fsm-agent replica peer")
    try:
        obj = json.loads(_recv_exact(sock, n))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _ProtocolError(f"a frame that is not JSON ({exc})") from exc
    if not isinstance(obj, dict):
        raise _ProtocolError("a frame that is not a JSON object")
    return obj


def _int(obj: dict[str, Any], key: str, minimum: int | None = None) -> int:
    value = obj.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise _ProtocolError(f"{key} missing or not an integer")
    if minimum is not None and value < minimum:
        raise _ProtocolError(f"{key} {value} is below {minimum}")
    return value


def _opt_int(obj: dict[str, Any], key: str) -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise _ProtocolError(f"{key} not an integer")
    return value


class _Behind:
    """Run ``work`` on each item in a thread of its own, in order, at most ``depth`` items behind
    the caller: the checksum of one piece overlaps the socket I/O of the next (``zlib.crc32``,
    ``sendall`` and ``recv_into`` all release the GIL). The first error of ``work`` is raised by
    the next ``put`` or by ``finish``; items after it are dropped."""

    def __init__(self, work: Callable[[memoryview], None], depth: int = 2):
        self._work = work
        self._queue: queue.Queue[memoryview | None] = queue.Queue(depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="fsm-agent-replica-io", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self._error is None:
                try:
                    self._work(item)
                except BaseException as exc:
                    self._error = exc

    def put(self, item: memoryview) -> None:
        if self._error is not None:
            raise self._error
        self._queue.put(item)

    def finish(self) -> None:
        """Wait for the items put so far; raise the first error of ``work``."""
        self.close()
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def __enter__(self) -> _Behind:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _send_slot(sock: socket.socket, slot: Slot, header: Header) -> _Streamed:
    """Send the payload of write ``header.seq`` of ``slot`` as data pieces and the end marker,
    stopping early when the slot is rewritten meanwhile (seqlock). The pieces go out from a
    second thread while ``read_consistent`` computes the checksum of the next; the slot's header
    is checked again after the last piece went out (they are sent from the slot's memory)."""
    length = header.payload_len
    queued = 0

    def send(part: memoryview) -> None:
        sock.sendall(_PIECE_LEN.pack(len(part)))
        sock.sendall(part)

    with _Behind(send) as sender:

        def sink(part: memoryview) -> None:
            nonlocal queued
            now = slot.header()
            if now.seq != header.seq or now.state != COMPLETE or queued + len(part) > length:
                raise _Torn
            sender.put(part)
            queued += len(part)

        try:
            result = read_consistent(slot, sink, PIECE)
        except _Torn:
            result = None
        sender.finish()
    sock.sendall(_PIECE_LEN.pack(0))
    after = slot.header()
    if result is None or result[0].seq != header.seq or queued != length or after.seq != header.seq:
        return _Streamed(False, 0, queued, "the slot was rewritten while it was read (torn read)")
    if after.state != COMPLETE:
        return _Streamed(False, 0, queued, f"the slot became {STATE_NAMES.get(after.state)} while it was read")
    return _Streamed(True, result[1], queued, "")


def _recv_slot(sock: socket.socket, slot: Slot, length: int) -> tuple[int, int]:
    """Receive data pieces into ``slot.payload`` up to the end marker; (bytes, their checksum,
    computed in a second thread while the next piece arrives).

    Raises:
        _Dropped: the connection closed first.
        _ProtocolError: more than ``length`` bytes.
    """
    sums = ChunkSums()
    offset = 0
    with _Behind(sums.update) as summer:
        while True:
            (n,) = _PIECE_LEN.unpack(_recv_exact(sock, _PIECE_LEN.size))
            if n == 0:
                break
            if offset + n > length:
                raise _ProtocolError(f"more payload than the {length} bytes announced")
            view = slot.payload[offset : offset + n]
            got = 0
            while got < n:
                r = sock.recv_into(view[got:], n - got)
                if r == 0:
                    raise _Dropped(f"connection closed after {offset + got} of {length} bytes")
                got += r
            summer.put(view)
            offset += n
        summer.finish()
    return offset, sums.value()


def _verdict(trailer: dict[str, Any], received: int, length: int, value: int, recorded: int | None) -> tuple[str, str]:
    """("ok" | "torn" | "bad", reason) for a transfer that ended with ``trailer``."""
    if trailer.get("consistent") is not True:
        return "torn", f"the sending side's read was torn: {trailer.get('reason') or 'no reason given'}"
    if received != length:
        return "bad", f"{received} bytes received, {length} announced"
    theirs = _opt_int(trailer, "checksum")
    if theirs != value:
        sender = "nothing" if theirs is None else f"{theirs:#010x}"
        return "bad", f"checksum {value:#010x} of the bytes received, the sending side computed {sender}"
    if recorded is not None and recorded != value:
        return "bad", f"checksum {value:#010x} does not match the one recorded when it was written ({recorded:#010x})"
    return "ok", ""


def _addr(address: tuple[str, int]) -> str:
    host, port = address[0], address[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _connect(address: tuple[str, int], timeout: float) -> socket.socket:
    try:
        return socket.create_connection((address[0], address[1]), timeout=timeout)
    except OSError as exc:
        raise PeerError(f"replica peer {_addr(address)}: cannot connect: {exc}") from exc


# -- client side ----------------------------------------------------------------------------------
def send_replica(address: tuple[str, int], token: str, slot: Slot, timeout: float) -> Sent | None:
    """Stream the COMPLETE checkpoint in ``slot`` to the ``ReplicaServer`` at ``address``.

    Args:
        address: the peer's (host, port).
        token: the run id; the peer refuses another.
        slot: the source slot (read with the seqlock, never written).
        timeout: seconds, for connecting and for each send or receive (a stall, not the total).

    Returns:
        A ``Sent`` (``reply`` says whether the peer committed it: check ``ok``), or None when there
        was nothing consistent to send: the slot was not COMPLETE, or it was rewritten while it was
        read (the peer was told so and did not commit).

    Raises:
        PeerError: cannot connect, a timeout, a dropped connection, or the peer refused the
            request before any payload (wrong token, too large for its slots, busy).
    """
    started = time.monotonic()
    header = slot.header()
    if not header.complete:
        return None
    peer = _addr(address)
    recorded = header.checksum if header.has_checksum else None
    with _connect(address, timeout) as sock:
        try:
            _send_json(
                sock,
                {
                    "op": "put",
                    "token": token,
                    "global_rank": header.global_rank,
                    "world_size": header.world_size,
                    "step": header.step,
                    "length": header.payload_len,
                    "recorded": recorded,
                },
            )
            ready = _recv_json(sock)
            if ready.get("status") != "ready":
                raise PeerError(f"replica peer {peer} refused rank {header.global_rank}: {ready.get('reason')}")
            streamed = _send_slot(sock, slot, header)
            _send_json(
                sock,
                {"consistent": streamed.consistent, "checksum": streamed.checksum, "reason": streamed.reason},
            )
            reply = _recv_json(sock)
        except PeerError:
            raise
        except (OSError, _Dropped, _ProtocolError) as exc:
            raise PeerError(f"replica peer {peer}: sending rank {header.global_rank}: {exc}") from exc
    if not streamed.consistent:
        log.debug("replica of rank %s step %s not sent: %s", header.global_rank, header.step, streamed.reason)
        return None
    status = str(reply.get("status"))
    reason = str(reply.get("reason") or "")
    if status != "ok":
        log.warning(
            "replica peer %s did not commit rank %s step %s: %s: %s",
            peer,
            header.global_rank,
            header.step,
            status,
            reason,
        )
    return Sent(
        header.step,
        header.global_rank,
        header.world_size,
        header.seq,
        streamed.bytes,
        time.monotonic() - started,
        streamed.checksum,
        status,
        reason,
    )


def fetch(
    address: tuple[str, int], token: str, global_rank: int, world_size: int, step: int, pair: SlotPair, timeout: float
) -> Fetched:
    """Fetch ``step`` of ``global_rank`` (in a world of ``world_size``) from the ``ReplicaServer``
    at ``address`` into ``pair`` (``pair.begin_write``: its newest complete checkpoint is kept).

    Args:
        address: the peer's (host, port).
        token: the run id; the peer refuses another.
        timeout: seconds, for connecting and for each send or receive (a stall, not the total).

    Returns:
        A ``Fetched``: ``header`` of the committed slot (checksum recorded), or None with
        ``reason``: the peer does not hold it, it is larger than ``pair``'s capacity, or the copy
        was torn or its checksum did not match (then the slot written is marked BAD).

    Raises:
        PeerError: cannot connect, a timeout, a dropped connection (the slot written is left
            WRITING), or the peer refused the request or spoke out of protocol.
    """
    started = time.monotonic()
    peer = _addr(address)
    what = f"rank {global_rank} step {step} (world {world_size})"
    with _connect(address, timeout) as sock:
        try:
            _send_json(
                sock,
                {"op": "get", "token": token, "global_rank": global_rank, "world_size": world_size, "step": step},
            )
            reply = _recv_json(sock)
            status = reply.get("status")
            if status == "not found":
                return Fetched(None, f"replica peer {peer}: {what} not held there", 0, time.monotonic() - started)
            if status != "found":
                raise PeerError(f"replica peer {peer} refused {what}: {reply.get('reason')}")
            length = _int(reply, "length", 0)
            recorded = _opt_int(reply, "recorded")
            if length > pair.capacity:
                return Fetched(
                    None,
                    f"replica peer {peer}: {what} is {length} bytes, the slot holds {pair.capacity}",
                    0,
                    time.monotonic() - started,
                )
            slot = pair.begin_write(step, global_rank, world_size)
            seq = slot.header().seq
            received, value = _recv_slot(sock, slot, length)
            verdict, reason = _verdict(_recv_json(sock), received, length, value, recorded)
        except PeerError:
            raise
        except (OSError, _Dropped, _ProtocolError) as exc:
            raise PeerError(f"replica peer {peer}: fetching {what}: {exc}") from exc
    seconds = time.monotonic() - started
    if verdict != "ok":
        slot.mark_bad(seq)
        reason = f"replica peer {peer}: {what}: {reason}"
        log.warning("%s", reason)
        return Fetched(None, reason, received, seconds)
    slot.commit(length, value)
    return Fetched(slot.header(), "", received, seconds)


# -- server side --------------------------------------------------------------------------------
class ReplicaServer:
    """Serves this agent's replicas: receives PUTs into ``<shm_dir>/replica-<global_rank>`` pairs
    and answers GETs from them and from ``local_lookup``.

    Args:
        shm_dir: the directory of this agent's slots (replica pairs are made there; never removed
            here: whoever made the directory removes it).
        capacity: bytes of payload each replica slot holds; a larger replica is refused.
        token: the run id every request must carry.
        host: the address to listen on.
        local_lookup: ``(global_rank, world_size, step) -> Slot | None``: this node's own slot
            holding that checkpoint COMPLETE, served to fetches the replicas cannot answer.
        timeout: seconds a connection may stall before it is dropped.
    """

    def __init__(
        self,
        shm_dir: str,
        capacity: int,
        token: str,
        host: str = "0.0.0.0",
        local_lookup: Callable[[int, int, int], Slot | None] | None = None,
        timeout: float = SERVER_TIMEOUT_S,
    ):
        self.shm_dir = shm_dir
        self.capacity = capacity
        self.host = host
        self._token = token.encode()
        self._local_lookup = local_lookup
        self._timeout = timeout
        self._listener: socket.socket | None = None
        self._accepter: threading.Thread | None = None
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._pairs: dict[int, SlotPair] = {}
        self._receiving: set[int] = set()
        self._conns: dict[socket.socket, threading.Thread] = {}

    def start(self) -> None:
        """Bind ``(host, 0)`` and serve from daemon threads.

        Raises:
            OSError: cannot bind.
        """
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        self._listener = socket.create_server((self.host, 0), family=family, backlog=16)
        self._listener.settimeout(0.2)
        self._accepter = threading.Thread(target=self._accept_loop, name="fsm-agent-replicas", daemon=True)
        self._accepter.start()

    @property
    def port(self) -> int:
        """The port it listens on (after ``start``)."""
        if self._listener is None:
            raise RuntimeError("ReplicaServer not started")
        return int(self._listener.getsockname()[1])

    def close(self) -> None:
        """Stop: no new connections, open ones shut down (a transfer in flight leaves its slot
        WRITING), threads joined, replica pairs unmapped. Files are left in ``shm_dir``."""
        self._closing.set()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept() at once (Linux); else the poll
        if self._accepter is not None:
            self._accepter.join()
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            conns = list(self._conns.items())
        for conn, _ in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for _, thread in conns:
            thread.join()
        with self._lock:
            pairs, self._pairs = list(self._pairs.values()), {}
        for pair in pairs:
            pair.close()

    def __enter__(self) -> ReplicaServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def keep_only(self, global_ranks: Iterable[int]) -> list[int]:
        """Drop the replicas of every rank not in ``global_ranks`` (unmapped, files removed: the
        memory goes back), except one being received now; the ranks dropped. The agent calls it
        when a round gives its predecessor other ranks: old replicas would fill ``/dev/shm``."""
        keep = set(global_ranks)
        dropped = []
        with self._lock:
            for g in self._replica_ranks():
                if g in keep or g in self._receiving:
                    continue
                pair = self._pairs.pop(g, None)
                if pair is not None:
                    pair.close()
                for path in slot_paths(os.path.join(self.shm_dir, f"replica-{g}")):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
                dropped.append(g)
        return dropped

    def holdings(self) -> list[Holding]:
        """The COMPLETE replicas held now (both slots of each rank's pair), by rank then seq."""
        found = []
        for g in self._replica_ranks():
            pair = self._pair(g, create=False)
            if pair is None:
                continue
            for slot in pair.slots:
                h = slot.header()
                if h.complete:
                    found.append(
                        Holding(h.global_rank, h.world_size, h.step, h.seq, h.checksum if h.has_checksum else None)
                    )
        return sorted(found, key=lambda h: (h.global_rank, h.seq))

    # -- internals ----------------------------------------------------------------------------
    def _replica_ranks(self) -> list[int]:
        try:
            names = os.listdir(self.shm_dir)
        except OSError:
            return []
        return sorted(int(m.group(1)) for m in map(_REPLICA_NAME.match, names) if m)

    def _pair(self, global_rank: int, create: bool) -> SlotPair | None:
        """The replica pair of ``global_rank``: mapped already, opened (made by an earlier server
        in this directory), made (``create``), or None."""
        with self._lock:
            pair = self._pairs.get(global_rank)
            if pair is not None or self._closing.is_set():
                return pair
            prefix = os.path.join(self.shm_dir, f"replica-{global_rank}")
            if all(os.path.exists(p) for p in slot_paths(prefix)):
                try:
                    pair = SlotPair.open(prefix)
                except Exception as exc:
                    log.warning("replica slots %s unreadable (%s): made again", prefix, exc)
                else:
                    if pair.capacity != self.capacity or pair.slots[1].capacity != self.capacity:
                        pair.close()
                        pair = None
            if pair is None:
                if not create:
                    return None
                pair = SlotPair.create(prefix, self.capacity, reserve=True)  # the memory now, not a SIGBUS later
            self._pairs[global_rank] = pair
            return pair

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._closing.is_set():
            try:
                conn, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if not self._closing.is_set():
                    log.warning("replica server: accept failed: %s", exc)
                    time.sleep(0.1)
                continue
            thread = threading.Thread(target=self._serve, args=(conn, peer), name="fsm-agent-replica-conn", daemon=True)
            with self._lock:
                if self._closing.is_set():
                    conn.close()
                    break
                self._conns[conn] = thread
            thread.start()

    def _serve(self, conn: socket.socket, peer: Any) -> None:
        who = _addr((str(peer[0]), int(peer[1])))
        try:
            conn.settimeout(self._timeout)
            request = _recv_json(conn)
            token = request.get("token")
            if not isinstance(token, str) or not hmac.compare_digest(token.encode(), self._token):
                log.warning("replica server: refused a request from %s: wrong token (another run's agent?)", who)
                _send_json(conn, {"status": "error", "reason": "wrong token: this agent serves another run"})
                return
            op = request.get("op")
            if op == "put":
                self._put(conn, who, request)
            elif op == "get":
                self._get(conn, who, request)
            else:
                _send_json(conn, {"status": "error", "reason": f"unknown op {op!r}"})
        except _ProtocolError as exc:
            log.warning("replica server: %s: %s", who, exc)
            with contextlib.suppress(OSError):
                _send_json(conn, {"status": "error", "reason": str(exc)})
        except (OSError, _Dropped) as exc:
            if not self._closing.is_set():
                log.warning("replica server: connection from %s failed: %s", who, exc)
        except Exception:
            log.exception("replica server: request from %s", who)
        finally:
            conn.close()
            with self._lock:
                self._conns.pop(conn, None)

    def _put(self, conn: socket.socket, who: str, request: dict[str, Any]) -> None:
        g = _int(request, "global_rank", 0)
        world = _int(request, "world_size", 1)
        step = _int(request, "step")
        length = _int(request, "length", 0)
        recorded = _opt_int(request, "recorded")
        what = f"rank {g} step {step} (world {world})"
        if g >= world:
            raise _ProtocolError(f"global_rank {g} outside a world of {world}")
        if length > self.capacity:
            _send_json(
                conn,
                {"status": "error", "reason": f"{what} is {length} bytes, this agent's slots hold {self.capacity}"},
            )
            return
        with self._lock:
            busy = g in self._receiving
            self._receiving.add(g)
        if busy:
            _send_json(conn, {"status": "error", "reason": f"a replica of rank {g} is being received already"})
            return
        try:
            try:
                pair = self._pair(g, create=True)
            except OSError as exc:
                _send_json(conn, {"status": "error", "reason": f"cannot make replica slots: {exc}"})
                return
            if pair is None:
                _send_json(conn, {"status": "error", "reason": "the server is closing"})
                return
            _send_json(conn, {"status": "ready"})
            slot = pair.begin_write(step, g, world)
            seq = slot.header().seq
            try:
                received, value = _recv_slot(conn, slot, length)
            except _ProtocolError:
                slot.mark_bad(seq)
                raise
            trailer = _recv_json(conn)
            verdict, reason = _verdict(trailer, received, length, value, recorded)
            if verdict == "ok":
                slot.commit(length, value)
                log.debug("replica server: %s from %s committed (%s bytes)", what, who, length)
            elif verdict == "bad":
                slot.mark_bad(seq)
                log.warning("replica server: %s from %s not committed: %s", what, who, reason)
            else:
                log.info("replica server: %s from %s not committed: %s", what, who, reason)
        finally:
            with self._lock:
                self._receiving.discard(g)
        # after the rank is free again: the sender's next replica of it may come right after this
        _send_json(conn, {"status": verdict, "reason": reason})

    def _get(self, conn: socket.socket, who: str, request: dict[str, Any]) -> None:
        g = _int(request, "global_rank", 0)
        world = _int(request, "world_size", 1)
        step = _int(request, "step")
        what = f"rank {g} step {step} (world {world})"
        found: tuple[Slot, Header] | None = None
        replica = False
        pair = self._pair(g, create=False)
        if pair is not None:
            found = pair.find(step, g, world)
            replica = found is not None
        if found is None and self._local_lookup is not None:
            slot = self._local_lookup(g, world, step)
            if slot is not None:
                h = slot.header()
                if h.complete and (h.step, h.global_rank, h.world_size) == (step, g, world):
                    found = (slot, h)
        if found is None:
            _send_json(conn, {"status": "not found", "reason": f"{what} is not held here"})
            return
        slot, header = found
        recorded = header.checksum if header.has_checksum else None
        _send_json(conn, {"status": "found", "length": header.payload_len, "recorded": recorded})
        streamed = _send_slot(conn, slot, header)
        if streamed.consistent and recorded is not None and streamed.checksum != recorded:
            # before the trailer: once the client has its answer, this copy is not offered again
            log.warning("replica server: %s in %s does not match its checksum: damaged in memory", what, slot.path)
            if replica:
                slot.mark_bad(header.seq)
        _send_json(conn, {"consistent": streamed.consistent, "checksum": streamed.checksum, "reason": streamed.reason})
        log.debug(
            "replica server: %s sent to %s (%s bytes, consistent %s)", what, who, streamed.bytes, streamed.consistent
        )
