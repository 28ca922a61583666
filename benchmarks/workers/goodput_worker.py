"""The training loop of ``benchmarks/goodput.py``: gloo all_reduce every step, a fixed compute time,
STATE_MIB of float32 state per rank, a checkpoint every K steps, restore on (re)start.

    goodput_worker.py OUT CKPT STATE_MIB COMPUTE_S K MAX_STEPS PG_TIMEOUT_S

CKPT: ``disk`` (``torch.save`` + fsync of ``$GOODPUT_CKPT_DIR/step-<s>/rank-<r>.pt``, a barrier,
then rank 0 commits ``LATEST``; a restore loads ``LATEST``'s file into the preallocated state) or
``memory`` (``fsm_agent.checkpoint.save``/``load``; every ``GOODPUT_PERSIST_EVERY``-th save is
also persisted to the agent's ``--checkpoint-dir``).

The compute of a step is ``time.sleep(COMPUTE_S)``: the host waiting for an accelerator (8 ranks
share 2 cores here; a busy loop would measure the CPU's contention, not the launcher).

Faults the benchmark injects from outside: SIGUSR1 raises an exception at the next step boundary,
SIGUSR2 hangs the worker there (it stops stepping and heartbeating, and sleeps forever); SIGKILL.

Records (appended with one ``write`` each): ``OUT/steps.<rank>.log`` has one line per completed
step, ``step wall_time pid``; ``OUT/events.log`` one JSON line per start, restore and checkpoint.
"""

import time

T0 = time.time()

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
dist.init_process_group("gloo", timeout=timedelta(seconds=PG_TIMEOUT))
TENSORS = 4
numel = STATE_MIB * (1 << 20) // 4 // TENSORS
state = {"layers": {f"l{i}": torch.full((numel,), float(RANK * 10 + i)) for i in range(TENSORS)}, "step": -1}
grad = torch.ones(64 * 1024)  # 256 KiB all_reduced every step


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


t = time.time()
last, source = restore()
event("restored", step=last, source=source, seconds=time.time() - t, ready_s=time.time() - T0)
steps_log = os.path.join(OUT, f"steps.{RANK}.log")
for step in range(last + 1, MAX_STEPS):
    if _fault:
        if _fault[0] == "exception":
            raise RuntimeError(f"goodput benchmark: injected exception at step {step}")
        event("hang", step=step)
        while True:
            time.sleep(3600)
    time.sleep(COMPUTE_S)
    dist.all_reduce(grad)
    if fsm_agent is not None:
        fsm_agent.heartbeat(step=step)
    append(steps_log, f"{step} {time.time():.4f} {os.getpid()}")
    if step % K == K - 1:
        t = time.time()
        save(step)
        event("checkpoint", step=step, seconds=time.time() - t)
dist.destroy_process_group()
