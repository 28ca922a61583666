"""The training loop of ``benchmarks/goodput.py``: gloo all_reduce every step, a fixed compute time,
STATE_MIB of float32 state per rank, a checkpoint every K steps, restore on (re)start.

    goodput_worker.py OUT CKPT STATE_MIB COMPUTE_S K MAX_STEPS PG_TIMEOUT_S [inprocess]

CKPT: ``disk`` (``torch.save`` + fsync of ``$GOODPUT_CKPT_DIR/step-<s>/rank-<r>.pt``, a barrier,
then rank 0 commits ``LATEST``; a restore loads ``LATEST``'s file into the preallocated state) or
``memory`` (``fsm_agent.checkpoint.save``/``load``; every ``GOODPUT_PERSIST_EVERY``-th save is
also persisted to the agent's ``--checkpoint-dir``).

``inprocess`` (fsm-agent ``--restart-mode inprocess``): the loop runs through
``fsm_agent.inprocess.run``. The state lives in the process (a survivor of a peer's fault keeps it
and its step); generation 0 of an attempt restores from the agent's checkpoint, a later generation
from the most advanced survivor: an ``all_gather`` of the ranks' last completed steps (a replaced
rank says -1), then the lowest rank holding the highest step sends its state and step to every rank
behind it (the replaced ones; a survivor interrupted between its all_reduce and its update), point
to point, into fresh tensors swapped in inside ``uninterrupted()``. Every layer starts with the same
values on every rank (data parallel: the replicas are equal). A step's update and its log line, and
a checkpoint, are ``uninterrupted()``: a survivor never logs a step twice.

The compute of a step is ``time.sleep(COMPUTE_S)``: the host waiting for an accelerator (8 ranks
share 2 cores here; a busy loop would measure the CPU's contention, not the launcher).

Faults the benchmark injects from outside: SIGUSR1 raises an exception at the next step boundary,
SIGUSR2 hangs the worker there (it stops stepping and heartbeating, and sleeps forever); SIGKILL.

Records (appended with one ``write`` each): ``OUT/steps.<rank>.log`` has one line per completed
step, ``step wall_time pid``; ``OUT/events.log`` one JSON line per start, restore and checkpoint.
"""

import time

T0 = time.time()

import contextlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from datetime import timedelta  # noqa: E402

OUT, CKPT = sys.argv[1], sys.argv[2]
STATE_MIB, COMPUTE_S, K, MAX_STEPS, PG_TIMEOUT = (
    int(sys.argv[3]),
    float(sys.argv[4]),
    int(sys.argv[5]),
    int(sys.argv[6]),
    float(sys.argv[7]),
)
INPROCESS = len(sys.argv) > 8 and sys.argv[8] == "inprocess"
RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
SLOT = os.environ.get("JOB_SLOT", "?")
CKPT_DIR = os.environ.get("GOODPUT_CKPT_DIR", "")
PERSIST_EVERY = int(os.environ.get("GOODPUT_PERSIST_EVERY", "0"))


def append(path, line):
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def event(kind, **fields):
    fields = {
        "kind": kind,
        "rank": RANK,
        "pid": os.getpid(),
        "slot": SLOT,
        "attempt": ATTEMPT,
        "t": time.time(),
        **fields,
    }
    append(os.path.join(OUT, "events.log"), json.dumps(fields))


event("start", t=T0, world=WORLD)
_fault = []
signal.signal(signal.SIGUSR1, lambda *_: _fault.append("exception"))
signal.signal(signal.SIGUSR2, lambda *_: _fault.append("hang"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

try:
    import fsm_agent
    from fsm_agent import checkpoint as fsm_checkpoint
except ImportError:  # torchrun without fsm-agent installed
    fsm_agent = fsm_checkpoint = None

torch.set_num_threads(1)
if not INPROCESS:
    dist.init_process_group("gloo", timeout=timedelta(seconds=PG_TIMEOUT))
TENSORS = 4
numel = STATE_MIB * (1 << 20) // 4 // TENSORS
state = {
    "layers": {f"l{i}": torch.full((numel,), float((0 if INPROCESS else RANK) * 10 + i)) for i in range(TENSORS)},
    "step": -1,
}
grad = torch.ones(64 * 1024)  # 256 KiB all_reduced every step
if INPROCESS:
    from fsm_agent import inprocess

    guarded = inprocess.uninterrupted
else:
    guarded = contextlib.nullcontext


def restore():
    """The step to resume after (-1: none) and where it came from."""
    if CKPT == "memory":
        restored = fsm_checkpoint.load(into=state)
        if restored is None:
            return -1, "none"
        return int(restored.step), restored.source
    try:
        with open(os.path.join(CKPT_DIR, "LATEST")) as f:
            step = int(f.read().strip())
    except (OSError, ValueError):
        return -1, "none"
    loaded = torch.load(os.path.join(CKPT_DIR, f"step-{step}", f"rank-{RANK}-of-{WORLD}.pt"), mmap=True)
    for name, tensor in state["layers"].items():
        tensor.copy_(loaded["layers"][name])
    return step, "disk"


def save(step):
    state["step"] = step
    if CKPT == "memory":
        persist = PERSIST_EVERY > 0 and (step // K) % PERSIST_EVERY == 0
        fsm_checkpoint.save(state, step=step, persist=persist)
        return
    folder = os.path.join(CKPT_DIR, f"step-{step}")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"rank-{RANK}-of-{WORLD}.pt")
    with open(path + ".tmp", "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(path + ".tmp", path)
    dist.barrier()  # every rank's file is complete: commit the step
    if RANK == 0:
        try:
            with open(os.path.join(CKPT_DIR, "LATEST")) as f:
                previous = int(f.read().strip())
        except (OSError, ValueError):
            previous = None
        with open(os.path.join(CKPT_DIR, "LATEST.tmp"), "w") as f:
            f.write(str(step))
            f.flush()
            os.fsync(f.fileno())
        os.rename(os.path.join(CKPT_DIR, "LATEST.tmp"), os.path.join(CKPT_DIR, "LATEST"))
        for name in os.listdir(CKPT_DIR):  # keep the committed step and the one before it
            if name.startswith("step-") and int(name[5:]) not in (step, previous):
                import shutil

                shutil.rmtree(os.path.join(CKPT_DIR, name), ignore_errors=True)


def restore_from_peer(replaced):
    """Every rank behind the most advanced survivor takes its state (module docstring); returns
    the source rank, or None when no rank was behind."""
    mine = torch.tensor([-1 if RANK in replaced else state["step"]], dtype=torch.int64)
    steps = [torch.zeros(1, dtype=torch.int64) for _ in range(WORLD)]
    dist.all_gather(steps, mine)
    steps = [int(t) for t in steps]
    best = max(steps)
    behind = [r for r in range(WORLD) if steps[r] < best]
    if not behind:
        return None
    source = steps.index(best)
    if source == RANK:
        for r in behind:
            for tensor in state["layers"].values():
                dist.send(tensor, r)
    elif RANK in behind:
        fresh = {name: torch.empty_like(t) for name, t in state["layers"].items()}
        for tensor in fresh.values():
            dist.recv(tensor, source)
        with guarded():
            state["layers"], state["step"] = fresh, best
    return source


def run_steps(first):
    steps_log = os.path.join(OUT, f"steps.{RANK}.log")
    for step in range(first, MAX_STEPS):
        if _fault:
            if _fault[0] == "exception":
                raise RuntimeError(f"goodput benchmark: injected exception at step {step}")
            event("hang", step=step)
            while True:
                time.sleep(3600)
        time.sleep(COMPUTE_S)
        dist.all_reduce(grad)
        with guarded():  # in-process: the step and its record, all or nothing
            state["step"] = step
            if fsm_agent is not None:
                fsm_agent.heartbeat(step=step)
            append(steps_log, f"{step} {time.time():.4f} {os.getpid()}")
        if step % K == K - 1:
            t = time.time()
            with guarded():  # in-process: an interrupted save would leave a half-written slot
                save(step)
            event("checkpoint", step=step, seconds=time.time() - t)


def train():
    """One generation (in-process) or the whole run: restore, then step."""
    gen = inprocess.context() if INPROCESS else None
    t = time.time()
    if gen is None or gen.generation == 0:
        last, source = restore()
        with guarded():
            state["step"] = last
        event("restored", step=last, source=source, seconds=time.time() - t, ready_s=time.time() - T0)
    else:
        peer = restore_from_peer(gen.replaced)
        event(
            "restored",
            step=state["step"],
            source="none" if peer is None else f"peer {peer}",
            seconds=time.time() - t,
            ready_s=time.time() - T0,
            generation=gen.generation,
            replaced=list(gen.replaced),
        )
        if fsm_agent is not None:  # progress: the recovery is done (the hang clock)
            fsm_agent.heartbeat(min_interval=0)
    run_steps(state["step"] + 1)


if INPROCESS:
    inprocess.run(train, backend="gloo", pg_timeout_s=PG_TIMEOUT)
else:
    train()
    dist.destroy_process_group()
