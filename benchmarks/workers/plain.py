"""A worker that imports nothing heavy: measures the launcher, not the job.

    plain.py exit                      started, returning, exit 0
    plain.py sleep SECONDS             started, sleep, returning, exit 0
    plain.py crash RANK DELAY          attempt 0: RANK sleeps DELAY s, records "crash", exits 1;
                                       the other ranks block; later attempts: started, returning
    plain.py hang RANK DELAY           attempt 0: every rank calls fsm_agent.heartbeat() every
                                       50 ms; after DELAY s RANK records "hang" and stops
                                       (blocks without heartbeats); later attempts: exit 0
    plain.py idle WORLD FILE           in a world smaller than WORLD once FILE exists (the harness
                                       makes it just before it kills a node): started, returning;
                                       otherwise started, then block until stopped

Events go to $FSMBENCH_EVENTS (see _emit.py).
"""

import time

T0 = time.time()  # the first thing the script does: "running user code"

import os  # noqa: E402
import sys  # noqa: E402

from _emit import ATTEMPT, RANK, WORLD_SIZE, emit, sleep_forever  # noqa: E402

emit("started", T0)
mode = sys.argv[1] if len(sys.argv) > 1 else "exit"

if mode == "sleep":
    time.sleep(float(sys.argv[2]))
elif mode == "crash" and ATTEMPT == 0:
    if int(sys.argv[2]) == RANK:
        time.sleep(float(sys.argv[3]))
        emit("crash")
        os._exit(1)
    sleep_forever()
elif mode == "hang" and ATTEMPT == 0:
    from fsm_agent import heartbeat  # a no-op outside fsm-agent --hang-timeout

    hang_rank, deadline = int(sys.argv[2]), time.time() + float(sys.argv[3])
    while True:
        heartbeat(min_interval=0.0)
        if hang_rank == RANK and time.time() >= deadline:
            emit("hang")
            sleep_forever()
        time.sleep(0.05)
elif mode == "idle" and (int(sys.argv[2]) <= WORLD_SIZE or not os.path.exists(sys.argv[3])):
    sleep_forever()
elif mode not in ("exit", "crash", "hang", "idle"):
    sys.exit(f"plain.py: unknown mode {mode!r}")

emit("returning")
