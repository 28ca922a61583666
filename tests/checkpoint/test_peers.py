"""Replicas between agents (``fsm_agent.checkpoint.peers``): real sockets on 127.0.0.1, real slot
files in ``/dev/shm``. A replica is stored byte for byte with its checksum, double buffered, served
back (also a node's own slots), and never committed when the bytes are damaged, the sender's read
was torn, the connection dropped, or the token is another run's."""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import struct
import tempfile
import threading
import time

import pytest

from fsm_agent.checkpoint.peers import Holding, PeerError, ReplicaServer, fetch, send_replica
from fsm_agent.checkpoint.slots import BAD, COMPLETE, EMPTY, HEADER_AREA, WRITING, SlotPair, checksum

pytestmark = pytest.mark.unit

TOKEN = "run-32"
CAPACITY = 24 << 20
TIMEOUT = 5.0


@pytest.fixture
def shm(request):
    """A fresh folder in /dev/shm, and ``make(name)``: a slot pair in it; all closed and removed at teardown."""
    path = tempfile.mkdtemp(dir="/dev/shm", prefix="fsm_agent_test_")
    pairs: list[SlotPair] = []

    def finish():
        for pair in pairs:
            pair.close()
        shutil.rmtree(path, ignore_errors=True)

    request.addfinalizer(finish)

    class Shm:
        dir = path

        @staticmethod
        def make(name: str, capacity: int = CAPACITY) -> SlotPair:
            pair = SlotPair.create(os.path.join(path, name), capacity)
            pairs.append(pair)
            return pair

        @staticmethod
        def open(name: str) -> SlotPair:
            pair = SlotPair.open(os.path.join(path, name))
            pairs.append(pair)
            return pair

    return Shm


@pytest.fixture
def servers(shm):
    """Start ReplicaServers on 127.0.0.1 (each with a directory of its own); all closed at the end,
    and no server thread left."""
    started: list[ReplicaServer] = []

    def start(capacity: int = CAPACITY, local_lookup=None, token: str = TOKEN) -> ReplicaServer:
        root = os.path.join(shm.dir, f"node{len(started)}")
        os.mkdir(root)
        server = ReplicaServer(root, capacity, token, host="127.0.0.1", local_lookup=local_lookup)
        server.start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.close()
    left = [t.name for t in threading.enumerate() if t.name.startswith("fsm-agent-replica")]
    assert not left, left


def addr(server: ReplicaServer) -> tuple[str, int]:
    return ("127.0.0.1", server.port)


def payload(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def save(pair: SlotPair, step: int, g: int, world: int, data: bytes):
    slot = pair.begin_write(step, g, world)
    slot.payload[: len(data)] = data
    slot.commit(len(data))
    return slot


def replica_states(server: ReplicaServer, g: int) -> list[tuple[int, int]]:
    """(state, step) of both slots of rank ``g``'s replica pair, by slot."""
    pair = SlotPair.open(os.path.join(server.shm_dir, f"replica-{g}"))
    try:
        return [(h.state, h.step) for h in (s.header() for s in pair.slots)]
    finally:
        pair.close()


def wait_for(predicate, timeout: float = 3.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_replica_is_stored_with_its_checksum_and_fetched_back_byte_for_byte(shm, servers):
    server = servers()
    data = payload(20 * 1024 * 1024 + 123, 1)  # three pieces, the last one odd
    src = shm.make("local-0")
    slot = save(src, 7, 3, 8, data)

    sent = send_replica(addr(server), TOKEN, slot, TIMEOUT)
    assert sent is not None and sent.ok, sent
    assert (sent.step, sent.global_rank, sent.world_size, sent.bytes) == (7, 3, 8, len(data))
    assert sent.seq == slot.header().seq
    assert sent.checksum == checksum(data)

    [held] = server.holdings()
    assert held == Holding(3, 8, 7, held.seq, checksum(data))

    dst = shm.make("restore-3")
    got = fetch(addr(server), TOKEN, 3, 8, 7, dst, TIMEOUT)
    assert got.ok, got.reason
    assert got.header is not None and got.header.has_checksum and got.header.checksum == checksum(data)
    assert (got.header.step, got.header.global_rank, got.header.world_size) == (7, 3, 8)
    assert got.bytes == len(data)
    found = dst.find(7, 3, 8)
    assert found is not None
    assert bytes(found[0].payload[: found[1].payload_len]) == data


def test_replicas_are_double_buffered(shm, servers):
    server = servers()
    src = shm.make("local-0", 1 << 20)
    for step in (1, 2):
        sent = send_replica(addr(server), TOKEN, save(src, step, 0, 2, payload(1000 + step, step)), TIMEOUT)
        assert sent is not None and sent.ok
    # the second went into the other slot: the first is still complete
    assert sorted(replica_states(server, 0)) == [(COMPLETE, 1), (COMPLETE, 2)]
    assert [h.step for h in server.holdings()] == [1, 2]
    # the third replaces the oldest
    sent = send_replica(addr(server), TOKEN, save(src, 3, 0, 2, payload(1003, 3)), TIMEOUT)
    assert sent is not None and sent.ok
    assert sorted(replica_states(server, 0)) == [(COMPLETE, 2), (COMPLETE, 3)]
    holdings = server.holdings()
    assert [h.step for h in holdings] == [2, 3]
    assert holdings[1].checksum == checksum(payload(1003, 3))
    assert holdings[0].seq < holdings[1].seq


def test_a_nodes_own_slots_are_served_through_local_lookup(shm, servers):
    local = shm.make("local-1", 1 << 20)
    data = payload(300_000, 5)
    save(local, 12, 1, 2, data)

    def lookup(g, world, step):
        found = local.find(step, g, world)
        return None if found is None else found[0]

    server = servers(local_lookup=lookup)
    dst = shm.make("restore-1", 1 << 20)
    got = fetch(addr(server), TOKEN, 1, 2, 12, dst, TIMEOUT)
    assert got.ok, got.reason
    found = dst.find(12, 1, 2)
    assert found is not None and found[1].checksum == checksum(data)
    assert bytes(found[0].payload[: len(data)]) == data
    # another step or another world size is not that checkpoint
    assert not fetch(addr(server), TOKEN, 1, 2, 11, dst, TIMEOUT).ok
    assert not fetch(addr(server), TOKEN, 1, 4, 12, dst, TIMEOUT).ok


def test_a_checkpoint_nobody_holds_is_not_found(shm, servers):
    server = servers(local_lookup=lambda g, world, step: None)
    dst = shm.make("restore-0", 1 << 20)
    got = fetch(addr(server), TOKEN, 0, 2, 5, dst, TIMEOUT)
    assert got.header is None
    assert "not held" in got.reason and f"127.0.0.1:{server.port}" in got.reason
    assert [s.header().state for s in dst.slots] == [EMPTY, EMPTY]


def test_a_wrong_token_is_refused_and_nothing_is_written(shm, servers):
    server = servers()
    src = shm.make("local-0", 1 << 20)
    slot = save(src, 1, 0, 2, payload(5000, 1))
    with pytest.raises(PeerError, match="wrong token") as err:
        send_replica(addr(server), "another-run", slot, TIMEOUT)
    assert f"127.0.0.1:{server.port}" in str(err.value) and "\n" not in str(err.value)
    assert server.holdings() == []
    assert not [n for n in os.listdir(server.shm_dir) if n.startswith("replica-")]

    assert send_replica(addr(server), TOKEN, slot, TIMEOUT).ok
    dst = shm.make("restore-0", 1 << 20)
    with pytest.raises(PeerError, match="wrong token"):
        fetch(addr(server), "another-run", 0, 2, 1, dst, TIMEOUT)
    assert [s.header().state for s in dst.slots] == [EMPTY, EMPTY]


def test_a_replica_larger_than_the_slots_is_refused(shm, servers):
    server = servers(capacity=1000)
    src = shm.make("local-0", 1 << 20)
    with pytest.raises(PeerError, match="1001 bytes"):
        send_replica(addr(server), TOKEN, save(src, 1, 0, 2, payload(1001, 1)), TIMEOUT)
    assert server.holdings() == []


def test_fetching_into_a_slot_too_small_is_refused(shm, servers):
    server = servers()
    src = shm.make("local-0", 1 << 20)
    assert send_replica(addr(server), TOKEN, save(src, 1, 0, 2, payload(5000, 1)), TIMEOUT).ok
    dst = shm.make("restore-0", 4096)
    got = fetch(addr(server), TOKEN, 0, 2, 1, dst, TIMEOUT)
    assert got.header is None and "5000 bytes" in got.reason
    assert [s.header().state for s in dst.slots] == [EMPTY, EMPTY]


def test_a_replica_damaged_in_memory_fails_its_checksum_when_fetched(shm, servers):
    server = servers()
    src = shm.make("local-0", 1 << 20)
    data = payload(100_000, 9)
    assert send_replica(addr(server), TOKEN, save(src, 4, 1, 2, data), TIMEOUT).ok
    [path] = [
        os.path.join(server.shm_dir, n)
        for n in sorted(os.listdir(server.shm_dir))
        if n.startswith("replica-1-") and state_of(os.path.join(server.shm_dir, n)) == COMPLETE
    ]
    with open(path, "r+b") as f:
        f.seek(HEADER_AREA + 54_321)
        byte = f.read(1)
        f.seek(HEADER_AREA + 54_321)
        f.write(bytes([byte[0] ^ 0x40]))

    dst = shm.make("restore-1", 1 << 20)
    got = fetch(addr(server), TOKEN, 1, 2, 4, dst, TIMEOUT)
    assert got.header is None
    assert "checksum" in got.reason and "recorded" in got.reason, got.reason
    assert sorted(s.header().state for s in dst.slots) == [EMPTY, BAD]
    # the holder marked its damaged copy too: it is not offered again
    assert server.holdings() == []


def test_a_sender_whose_copy_does_not_match_its_recorded_checksum_is_not_committed(shm, servers):
    server = servers()
    src = shm.make("local-0", 1 << 20)
    data = payload(70_000, 4)
    slot = src.begin_write(6, 1, 2)
    slot.payload[: len(data)] = data
    slot.commit(len(data), checksum=checksum(data) ^ 1)  # damaged after its checksum was recorded
    sent = send_replica(addr(server), TOKEN, slot, TIMEOUT)
    assert sent is not None and not sent.ok and sent.reply == "bad"
    assert "recorded" in sent.reason and sent.checksum == checksum(data)
    assert server.holdings() == []
    assert sorted(replica_states(server, 1)) == [(EMPTY, -1), (BAD, 6)]


def state_of(path: str) -> int:
    """The state in a slot file's header, read from the file."""
    with open(path, "rb") as f:
        return struct.unpack_from("<I", f.read(16), 12)[0]


def _put_request(g: int, world: int, step: int, length: int, token: str = TOKEN) -> bytes:
    body = json.dumps(
        {
            "op": "put",
            "token": token,
            "global_rank": g,
            "world_size": world,
            "step": step,
            "length": length,
            "recorded": None,
        }
    ).encode()
    return struct.pack(">I", len(body)) + body


def test_a_sender_that_drops_mid_transfer_leaves_the_previous_replica_newest(shm, servers):
    server = servers()
    src = shm.make("local-0", 1 << 20)
    first = payload(40_000, 1)
    assert send_replica(addr(server), TOKEN, save(src, 1, 0, 2, first), TIMEOUT).ok

    with socket.create_connection(addr(server), timeout=TIMEOUT) as raw:
        raw.sendall(_put_request(0, 2, 2, 40_000))
        (n,) = struct.unpack(">I", raw.recv(4, socket.MSG_WAITALL))
        assert json.loads(raw.recv(n, socket.MSG_WAITALL))["status"] == "ready"
        raw.sendall(struct.pack(">Q", 40_000) + payload(20_000, 2))  # half, then gone
    wait_for(lambda: sorted(replica_states(server, 0)) == [(WRITING, 2), (COMPLETE, 1)])
    wait_for(lambda: not [t for t in threading.enumerate() if t.name == "fsm-agent-replica-conn"])
    assert [(h.step, h.checksum) for h in server.holdings()] == [(1, checksum(first))]

    dst = shm.make("restore-0", 1 << 20)
    got = fetch(addr(server), TOKEN, 0, 2, 1, dst, TIMEOUT)
    assert got.ok and bytes(dst.find(1, 0, 2)[0].payload[: len(first)]) == first
    assert not fetch(addr(server), TOKEN, 0, 2, 2, dst, TIMEOUT).ok

    # and the next replica goes into the slot left WRITING
    assert send_replica(addr(server), TOKEN, save(src, 3, 0, 2, payload(500, 3)), TIMEOUT).ok
    assert sorted(replica_states(server, 0)) == [(COMPLETE, 1), (COMPLETE, 3)]


def _one_shot_peer(reply: dict, then_read: int) -> tuple[tuple[str, int], threading.Thread]:
    """A fake peer for one connection: reads the request, answers ``reply``, reads ``then_read``
    bytes, and closes."""
    listener = socket.create_server(("127.0.0.1", 0))

    def run():
        with listener:
            conn, _ = listener.accept()
            with conn:
                (n,) = struct.unpack(">I", conn.recv(4, socket.MSG_WAITALL))
                conn.recv(n, socket.MSG_WAITALL)
                body = json.dumps(reply).encode()
                conn.sendall(struct.pack(">I", len(body)) + body)
                if reply.get("status") == "found":
                    conn.sendall(struct.pack(">Q", reply["length"]) + b"x" * 1000)
                conn.recv(then_read, socket.MSG_WAITALL)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return ("127.0.0.1", listener.getsockname()[1]), thread


def test_a_peer_that_drops_mid_transfer_is_a_peer_error_naming_it(shm):
    size = 32 << 20
    src = shm.make("local-0", size)
    slot = src.begin_write(1, 0, 2)
    slot.payload[:size] = b"\x11" * size
    slot.commit(size)
    address, peer = _one_shot_peer({"status": "ready"}, 1 << 20)
    with pytest.raises(PeerError, match=f"127.0.0.1:{address[1]}"):
        send_replica(address, TOKEN, slot, TIMEOUT)
    peer.join(TIMEOUT)
    assert not [t for t in threading.enumerate() if t.name.startswith("fsm-agent-replica")]

    dst = shm.make("restore-0", size)
    address, peer = _one_shot_peer({"status": "found", "length": 5000, "recorded": None}, 0)
    with pytest.raises(PeerError, match=f"127.0.0.1:{address[1]}.*connection closed"):
        fetch(address, TOKEN, 0, 2, 1, dst, TIMEOUT)
    peer.join(TIMEOUT)
    # the slot it was writing is not a checkpoint; the pair's newest is unchanged
    assert dst.newest() is None and sorted(s.header().state for s in dst.slots) == [EMPTY, WRITING]


class PausingProxy:
    """A TCP relay to ``target`` that stops relaying one direction ("up": client to server, "down":
    server to client) after ``after`` bytes, until ``resume`` is set: the sender then blocks in
    ``sendall`` mid-payload, and the test changes the source slot meanwhile."""

    def __init__(self, target: tuple[str, int], direction: str, after: int):
        self.target, self.direction, self.after = target, direction, after
        self.paused, self.resume = threading.Event(), threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = ("127.0.0.1", self.listener.getsockname()[1])
        self.threads: list[threading.Thread] = []
        self.socks: list[socket.socket] = []
        accepter = threading.Thread(target=self._accept, daemon=True)
        accepter.start()
        self.threads.append(accepter)

    def _accept(self):
        client, _ = self.listener.accept()
        server = socket.create_connection(self.target)
        self.socks += [client, server]
        for src, dst, name in ((client, server, "up"), (server, client, "down")):
            t = threading.Thread(target=self._pump, args=(src, dst, name == self.direction), daemon=True)
            t.start()
            self.threads.append(t)

    def _pump(self, src: socket.socket, dst: socket.socket, pausing: bool):
        relayed = 0
        try:
            while True:
                data = src.recv(1 << 20)
                if not data:
                    break
                if pausing and relayed + len(data) > self.after and not self.resume.is_set():
                    dst.sendall(data[: self.after - relayed])
                    data = data[self.after - relayed :]
                    self.paused.set()
                    self.resume.wait()
                dst.sendall(data)
                relayed += len(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self):
        self.resume.set()
        for t in self.threads:
            t.join(TIMEOUT)
        for s in [*self.socks, self.listener]:
            s.close()


def tear_when_paused(proxy: PausingProxy, slot) -> threading.Thread:
    """Begin a new write into ``slot`` (what a worker's next save does) while the transfer is
    paused, then let it go on."""

    def run():
        assert proxy.paused.wait(TIMEOUT)
        h = slot.header()
        slot.begin(h.seq + 1, h.step + 1, h.global_rank, h.world_size)
        proxy.resume.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_torn_sender_is_not_committed(shm, servers):
    size = 64 << 20  # larger than every socket buffer on the way: the sender blocks mid-payload
    server = servers(capacity=size)
    src = shm.make("local-0", size)
    before = payload(1000, 1)
    assert send_replica(addr(server), TOKEN, save(src, 1, 0, 2, before), TIMEOUT).ok

    slot = src.begin_write(2, 0, 2)
    slot.payload[:size] = b"\x5a" * size
    slot.commit(size)
    proxy = PausingProxy(addr(server), "up", 1 << 20)
    try:
        tearer = tear_when_paused(proxy, slot)
        assert send_replica(proxy.address, TOKEN, slot, TIMEOUT) is None
        tearer.join(TIMEOUT)
    finally:
        proxy.close()
    wait_for(lambda: not [t for t in threading.enumerate() if t.name == "fsm-agent-replica-conn"])
    assert sorted(replica_states(server, 0)) == [(WRITING, 2), (COMPLETE, 1)]
    assert [h.step for h in server.holdings()] == [1]


def test_a_holder_slot_rewritten_while_fetched_is_not_committed(shm, servers):
    size = 64 << 20
    local = shm.make("local-0", size)
    slot = local.begin_write(5, 0, 2)
    slot.payload[:size] = b"\xa5" * size
    slot.commit(size)
    server = servers(capacity=size, local_lookup=lambda g, world, step: slot)
    dst = shm.make("restore-0", size)
    proxy = PausingProxy(addr(server), "down", 1 << 20)
    try:
        tearer = tear_when_paused(proxy, slot)
        got = fetch(proxy.address, TOKEN, 0, 2, 5, dst, TIMEOUT)
        tearer.join(TIMEOUT)
    finally:
        proxy.close()
    assert got.header is None and "torn" in got.reason, got.reason
    assert sorted(s.header().state for s in dst.slots) == [EMPTY, BAD]


def test_close_ends_idle_connections_and_refuses_new_ones(shm, servers):
    server = servers()
    address = addr(server)
    idle = socket.create_connection(address, timeout=TIMEOUT)  # connected, never sends
    wait_for(lambda: [t for t in threading.enumerate() if t.name == "fsm-agent-replica-conn"])
    started = time.monotonic()
    server.close()
    assert time.monotonic() - started < 2.0
    assert idle.recv(1) == b""
    idle.close()
    with pytest.raises(PeerError, match="cannot connect"):
        send_replica(address, TOKEN, save(shm.make("local-0", 4096), 1, 0, 2, b"x"), 1.0)


def test_replicas_of_ranks_the_predecessor_no_longer_runs_are_dropped(shm, servers):
    """A new round gives the predecessor other ranks: ``keep_only`` unmaps and removes the others'
    replicas (their memory goes back), and keeps the ranks still run."""
    server = servers()
    for g in (1, 2):
        assert send_replica(addr(server), TOKEN, save(shm.make(f"local-{g}"), 5, g, 4, payload(1024, g)), TIMEOUT).ok
    assert {h.global_rank for h in server.holdings()} == {1, 2}
    assert server.keep_only([2]) == [1]
    assert {h.global_rank for h in server.holdings()} == {2}
    assert not [name for name in os.listdir(server.shm_dir) if name.startswith("replica-1-")]
