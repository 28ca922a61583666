"""fsm_agent.inprocess's worker API: real gloo workers survive a peer's fault in their own processes.

The test plays the agent with the protocol's keys (``fsm_agent.inprocess.protocol``): it hosts the
TCPStore on 127.0.0.1, starts three workers (``workers/inprocess_worker.py``: a tiny model whose
every value is exact), and, when one exits, begins the next generation and starts a new process
for that rank alone. Every process is killed by pid at teardown; everything lies in ``tmp_path``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from fsm_agent.inprocess import protocol
from fsm_agent.testing.conformance import free_port
from tests.helpers.processes import checkout_env
from tests.inprocess.workers.inprocess_worker import reference_params

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

WORKER = Path(__file__).parent / "workers" / "inprocess_worker.py"
WORLD_SIZE = 3
STEPS = 60
FAULT_RANK = 1
FAULT_STEP = 10
#: Seconds a test waits for a process it expects to end (2 slow cores, three torch imports).
WAIT_S = 120.0


class Job:
    """Three workers and the agent's part: the store, the generations, the replacements."""

    def __init__(self, tmp_path: Path, port: int, timeout_s: float, in_process: bool = True) -> None:
        self.out, self.port, self.timeout_s, self.in_process = tmp_path / "out", port, timeout_s, in_process
        (tmp_path / "tmp").mkdir()
        self.out.mkdir()
        self.tmp = tmp_path
        self.procs: list[subprocess.Popen] = []
        self.logs: dict[int, Path] = {}
        self.prefix = protocol.attempt_prefix("test-job", 0)
        self.server = None
        if in_process:
            self.server = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=30), wait_for_workers=False)
            self.store = dist.PrefixStore(self.prefix, self.server)

    def env(self, rank: int, generation: int) -> dict[str, str]:
        env = {k: v for k, v in checkout_env().items() if not k.startswith(("TORCHELASTIC_", "TORCH_ELASTIC_"))}
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE), MASTER_ADDR="127.0.0.1")
        env.update(MASTER_PORT=str(self.port), OMP_NUM_THREADS="1", TMPDIR=str(self.tmp / "tmp"))
        if self.in_process:
            env[protocol.ENV_STORE] = f"127.0.0.1:{self.port}"
            env[protocol.ENV_PREFIX] = self.prefix
            env[protocol.ENV_TIMEOUT] = f"{self.timeout_s:g}"
            env[protocol.ENV_GENERATION] = str(generation)
        return env

    def start(self, rank: int, *fault: object, generation: int = 0) -> subprocess.Popen:
        path = self.tmp / f"rank{rank}-{len(self.procs)}.log"
        args = [sys.executable, str(WORKER), str(self.out), str(STEPS), *map(str, fault)]
        with open(path, "wb") as log:
            proc = subprocess.Popen(args, env=self.env(rank, generation), stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        self.logs[proc.pid] = path
        return proc

    def start_all(self, *fault: object) -> list[subprocess.Popen]:
        return [self.start(rank, *fault) for rank in range(WORLD_SIZE)]

    def replace(self, rank: int, *fault: object) -> subprocess.Popen:
        """What the agent does when ``rank``'s process failed: the next generation, a new process."""
        generation = self.store.add(protocol.GENERATION, 1)
        self.store.set(protocol.replaced_key(generation), json.dumps([rank]))
        self.store.set(protocol.begun_key(generation), b"1")
        return self.start(rank, *fault, generation=generation)

    def output(self, proc: subprocess.Popen) -> str:
        return self.logs[proc.pid].read_text(errors="replace")

    def results(self) -> dict[int, dict]:
        found = {int(p.name.split("-")[1][4:]): json.loads(p.read_text()) for p in self.out.glob("result-*.json")}
        assert len(found) == len(list(self.out.glob("result-*.json"))), "one result per rank"
        return found

    def generations(self, rank: int) -> list[dict]:
        return [json.loads(line) for line in (self.out / f"generations-rank{rank}.jsonl").read_text().splitlines()]

    def steps(self, rank: int) -> dict[int, list[int]]:
        """``{pid: [steps completed, in order]}`` of ``rank``'s processes."""
        by_pid: dict[int, list[int]] = {}
        for line in (self.out / f"steps-rank{rank}.txt").read_text().splitlines():
            pid, step = map(int, line.split())
            by_pid.setdefault(pid, []).append(step)
        return by_pid

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        self.server = self.store = None


@pytest.fixture
def job(tmp_path):
    """``make(timeout_s=60, in_process=True)``: a :class:`Job` in ``tmp_path``, stopped at teardown."""
    made: list[Job] = []

    def make(timeout_s: float = 60.0, in_process: bool = True) -> Job:
        made.append(Job(tmp_path, free_port(), timeout_s, in_process))
        return made[-1]

    yield make
    for each in made:
        each.stop()


def exit_code(proc: subprocess.Popen, timeout: float = WAIT_S) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"pid {proc.pid} still runs after {timeout:g}s")


def when_ended(procs: list[subprocess.Popen], timeout: float = WAIT_S) -> dict[int, float]:
    """``{pid: time.monotonic() when seen ended}`` once every one of ``procs`` ended."""
    ended: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    while len(ended) < len(procs) and time.monotonic() < deadline:
        ended |= {p.pid: time.monotonic() for p in procs if p.pid not in ended and p.poll() is not None}
        time.sleep(0.02)
    assert len(ended) == len(procs), f"still running after {timeout:g}s: {[p.pid for p in procs if p.poll() is None]}"
    return ended


@pytest.mark.parametrize(
    ("fault", "code"),
    [("raise", 1), ("kill", -signal.SIGKILL), ("busy", 1), ("deferred", 1)],
    ids=["exception", "sigkill", "interrupted-mid-compute", "interrupt-deferred-by-uninterrupted"],
)
def test_a_failed_rank_is_replaced_and_the_survivors_keep_their_processes(job, fault, code):
    """``busy``: the survivors are in Python, in no collective, at the fault; only the watcher's
    interrupt stops them (else they would loop for minutes). ``deferred``: they are inside
    ``uninterrupted()`` when the interrupt comes; it is raised as the block ends."""
    run = job()
    first = run.start_all(fault, FAULT_RANK, FAULT_STEP)
    assert exit_code(first[FAULT_RANK]) == code, run.output(first[FAULT_RANK])
    survivors = [proc for rank, proc in enumerate(first) if rank != FAULT_RANK]
    assert all(proc.poll() is None for proc in survivors), "a survivor's process ended"
    new = run.replace(FAULT_RANK, fault, FAULT_RANK, FAULT_STEP)
    for proc in [*survivors, new]:
        assert exit_code(proc) == 0, run.output(proc)

    results = run.results()
    assert sorted(results) == list(range(WORLD_SIZE))
    for rank, result in results.items():
        assert result["params"] == reference_params(WORLD_SIZE, STEPS), rank
        assert result["step"] == STEPS
        assert result["pid"] == (new if rank == FAULT_RANK else first[rank]).pid
    for rank in range(WORLD_SIZE):
        steps = run.steps(rank)
        if rank == FAULT_RANK:  # the replacement took step 10 from a survivor and went on
            assert steps == {first[rank].pid: list(range(FAULT_STEP)), new.pid: list(range(FAULT_STEP, STEPS))}
        else:  # each step once: none repeated after the recovery
            assert steps == {first[rank].pid: list(range(STEPS))}
    survivor = [(g["pid"], g["generation"], g["replaced"], g["is_replacement"]) for g in run.generations(0)]
    assert survivor == [(first[0].pid, 0, [], False), (first[0].pid, 1, [FAULT_RANK], False)]
    if fault == "deferred":
        for rank in (0, 2):
            assert (run.out / f"deferred-rank{rank}.txt").read_text().split() == ["block-done"]
    replacement = run.generations(FAULT_RANK)[-1]
    assert (replacement["pid"], replacement["generation"], replacement["replaced"]) == (new.pid, 1, [FAULT_RANK])
    assert replacement["is_replacement"] and replacement["step"] == 0


def test_without_the_store_it_trains_once_as_under_torchrun(job):
    """No ``FSM_AGENT_INPROCESS_STORE``: ``init_process_group`` from ``env://`` (MASTER_ADDR/PORT),
    one call of ``train_fn``, its result returned: the same script runs under plain torchrun."""
    run = job(in_process=False)
    procs = run.start_all()
    for proc in procs:
        assert exit_code(proc) == 0, run.output(proc)
    results = run.results()
    assert {rank: r["params"] for rank, r in results.items()} == {
        rank: reference_params(WORLD_SIZE, STEPS) for rank in range(WORLD_SIZE)
    }
    for rank in range(WORLD_SIZE):
        assert [(g["generation"], g["replaced"], g["is_replacement"]) for g in run.generations(rank)] == [
            (0, [], False)
        ]
        assert run.steps(rank) == {procs[rank].pid: list(range(STEPS))}


def test_a_ranks_own_exception_ends_its_process_at_once(job, tmp_path):
    """A ``ValueError`` of ``train_fn`` is this rank's fault: it exits at once (the agent replaces
    it), not after the 60 s recovery timeout; the survivors, their collective broken, wait for
    the new generation (none comes here: the test does not play the agent)."""
    run = job(timeout_s=60.0)
    procs = run.start_all("raise", FAULT_RANK, FAULT_STEP)
    ended = when_ended([procs[FAULT_RANK]])
    faulted = (run.out / "fault-done").stat().st_mtime
    assert procs[FAULT_RANK].returncode == 1
    assert time.time() - faulted < 30.0, "the failed rank exited only after the recovery timeout"
    assert "ValueError: rank 1's own fault at step 10" in run.output(procs[FAULT_RANK])
    assert ended and all(p.poll() is None for r, p in enumerate(procs) if r != FAULT_RANK), "survivors wait"


def test_a_survivor_re_raises_the_distributed_error_when_no_generation_begins(job):
    """A peer's loss (gloo's "Connection reset by peer") with no new generation within the 3 s
    timeout: the survivors re-raise the distributed error, at least ~3 s after the loss."""
    run = job(timeout_s=3.0)
    procs = run.start_all("raise", FAULT_RANK, FAULT_STEP)
    survivors = [p for r, p in enumerate(procs) if r != FAULT_RANK]
    ended = when_ended(procs)
    for proc in survivors:
        out = run.output(proc)
        assert proc.returncode == 1, out
        assert ended[proc.pid] - ended[procs[FAULT_RANK].pid] > 2.0, "re-raised before the timeout"
        last = out.strip().splitlines()[-1]
        assert "Error" in last and ("gloo" in last or "Connection" in last), last
        assert "ValueError" not in out and "RecoveryTimeout" not in out
