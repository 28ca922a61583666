"""The worker of ``benchmarks/checkpoint.py``: saves and restores one rank's float32 state three ways.

    checkpoint_worker.py OUT SIZE_BYTES TENSORS ROUNDS FILES_DIR KILL_RANK

State: ``{"step": s, "layers": {"l0": ..., "l<TENSORS-1>": ...}}``, SIZE_BYTES of float32 split
evenly over TENSORS tensors; element 1 of ``l<i>`` is ``1000 * rank + i`` and element 0 the step,
so a restore proves itself. Ranks join a gloo group (barriers, and DCP's collectives).

Attempt 0 (``TORCHELASTIC_RESTART_COUNT=0``): ROUNDS rounds; in each, every rank times, in an order
rotated by the round (a barrier before each call):

- ``fsm_save``: ``fsm_agent.checkpoint.save(state, step=round)`` (into the agent's /dev/shm slots);
- ``torch_save``: ``torch.save`` to ``FILES_DIR/torch-<rank>.pt``, then ``fsync`` of the file;
- ``dcp_save``: ``torch.distributed.checkpoint.save({"rank<r>": state}, checkpoint_id=FILES_DIR/dcp)``
  (collective, ``FileSystemWriter``: one file per rank, fsynced; the rank key keeps DCP from
  de-duplicating the ranks' same-named tensors, so each rank writes its whole state).

Then each rank records ``saved`` (its RSS before and after the state and after the saves, the slot
directory) and waits for ``OUT/go`` (the harness measures /dev/shm meanwhile); then rank KILL_RANK
SIGKILLs itself and the other blocks until the agent stops it.

Attempt 1: a preallocated state of the same shapes (zeros), then ROUNDS rounds of (round 0 in this
order, the first thing the restarted worker does being the agent's restore):

- ``fsm_load``: ``fsm_agent.checkpoint.load(into=prealloc)`` (checked: step, values, same tensors);
- ``torch_load``: ``torch.load`` of the last ``torch-<rank>.pt`` (page cache warm: written in
  attempt 0 and not evicted);
- ``torch_load_copy``: the same, then ``copy_`` into the preallocated tensors;
- ``torch_load_mmap_copy``: ``torch.load(mmap=True)`` then ``copy_`` into them;
- ``dcp_load``: ``torch.distributed.checkpoint.load`` into the preallocated state (in place).

Records: one JSON line per event, appended to ``OUT/records.jsonl`` (``O_APPEND``, one write).
"""

import time

T0 = time.time()

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402

OUT, SIZE, TENSORS, ROUNDS, FILES, KILL_RANK = (
    sys.argv[1],
    int(sys.argv[2]),
    int(sys.argv[3]),
    int(sys.argv[4]),
    sys.argv[5],
    int(sys.argv[6]),
)
RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def record(kind, **fields):
    line = json.dumps({"kind": kind, "rank": RANK, "attempt": ATTEMPT, "pid": os.getpid(), "t": time.time(), **fields})
    fd = os.open(os.path.join(OUT, "records.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def rss():
    """VmRSS, RssAnon, RssFile, RssShmem of this process, bytes."""
    found = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                found[name] = int(value.split()[0]) * 1024
    return found


record("started", t=T0, restore_env=os.environ.get("FSM_AGENT_CHECKPOINT_RESTORE"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from fsm_agent import checkpoint  # noqa: E402

NUMEL = SIZE // 4 // TENSORS
TORCH_PATH = os.path.join(FILES, f"torch-{RANK}.pt")
DCP_DIR = os.path.join(FILES, "dcp")
dist.init_process_group("gloo")
# dcp.save writes into the same directory every round, on purpose
warnings.filterwarnings("ignore", message="Detected an existing checkpoint")


def timed(method, phase, rnd, fn):
    dist.barrier()
    started = time.perf_counter()
    fn()
    seconds = time.perf_counter() - started
    record("time", phase=phase, method=method, round=rnd, seconds=seconds)


def rotated(names, rnd):
    k = rnd % len(names)
    return names[k:] + names[:k]


def attempt0():
    before = rss()
    state = {"step": 0, "layers": {}}
    for i in range(TENSORS):
        t = torch.full((NUMEL,), float(1000 * RANK + i), dtype=torch.float32)
        state["layers"][f"l{i}"] = t
    allocated = rss()

    def fsm_save(rnd):
        checkpoint.save(state, step=rnd)

    def torch_save(rnd):
        with open(TORCH_PATH, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    def dcp_save(rnd):
        dcp.save({f"rank{RANK}": state}, checkpoint_id=DCP_DIR)

    methods = {"fsm_save": fsm_save, "torch_save": torch_save, "dcp_save": dcp_save}
    for rnd in range(ROUNDS):
        state["step"] = rnd
        for t in state["layers"].values():
            t[0] = float(rnd)
        for name in rotated(list(methods), rnd):
            timed(name, "save", rnd, lambda name=name, rnd=rnd: methods[name](rnd))
    slots = os.environ.get("FSM_AGENT_CHECKPOINT_SLOTS", "")
    record("saved", step=ROUNDS - 1, slots_dir=os.path.dirname(slots), rss=[before, allocated, rss()])
    dist.barrier()
    go = os.path.join(OUT, "go")
    deadline = time.monotonic() + 600
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.05)
    if RANK == KILL_RANK:
        record("killing")
        os.kill(os.getpid(), signal.SIGKILL)
    while True:
        time.sleep(3600)


def check(state, step, same_as=None):
    """Raise unless ``state`` holds this rank's checkpoint of ``step`` (and, with ``same_as``, in
    those very tensor objects)."""
    if state["step"] != step:
        raise SystemExit(f"rank {RANK}: restored step {state['step']}, expected {step}")
    for i in range(TENSORS):
        t = state["layers"][f"l{i}"]
        if float(t[0]) != float(step) or float(t[1]) != float(1000 * RANK + i) or t.numel() != NUMEL:
            raise SystemExit(f"rank {RANK}: restored l{i} is wrong: {t[:2].tolist()}")
        if same_as is not None and t is not same_as["layers"][f"l{i}"]:
            raise SystemExit(f"rank {RANK}: load(into=...) did not restore into the preallocated l{i}")


def attempt1():
    before = rss()
    prealloc = {"step": -1, "layers": {f"l{i}": torch.zeros(NUMEL, dtype=torch.float32) for i in range(TENSORS)}}
    allocated = rss()
    expected = ROUNDS - 1
    restored = {}

    def fsm_load():
        restored["r"] = checkpoint.load(into=prealloc)

    def copy_into(loaded):
        for key, t in prealloc["layers"].items():
            t.copy_(loaded["layers"][key])
        prealloc["step"] = loaded["step"]

    def torch_load():
        restored["r"] = torch.load(TORCH_PATH, weights_only=True)

    def torch_load_copy():
        copy_into(torch.load(TORCH_PATH, weights_only=True))

    def torch_load_mmap_copy():
        copy_into(torch.load(TORCH_PATH, weights_only=True, mmap=True))

    def dcp_load():
        wrapped = {f"rank{RANK}": prealloc}
        dcp.load(wrapped, checkpoint_id=DCP_DIR)
        prealloc["step"] = wrapped[f"rank{RANK}"]["step"]

    methods = {
        "fsm_load": fsm_load,
        "torch_load": torch_load,
        "torch_load_copy": torch_load_copy,
        "torch_load_mmap_copy": torch_load_mmap_copy,
        "dcp_load": dcp_load,
    }
    for rnd in range(ROUNDS):
        for name in rotated(list(methods), rnd):
            for t in prealloc["layers"].values():
                t[:2] = -1.0
            prealloc["step"] = -1
            timed(name, "load", rnd, methods[name])
            if name == "fsm_load":
                got = restored.pop("r")
                if got is None:
                    raise SystemExit(
                        f"rank {RANK}: load() returned None (restore env {os.environ.get(checkpoint.RESTORE_ENV)!r})"
                    )
                if got.step != expected:
                    raise SystemExit(f"rank {RANK}: load() gave step {got.step}, expected {expected}")
                check(got.state_dict, expected, same_as=prealloc)
                record("restored", source=got.source, step=got.step, round=rnd)
            elif name == "torch_load":
                check(restored.pop("r"), expected)
            else:
                check(prealloc, expected)
    record("done", rss=[before, allocated, rss()])
    dist.destroy_process_group()


if ATTEMPT == 0:
    attempt0()
else:
    attempt1()
