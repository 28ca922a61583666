"""Seeded random faults against in-process restart: 2 real agents x 2 gloo workers on loopback
(preload launcher), a worker SIGKILLed every few tenths of a second, many of them while a recovery
runs (a second fault then restarts the whole group). Checked on every run:

* the job ends 0 with every rank's parameters equal to a fault-free run's (no rank lost, no step
  applied twice or skipped: the arithmetic is exact);
* never two generations running: every generation that ran ``train_fn`` in an attempt was entered
  by at most one process of each rank, and by every rank (the barrier admits a whole world or
  nobody) unless a fault cut it short after the barrier, before every rank had written its
  record (then a kill landed at that time and a later generation followed);
* the agents' events agree: each in-process recovery's outcome is recorded, and every recovery
  that did not complete ended in a whole-group restart.

``INPROCESS_CHAOS_SEED=S INPROCESS_CHAOS_TRIALS=N python -m pytest tests/inprocess/test_inprocess_chaos.py``
runs more.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections import Counter

import pytest

from tests.conftest import free_port
from tests.helpers.events import read_events, transitions
from tests.inprocess.conftest import assert_fault_free_result, live_pid, run_flags, worker_args

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

SEED = int(os.environ.get("INPROCESS_CHAOS_SEED", "20261207"))
TRIALS = int(os.environ.get("INPROCESS_CHAOS_TRIALS", "2"))
WORLD, STEPS, FAULTS = 4, 300, 6


def generations(out) -> list[dict]:
    records = []
    for rank in range(WORLD):
        path = out / f"generations-rank{rank}.jsonl"
        records += [{**json.loads(line), "rank": rank} for line in path.read_text().splitlines()]
    return records


@pytest.mark.parametrize("trial", range(TRIALS))
def test_random_faults_during_recovery_keep_one_generation_and_the_fault_free_result(agents, tmp_path, trial):
    rng = random.Random(SEED + trial)
    out, port = tmp_path / "out", free_port()
    rendezvous = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "fsm", "--rdzv-id", f"chaos-{trial}"]
    rendezvous += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--launcher", "preload", "--max-restarts", "20"]
    rendezvous += ["--inprocess-timeout", "5", "--shutdown-timeout", "2"]
    procs = {
        name: agents.start(*run_flags(tmp_path, name), *rendezvous, *worker_args(out, steps=STEPS))
        for name in ("a", "b")
    }
    injected = []
    deadline = time.monotonic() + 120
    while len(injected) < FAULTS and time.monotonic() < deadline and all(p.poll() is None for p in procs.values()):
        time.sleep(rng.uniform(0.1, 1.2))  # short gaps land faults during recoveries
        rank = rng.randrange(WORLD)
        if (pid := live_pid(out, rank)) is not None:
            os.kill(pid, signal.SIGKILL)
            injected.append((rank, pid, time.time()))
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, (name, injected, err[-3000:])
    assert len(injected) >= FAULTS // 2, f"too few faults landed before the job ended: {injected}"
    assert_fault_free_result(out, WORLD, steps=STEPS)
    records = generations(out)
    entered = Counter((r["attempt"], r["generation"], r["rank"]) for r in records)
    assert max(entered.values()) == 1, [key for key, n in entered.items() if n > 1]  # one process per rank
    runs = sorted({(a, g) for a, g, _ in entered})
    for attempt, generation in runs:
        ranks = sorted(r for a, g, r in entered if (a, g) == (attempt, generation))
        if ranks == list(range(WORLD)):
            continue  # a whole world or nobody: the barrier admitted every rank
        # Or a fault ended the generation after the barrier admitted every rank and before all of
        # them had written their record: a kill lands then, and a later generation follows.
        began = min(r["entered_at"] for r in records if (r["attempt"], r["generation"]) == (attempt, generation))
        assert (attempt, generation) != runs[-1], (attempt, generation, ranks)
        assert any(at >= began - 1.0 for *_, at in injected), (attempt, generation, ranks, injected)
    for name in procs:
        events = read_events(tmp_path / f"events_{name}.jsonl")
        trace = transitions(tmp_path / f"events_{name}.jsonl")
        begun = [e for e in events if e["kind"] == "inprocess_recovery_begun"]
        ended = [e for e in events if e["kind"] == "inprocess_recovery"]
        # Each recovery begun ends recorded, or a fault during it restarted the group first.
        restarts = sum(1 for t in trace if t[1] == "STOPPED")
        assert len(ended) <= len(begun) <= len(ended) + restarts, (name, begun, ended, trace)
        assert all(e["outcome"] in ("recovered", "failed") for e in ended)
