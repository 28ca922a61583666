"""What the in-process restart tests share: the agents' flags, the worker's files, the fault-free result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil

from fsm_agent.testing.processes import wait_until
from tests.inprocess.workers.inprocess_worker import reference_params

WORKER = str(Path(__file__).resolve().parent / "workers" / "inprocess_worker.py")
STEPS = 40


def run_flags(tmp_path: Path, name: str = "agent", *extra: str) -> list[str]:
    return [
        "--events-file",
        str(tmp_path / f"events_{name}.jsonl"),
        "--monitor-interval",
        "0.1",
        "--restart-mode",
        "inprocess",
        *extra,
    ]


def single_node(tmp_path: Path, *extra: str, nproc: int = 3) -> list[str]:
    return [*run_flags(tmp_path, "agent", *extra), "--standalone", "--nproc-per-node", str(nproc)]


def worker_args(out: Path, *fault: str, steps: int = STEPS) -> list[str]:
    out.mkdir(exist_ok=True)
    return [WORKER, str(out), str(steps), *fault]


def steps_by_pid(out: Path, rank: int) -> dict[int, list[int]]:
    """{pid: the steps it completed, in order} of one rank."""
    path = out / f"steps-rank{rank}.txt"
    by_pid: dict[int, list[int]] = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        pid, step = map(int, line.split())
        by_pid.setdefault(pid, []).append(step)
    return by_pid


def results(out: Path) -> dict[int, dict]:
    """{rank: its last process's result}."""
    found = {}
    for path in sorted(out.glob("result-rank*-*.json"), key=os.path.getmtime):
        found[int(path.name.split("-")[1][4:])] = json.loads(path.read_text())
    return found


def assert_fault_free_result(out: Path, world_size: int, steps: int = STEPS) -> None:
    final = results(out)
    assert sorted(final) == list(range(world_size)), final
    expected = reference_params(world_size, steps)
    assert all(r["params"] == expected and r["step"] == steps for r in final.values()), (final, expected)


def assert_replays_identically(events: Path) -> None:
    """``fsm-agent replay`` takes the recorded run through the same rows (in process or not)."""
    command = [sys.executable, "-m", "fsm_agent", "replay", str(events)]
    replayed = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert replayed.returncode == 0 and "identical trace" in replayed.stdout, replayed.stdout + replayed.stderr


def worker_pid(out: Path, rank: int, at_least_step: int, timeout: float = 90) -> int:
    """The pid of ``rank``'s process once it completed ``at_least_step``."""
    reached = wait_until(lambda: any(max(s) >= at_least_step for s in steps_by_pid(out, rank).values()), timeout)
    assert reached, f"rank {rank} did not reach step {at_least_step} in {timeout} s"
    return next(pid for pid, s in steps_by_pid(out, rank).items() if max(s) >= at_least_step)


def live_pid(out: Path, rank: int) -> int | None:
    """The newest process of ``rank`` (from its completed steps), if it is alive, else None."""
    pids = list(steps_by_pid(out, rank))
    try:
        return pids[-1] if pids and psutil.Process(pids[-1]).status() != psutil.STATUS_ZOMBIE else None
    except psutil.NoSuchProcess:
        return None
