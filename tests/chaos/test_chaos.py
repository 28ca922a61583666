"""Seeded chaos: random faults against real agents and workers, with invariants checked per trial.

CI runs a few trials; run more with ``CHAOS_TRIALS=100 CHAOS_SEED=7 python -m pytest tests/chaos -q``.
Each trial starts ``fsm-agent run --standalone --nproc-per-node 2 --max-restarts 1 --hang-timeout 1``
on a worker that heartbeats for about 1.5 s, applies one fault drawn from the seed, and checks:
zero processes of the job survive, the exit code and the verdict fit the fault, and every
worker's logs are kept.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow

TRIALS = int(os.environ.get("CHAOS_TRIALS", "6"))
SEED = int(os.environ.get("CHAOS_SEED", "20261130"))
FAULTS = ("worker_crash", "worker_sigkill", "worker_hang", "agent_sigterm", "agent_sigkill")

WORKER = textwrap.dedent("""
    import os, sys, time
    import fsm_agent
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank = int(os.environ["RANK"])
    open(os.path.join(os.environ["CHAOS_DIR"], f"pid_{attempt}_{rank}_{os.getpid()}"), "w").close()
    fault, fault_rank, delay = os.environ.get("CHAOS_FAULT", "none:0:0").split(":")
    print(f"worker {rank} attempt {attempt} running", flush=True)
    start = time.monotonic()
    while time.monotonic() - start < 1.5:
        fsm_agent.heartbeat(0.05)
        if attempt == 0 and rank == int(fault_rank) and time.monotonic() - start > float(delay):
            if fault == "worker_crash":
                print("crashing on purpose", file=sys.stderr, flush=True)
                sys.exit(3)
            if fault == "worker_hang":
                time.sleep(600)
        time.sleep(0.02)
    print(f"worker {rank} done", flush=True)
""")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _job_pids(chaos_dir: Path) -> list[int]:
    return [int(p.name.rsplit("_", 1)[1]) for p in chaos_dir.glob("pid_*")]


def _wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def run_trial(tmp: Path, rng: random.Random) -> dict:
    fault = rng.choice(FAULTS)
    rank, delay = rng.randrange(2), round(rng.uniform(0.2, 0.8), 2)
    chaos_dir, log_dir = tmp / "chaos", tmp / "logs"
    chaos_dir.mkdir(parents=True)
    script = tmp / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "CHAOS_DIR": str(chaos_dir), "CHAOS_FAULT": f"{fault}:{rank}:{delay}"}
    agent = subprocess.Popen(
        [sys.executable, "-m", "fsm_agent", "run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
         "--hang-timeout", "1", "--monitor-interval", "0.1", "--shutdown-timeout", "2", "--log-dir", str(log_dir),
         "-r", "3", "--events-file", str(tmp / "events.jsonl"), str(script)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        if fault.startswith("agent_") or fault == "worker_sigkill":
            assert _wait_for(lambda: len(list(chaos_dir.glob("pid_0_*"))) == 2, 60), "workers never started"
            time.sleep(delay)
            if fault == "worker_sigkill":
                victim = next(p for p in chaos_dir.glob(f"pid_0_{rank}_*"))
                os.kill(int(victim.name.rsplit("_", 1)[1]), signal.SIGKILL)
            else:
                agent.send_signal(signal.SIGTERM if fault == "agent_sigterm" else signal.SIGKILL)
        out, err = agent.communicate(timeout=120)
    finally:
        try:
            os.killpg(agent.pid, signal.SIGKILL)  # the harness's own cleanup: the agent's process group
        except ProcessLookupError:
            pass
    pids = _job_pids(chaos_dir)
    survivors_gone = _wait_for(lambda: not any(_alive(p) for p in pids), 5)
    leftover = [p for p in pids if _alive(p)]
    for pid in leftover:  # never leave them behind, even when the invariant failed
        os.kill(pid, signal.SIGKILL)
    events = [json.loads(x) for x in (tmp / "events.jsonl").read_text().splitlines()] \
        if (tmp / "events.jsonl").exists() else []
    return {"fault": fault, "rank": rank, "delay": delay, "rc": agent.returncode, "stderr": err, "stdout": out,
            "survivors_gone": survivors_gone, "leftover": leftover, "events": events, "log_dir": log_dir,
            "triggers": [e["trigger"] for e in events if e["kind"] == "transition"]}


def check_invariants(t: dict) -> list[str]:
    problems = []
    if not t["survivors_gone"]:
        problems.append(f"processes survived: {t['leftover']}")
    fault, rc, triggers = t["fault"], t["rc"], t["triggers"]
    if fault in ("worker_crash", "worker_sigkill", "worker_hang"):
        if rc != 0:
            problems.append(f"expected a restart and exit 0, got {rc}")
        expected = ["start", "workers_hung", "workers_failed", "restart", "workers_succeeded"] if fault == "worker_hang" \
            else ["start", "workers_failed", "restart", "workers_succeeded"]
        if triggers != expected:
            problems.append(f"trace {triggers} != {expected}")
    elif fault == "agent_sigterm":
        if rc != 128 + signal.SIGTERM:
            problems.append(f"expected exit 143, got {rc}")
        if "Root Cause" not in t["stderr"] or "signal 15" not in t["stderr"]:
            problems.append("no verdict naming the signal")
        if triggers[-1:] != ["stop_requested"]:
            problems.append(f"trace {triggers} does not end in stop_requested")
    elif fault == "agent_sigkill" and rc != -signal.SIGKILL:
        problems.append(f"expected the agent killed by SIGKILL, got {rc}")
    attempts = list(t["log_dir"].glob("*/attempt_0/*/stdout.log"))
    if len(attempts) != 2 or not all(p.read_text() for p in attempts):
        problems.append(f"worker logs of attempt 0 missing or empty: {attempts}")
    return problems


def test_chaos(tmp_path):
    rng = random.Random(SEED)
    report = []
    for trial in range(TRIALS):
        result = run_trial(tmp_path / f"trial_{trial}", rng)
        problems = check_invariants(result)
        report.append((trial, result["fault"], result["rc"], problems))
        assert not problems, f"trial {trial} ({result['fault']} rank {result['rank']} after {result['delay']}s): " \
                             f"{problems}\n{result['stderr'][-3000:]}"
    held = sum(1 for *_, p in report if not p)
    print(f"\nchaos: seed={SEED} trials={TRIALS} invariants held in {held}/{TRIALS}: "
          + ", ".join(f"{f}->{rc}" for _, f, rc, _ in report))
