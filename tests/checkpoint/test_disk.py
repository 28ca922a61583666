"""fsm_agent.checkpoint.disk: checkpoints persisted to --checkpoint-dir and read back, on real files.

Slots are real shared-memory files (``SlotPair.create`` in a fresh ``/dev/shm`` folder, removed at
teardown); the directory is a real one under ``tmp_path``. A persister SIGKILLed mid-write is a
real subprocess; a full disk and a read-only file system are small tmpfs mounts made inside a
private mount namespace (``unshare --mount``, root), so nothing is mounted outside it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fsm_agent.checkpoint import slots
from fsm_agent.checkpoint.disk import (
    FORMAT,
    DiskCheckpoints,
    DiskEntry,
    PersistError,
    check_dir,
    format_bytes,
    free_bytes,
)
from fsm_agent.checkpoint.slots import BAD, COMPLETE, WRITING, SlotPair
from tests.helpers.processes import checkout_env

pytestmark = pytest.mark.unit

MiB = 1 << 20


@pytest.fixture
def pairs(shm, request):
    """``make(name, capacity)``: a SlotPair in ``shm`` (closed at teardown)."""
    made = []

    def make(name: str, capacity: int) -> SlotPair:
        pair = SlotPair.create(os.path.join(shm, name), capacity)
        made.append(pair)
        return pair

    request.addfinalizer(lambda: [pair.close() for pair in made])
    return make


@pytest.fixture
def root(tmp_path):
    return str(tmp_path / "ckpt")


def fill(pair: SlotPair, step: int, rank: int, world: int, data: bytes) -> slots.Slot:
    """Write ``data`` as the checkpoint of ``step`` the way a worker does; return the slot."""
    slot = pair.begin_write(step, rank, world)
    slot.payload[: len(data)] = data
    slot.commit(len(data))
    return slot


def fill_large(pair: SlotPair, step: int, rank: int, world: int, size: int) -> slots.Slot:
    """A ``size``-byte checkpoint of a repeated random MiB (quick to make, any size)."""
    block = os.urandom(MiB)
    slot = pair.begin_write(step, rank, world)
    for offset in range(0, size, MiB):
        slot.payload[offset : min(offset + MiB, size)] = block[: min(MiB, size - offset)]
    slot.commit(size)
    return slot


def wait_for_bytes_in(path: str, timeout: float = 30) -> None:
    """Return once ``path`` holds a byte (a persist in flight has written its first piece)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_size > 0:
                return
        time.sleep(0.0005)


def files_under(path: str) -> list[str]:
    """Every file and folder under ``path``, relative, sorted."""
    found = []
    for folder, dirs, names in os.walk(path):
        found += [os.path.relpath(os.path.join(folder, n), path) for n in dirs + names]
    return sorted(found)


def test_persist_scan_and_read_back_give_the_same_bytes(pairs, root):
    data = os.urandom(slots.CHUNK + 12345)  # more than one checksum chunk, not a whole piece
    pair = pairs("local-0", len(data) + MiB)
    slot = fill(pair, 1200, 3, 8, data)
    disk = DiskCheckpoints(root, keep=2)

    done = disk.persist(slot, run_id="job-7")

    expected = slots.checksum(data)
    step_dir = os.path.join(root, "step-000000001200")
    assert done is not None
    assert done[:6] == (1200, 3, 8, len(data), expected, os.path.join(step_dir, "rank-000003-of-000008.ckpt"))
    assert done.seconds > 0
    assert files_under(root) == [
        "step-000000001200",
        "step-000000001200/rank-000003-of-000008.ckpt",
        "step-000000001200/rank-000003-of-000008.json",
    ]
    manifest = json.loads(Path(step_dir, "rank-000003-of-000008.json").read_text())
    assert manifest["written_at"] == pytest.approx(time.time(), abs=60)
    del manifest["written_at"]
    assert manifest == {
        "format": FORMAT,
        "step": 1200,
        "global_rank": 3,
        "world_size": 8,
        "size": len(data),
        "checksum": expected,
        "chunk": slots.CHUNK,
        "run_id": "job-7",
        "data": "rank-000003-of-000008.ckpt",
    }
    header = slot.header()
    assert header.has_checksum and header.checksum == expected  # the agent's first pass recorded it

    found = disk.scan()
    assert list(found) == [(3, 8)]
    [entry] = found[(3, 8)]
    assert entry[:7] == (
        1200,
        3,
        8,
        len(data),
        expected,
        done.path,
        os.path.join(step_dir, manifest["data"][:-5] + ".json"),
    )
    assert entry.run_id == "job-7"

    target = pairs("replica-3", len(data) + MiB)
    loaded = disk.read_into(entry, target)
    assert loaded is not None and loaded.complete and loaded.has_checksum
    assert (loaded.step, loaded.global_rank, loaded.world_size, loaded.payload_len) == (1200, 3, 8, len(data))
    assert loaded.checksum == expected
    found_slot, header = target.find(1200, 3, 8)
    assert bytes(found_slot.payload[: header.payload_len]) == data
    assert slots.verify(found_slot, header) is True


def test_persisting_the_same_checkpoint_again_writes_nothing_new(pairs, root):
    pair = pairs("local-0", MiB)
    slot = fill(pair, 5, 0, 2, os.urandom(1000))
    disk = DiskCheckpoints(root, keep=2)
    first = disk.persist(slot, "r")
    mtime = os.stat(first.path).st_mtime_ns
    again = disk.persist(slot, "r")
    assert again[:6] == first[:6]
    assert os.stat(first.path).st_mtime_ns == mtime


def test_a_new_checkpoint_of_a_step_already_on_disk_replaces_it_whole(pairs, root):
    """After a restart the same step is written again with other bytes: the old manifest never
    describes the new data (it is removed before the data file is replaced)."""
    disk = DiskCheckpoints(root, keep=2)
    disk.persist(fill(pairs("local-0", MiB), 5, 0, 2, b"old" * 100), "r")
    new = os.urandom(4000)
    disk.persist(fill(pairs("local-1", MiB), 5, 0, 2, new), "r")
    [entry] = disk.scan()[(0, 2)]
    assert (entry.size, entry.checksum) == (len(new), slots.checksum(new))
    assert Path(entry.path).read_bytes() == new


def test_keep_leaves_the_newest_steps_of_the_rank_and_never_touches_another_ranks_files(pairs, root):
    mine = DiskCheckpoints(root, keep=2)
    other_node = DiskCheckpoints(root, keep=10)  # another node's agent sharing the directory
    pair, other_pair = pairs("local-1", MiB), pairs("local-2", MiB)
    for step in (10, 20, 30, 40):  # keep + 2
        if step > 10:
            other_node.persist(fill(other_pair, step, 2, 4, b"two%d" % step), "r")
        mine.persist(fill(pair, step, 1, 4, b"one%d" % step), "r")

    found = mine.scan()
    assert [e.step for e in found[(1, 4)]] == [40, 30]
    assert [e.step for e in found[(2, 4)]] == [40, 30, 20]
    # step 10 held only rank 1's files: its folder went; step 20 keeps rank 2's files only
    assert files_under(root) == [
        "step-000000000020",
        "step-000000000020/rank-000002-of-000004.ckpt",
        "step-000000000020/rank-000002-of-000004.json",
        "step-000000000030",
        "step-000000000030/rank-000001-of-000004.ckpt",
        "step-000000000030/rank-000001-of-000004.json",
        "step-000000000030/rank-000002-of-000004.ckpt",
        "step-000000000030/rank-000002-of-000004.json",
        "step-000000000040",
        "step-000000000040/rank-000001-of-000004.ckpt",
        "step-000000000040/rank-000001-of-000004.json",
        "step-000000000040/rank-000002-of-000004.ckpt",
        "step-000000000040/rank-000002-of-000004.json",
    ]
    assert Path(root, "step-000000000020/rank-000002-of-000004.ckpt").read_bytes() == b"two20"


def test_ranks_persisting_in_parallel_into_one_directory_race_safely(pairs, root):
    """Four agents' threads, keep=1: each prunes its rank's old steps and removes folders left
    empty while the others still write into the same step folders."""
    disks = [DiskCheckpoints(root, keep=1) for _ in range(4)]
    rank_pairs = [pairs(f"local-{rank}", MiB) for rank in range(4)]
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            for step in range(1, 31):
                assert disks[rank].persist(fill(rank_pairs[rank], step, rank, 4, os.urandom(2000)), "r") is not None
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    found = disks[0].scan()
    assert {key: [e.step for e in entries] for key, entries in found.items()} == {(r, 4): [30] for r in range(4)}
    assert os.listdir(root) == ["step-000000000030"]


def test_a_write_into_the_slot_during_persist_drops_the_copy_and_leaves_nothing(pairs, root):
    size = 512 * MiB
    pair = pairs("local-0", size)
    fill(pair, 1, 0, 2, b"first")
    slot = fill_large(pair, 2, 0, 2, size)  # the older is slot a now: the next write goes there
    fill(pair, 3, 0, 2, b"third")
    assert pair.newest()[1].step == 3 and slot.header().step == 2
    tmp = os.path.join(root, "step-000000000002", f"rank-000000-of-000002.ckpt.tmp-{os.getpid()}")
    began = threading.Event()

    def worker_writes_again() -> None:
        wait_for_bytes_in(tmp)
        assert pair.begin_write(4, 0, 2) is slot  # the worker's next save, into the slot being copied
        began.set()

    thread = threading.Thread(target=worker_writes_again)
    thread.start()
    done = DiskCheckpoints(root, keep=2).persist(slot, "r")
    thread.join()

    assert began.is_set()
    assert done is None
    assert files_under(root) == []
    header = slot.header()
    assert (header.state, header.step, header.has_checksum) == (WRITING, 4, False)


def _bytes_written_by_this_process() -> int:
    """``wchar`` of /proc/self/io: bytes this process handed to write() so far."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs /proc/self/io")
def test_a_restore_that_abandons_the_step_being_persisted_stops_the_copy_early(pairs, root):
    """A restore discards the slots of steps after the one it restores, then the same steps on
    disk (``discard_after``, under the rank's disk lock). A persist of such a step in flight
    stops at its next piece instead of writing the whole checkpoint first, holding that lock."""
    size = 256 * MiB
    pair = pairs("local-0", size)
    slot = fill_large(pair, 7, 0, 2, size)
    disk = DiskCheckpoints(root, keep=2)
    tmp = os.path.join(root, "step-000000000007", f"rank-000000-of-000002.ckpt.tmp-{os.getpid()}")
    removed: list[int] = []

    def restore_abandons_step_7() -> None:
        wait_for_bytes_in(tmp)
        slot.discard(slot.header().seq)  # what CheckpointKeeper._abandon_after does first
        removed.append(disk.discard_after(0, 5))  # then this, once the persist let go of the lock

    before = _bytes_written_by_this_process()
    thread = threading.Thread(target=restore_abandons_step_7)
    thread.start()
    done = disk.persist(slot, "r")
    thread.join()
    written = _bytes_written_by_this_process() - before

    assert done is None and removed == [0]
    assert files_under(root) == []
    assert written < size // 2, f"{written >> 20} MiB written of a {size >> 20} MiB checkpoint being discarded"


def test_a_restore_does_not_wait_for_the_persist_of_the_step_it_restores(pairs, root):
    """The step being persisted is the one restored (the newest every rank holds): the restore's
    ``discard_after`` does not wait for that persist (seconds) but leaves it the removal of the
    abandoned steps, which ``scan`` hides meanwhile."""
    size = 512 * MiB
    disk = DiskCheckpoints(root, keep=3)
    assert disk.persist(fill(pairs("local-1", MiB), 9, 0, 2, b"abandoned"), "r") is not None
    slot = fill_large(pairs("local-0", size), 7, 0, 2, size)
    tmp = os.path.join(root, "step-000000000007", f"rank-000000-of-000002.ckpt.tmp-{os.getpid()}")
    seen: dict = {}

    def restore_of_step_7() -> None:
        wait_for_bytes_in(tmp)
        seen["removed"] = disk.discard_after(0, 7)
        seen["steps listed"] = sorted(e.step for e in disk.scan().get((0, 2), []))
        seen["returned"] = time.monotonic()

    thread = threading.Thread(target=restore_of_step_7)
    thread.start()
    done = disk.persist(slot, "r")
    persisted = time.monotonic()
    thread.join()

    assert done is not None and done.step == 7
    assert seen["removed"] == 0 and seen["returned"] < persisted  # left to the persist in flight
    assert seen["steps listed"] == []  # step 9 hidden at once; step 7 not committed yet
    assert [e.step for e in disk.scan()[(0, 2)]] == [7]  # the persist removed step 9 before it ended
    assert not any("step-000000000009" in f for f in files_under(root))


def test_a_slot_without_a_complete_checkpoint_is_not_persisted(pairs, root):
    pair = pairs("local-0", MiB)
    slot = pair.begin_write(1, 0, 1)
    assert DiskCheckpoints(root, keep=2).persist(slot, "r") is None
    assert not os.path.exists(root)


PERSIST_IN_CHILD = """
import sys
from fsm_agent.checkpoint.disk import DiskCheckpoints
from fsm_agent.checkpoint.slots import SlotPair
root, prefix = sys.argv[1:3]
slot, header = SlotPair.open(prefix).newest()
DiskCheckpoints(root, keep=2).persist(slot, "child")
"""


def _state(pid: int) -> str:
    """The process's state letter (``T``: stopped, ``Z``: ended, not yet reaped)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_a_persister_killed_mid_write_leaves_the_previous_checkpoint_and_no_manifest(pairs, root, request):
    size = 512 * MiB
    prefix = "local-0"
    pair = pairs(prefix, size)
    disk = DiskCheckpoints(root, keep=2)
    disk.persist(fill(pair, 1, 0, 2, b"one" * 1000), "r")
    fill_large(pair, 2, 0, 2, size)
    child = subprocess.Popen(
        [sys.executable, "-c", PERSIST_IN_CHILD, root, os.path.join(os.path.dirname(pair.slots[0].path), prefix)],
        env=checkout_env(),
        start_new_session=True,
    )
    request.addfinalizer(lambda: child.poll() is None and (child.kill(), child.wait()))
    step2 = os.path.join(root, "step-000000000002")
    tmp = os.path.join(step2, f"rank-000000-of-000002.ckpt.tmp-{child.pid}")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and child.poll() is None:
        with contextlib.suppress(FileNotFoundError):
            if os.stat(tmp).st_size > 0:
                break
        time.sleep(0.0005)
    assert child.poll() is None, f"the persister ended (rc {child.returncode}) before it could be killed"
    os.kill(child.pid, signal.SIGSTOP)  # freeze it (not reaped: its pid stays ours) to see where it is
    while _state(child.pid) not in ("T", "t", "Z"):
        time.sleep(0.001)
    assert _state(child.pid) != "Z", "the persister ended before it could be killed"
    assert not os.path.exists(os.path.join(step2, "rank-000000-of-000002.json")), "the persist had already finished"
    assert 0 < os.stat(tmp).st_size < size
    os.kill(child.pid, signal.SIGKILL)
    assert child.wait(30) == -signal.SIGKILL

    [entry] = disk.scan()[(0, 2)]
    assert entry.step == 1 and Path(entry.path).read_bytes() == b"one" * 1000
    assert os.path.exists(tmp)  # the dead agent's temporary: the next persist removes it (old enough)
    old = time.time() - 3600
    os.utime(tmp, (old, old))
    disk.persist(fill(pair, 3, 0, 2, b"three"), "r")
    assert not os.path.exists(tmp)
    assert [e.step for e in disk.scan()[(0, 2)]] == [3, 1]


def test_the_sweep_removes_old_leftovers_of_the_rank_and_keeps_a_live_writers_file(pairs, root):
    disk = DiskCheckpoints(root, keep=5)
    pair = pairs("local-0", MiB)
    disk.persist(fill(pair, 1, 0, 2, b"one"), "r")
    step1 = Path(root, "step-000000000001")
    old = time.time() - 3600
    leftovers = {
        "dead": step1 / "rank-000000-of-000002.ckpt.tmp-999999999",  # another agent, long gone
        "orphan": Path(root, "step-000000000007", "rank-000000-of-000004.ckpt"),  # killed before its manifest
        "mine": step1 / f"rank-000000-of-000002.json.tmp-{os.getpid()}",  # this process, earlier failure
    }
    kept = {
        "live": step1 / "rank-000000-of-000002.ckpt.tmp-999999998",  # being written now
        "other rank": step1 / "rank-000001-of-000002.ckpt.tmp-999999997",  # not this rank's
    }
    for path in [*leftovers.values(), *kept.values()]:
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"x")
    for name in ("dead", "orphan"):
        os.utime(leftovers[name], (old, old))
    os.utime(kept["other rank"], (old, old))

    disk.persist(fill(pair, 2, 0, 2, b"two"), "r")

    assert [name for name, path in leftovers.items() if path.exists()] == []
    assert [name for name, path in kept.items() if path.exists()] == list(kept)


def test_a_damaged_file_fails_its_checksum_and_the_slot_is_marked_bad(pairs, root):
    data = os.urandom(3 * MiB + 7)
    disk = DiskCheckpoints(root, keep=2)
    done = disk.persist(fill(pairs("local-0", 4 * MiB), 9, 1, 2, data), "r")
    with open(done.path, "r+b") as f:
        f.seek(2 * MiB)
        byte = f.read(1)
        f.seek(2 * MiB)
        f.write(bytes([byte[0] ^ 0x01]))
    [entry] = disk.scan()[(1, 2)]  # the size is right: only the checksum can tell

    target = pairs("replica-1", 4 * MiB)
    assert disk.read_into(entry, target) is None
    states = [slot.header().state for slot in target.slots]
    assert states == [BAD, slots.EMPTY]
    assert target.newest() is None and target.find(9, 1, 2) is None


def test_a_file_of_another_size_or_too_large_for_the_slot_leaves_the_pair_untouched(pairs, root):
    disk = DiskCheckpoints(root, keep=2)
    done = disk.persist(fill(pairs("local-0", 4 * MiB), 9, 1, 2, os.urandom(2 * MiB)), "r")
    [entry] = disk.scan()[(1, 2)]
    target = pairs("replica-1", MiB)
    with pytest.raises(
        ValueError, match=r"is 2\.0 MiB, more than the 1\.0 MiB a slot holds: raise --checkpoint-memory"
    ):
        disk.read_into(entry, target)
    target = pairs("replica-2", 4 * MiB)
    os.truncate(done.path, MiB)  # changed since the scan
    assert disk.read_into(entry, target) is None
    assert [slot.header().state for slot in target.slots] == [slots.EMPTY, slots.EMPTY]
    assert disk.scan() == {}


def test_scan_takes_only_complete_checkpoints_newest_first(pairs, root):
    disk = DiskCheckpoints(root, keep=10)
    pair = pairs("local-0", MiB)
    for step in (3, 1, 2):
        disk.persist(fill(pair, step, 0, 2, b"s%d" % step), "r")
    disk.persist(fill(pairs("local-1", MiB), 2, 1, 2, b"rank one"), "r")
    junk = {
        "step-000000000009/rank-000000-of-000002.json": "{not json",
        "step-000000000008/rank-000000-of-000002.json": json.dumps({"format": 99}),
        "step-000000000007/rank-000000-of-000002.ckpt": "no manifest",
        "step-000000000006/rank-000000-of-000002.ckpt.tmp-1": "tmp",
        "step-000000000005/README": "unrelated",
        "step-5/rank-000000-of-000002.json": "not a step folder",
        "notes.txt": "unrelated",
    }
    for name, text in junk.items():
        Path(root, name).parent.mkdir(exist_ok=True)
        Path(root, name).write_text(text)
    manifest = json.loads(Path(root, "step-000000000002/rank-000000-of-000002.json").read_text())
    for step, change in ((4, {"size": 999}), (10, {"step": 11})):  # data of another size; step of another folder
        Path(root, f"step-{step:012d}").mkdir()
        shutil.copy(Path(root, "step-000000000002/rank-000000-of-000002.ckpt"), Path(root, f"step-{step:012d}"))
        record = {**manifest, "step": step, **change}
        Path(root, f"step-{step:012d}/rank-000000-of-000002.json").write_text(json.dumps(record))

    found = disk.scan()
    assert {key: [e.step for e in entries] for key, entries in found.items()} == {(0, 2): [3, 2, 1], (1, 2): [2]}
    assert all(isinstance(e, DiskEntry) for entries in found.values() for e in entries)
    assert DiskCheckpoints(os.path.join(root, "missing"), keep=1).scan() == {}


def test_discard_after_removes_the_ranks_abandoned_timeline(pairs, root):
    disk = DiskCheckpoints(root, keep=10)
    pair = pairs("local-0", MiB)
    for step in (1, 2, 3):
        disk.persist(fill(pair, step, 0, 2, b"x"), "r")
    disk.persist(fill(pairs("local-1", MiB), 3, 1, 2, b"y"), "r")
    assert disk.discard_after(0, 1) == 2
    assert {k: [e.step for e in v] for k, v in disk.scan().items()} == {(0, 2): [1], (1, 2): [3]}
    assert sorted(os.listdir(root)) == ["step-000000000001", "step-000000000003"]


def test_check_dir_creates_and_probes_the_directory(tmp_path):
    root = tmp_path / "a" / "b"
    check_dir(str(root))
    assert root.is_dir() and list(root.iterdir()) == []
    assert free_bytes(str(root)) > 0
    assert free_bytes(str(root / "not" / "yet")) == free_bytes(str(root))


def test_a_file_in_place_of_the_directory_is_one_line_with_the_fix(pairs, tmp_path):
    path = tmp_path / "file"
    path.write_text("")
    expected = f"--checkpoint-dir {path}: Not a directory: a part of the path is a file, not a directory: choose another directory"
    with pytest.raises(PersistError) as caught:
        check_dir(str(path))
    assert (str(caught.value), caught.value.errno) == (expected, 20)
    with pytest.raises(PersistError) as caught:
        DiskCheckpoints(str(path), keep=1).persist(fill(pairs("local-0", 64), 1, 0, 1, b"x"), "r")
    assert str(caught.value) == expected
    assert path.read_text() == ""


def test_format_bytes():
    assert [format_bytes(n) for n in (0, 1023, 1024, 3 * MiB // 2, 1 << 30, 5 << 40)] == [
        "0 B",
        "1023 B",
        "1.0 KiB",
        "1.5 MiB",
        "1.0 GiB",
        "5.0 TiB",
    ]


# A full disk and a read-only file system, each a small tmpfs in a private mount namespace.
IN_NAMESPACE = """
import json, os, subprocess, sys
from fsm_agent.checkpoint.disk import DiskCheckpoints, PersistError, check_dir
from fsm_agent.checkpoint.slots import SlotPair
mnt, mode, prefix = sys.argv[1:4]
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", mnt], check=True)
root = os.path.join(mnt, "ckpt")
os.mkdir(root)
if mode == "ro":
    subprocess.run(["mount", "-o", "remount,ro", mnt], check=True)
out = {}
try:
    check_dir(root)
    out["check_dir"] = None
except PersistError as exc:
    out["check_dir"] = [str(exc), exc.errno]
slot, header = SlotPair.open(prefix).newest()
try:
    out["persist"] = list(DiskCheckpoints(root, keep=2).persist(slot, "r"))
except PersistError as exc:
    out["persist"] = [str(exc), exc.errno]
out["left"] = sorted(os.path.relpath(os.path.join(d, n), mnt) for d, ds, ns in os.walk(mnt) for n in ds + ns)
print(json.dumps(out))
"""


@pytest.fixture
def namespace_run(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root: mounts a tmpfs in a private mount namespace")
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux) for a private mount namespace")
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a mount namespace here: {probe.stderr.strip()}")

    def run(mode: str, prefix: str) -> dict:
        mnt = tmp_path / f"mnt-{mode}"
        mnt.mkdir()
        done = subprocess.run(
            [
                "unshare",
                "--mount",
                "--propagation",
                "private",
                sys.executable,
                "-c",
                IN_NAMESPACE,
                str(mnt),
                mode,
                prefix,
            ],
            env=checkout_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert not os.path.ismount(mnt) and list(mnt.iterdir()) == []  # the mount lived only in there
        result = json.loads(done.stdout)
        result["root"] = str(mnt / "ckpt")
        return result

    return run


def test_a_full_disk_is_one_line_with_what_is_needed_and_leaves_no_temporary(pairs, namespace_run):
    pair = pairs("local-0", 4 * MiB)
    fill(pair, 1, 0, 1, os.urandom(3 * MiB))
    out = namespace_run("full", pair.slots[0].path[: -len("-a")])
    assert out["check_dir"] is None  # a little room is room: only the checkpoint does not fit
    message, code = out["persist"]
    assert code == 28
    assert message.startswith(f"--checkpoint-dir {out['root']}: No space left on device (needs ")
    assert message.endswith(" more): free space, lower --checkpoint-keep or choose another directory")
    assert "\n" not in message
    assert out["left"] == ["ckpt"]
    assert pair.slots[0].header().has_checksum is False


def test_a_read_only_file_system_is_one_line_with_the_fix(pairs, namespace_run):
    pair = pairs("local-0", MiB)
    fill(pair, 1, 0, 1, b"data")
    out = namespace_run("ro", pair.slots[0].path[: -len("-a")])
    root = out["root"]
    fix = ": choose a directory on a writable file system"
    assert out["check_dir"][1] == 30
    assert out["check_dir"][0].startswith(f"--checkpoint-dir {root}: Read-only file system at .probe-")
    assert out["check_dir"][0].endswith(fix)
    assert out["persist"] == [f"--checkpoint-dir {root}: Read-only file system at step-000000000001{fix}", 30]
    assert out["left"] == ["ckpt"]
    assert pair.slots[0].header().state == COMPLETE
