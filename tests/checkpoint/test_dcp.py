"""fsm_agent.checkpoint's DCP storage: dcp.save with FsmStorageWriter, dcp.load with FsmStorageReader, two real ranks.

Two real processes form a gloo group on 127.0.0.1 (a port from binding port 0), each with its own
SlotPair in a fresh ``/dev/shm`` folder (removed at teardown), as two workers of one agent have.
Each saves a DTensor sharded across both ranks, a plain tensor whose values differ per rank (DCP
would deduplicate it to one rank's copy; here each rank keeps its own), a bfloat16 tensor and
non-tensor values; then, as the agent does before a restart, points
``FSM_AGENT_CHECKPOINT_RESTORE`` at its newest slot and loads into zeros. Teardown kills any
process still running, by pid.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from fsm_agent.checkpoint import RESTORE_ENV, SLOTS_ENV
from fsm_agent.checkpoint.slots import SlotPair
from fsm_agent.testing.conformance import free_port
from tests.helpers.processes import checkout_env

pytestmark = pytest.mark.integration

MiB = 1 << 20
WORLD = 2

RANK_SCRIPT = r"""
import os
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import fsm_agent.checkpoint as ckpt
from fsm_agent.checkpoint import FsmStorageReader, FsmStorageWriter
from fsm_agent.checkpoint.slots import SlotPair

rank = int(os.environ["RANK"])
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2,))
torch.manual_seed(0)
full = torch.randn(8, 6)


def state(filled):
    make = (lambda t: t) if filled else torch.zeros_like
    return {
        "model": {
            "w": distribute_tensor(make(full), mesh, [Shard(0)]),
            "b": make(torch.arange(5.0) + 10 * rank),
            "h": make(torch.linspace(0, 1, 9).bfloat16()),
        },
        "extra": {"step": 7 if filled else -1, "names": ["a", "b"] if filled else []},
    }


assert FsmStorageReader().step is None
saved = state(True)
dcp.save(saved, storage_writer=FsmStorageWriter(step=7))

slot, header = SlotPair.open(os.environ["FSM_AGENT_CHECKPOINT_SLOTS"]).newest()
assert (header.step, header.global_rank, header.world_size) == (7, rank, 2), header
os.environ["FSM_AGENT_CHECKPOINT_RESTORE"] = f"7:memory:{slot.path}"

reader = FsmStorageReader()
assert (reader.step, reader.source) == (7, "memory")
target = state(False)
dcp.load(target, storage_reader=reader)
assert torch.equal(target["model"]["w"].to_local(), saved["model"]["w"].to_local())
assert target["model"]["w"].to_local().shape == (4, 6)
assert torch.equal(target["model"]["b"], torch.arange(5.0) + 10 * rank)
assert torch.equal(target["model"]["h"], saved["model"]["h"])
assert target["extra"] == {"step": 7, "names": ["a", "b"]}, target["extra"]

try:
    ckpt.load()
except RuntimeError as exc:
    assert "FsmStorageReader" in str(exc), exc
else:
    raise AssertionError("load() read a DCP checkpoint")

dist.barrier()
dist.destroy_process_group()
print("ok", rank, flush=True)
"""


@pytest.fixture
def started(request):
    """The processes the test starts; teardown SIGKILLs any still running (by pid) and reaps it."""
    procs: list[subprocess.Popen] = []

    def reap():
        for proc in procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait()

    request.addfinalizer(reap)
    return procs


def test_two_ranks_save_with_the_writer_and_load_their_own_shards_with_the_reader(shm, started):
    port = free_port()
    pairs = [SlotPair.create(os.path.join(shm, f"local-{rank}"), 4 * MiB) for rank in range(WORLD)]
    for rank in range(WORLD):
        env = checkout_env(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(WORLD),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            **{SLOTS_ENV: os.path.join(shm, f"local-{rank}")},
        )
        env.pop(RESTORE_ENV, None)
        started.append(
            subprocess.Popen(
                [sys.executable, "-c", RANK_SCRIPT],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [proc.communicate(timeout=120)[0] for proc in started]
    for rank, (proc, output) in enumerate(zip(started, outputs)):
        assert proc.returncode == 0, f"rank {rank} failed:\n{output}"
        assert f"ok {rank}" in output
    for rank, pair in enumerate(pairs):
        found = pair.find(7, rank, WORLD)
        assert found is not None and found[1].payload_len > 0
        pair.close()


@pytest.fixture
def one_worker(shm, monkeypatch):
    """``make(capacity)``: this process as rank 0 of 1 with a SlotPair in ``shm`` (no process group:
    DCP saves and loads in this one process)."""

    def make(capacity: int = 4 * MiB) -> SlotPair:
        prefix = os.path.join(shm, "local-0")
        pair = SlotPair.create(prefix, capacity)
        monkeypatch.setenv(SLOTS_ENV, prefix)
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "1")
        monkeypatch.delenv(RESTORE_ENV, raising=False)
        return pair

    return make


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_one_process_round_trip_and_the_readers_errors(one_worker, monkeypatch):
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    import fsm_agent.checkpoint as ckpt
    from fsm_agent.checkpoint import CheckpointTooLarge, FsmStorageReader, FsmStorageWriter

    pair = one_worker(capacity=1 * MiB)
    # dcp wraps a storage's error in a CheckpointException (a BaseException) whose message holds ours
    with pytest.raises(CheckpointException, match="no checkpoint was staged"):
        dcp.load({"w": torch.zeros(3)}, storage_reader=FsmStorageReader())
    saved = {"w": torch.arange(6.0).view(2, 3).t(), "n": {"k": 3}}
    dcp.save(saved, storage_writer=FsmStorageWriter(step=4))
    with pytest.raises(CheckpointException, match="--checkpoint-memory at least") as raised:
        dcp.save({"w": torch.ones(1 << 19)}, storage_writer=FsmStorageWriter(step=5))
    assert CheckpointTooLarge.__name__ in str(raised.value)
    slot, header = pair.newest()
    assert header.step == 4
    monkeypatch.setenv(RESTORE_ENV, f"4:disk:{slot.path}")
    target = {"w": torch.zeros(3, 2), "n": {"k": 0}}
    dcp.load(target, storage_reader=FsmStorageReader())
    assert torch.equal(target["w"], saved["w"]) and target["n"] == {"k": 3}

    ckpt.save({"w": torch.ones(3)}, step=6)  # a plain checkpoint is not for the DCP reader
    slot, header = pair.newest()
    monkeypatch.setenv(RESTORE_ENV, f"6:memory:{slot.path}")
    with pytest.raises(CheckpointException, match=r"fsm_agent.checkpoint.load\(\)"):
        dcp.load({"w": torch.zeros(3)}, storage_reader=FsmStorageReader())
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(CheckpointException, match="not restored: it holds step 6 of rank 0"):
        dcp.load({"w": torch.zeros(3)}, storage_reader=FsmStorageReader())
    pair.close()
