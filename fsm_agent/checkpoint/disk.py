"""Checkpoints on disk: the agent's background persistence of its ranks' checkpoints to ``--checkpoint-dir``.

The agent copies each new COMPLETE checkpoint of a slot (``slots``) to disk from a background
thread while training goes on; after a node or a whole job is lost, ``scan`` finds what is on
disk and ``read_into`` loads one back into a slot for a restore. Standard library only: a
checkpoint is opaque bytes here.

Layout (``root`` is ``--checkpoint-dir``, shared by every node of the job or local to one)::

    <root>/step-<step:012d>/rank-<g:06d>-of-<world:06d>.ckpt   the payload, byte for byte
    <root>/step-<step:012d>/rank-<g:06d>-of-<world:06d>.json   its manifest (the commit point)
    <root>/step-<step:012d>/rank-...ckpt.tmp-<pid>             being written (or left by a dead agent)

The manifest is JSON: ``format`` (``FORMAT``), ``step``, ``global_rank``, ``world_size``, ``size``
(bytes), ``checksum`` (``slots.checksum`` of the payload), ``chunk`` (``slots.CHUNK``, the
checksum's chunk), ``written_at`` (seconds since the epoch), ``run_id`` and ``data`` (the data
file's name).

Commit protocol (``persist``): the payload streams from the slot (``slots.read_consistent``: a
seqlock read, its checksum computed on the way) into ``.ckpt.tmp-<pid>``, which is fsynced and
renamed to ``.ckpt``; then the manifest is written the same way (tmp, fsync, rename), and the
step directory and the root are fsynced. A manifest of the same name is removed (and the removal
made durable) before the data file is replaced. So a checkpoint on disk is complete (manifest
present, data file of the stated size) or absent, never torn: a crash, a SIGKILL or a full disk
before the manifest's rename leaves at most a temporary or an unreferenced data file, which
``scan`` ignores. A write the worker overwrites mid-copy (a torn read) is dropped, its temporary
removed.

What survives what: everything renamed and fsynced survives the agent's death and a power loss
(on a file system that honours fsync; on a network file system, what its server commits). The
checksum is verified again when a checkpoint is read back (``read_into``), so a data file
changed or damaged after its manifest was written is caught there (the slot is marked BAD).

The keep rule, in a directory other nodes' agents share: after each persist, for the global rank
just written (only that one: a rank belongs to one agent at a time), the newest ``keep`` steps
that hold its manifest are kept and its files in older step directories are removed (manifest
first), then those directories are removed if left empty (another rank's files or a concurrent
writer keep them: ENOTEMPTY and ENOENT are expected and ignored). No agent ever deletes another
rank's files. Temporary files of the rank (and data files without a manifest) left by a dead
agent are removed on its next persist: at once when this process wrote them, otherwise once
untouched for ``stale_after`` seconds (a live writer touches its file every few milliseconds).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any, NamedTuple

from fsm_agent.checkpoint.slots import (
    BAD,
    CHUNK,
    COMPLETE,
    ChunkSums,
    Header,
    Slot,
    SlotPair,
    format_bytes,
    read_consistent,
)

log = logging.getLogger(__name__)
#: The manifest's format version.
FORMAT = 1
#: Bytes per write or read call (the piece ``read_consistent`` hands on).
PIECE = 8 << 20

_STEP_DIR = re.compile(r"step-(\d{12})\Z")
_MANIFEST = re.compile(r"rank-(\d{6})-of-(\d{6})\.json\Z")
_RANK_FILE = re.compile(r"rank-(\d{6})-of-(\d{6})\.(ckpt|json)(?:\.tmp-(\d+))?\Z")

_FIXES = {
    errno.ENOSPC: "free space, lower --checkpoint-keep or choose another directory",
    errno.EDQUOT: "free space within the quota, lower --checkpoint-keep or choose another directory",
    errno.EACCES: "make it writable by this user or choose another directory",
    errno.EPERM: "make it writable by this user or choose another directory",
    errno.EROFS: "choose a directory on a writable file system",
    errno.ENOTDIR: "a part of the path is a file, not a directory: choose another directory",
    errno.EEXIST: "a part of the path is a file, not a directory: choose another directory",
    errno.EIO: "check the storage (dmesg) or choose another directory",
    errno.ENAMETOOLONG: "choose a shorter path",
    errno.ELOOP: "fix its symbolic links or choose another directory",
}


class PersistError(OSError):
    """Writing or reading ``--checkpoint-dir`` failed; ``str()`` is one line naming the directory,
    the cause and the fix. ``errno`` is the cause's (None when it had none); ``root`` the directory."""

    def __init__(self, message: str, root: str, err: int | None = None):
        super().__init__(message)
        self.message = " ".join(message.splitlines())
        self.root = root
        self.errno = err

    def __str__(self) -> str:
        return self.message


class Persisted(NamedTuple):
    """A checkpoint ``persist`` wrote: its step, rank, world size, ``size`` (bytes), ``checksum``,
    the data file's ``path``, and the ``seconds`` the whole persist took."""

    step: int
    global_rank: int
    world_size: int
    size: int
    checksum: int
    path: str
    seconds: float


class DiskEntry(NamedTuple):
    """A complete checkpoint on disk (``scan``): its step, rank, world size, ``size`` (bytes),
    ``checksum`` (as its manifest states it), the data file's ``path`` and the manifest's
    ``manifest_path``; ``run_id`` and ``written_at`` (seconds since the epoch) from the manifest."""

    step: int
    global_rank: int
    world_size: int
    size: int
    checksum: int
    path: str
    manifest_path: str
    run_id: str = ""
    written_at: float = 0.0


def free_bytes(root: str) -> int:
    """Bytes an unprivileged user may still write in the file system of ``root`` (of its nearest
    existing parent when ``root`` does not exist yet).

    Raises:
        OSError: the file system cannot be queried.
    """
    path = os.path.abspath(root)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _error(root: str, exc: OSError, detail: str = "") -> PersistError:
    """The one-line PersistError for ``exc`` met under ``root``."""
    code = exc.errno
    cause = os.strerror(code) if code is not None else str(exc)
    where = ""
    if exc.filename and os.path.abspath(str(exc.filename)) != os.path.abspath(root):
        where = f" at {os.path.relpath(str(exc.filename), root)}"
    fix = _FIXES.get(code or 0, "check the directory or choose another one")
    return PersistError(f"--checkpoint-dir {root}: {cause}{detail}{where}: {fix}", root, code)


def check_dir(root: str) -> None:
    """Make sure ``root`` can hold checkpoints (at the agent's start): create it if needed, then
    create, write, fsync and remove a probe file in it.

    Raises:
        PersistError: it cannot be created or written (one line: the cause and the fix).
    """
    if os.path.exists(root) and not os.path.isdir(root):
        raise _error(root, OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR)))
    probe = os.path.join(root, f".probe-{os.uname().nodename}-{os.getpid()}")
    try:
        os.makedirs(root, exist_ok=True)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, b"fsm-agent checkpoint directory probe\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        _unlink_quietly(probe)
        raise _error(root, exc) from exc


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass  # gone already, or the directory cannot be written: nothing more to do


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: memoryview) -> None:
    while len(data):
        data = data[os.write(fd, data) :]


class _Torn(Exception):
    """The slot being copied to disk was written again or discarded: stop copying."""


class _Pipe:
    """Pieces handed to ``consume`` in a thread of its own, in order, while the caller produces
    the next ones (the checksum and the file I/O both release the GIL: they overlap)."""

    def __init__(self, consume: Callable[[memoryview], None], depth: int = 3):
        self._consume = consume
        self._queue: queue.Queue[memoryview | None] = queue.Queue(depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="fsm-agent-checkpoint-io", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (piece := self._queue.get()) is not None:
            if self._error is None:  # after an error, drain without consuming: put never blocks
                try:
                    self._consume(piece)
                except BaseException as exc:
                    self._error = exc

    def put(self, piece: memoryview) -> None:
        """Queue ``piece``; raises what ``consume`` raised on an earlier piece, if it did."""
        if self._error is not None:
            raise self._error
        self._queue.put(piece)

    def __enter__(self) -> _Pipe:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        """Wait for the last piece; raise what ``consume`` raised (unless an error is on its way)."""
        self._queue.put(None)
        self._thread.join()
        if kind is None and self._error is not None:
            raise self._error


def _rmdir_quietly(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass  # other files are in it (ENOTEMPTY: another rank's, a concurrent writer's), or it is gone


def _rank_base(global_rank: int, world_size: int) -> str:
    return f"rank-{global_rank:06d}-of-{world_size:06d}"


def _manifest_record(header: Header, value: int, run_id: str, data: str) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "step": header.step,
        "global_rank": header.global_rank,
        "world_size": header.world_size,
        "size": header.payload_len,
        "checksum": value,
        "chunk": CHUNK,
        "written_at": time.time(),
        "run_id": run_id,
        "data": os.path.basename(data),
    }


class DiskCheckpoints:
    """The checkpoints of this node's ranks under ``root`` (``--checkpoint-dir``).

    ``keep`` (at least 1): the steps kept per global rank. ``stale_after``: seconds after which
    another process's untouched temporary file of a rank this agent persists counts as left by a
    dead agent. ``persist`` calls for different ranks may run in parallel threads; those for one
    rank are serialized.

    Raises:
        ValueError: ``keep`` is below 1.
    """

    def __init__(self, root: str, keep: int, *, stale_after: float = 300.0):
        if keep < 1:
            raise ValueError(f"--checkpoint-keep must be at least 1, not {keep}")
        self.root = root
        self.keep = keep
        self.stale_after = stale_after
        self._locks: dict[int, threading.Lock] = {}
        self._locks_lock = threading.Lock()
        #: global_rank -> step: a ``discard_after`` that found the rank's lock held by a persist,
        #: applied by whoever releases that lock next (``_discard_pending``); ``scan`` hides those steps
        self._pending_discards: dict[int, int] = {}

    def _lock(self, global_rank: int) -> threading.Lock:
        with self._locks_lock:
            return self._locks.setdefault(global_rank, threading.Lock())

    def step_dir(self, step: int) -> str:
        """The directory of ``step``'s checkpoints."""
        return os.path.join(self.root, f"step-{step:012d}")

    def persist(self, slot: Slot, run_id: str) -> Persisted | None:
        """Write the COMPLETE checkpoint in ``slot`` to disk (the module's commit protocol), record
        its checksum in the slot, then apply the keep rule to its rank.

        Returns what was written, or None: the slot holds no COMPLETE checkpoint, or the worker
        began a new write into it while it was being copied (nothing is left on disk).

        Raises:
            PersistError: the directory cannot be written (its temporary file is removed).
        """
        started = time.monotonic()
        header = slot.header()
        if not header.complete:
            return None
        try:
            with self._lock(header.global_rank):
                done = self._persist(slot, header, run_id)
                if done is None:
                    return None
                self._prune(header.global_rank)
        finally:
            try:
                self._discard_pending(header.global_rank)
            except OSError as exc:  # the directory's error is this persist's to report, if any
                log.debug("checkpoint: a deferred discard of rank %s failed: %s", header.global_rank, exc)
        size, value, path = done
        slot.set_checksum(header.seq, value)
        seconds = time.monotonic() - started
        return Persisted(header.step, header.global_rank, header.world_size, size, value, path, seconds)

    def _persist(self, slot: Slot, header: Header, run_id: str) -> tuple[int, int, str] | None:
        step_dir = self.step_dir(header.step)
        base = os.path.join(step_dir, _rank_base(header.global_rank, header.world_size))
        data, manifest = base + ".ckpt", base + ".json"
        if header.has_checksum and self._already_there(manifest, header):
            return header.payload_len, header.checksum, data
        tmp = f"{data}.tmp-{os.getpid()}"
        renamed = committed = False
        try:
            self._sweep(header.global_rank)
            copied = self._copy(slot, header, step_dir, tmp)
            if copied is None:
                _unlink_quietly(tmp)
                _rmdir_quietly(step_dir)
                return None
            value = copied[1]
            if os.path.exists(manifest):  # the same step again: never pair the old manifest with new data
                os.unlink(manifest)
                _fsync_dir(step_dir)
            os.rename(tmp, data)
            renamed = True
            self._write_manifest(manifest, _manifest_record(header, value, run_id, data))
            committed = True
            _fsync_dir(step_dir)
            _fsync_dir(self.root)
        except OSError as exc:
            _unlink_quietly(tmp)
            _unlink_quietly(f"{manifest}.tmp-{os.getpid()}")
            if renamed and not committed:
                _unlink_quietly(data)  # no manifest will ever name it
            _rmdir_quietly(step_dir)
            raise self._persist_error(exc, header.payload_len) from exc
        return header.payload_len, value, data

    def _persist_error(self, exc: OSError, size: int) -> PersistError:
        detail = ""
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            try:
                free = free_bytes(self.root)
            except OSError:
                free = 0
            more = size - free
            detail = f" (needs {format_bytes(more)} more)" if more > 0 else f" (needs {format_bytes(size)})"
        return _error(self.root, exc, detail)

    def _open_tmp(self, step_dir: str, tmp: str) -> int:
        """Open ``tmp`` for writing, creating ``step_dir`` (again, when another rank's keep rule
        removed it meanwhile: that agent saw it empty; ``makedirs`` then fails either way)."""
        for attempt in range(5):
            try:
                os.makedirs(step_dir, exist_ok=True)
                return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            except (FileNotFoundError, FileExistsError):
                if attempt == 4 or (os.path.lexists(step_dir) and not os.path.isdir(step_dir)):
                    raise
        raise AssertionError("unreachable")

    def _copy(self, slot: Slot, header: Header, step_dir: str, tmp: str) -> tuple[Header, int] | None:
        """Stream the slot into ``tmp`` and fsync it; (header, checksum), or None when torn."""
        fd = self._open_tmp(step_dir, tmp)

        def put(part: memoryview) -> None:
            # A slot written again or discarded meanwhile (a restore abandons its step) stops the
            # copy at the next piece: the copy is dropped anyway, and the disk's per-rank lock,
            # which the restore's discard_after waits for, is held seconds less.
            now = slot.header()
            if now.seq != header.seq or now.state not in (COMPLETE, BAD):
                raise _Torn
            writer.put(part)

        try:
            with _Pipe(lambda part: _write_all(fd, part)) as writer:
                read = read_consistent(slot, put, PIECE)
            os.fsync(fd)
        except _Torn:
            return None
        finally:
            os.close(fd)
        # The writer copied each piece after read_consistent checksummed it: the seqlock's last
        # check must come after the last byte reached the file.
        after = slot.header()
        if read is None or read[0].seq != header.seq or after.seq != header.seq or after.state not in (COMPLETE, BAD):
            return None
        return read

    def _write_manifest(self, manifest: str, record: dict[str, Any]) -> None:
        tmp = f"{manifest}.tmp-{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_all(fd, memoryview(json.dumps(record, indent=1).encode() + b"\n"))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, manifest)

    def _already_there(self, manifest: str, header: Header) -> bool:
        """Whether ``manifest`` already commits this very checkpoint (same size and checksum)."""
        record = _read_manifest(manifest)
        if record is None or record["size"] != header.payload_len or record["checksum"] != header.checksum:
            return False
        data = os.path.join(os.path.dirname(manifest), record["data"])
        try:
            return os.stat(data).st_size == header.payload_len
        except OSError:
            return False

    def _steps(self) -> list[tuple[int, str]]:
        """(step, directory) of every step directory, oldest first."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        found = [(int(m.group(1)), os.path.join(self.root, name)) for name in names if (m := _STEP_DIR.match(name))]
        return sorted(found)

    def _rank_files(self, global_rank: int) -> Iterator[tuple[int, str, str, re.Match[str]]]:
        """(step, step directory, file name, name match) of each file of ``global_rank``."""
        for step, step_dir in self._steps():
            try:
                names = os.listdir(step_dir)
            except OSError:
                continue  # removed meanwhile, or not a directory
            for name in names:
                m = _RANK_FILE.match(name)
                if m and int(m.group(1)) == global_rank:
                    yield step, step_dir, name, m

    def _sweep(self, global_rank: int) -> None:
        """Remove the rank's temporary files and manifest-less data files left by a dead agent."""
        now, mine = time.time(), str(os.getpid())
        for _, step_dir, name, m in list(self._rank_files(global_rank)):
            path = os.path.join(step_dir, name)
            if m.group(3) == "ckpt" and m.group(4) is None:
                if os.path.exists(path[: -len(".ckpt")] + ".json"):
                    continue
            elif m.group(3) == "json" and m.group(4) is None:
                continue
            try:
                stale = m.group(4) == mine or now - os.stat(path).st_mtime > self.stale_after
            except OSError:
                continue
            if stale:
                _unlink_quietly(path)

    def _prune(self, global_rank: int) -> None:
        """The keep rule for ``global_rank`` (the module's docstring)."""
        files = list(self._rank_files(global_rank))
        committed = sorted({step for step, _, _, m in files if m.group(3) == "json" and m.group(4) is None})
        if len(committed) <= self.keep:
            return
        cutoff = committed[-self.keep]
        old = sorted(
            ((step, step_dir, name) for step, step_dir, name, _ in files if step < cutoff),
            key=lambda f: (f[0], not f[2].endswith(".json")),  # each step's manifests first
        )
        for _, step_dir, name in old:
            _unlink_quietly(os.path.join(step_dir, name))
        for step_dir in sorted({step_dir for _, step_dir, _ in old}):
            _rmdir_quietly(step_dir)

    def discard_after(self, global_rank: int, step: int) -> int:
        """Remove ``global_rank``'s checkpoints of steps after ``step`` (any world size): after a
        restore from ``step`` they belong to an abandoned timeline, and a later persist of the same
        step number must not meet them. Never waits: while a persist of the rank holds its lock
        (seconds, for a large checkpoint under load, which the workers' start would otherwise wait
        for), the removal is left to that persist, which does it before it lets go of the lock, and
        ``scan`` does not list those steps meanwhile. Returns how many checkpoints were removed now."""
        with self._locks_lock:
            self._pending_discards[global_rank] = min(step, self._pending_discards.get(global_rank, step))
        return self._discard_pending(global_rank)

    def _discard_pending(self, global_rank: int) -> int:
        """Apply the rank's deferred ``discard_after`` if its lock is free (else its holder will:
        each side looks again after its own change, so none is left behind). Returns how many
        checkpoints were removed."""
        removed = 0
        lock = self._lock(global_rank)
        while global_rank in self._pending_discards and lock.acquire(blocking=False):
            step = self._pending_discards.get(global_rank)
            try:
                if step is not None:
                    removed += self._discard_after_locked(global_rank, step)
            finally:  # also after an error (an unusable directory): its caller hears of it once
                with self._locks_lock:  # scan hides the steps until they are gone; a lower step since: again
                    if self._pending_discards.get(global_rank) == step:
                        del self._pending_discards[global_rank]
                lock.release()
        return removed

    def _discard_after_locked(self, global_rank: int, step: int) -> int:
        removed = 0
        files = sorted(
            (f for f in self._rank_files(global_rank) if f[0] > step), key=lambda f: not f[2].endswith(".json")
        )
        for _, step_dir, name, m in files:  # manifests first: a data file without one is never listed
            _unlink_quietly(os.path.join(step_dir, name))
            removed += m.group(3) == "json" and m.group(4) is None
        for step_dir in {f[1] for f in files}:
            _rmdir_quietly(step_dir)
        return removed

    def scan(self) -> dict[tuple[int, int], list[DiskEntry]]:
        """Every complete checkpoint under ``root`` (every node's): {(global_rank, world_size):
        entries, newest step first}. Complete: the manifest parses, names this format, ``CHUNK``
        and its own file's rank, and the data file has the stated size.

        Raises:
            PersistError: ``root`` cannot be listed (a missing ``root`` is no error: {}).
        """
        found: dict[tuple[int, int], list[DiskEntry]] = {}
        try:
            steps = self._steps()
        except OSError as exc:
            raise _error(self.root, exc) from exc
        for step, step_dir in reversed(steps):
            try:
                names = sorted(os.listdir(step_dir))
            except OSError:
                continue
            for name in names:
                entry = _entry(step, step_dir, name)
                if entry is not None and entry.step <= self._pending_discards.get(entry.global_rank, entry.step):
                    found.setdefault((entry.global_rank, entry.world_size), []).append(entry)
        return found

    def read_into(self, entry: DiskEntry, pair: SlotPair) -> Header | None:
        """Load ``entry`` into ``pair`` (into the slot ``begin_write`` picks) and verify it.

        Returns the slot's new header (COMPLETE, its checksum recorded), or None: the data file no
        longer has the stated size (the pair is left untouched), or its checksum does not match
        the manifest's (the slot is marked BAD). Either way the caller reports it and tries the
        next source.

        Raises:
            ValueError: the checkpoint is larger than the slots' capacity (the pair is untouched).
            PersistError: the file cannot be read (the slot is marked BAD when it was begun).
        """
        if entry.size > pair.capacity:
            raise ValueError(
                f"checkpoint {entry.path} is {format_bytes(entry.size)}, more than the "
                f"{format_bytes(pair.capacity)} a slot holds: raise --checkpoint-memory to at least that"
            )
        try:
            with open(entry.path, "rb", buffering=0) as f:
                if os.fstat(f.fileno()).st_size != entry.size:
                    return None
                slot = pair.begin_write(entry.step, entry.global_rank, entry.world_size)
                seq = slot.header().seq
                try:
                    value = _read_payload(f, slot, entry.size)
                except OSError:
                    slot.mark_bad(seq)
                    raise
        except OSError as exc:
            raise _error(self.root, exc) from exc
        if value != entry.checksum:
            slot.mark_bad(seq)
            return None
        slot.commit(entry.size, checksum=value)
        return slot.header()


def _read_payload(f: Any, slot: Slot, size: int) -> int | None:
    """Read ``size`` bytes of ``f`` into ``slot.payload`` (the checksum computed in a second
    thread meanwhile); their checksum, or None when the file ends early."""
    sums = ChunkSums()
    offset = 0
    with _Pipe(sums.update) as summer:
        while offset < size:
            view = slot.payload[offset : min(offset + PIECE, size)]
            n = f.readinto(view)
            if not n:
                break
            summer.put(view[:n])
            offset += n
    return sums.value() if offset == size else None


def _read_manifest(path: str) -> dict[str, Any] | None:
    """The manifest at ``path`` when it parses and has this format's fields; else None."""
    try:
        with open(path, "rb") as f:
            record = json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("format") != FORMAT or record.get("chunk") != CHUNK:
        return None
    ints = ("step", "global_rank", "world_size", "size", "checksum")
    if not all(type(record.get(k)) is int for k in ints) or not isinstance(record.get("data"), str):
        return None
    return record


def _entry(step: int, step_dir: str, name: str) -> DiskEntry | None:
    """The complete checkpoint whose manifest is ``step_dir/name``, or None."""
    m = _MANIFEST.match(name)
    if m is None:
        return None
    path = os.path.join(step_dir, name)
    record = _read_manifest(path)
    if record is None:
        return None
    rank, world = int(m.group(1)), int(m.group(2))
    if (record["step"], record["global_rank"], record["world_size"]) != (step, rank, world):
        return None
    data = os.path.join(step_dir, _rank_base(rank, world) + ".ckpt")
    if record["data"] != os.path.basename(data):
        return None
    try:
        if os.stat(data).st_size != record["size"]:
            return None
    except OSError:
        return None
    run_id = record.get("run_id")
    written_at = record.get("written_at")
    return DiskEntry(
        step,
        rank,
        world,
        record["size"],
        record["checksum"],
        data,
        path,
        run_id if isinstance(run_id, str) else "",
        float(written_at) if isinstance(written_at, (int, float)) else 0.0,
    )
