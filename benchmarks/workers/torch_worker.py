"""A worker that imports torch and joins a gloo process group (the cost a real job pays).

    torch_worker.py allreduce              started, import torch, init gloo, one all_reduce
                                           ("allreduce_done"), destroy, returning
    torch_worker.py crash RANK DELAY       as allreduce; then in attempt 0, RANK sleeps DELAY s,
                                           records "crash" and exits 1 while the others block;
                                           later attempts finish normally
    torch_worker.py crashes N RANK DELAY   as crash, in every attempt before attempt N (N restarts in
                                           one run); attempt N finishes normally
    torch_worker.py loop INITIAL_WORLD     as allreduce; then while WORLD_SIZE >= INITIAL_WORLD,
                                           all_reduce every 50 ms until a collective fails
                                           ("collective_failed", exit 1); once the world has
                                           shrunk (a node was lost) finish normally
    torch_worker.py spare FILE             as loop, but the world keeps its size (a hot spare takes
                                           the lost node's seat): loop while FILE does not exist (the
                                           harness makes it just before it kills a node); once it
                                           does, finish normally

Events go to $FSMBENCH_EVENTS (see _emit.py).
"""

import time

T0 = time.time()

import os  # noqa: E402
import sys  # noqa: E402

from _emit import ATTEMPT, RANK, WORLD_SIZE, emit, sleep_forever  # noqa: E402

emit("started", T0)
mode = sys.argv[1] if len(sys.argv) > 1 else "allreduce"

from datetime import timedelta  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

emit("imported")
dist.init_process_group("gloo", timeout=timedelta(seconds=float(os.environ.get("FSMBENCH_PG_TIMEOUT", "60"))))
value = torch.ones(1)
dist.all_reduce(value)
if int(value.item()) != dist.get_world_size():
    sys.exit(f"all_reduce gave {value.item()}, expected {dist.get_world_size()}")
emit("allreduce_done")

if mode == "crashes":  # crashes N RANK DELAY: the crash of mode crash, in attempts 0 .. N-1
    mode, last_crash, crash_args = "crash", int(sys.argv[2]) - 1, sys.argv[3:]
else:
    last_crash, crash_args = 0, sys.argv[2:]
if mode == "crash" and last_crash >= ATTEMPT:
    if int(crash_args[0]) == RANK:
        time.sleep(float(crash_args[1]))
        emit("crash")
        os._exit(1)
    sleep_forever()
elif (mode == "loop" and int(sys.argv[2]) <= WORLD_SIZE) or (mode == "spare" and not os.path.exists(sys.argv[2])):
    while True:
        try:
            dist.all_reduce(value)
        except Exception as exc:  # a peer died: gloo reports the closed connection
            emit("collective_failed")
            print(f"rank {RANK}: collective failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            os._exit(1)
        time.sleep(0.05)
elif mode not in ("allreduce", "crash", "loop", "spare"):
    sys.exit(f"torch_worker.py: unknown mode {mode!r}")

dist.destroy_process_group()
emit("returning")
