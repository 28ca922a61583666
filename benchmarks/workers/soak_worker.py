"""The soak's worker (``benchmarks/soak.py``): no torch and no collectives, so that 64 agents'
workers fit on 2 cores and the soak measures the agents: a step every STEP_S seconds, a heartbeat
after each (``--hang-timeout`` finds a hung one).

    soak_worker.py OUT STEP_S

Records, one JSON line each appended to ``OUT/events.log``: ``start`` (t, rank, pid, slot, restart)
as the first thing, ``first_step`` (t, rank, pid) once its first step is done. Faults the harness
injects: SIGUSR1 raises at the next step boundary; SIGUSR2 hangs the worker (no more steps, no
heartbeats); SIGKILL. The job ends when ``OUT/done`` exists: every worker returns 0.
"""

import time

T0 = time.time()

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402

from fsm_agent import heartbeat  # noqa: E402

OUT, STEP_S = sys.argv[1], float(sys.argv[2])
RANK = int(os.environ["RANK"])
_raise_next = False
_hang = False


def emit(kind: str, t: float, **fields) -> None:
    line = json.dumps({"kind": kind, "t": t, "rank": RANK, "pid": os.getpid(), **fields}) + "\n"
    fd = os.open(os.path.join(OUT, "events.log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())  # one write of a short line: appends from many workers do not interleave
    finally:
        os.close(fd)


def on_usr1(signum, frame):
    global _raise_next
    _raise_next = True


def on_usr2(signum, frame):
    global _hang
    _hang = True


signal.signal(signal.SIGUSR1, on_usr1)
signal.signal(signal.SIGUSR2, on_usr2)
emit("start", T0, slot=os.environ.get("JOB_SLOT", "?"), restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
done = os.path.join(OUT, "done")
step = 0
while not os.path.exists(done):
    time.sleep(STEP_S)
    while _hang:
        time.sleep(3600)
    if _raise_next:
        raise RuntimeError(f"injected fault: rank {RANK} raises at step {step}")
    step += 1
    heartbeat(step=step)
    if step == 1:
        emit("first_step", time.time())
