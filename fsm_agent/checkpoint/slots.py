"""Checkpoint slots: the shared-memory layout the agent and its workers both read and write.

A *slot* is one file in ``/dev/shm`` (``mmap``ed, so a memory copy) holding one checkpoint of one
rank: a fixed header (``HEADER_AREA`` bytes) and a payload of at most ``capacity`` bytes. The agent
creates the files (so they outlive a worker, and its cgroup keeper removes them if the agent dies);
workers write their checkpoints into them (``fsm_agent.checkpoint.save``); the agent reads them to
persist (``disk``), replicate (``peers``) and stage a restore.

A *pair* of slots (``<prefix>-a``, ``<prefix>-b``) holds one rank's two newest checkpoints: a write
goes into the slot that is not the newest complete one, so a writer killed mid-write leaves the
previous checkpoint intact (double buffering: memory is twice the capacity).

Consistency without locks (a seqlock): ``begin`` marks the slot WRITING and gives it a new ``seq``
before any payload byte is written; ``commit`` marks it COMPLETE after the last. A reader that reads
a COMPLETE header, the payload, then the header again, and sees the same ``seq`` and state, read a
whole checkpoint (``read_consistent``); otherwise the writer came back to this slot meanwhile and
the copy is torn: the reader drops it.

The checksum (``checksum``): CRC-32 of each ``CHUNK`` bytes of the payload (chunks computed in
threads: ``zlib.crc32`` releases the GIL), then CRC-32 of those CRCs. Writers do not compute it (it
would cost a worker ~0.3 s per GiB); the agent does, on its first pass over a new checkpoint, and
stores it with the ``seq`` it belongs to; a restore recomputes and compares it.

Standard library only: the agent never imports torch, and to it a checkpoint is bytes.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

MAGIC = b"FSMCKPT1"
VERSION = 1
#: Bytes before the payload (one page: the payload starts page-aligned).
HEADER_AREA = 4096
#: The checksum's chunk, bytes.
CHUNK = 64 << 20

EMPTY, WRITING, COMPLETE, BAD = 0, 1, 2, 3
STATE_NAMES = {EMPTY: "empty", WRITING: "writing", COMPLETE: "complete", BAD: "bad"}

#: ``flags``: the writer asks the agent to persist this checkpoint to ``--checkpoint-dir``.
PERSIST = 1

# magic, version, state, seq, step, global_rank, world_size, payload_len, capacity,
# checksum, checksum_seq, written_at (seconds since the epoch), flags, persisted_seq
_HEADER = struct.Struct("<8sIIQqiiQQIQdIQ")
_STATE = struct.Struct("<I")
_STATE_OFFSET = 12
_CHECKSUM = struct.Struct("<IQ")
_CHECKSUM_OFFSET = struct.calcsize("<8sIIQqiiQQ")
_PERSISTED = struct.Struct("<Q")
_PERSISTED_OFFSET = struct.calcsize("<8sIIQqiiQQIQdI")


class SlotError(Exception):
    """A slot file that is missing, too small, or not a checkpoint slot."""


class Header(NamedTuple):
    """A slot's header as last read.

    Attributes:
        state: EMPTY, WRITING, COMPLETE or BAD.
        seq: the write's sequence number (higher: newer, within a pair).
        step: the training step the checkpoint is of.
        global_rank / world_size: the rank the checkpoint is of, and the world size it ran with.
        payload_len: bytes of payload.
        capacity: bytes the payload may take.
        checksum: ``checksum()`` of the payload, valid when ``checksum_seq == seq``.
        written_at: when it was committed, seconds since the epoch.
        flags: ``PERSIST`` when the writer asked for a disk copy.
        persisted_seq: the write the agent is done persisting (written, or given up on a failing
            disk); equal to ``seq`` once it is.
    """

    state: int
    seq: int
    step: int
    global_rank: int
    world_size: int
    payload_len: int
    capacity: int
    checksum: int
    checksum_seq: int
    written_at: float
    flags: int = 0
    persisted_seq: int = 0

    @property
    def complete(self) -> bool:
        return self.state == COMPLETE

    @property
    def has_checksum(self) -> bool:
        return self.state == COMPLETE and self.checksum_seq == self.seq

    @property
    def awaiting_persist(self) -> bool:
        """A complete checkpoint the writer asked to persist, which the agent is not done with."""
        return self.state == COMPLETE and bool(self.flags & PERSIST) and self.persisted_seq != self.seq


class Slot:
    """One slot file, mapped. ``Slot.create`` (the agent) makes it; ``Slot.open`` maps an existing one."""

    def __init__(self, path: str, mapped: mmap.mmap):
        self.path = path
        self._map = mapped
        self.capacity = len(mapped) - HEADER_AREA
        #: The payload area (``capacity`` bytes): write into it between ``begin`` and ``commit``.
        self.payload = memoryview(mapped)[HEADER_AREA:]

    @classmethod
    def create(cls, path: str, capacity: int, reserve: bool = False) -> Slot:
        """Create (or reset) ``path`` with room for ``capacity`` payload bytes. ``reserve``: take
        the memory now (``posix_fallocate``: a full ``/dev/shm`` fails here, with ENOSPC, instead of
        a SIGBUS in the writer later); else sparse, pages taken when first written.

        The slot is made under a temporary name and renamed into place once its header is written:
        a reader that lists the directory (a status call, the replica server's peer, a test) never
        maps a half-made slot, which a reserve of many MiB would otherwise leave visible for a while.

        Raises:
            OSError: the file cannot be created, sized or reserved.
        """
        making = f"{path}.making"
        fd = os.open(making, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, HEADER_AREA + capacity)
            if reserve:
                os.posix_fallocate(fd, 0, HEADER_AREA + capacity)
            mapped = mmap.mmap(fd, HEADER_AREA + capacity)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(making)
            raise
        finally:
            os.close(fd)
        try:
            _HEADER.pack_into(mapped, 0, MAGIC, VERSION, EMPTY, 0, -1, -1, 0, 0, capacity, 0, 0, 0.0, 0, 0)
            os.rename(making, path)
        except BaseException:
            mapped.close()
            with contextlib.suppress(OSError):
                os.unlink(making)
            raise
        return cls(path, mapped)

    @classmethod
    def open(cls, path: str, populate: bool = False) -> Slot:
        """Map the existing slot ``path``. ``populate``: map every page now (``MAP_POPULATE``, one
        call in the kernel instead of a fault per 4 KiB page at the first write: a worker's first
        save into a slot about twice as fast).

        Raises:
            SlotError: it does not exist or is not a slot.
        """
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise SlotError(f"checkpoint slot {path}: {exc.strerror}") from exc
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_AREA:
                raise SlotError(f"checkpoint slot {path}: {size} bytes, not a slot")
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
            mapped = mmap.mmap(fd, size, flags=flags)
        finally:
            os.close(fd)
        if mapped[:8] != MAGIC:
            mapped.close()
            raise SlotError(f"checkpoint slot {path}: not a checkpoint slot (bad magic)")
        return cls(path, mapped)

    def header(self) -> Header:
        fields = _HEADER.unpack_from(self._map, 0)
        return Header(*fields[2:])

    def begin(self, seq: int, step: int, global_rank: int, world_size: int, flags: int = 0) -> None:
        """Mark the slot WRITING with a new ``seq`` (before any payload byte is written)."""
        _STATE.pack_into(self._map, _STATE_OFFSET, WRITING)
        _HEADER.pack_into(
            self._map,
            0,
            MAGIC,
            VERSION,
            WRITING,
            seq,
            step,
            global_rank,
            world_size,
            0,
            self.capacity,
            0,
            0,
            0.0,
            flags,
            0,
        )

    def commit(self, payload_len: int, checksum: int | None = None) -> None:
        """Mark the slot COMPLETE with ``payload_len`` bytes (after the last payload byte).

        Raises:
            ValueError: ``payload_len`` exceeds the capacity.
        """
        if payload_len > self.capacity:
            raise ValueError(f"payload of {payload_len} bytes exceeds the slot's {self.capacity}")
        h = self.header()
        _HEADER.pack_into(
            self._map,
            0,
            MAGIC,
            VERSION,
            WRITING,
            h.seq,
            h.step,
            h.global_rank,
            h.world_size,
            payload_len,
            self.capacity,
            checksum or 0,
            h.seq if checksum is not None else 0,
            time.time(),
            h.flags,
            0,
        )
        _STATE.pack_into(self._map, _STATE_OFFSET, COMPLETE)

    def set_checksum(self, seq: int, value: int) -> bool:
        """Record ``value`` as the checksum of write ``seq``; False (nothing written) when the slot
        holds another write now."""
        if self.header().seq != seq:
            return False
        _CHECKSUM.pack_into(self._map, _CHECKSUM_OFFSET, value, seq)
        return True

    def set_persisted(self, seq: int) -> None:
        """The agent is done persisting write ``seq`` (written, or given up): a writer waiting to
        reuse this slot goes on."""
        if self.header().seq == seq:
            _PERSISTED.pack_into(self._map, _PERSISTED_OFFSET, seq)

    def discard(self, seq: int) -> None:
        """Mark write ``seq`` EMPTY (its timeline was abandoned: the job restored an older step)."""
        if self.header().seq == seq:
            _STATE.pack_into(self._map, _STATE_OFFSET, EMPTY)

    def mark_bad(self, seq: int) -> None:
        """Mark write ``seq`` BAD (its checksum did not match): no reader takes it again."""
        if self.header().seq == seq:
            _STATE.pack_into(self._map, _STATE_OFFSET, BAD)

    def close(self) -> None:
        """Unmap the slot; a view of its payload still held elsewhere keeps the map (closed at
        garbage collection instead)."""
        try:
            self.payload.release()
            self._map.close()
        except BufferError:
            pass


def slot_paths(prefix: str) -> tuple[str, str]:
    """The two files of the pair ``prefix``."""
    return prefix + "-a", prefix + "-b"


class SlotPair:
    """The two slots of one rank's checkpoints (``prefix-a``, ``prefix-b``)."""

    def __init__(self, slots: tuple[Slot, Slot]):
        self.slots = slots

    @classmethod
    def create(cls, prefix: str, capacity: int, reserve: bool = False) -> SlotPair:
        """Create both slots (``Slot.create``)."""
        a, b = slot_paths(prefix)
        return cls((Slot.create(a, capacity, reserve), Slot.create(b, capacity, reserve)))

    @classmethod
    def open(cls, prefix: str, populate: bool = False) -> SlotPair:
        """Map both slots (``Slot.open``)."""
        a, b = slot_paths(prefix)
        return cls((Slot.open(a, populate), Slot.open(b, populate)))

    @property
    def capacity(self) -> int:
        return self.slots[0].capacity

    def newest(self) -> tuple[Slot, Header] | None:
        """The COMPLETE slot with the highest ``seq``, and its header; None when neither is."""
        best = None
        for slot in self.slots:
            h = slot.header()
            if h.complete and (best is None or h.seq > best[1].seq):
                best = (slot, h)
        return best

    def find(self, step: int, global_rank: int, world_size: int) -> tuple[Slot, Header] | None:
        """The COMPLETE slot holding ``step`` of ``global_rank`` in a world of ``world_size``."""
        found = None
        for slot in self.slots:
            h = slot.header()
            matches = h.complete and (h.step, h.global_rank, h.world_size) == (step, global_rank, world_size)
            if matches and (found is None or h.seq > found[1].seq):
                found = (slot, h)
        return found

    def next_target(self) -> Slot:
        """The slot the next ``begin_write`` writes into: the one that is not the newest COMPLETE."""
        newest = self.newest()
        return self.slots[1] if newest is not None and newest[0] is self.slots[0] else self.slots[0]

    def begin_write(self, step: int, global_rank: int, world_size: int, flags: int = 0) -> Slot:
        """Begin a write into the slot that is not the newest COMPLETE one (``next_target``); return it."""
        headers = [s.header() for s in self.slots]
        target = self.next_target()
        target.begin(max(h.seq for h in headers) + 1, step, global_rank, world_size, flags)
        return target

    def close(self) -> None:
        for slot in self.slots:
            slot.close()


def format_bytes(n: float) -> str:
    """``n`` bytes for a person: ``512 B``, ``1.5 MiB``, ``2.0 GiB``."""
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            break
    return f"{n:.1f} {unit}"


def _chunks(length: int) -> Iterator[tuple[int, int]]:
    for start in range(0, length, CHUNK):
        yield start, min(start + CHUNK, length)


def checksum(data: memoryview | bytes, length: int | None = None, threads: int = 2) -> int:
    """The checksum of ``data[:length]``: CRC-32 of each ``CHUNK``, in ``threads`` threads, then
    CRC-32 of the list of those CRCs (little-endian 32-bit each)."""
    view = memoryview(data)[: len(data) if length is None else length]
    spans = list(_chunks(len(view)))
    if threads > 1 and len(spans) > 1:
        with ThreadPoolExecutor(threads) as pool:
            crcs = list(pool.map(lambda span: zlib.crc32(view[span[0] : span[1]]), spans))
    else:
        crcs = [zlib.crc32(view[a:b]) for a, b in spans]
    return combine(crcs)


def combine(chunk_crcs: list[int]) -> int:
    """The checksum from the chunks' CRCs, in order (what ``checksum`` returns)."""
    return zlib.crc32(struct.pack(f"<{len(chunk_crcs)}I", *chunk_crcs))


class ChunkSums:
    """A checksum computed while streaming: ``update`` with consecutive pieces (any sizes),
    ``value()`` at the end equals ``checksum()`` of the whole."""

    def __init__(self) -> None:
        self._crcs: list[int] = []
        self._crc = 0
        self._filled = 0

    def update(self, piece: memoryview | bytes) -> None:
        view = memoryview(piece)
        while len(view):
            take = min(CHUNK - self._filled, len(view))
            self._crc = zlib.crc32(view[:take], self._crc)
            self._filled += take
            view = view[take:]
            if self._filled == CHUNK:
                self._crcs.append(self._crc)
                self._crc, self._filled = 0, 0

    def value(self) -> int:
        return combine(self._crcs + ([self._crc] if self._filled else []))


def read_consistent(slot: Slot, sink: Callable[[memoryview], None], piece: int = 8 << 20) -> tuple[Header, int] | None:
    """Stream the COMPLETE checkpoint in ``slot`` to ``sink`` in pieces of ``piece`` bytes,
    computing its checksum on the way. Returns (header, checksum), or None: the slot was not
    COMPLETE, or a writer began a new write into it meanwhile (the copy is torn: drop it)."""
    before = slot.header()
    if not before.complete:
        return None
    sums = ChunkSums()
    for start in range(0, before.payload_len, piece):
        part = slot.payload[start : min(start + piece, before.payload_len)]
        sums.update(part)
        sink(part)
    after = slot.header()
    if after.seq != before.seq or after.state not in (COMPLETE, BAD):
        return None
    return before, sums.value()


def verify(slot: Slot, header: Header, threads: int = 2) -> bool | None:
    """Whether ``slot``'s payload still matches the checksum recorded for write ``header.seq``;
    None when none was recorded (nothing to compare)."""
    if header.checksum_seq != header.seq:
        return None
    return checksum(slot.payload, header.payload_len, threads) == header.checksum
