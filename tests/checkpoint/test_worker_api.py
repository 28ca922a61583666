"""fsm_agent.checkpoint's worker API: save() into real shared-memory slots, load() back, with real torch.

Each test makes its own SlotPair (``SlotPair.create`` in a fresh ``/dev/shm`` folder, removed at
teardown) and points ``FSM_AGENT_CHECKPOINT_SLOTS`` at it; the agent's staged restore is simulated
by pointing ``FSM_AGENT_CHECKPOINT_RESTORE`` at a slot of the pair. A save killed mid-write is a
real subprocess SIGKILLed by pid; the fork test forks this process.
"""

from __future__ import annotations

import os
import pickle
import signal
import struct
import subprocess
import sys
import time

import pytest
import torch

import fsm_agent.checkpoint as ckpt
from fsm_agent.checkpoint import CheckpointTooLarge, Restored, payload
from fsm_agent.checkpoint.slots import COMPLETE, EMPTY, WRITING, Slot, SlotPair
from tests.helpers.processes import checkout_env

pytestmark = pytest.mark.unit

MiB = 1 << 20


@pytest.fixture
def worker(shm, monkeypatch, request):
    """``make(capacity=8 MiB)``: a SlotPair in ``shm``, this process set up as rank 0 of 1 saving into it."""

    def make(capacity: int = 8 * MiB, name: str = "local-0") -> SlotPair:
        pair = SlotPair.create(os.path.join(shm, name), capacity)
        request.addfinalizer(pair.close)
        monkeypatch.setenv(ckpt.SLOTS_ENV, os.path.join(shm, name))
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "1")
        monkeypatch.delenv(ckpt.RESTORE_ENV, raising=False)
        return pair

    return make


def stage(monkeypatch, pair: SlotPair, step: int | None = None, source: str = "memory") -> Slot:
    """What the agent does before a restart: point the worker at the slot holding ``step`` (newest: None)."""
    found = pair.newest() if step is None else pair.find(step, 0, 1)
    assert found is not None
    slot, header = found
    monkeypatch.setenv(ckpt.RESTORE_ENV, f"{header.step}:{source}:{slot.path}")
    return slot


def assert_same(restored, saved, path="") -> None:
    """Equal structure, types and values; tensors equal in dtype, shape and elements."""
    if isinstance(saved, torch.Tensor):
        assert isinstance(restored, torch.Tensor), path
        assert (restored.dtype, restored.shape) == (saved.dtype, saved.shape), path
        assert torch.equal(restored, saved.detach()), path
    elif isinstance(saved, dict):
        assert type(restored) is type(saved) and list(restored) == list(saved), path
        for key in saved:
            assert_same(restored[key], saved[key], f"{path}/{key}")
    elif isinstance(saved, (list, tuple)):
        assert type(restored) is type(saved) and len(restored) == len(saved), path
        for i, (r, s) in enumerate(zip(restored, saved)):
            assert_same(r, s, f"{path}/{i}")
    else:
        assert restored == saved, path


def trained():
    """A small model and an Adam optimizer after one step (so the optimizer has state)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 6)).sum().backward()
    optim.step()
    return model, optim


def mixed_state():
    model, optim = trained()
    torch.manual_seed(1)
    return {
        "model": model.state_dict(),
        "optim": optim.state_dict(),
        "bf16": torch.randn(7, 3).bfloat16(),
        "mask": torch.rand(11) > 0.5,
        "transposed": torch.randn(5, 4).t(),
        "strided": torch.arange(40.0).view(5, 8)[:, ::3],
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "complex": torch.randn(3, dtype=torch.complex64),
        "empty": torch.empty(0, 4),
        "int8": torch.arange(-5, 5, dtype=torch.int8),
        "rng": torch.get_rng_state(),
        "param": torch.nn.Parameter(torch.ones(2)),
        "nested": {"lists": [torch.ones(2), (3, "x", torch.zeros(1, dtype=torch.int64))], "none": None},
        "meta": {"step": 12, "lr": 0.01, "name": "run-α", "tags": ("a", "b")},
    }


def test_a_mixed_state_dict_round_trips(worker, monkeypatch):
    worker()
    saved = mixed_state()
    ckpt.save(saved, step=12)
    stage(monkeypatch, SlotPair.open(os.environ[ckpt.SLOTS_ENV]), source="peer")
    restored = ckpt.load()
    assert isinstance(restored, Restored)
    assert (restored.step, restored.source) == (12, "peer")
    assert_same(restored.state_dict, saved)
    assert restored.state_dict["param"].requires_grad and not restored.state_dict["bf16"].requires_grad
    model, optim = trained()
    model.load_state_dict(restored.state_dict["model"])
    optim.load_state_dict(restored.state_dict["optim"])


def test_restored_tensors_are_copies_that_later_saves_do_not_change(worker, monkeypatch):
    pair = worker()
    ckpt.save({"w": torch.full((1000,), 1.0)}, step=1)
    stage(monkeypatch, pair)
    first = ckpt.load().state_dict["w"]
    ckpt.save({"w": torch.full((1000,), 2.0)}, step=2)
    ckpt.save({"w": torch.full((1000,), 3.0)}, step=3)  # over step 1's slot
    assert bool(torch.all(first == 1.0))


def test_the_same_tensor_twice_is_stored_once_and_restored_as_one(worker, monkeypatch):
    pair = worker()
    shared = torch.arange(1000.0)
    saved = {"a": shared, "b": [shared], "c": torch.ones(1)}
    ckpt.save(saved, step=0)
    assert payload.needed_bytes(saved) < payload.needed_bytes({"a": shared, "b": [shared.clone()], "c": torch.ones(1)})
    stage(monkeypatch, pair)
    restored = ckpt.load().state_dict
    assert restored["a"] is restored["b"][0]
    assert torch.equal(restored["a"], shared)


def test_load_into_copies_in_place_and_returns_the_same_tensors(worker, monkeypatch):
    pair = worker()
    model, optim = trained()
    saved = {"model": model.state_dict(), "optim": optim.state_dict(), "extra": torch.arange(6.0), "step": 12}
    ckpt.save(saved, step=12)
    stage(monkeypatch, pair)

    fresh_model, fresh_optim = trained()
    with torch.no_grad():
        for p in fresh_model.parameters():
            p.zero_()
    for state in fresh_optim.state.values():
        for value in state.values():
            value.zero_()
    into = {"model": fresh_model.state_dict(), "optim": fresh_optim.state_dict(), "extra": torch.zeros(3)}
    before = {id(t) for t in (into["model"]["0.weight"], into["optim"]["state"][0]["exp_avg"])}
    restored = ckpt.load(into=into)

    state = restored.state_dict
    assert state["model"]["0.weight"] is into["model"]["0.weight"]
    assert state["optim"]["state"][0]["exp_avg"] is into["optim"]["state"][0]["exp_avg"]
    assert {id(state["model"]["0.weight"]), id(state["optim"]["state"][0]["exp_avg"])} == before
    for name, param in fresh_model.named_parameters():  # the live model changed, in place
        assert torch.equal(param, model.state_dict()[name])
    assert torch.equal(fresh_optim.state[fresh_model[0].weight]["exp_avg"], optim.state[model[0].weight]["exp_avg"])
    # a shape mismatch is not copied into: a fresh tensor, the target left alone
    assert state["extra"] is not into["extra"] and torch.equal(state["extra"], torch.arange(6.0))
    assert torch.equal(into["extra"], torch.zeros(3))
    assert_same(state, saved)


def test_load_into_skips_a_tensor_of_another_dtype(worker, monkeypatch):
    pair = worker()
    ckpt.save({"w": torch.arange(4, dtype=torch.float32)}, step=0)
    stage(monkeypatch, pair)
    into = {"w": torch.zeros(4, dtype=torch.float64)}
    state = ckpt.load(into=into).state_dict
    assert state["w"] is not into["w"] and state["w"].dtype == torch.float32
    assert bool(torch.all(into["w"] == 0))


def test_saves_alternate_slots_and_keep_the_previous_checkpoint(worker, monkeypatch):
    pair = worker()
    for step in (1, 2):
        ckpt.save({"w": torch.full((100,), float(step)), "step": step}, step=step)
    assert sorted(slot.header().step for slot in pair.slots) == [1, 2]
    assert all(slot.header().state == COMPLETE for slot in pair.slots)
    stage(monkeypatch, pair, step=1)
    assert ckpt.load().state_dict["step"] == 1
    ckpt.save({"w": torch.full((100,), 3.0), "step": 3}, step=3)  # over step 1, step 2 intact
    assert sorted(slot.header().step for slot in pair.slots) == [2, 3]
    stage(monkeypatch, pair, step=2)
    restored = ckpt.load()
    assert restored.step == 2 and bool(torch.all(restored.state_dict["w"] == 2.0))


KILLED_SAVER = """
import sys, torch
import fsm_agent.checkpoint as ckpt
ckpt.save({"w": torch.full((1000,), 1.0), "step": 1}, step=1)
big = torch.ones(4096, 32768).t()  # 512 MiB, transposed: a slow strided copy
print("ready", flush=True)
ckpt.save({"w": big, "step": 2}, step=2)
print("saved", flush=True)
"""


def test_a_save_killed_mid_write_leaves_the_previous_checkpoint_newest(worker, monkeypatch, request):
    pair = worker(capacity=520 * MiB)
    env = checkout_env(**{ckpt.SLOTS_ENV: os.environ[ckpt.SLOTS_ENV], "RANK": "0", "WORLD_SIZE": "1"})
    proc = subprocess.Popen([sys.executable, "-c", KILLED_SAVER], env=env, stdout=subprocess.PIPE, text=True)

    def reap():
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()

    request.addfinalizer(reap)
    assert proc.stdout.readline().strip() == "ready"
    deadline = time.monotonic() + 30
    while not any(s.header().state == WRITING and s.header().step == 2 for s in pair.slots):
        assert proc.poll() is None and time.monotonic() < deadline, "the second save never began"
        time.sleep(0.0005)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    states = {s.header().step: s.header().state for s in pair.slots}
    assert states == {1: COMPLETE, 2: WRITING}, "killed too late: the save had completed"
    slot, header = pair.newest()
    assert header.step == 1
    stage(monkeypatch, pair)
    restored = ckpt.load()
    assert restored.step == 1 and bool(torch.all(restored.state_dict["w"] == 1.0))


def test_a_checkpoint_too_large_raises_before_anything_is_written(worker, monkeypatch):
    pair = worker(capacity=1 * MiB)
    ckpt.save({"w": torch.ones(10)}, step=1)
    headers = [s.header() for s in pair.slots]
    untouched = bytes(pair.slots[1].payload[:4096])
    big = {"w": torch.ones(512 * 1024)}  # 2 MiB
    needed = payload.needed_bytes(big)
    with pytest.raises(CheckpointTooLarge) as raised:
        ckpt.save(big, step=2)
    assert isinstance(raised.value, ValueError)
    assert (raised.value.needed, raised.value.capacity) == (needed, pair.capacity)
    message = str(raised.value)
    assert str(needed) in message and str(pair.capacity) in message
    assert f"--checkpoint-memory at least {needed}" in message
    assert [s.header() for s in pair.slots] == headers
    assert headers[1].state == EMPTY and bytes(pair.slots[1].payload[:4096]) == untouched


def test_not_run_by_fsm_agent_save_says_how_and_load_returns_none(monkeypatch):
    monkeypatch.delenv(ckpt.SLOTS_ENV, raising=False)
    monkeypatch.delenv(ckpt.RESTORE_ENV, raising=False)
    assert not ckpt.enabled()
    with pytest.raises(RuntimeError, match=r"--checkpoint-memory") as raised:
        ckpt.save({"w": torch.ones(1)}, step=0)
    assert ckpt.SLOTS_ENV in str(raised.value)
    assert ckpt.load() is None


def test_enabled_when_the_agent_set_the_slots(worker):
    worker()
    assert ckpt.enabled()


@pytest.mark.parametrize(
    "step, error", [(-1, ValueError), ("3", TypeError), (True, TypeError), (1.0, TypeError), (None, TypeError)]
)
def test_a_step_that_is_not_an_int_at_least_zero_is_refused(worker, step, error):
    pair = worker()
    with pytest.raises(error, match="step must be an int >= 0"):
        ckpt.save({"w": torch.ones(1)}, step=step)
    assert all(s.header().state == EMPTY for s in pair.slots)


def test_tensors_save_cannot_copy_are_refused_before_writing(worker):
    pair = worker()
    with pytest.raises(TypeError, match="layout"):
        ckpt.save({"s": torch.eye(3).to_sparse()}, step=0)
    with pytest.raises(TypeError, match="meta device"):
        ckpt.save({"m": torch.empty(3, device="meta")}, step=0)
    assert all(s.header().state == EMPTY for s in pair.slots)


@pytest.mark.parametrize(
    "env, reason",
    [
        ({"RANK": "1", "WORLD_SIZE": "2"}, "rank 0 in a world of 1"),
        ({"WORLD_SIZE": "2"}, "world of 1"),
        ({"staged_step": "4"}, "holds step 5"),
    ],
    ids=["rank", "world-size", "step"],
)
def test_a_checkpoint_of_another_rank_world_size_or_step_is_not_loaded(worker, monkeypatch, env, reason):
    pair = worker()
    ckpt.save({"w": torch.ones(3)}, step=5)
    slot = stage(monkeypatch, pair)
    monkeypatch.setenv(ckpt.RESTORE_ENV, f"{env.pop('staged_step', '5')}:memory:{slot.path}")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.warns(RuntimeWarning, match=reason):
        assert ckpt.load() is None


def test_an_incomplete_staged_slot_is_not_loaded(worker, monkeypatch):
    pair = worker()
    ckpt.save({"w": torch.ones(3)}, step=5)
    slot = stage(monkeypatch, pair)
    slot.begin(slot.header().seq + 1, 5, 0, 1)
    with pytest.warns(RuntimeWarning, match="writing, not complete"):
        assert ckpt.load() is None


class Interloper(dict):
    """An ``into`` whose walk begins a write into the slot being read: a writer racing the reader."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def items(self):
        slot = Slot.open(self.path)
        slot.begin(slot.header().seq + 1, 9, 0, 1)
        slot.close()
        return super().items()


def test_a_slot_overwritten_while_being_read_is_not_loaded(worker, monkeypatch):
    pair = worker()
    ckpt.save({"w": torch.ones(3)}, step=5)
    slot = stage(monkeypatch, pair)
    with pytest.warns(RuntimeWarning, match="overwritten while being read"):
        assert ckpt.load(into=Interloper(slot.path)) is None


def test_a_malformed_restore_variable_is_an_error(worker, monkeypatch):
    worker()
    monkeypatch.setenv(ckpt.RESTORE_ENV, "five:memory:/dev/shm/x")
    with pytest.raises(ValueError, match="<step>:<source>:<slot path>"):
        ckpt.load()


def test_the_payload_describes_itself_with_aligned_entries(worker):
    pair = worker()
    saved = {"a": torch.ones(3, dtype=torch.bfloat16), "b": {"c": torch.arange(5)}, "n": 4}
    ckpt.save(saved, step=3)
    slot, header = pair.newest()
    assert header.payload_len == payload.needed_bytes(saved)
    magic, meta_len = struct.unpack_from("<8sQ", slot.payload, 0)
    assert magic == payload.PAYLOAD_MAGIC
    meta = pickle.loads(bytes(slot.payload[16 : 16 + meta_len]))  # standard-library types only
    assert meta["kind"] == "state_dict" and meta["version"] == payload.FORMAT_VERSION
    data_start = (16 + meta_len + 63) // 64 * 64
    entries = [payload.Entry(*e) for e in meta["entries"]]
    assert [(e.dtype, e.shape, e.path) for e in entries] == [("bfloat16", (3,), ("a",)), ("int64", (5,), ("b", "c"))]
    assert all((data_start + e.offset) % 64 == 0 for e in entries)
    assert header.payload_len == data_start + entries[-1].offset + entries[-1].nbytes
    start = data_start + entries[1].offset
    assert bytes(slot.payload[start : start + 40]) == torch.arange(5).numpy().tobytes()


def test_a_forked_child_opens_the_slots_again(worker, monkeypatch):
    pair = worker()
    ckpt.save({"w": torch.ones(4)}, step=1)
    assert ckpt._cached is not None
    pid = os.fork()
    if pid == 0:  # the child: report through the exit status only
        code = 1
        try:
            if ckpt._cached is None:
                ckpt.save({"w": torch.full((4,), 2.0)}, step=2)
                code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + 20
    while (done := os.waitpid(pid, os.WNOHANG)) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung")
        time.sleep(0.01)
    assert os.waitstatus_to_exitcode(done[1]) == 0
    assert pair.newest()[1].step == 2
    stage(monkeypatch, pair)
    assert torch.equal(ckpt.load().state_dict["w"], torch.full((4,), 2.0))


def test_importing_the_package_does_not_import_torch():
    code = "import sys, fsm_agent.checkpoint as c; assert 'torch' not in sys.modules; c.enabled(); c.Restored"
    subprocess.run([sys.executable, "-c", code], env=checkout_env(), check=True, timeout=60)


def test_dcp_classes_are_exported_lazily():
    from fsm_agent.checkpoint.dcp import FsmStorageReader, FsmStorageWriter

    assert ckpt.FsmStorageWriter is FsmStorageWriter and ckpt.FsmStorageReader is FsmStorageReader
    with pytest.raises(AttributeError):
        ckpt.no_such_name  # noqa: B018


def test_a_save_waits_for_the_agent_to_persist_the_checkpoint_it_would_overwrite(worker, monkeypatch):
    """With ``--checkpoint-dir`` every save asks for a disk copy; the third save would overwrite the
    first, which the agent has not persisted yet: it waits until the agent says it is done."""
    import threading

    from fsm_agent.checkpoint.slots import PERSIST

    pair = worker()
    monkeypatch.setenv(ckpt.PERSIST_ENV, "1")
    ckpt.save({"w": torch.zeros(4)}, step=1)
    ckpt.save({"w": torch.ones(4)}, step=2)
    first = next(s for s in pair.slots if s.header().step == 1)
    assert first.header().flags & PERSIST and first.header().awaiting_persist
    done = threading.Event()
    saver = threading.Thread(target=lambda: (ckpt.save({"w": torch.full((4,), 3.0)}, step=3), done.set()))
    saver.start()
    assert not done.wait(0.5)  # waiting: step 1 is not on disk yet
    assert first.header().step == 1
    first.set_persisted(first.header().seq)  # what the agent does once the manifest is written
    assert done.wait(10)
    saver.join()
    assert first.header().step == 3
    second = next(s for s in pair.slots if s.header().step == 2)
    second.set_persisted(second.header().seq)
    assert ckpt.save({"w": torch.zeros(4)}, step=4, persist=False) is None  # memory only: never waited for
    assert not [s for s in pair.slots if s.header().step == 4][0].header().awaiting_persist


def test_a_slot_appears_under_its_name_only_once_whole(tmp_path, monkeypatch):
    """A reader listing the directory while the agent reserves a slot never maps a half-made one
    (a CI run once read zeros there: "bad magic"): the slot is renamed into place after its header."""
    path = str(tmp_path / "local-0-a")
    seen_while_reserving = []
    real_fallocate = os.posix_fallocate

    def reserve_and_look(fd, offset, length):
        seen_while_reserving.append(sorted(os.listdir(tmp_path)))
        real_fallocate(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", reserve_and_look)
    slot = Slot.create(path, 1 << 20, reserve=True)
    assert seen_while_reserving == [["local-0-a.making"]]
    assert os.listdir(tmp_path) == ["local-0-a"]
    reopened = Slot.open(path)
    assert reopened.header().state == EMPTY
    reopened.close()
    slot.close()


def test_a_slot_that_cannot_be_reserved_leaves_no_file(tmp_path, monkeypatch):
    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError):
        Slot.create(str(tmp_path / "local-0-a"), 1 << 20, reserve=True)
    assert os.listdir(tmp_path) == []
