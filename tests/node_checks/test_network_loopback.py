"""The network check between 4 real processes on 127.0.0.1 through a real TCPStore: a healthy round
blames nobody; a node that never shows up is blamed by group rank 0 within the deadline, and no
process waits past it."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DRIVER = Path(__file__).with_name("network_driver.py")
REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 15.0  # the round's --node-check-timeout


@pytest.fixture
def store():
    master = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30)
    )
    yield master


def run_nodes(store, ranks, world, runs=1):
    """Start one driver per rank, wait for all; their JSON lines by rank."""
    procs = {}
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    try:
        for rank in ranks:
            argv = [sys.executable, str(DRIVER), "--store", f"127.0.0.1:{store.port}", "--rank", str(rank)]
            argv += ["--world", str(world), "--addr", "127.0.0.1", "--expect", str(len(ranks)), "--runs", str(runs)]
            argv += ["--timeout", str(TIMEOUT_S)]
            procs[rank] = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
            )
        out = {}
        for rank, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=60 + runs * TIMEOUT_S)
            assert proc.returncode == 0, f"driver {rank} exited {proc.returncode}:\n{stderr[-3000:]}"
            out[rank] = [json.loads(line) for line in stdout.splitlines()]
        return out
    finally:
        for proc in procs.values():  # each driver leads its own process group
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


def test_four_healthy_nodes_blame_nobody(store):
    out = run_nodes(store, [0, 1, 2, 3], 4, runs=3)
    for run in range(3):
        records = {rank: lines[run] for rank, lines in out.items()}
        for rank, record in records.items():
            result = record["result"]
            assert result["ok"] and result["blamed"] == {}, (rank, result)
            assert result["measurements"]["up_mbps"] > 0 and result["measurements"]["rounds"] == 1
            assert result["measurements"]["store_requests"] <= (7 if rank == 0 else 6)
        print(f"run {run}: 4 healthy nodes on loopback, check {max(r['seconds'] for r in records.values()):.2f} s")
    assert max(lines[run]["seconds"] for lines in out.values() for run in range(3)) < 3.0


@pytest.mark.parametrize("absent", [1, 2])
def test_a_node_that_never_shows_up_is_blamed_within_the_deadline(store, absent):
    started = time.monotonic()
    out = run_nodes(store, [r for r in range(4) if r != absent], 4)
    took = time.monotonic() - started
    decider = out[0][0]["result"]
    assert decider["ok"] and list(decider["blamed"]) == [str(absent)], decider
    assert "no network result" in decider["blamed"][str(absent)]
    assert all(lines[0]["seconds"] < TIMEOUT_S for lines in out.values())
    # The absent node's predecessor could not measure, but it is not excluded for that.
    assert all(lines[0]["result"]["ok"] for lines in out.values())
    print(f"absent node {absent}: blamed by group rank 0 after {out[0][0]['seconds']:.2f} s (all drivers {took:.1f} s)")
