"""In-process restart with real agents (``fsm-agent run --restart-mode inprocess``) and real gloo
workers (``workers/inprocess_worker.py``: exact float64 arithmetic, so every run that completes its
steps ends with ``reference_params``).

* a failed rank (an exception, a SIGKILL; subprocess and preload launchers) is replaced: the other
  ranks keep their processes, repeat no step they completed, and the job ends with a fault-free
  run's parameters, ``restart_count`` 0, the recovery's rows and its ``inprocess_recovery`` event;
* two nodes: a fault on one node leaves the other node's agent and workers alone;
* each fallback to the whole-group restart: a survivor that never reaches the barrier
  (``--inprocess-timeout``), a second fault during a recovery, a rank that fails again right after
  its replacement, a worker that does not use the API.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from fsm_agent.testing.processes import wait_until
from tests.conftest import free_port
from tests.helpers.events import read_events, transitions
from tests.inprocess.conftest import (
    STEPS,
    assert_fault_free_result,
    assert_replays_identically,
    run_flags,
    single_node,
    steps_by_pid,
    worker_args,
    worker_pid,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RECOVERED = [
    ("INIT", "HEALTHY", "start"),
    ("HEALTHY", "HEALTHY", "workers_failed"),
    ("HEALTHY", "HEALTHY", "inprocess_recovered"),
    ("HEALTHY", "SUCCEEDED", "workers_succeeded"),
]


@pytest.mark.parametrize(
    "launcher, fault", [("preload", "raise"), ("subprocess", "kill")], ids=["preload-exception", "subprocess-sigkill"]
)
def test_a_failed_rank_is_replaced_and_the_others_keep_their_processes(agents, tmp_path, launcher, fault):
    out = tmp_path / "out"
    done = agents.run(*single_node(tmp_path, "--launcher", launcher), *worker_args(out, fault, "1", "10"), timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    events = tmp_path / "events_agent.jsonl"
    assert transitions(events) == RECOVERED
    (recovery,) = [e for e in read_events(events) if e["kind"] == "inprocess_recovery"]
    assert recovery["outcome"] == "recovered" and recovery["replaced"] == {"1": 1}, recovery
    assert recovery["total_s"] >= recovery["barrier_s"] >= 0, recovery
    assert read_events(events)[-1]["restart_count"] == 0
    for survivor in (0, 2):  # one process each, every step once
        (steps,) = steps_by_pid(out, survivor).values()
        assert steps == list(range(STEPS)), (survivor, steps)
    assert len(steps_by_pid(out, 1)) == 2  # the failed process and its replacement
    assert_fault_free_result(out, 3)
    assert_replays_identically(events)


def test_two_nodes_a_fault_on_one_node_leaves_the_other_node_alone(agents, tmp_path):
    out, port = tmp_path / "out", free_port()
    rendezvous = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "fsm"]
    rendezvous += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "inprocess-two-nodes", "--launcher", "preload"]
    procs = {
        name: agents.start(*run_flags(tmp_path, name), *rendezvous, *worker_args(out, "kill", "3", "10"))
        for name in ("a", "b")
    }
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, (name, err[-3000:])
    traces = {name: transitions(tmp_path / f"events_{name}.jsonl") for name in procs}
    faulted = [name for name, trace in traces.items() if ("HEALTHY", "HEALTHY", "workers_failed") in trace]
    assert len(faulted) == 1, traces
    (other,) = set(procs) - set(faulted)
    assert traces[faulted[0]] == RECOVERED
    assert traces[other] == [("INIT", "HEALTHY", "start"), ("HEALTHY", "SUCCEEDED", "workers_succeeded")]
    for survivor in (0, 1, 2):
        assert len(steps_by_pid(out, survivor)) == 1, survivor
    assert_fault_free_result(out, 4)


@pytest.mark.parametrize("max_restarts", [1, 0])
def test_a_survivor_that_never_reaches_the_barrier_falls_back_to_a_whole_group_restart(agents, tmp_path, max_restarts):
    """Rank 2 stopped (SIGSTOP: hung where no interrupt reaches it), rank 1 killed: the recovery
    cannot complete; after --inprocess-timeout the whole group restarts (class inprocess_failed),
    or, with no restarts left, the job fails."""
    out = tmp_path / "out"
    flags = single_node(
        tmp_path, "--inprocess-timeout", "3", "--max-restarts", str(max_restarts), "--shutdown-timeout", "2"
    )
    proc = agents.start(*flags, *worker_args(out))
    hung, victim = worker_pid(out, 2, 5), worker_pid(out, 1, 5)
    os.kill(hung, signal.SIGSTOP)
    os.kill(victim, signal.SIGKILL)
    _, err = proc.communicate(timeout=180)
    events = tmp_path / "events_agent.jsonl"
    recovering = [("INIT", "HEALTHY", "start"), ("HEALTHY", "HEALTHY", "workers_failed")]
    (recovery,) = [e for e in read_events(events) if e["kind"] == "inprocess_recovery"]
    assert recovery["outcome"] == "failed" and "--inprocess-timeout" in recovery["reason"], recovery
    if max_restarts == 0:
        assert proc.returncode != 0 and "no restarts left" in err, err[-3000:]
        assert transitions(events) == [*recovering, ("HEALTHY", "FAILED", "inprocess_failed")]
        return
    assert proc.returncode == 0, err[-3000:]
    assert transitions(events) == [
        *recovering,
        ("HEALTHY", "STOPPED", "inprocess_failed"),
        ("STOPPED", "HEALTHY", "restart"),
        ("HEALTHY", "SUCCEEDED", "workers_succeeded"),
    ]
    assert read_events(events)[-1]["restart_count"] == 1
    assert_fault_free_result(out, 3)
    assert_replays_identically(events)


def test_a_second_fault_during_a_recovery_restarts_the_whole_group(agents, tmp_path):
    out = tmp_path / "out"
    flags = single_node(tmp_path, "--inprocess-timeout", "120", "--max-restarts", "1", "--shutdown-timeout", "2")
    proc = agents.start(*flags, *worker_args(out))
    hung, first, second = worker_pid(out, 2, 5), worker_pid(out, 1, 5), worker_pid(out, 0, 5)
    os.kill(hung, signal.SIGSTOP)  # the first recovery waits for rank 2
    os.kill(first, signal.SIGKILL)
    events = tmp_path / "events_agent.jsonl"
    assert wait_until(lambda: ("HEALTHY", "HEALTHY", "workers_failed") in transitions(events, while_written=True), 60)
    time.sleep(0.5)
    os.kill(second, signal.SIGKILL)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:]
    assert transitions(events)[:4] == [
        ("INIT", "HEALTHY", "start"),
        ("HEALTHY", "HEALTHY", "workers_failed"),
        ("HEALTHY", "STOPPED", "workers_failed"),
        ("STOPPED", "HEALTHY", "restart"),
    ]
    assert "a second fault during the recovery of generation 1" in err
    assert_fault_free_result(out, 3)


def test_a_rank_that_fails_again_at_once_restarts_the_whole_group(agents, tmp_path):
    """Rank 1 fails at step 10 in every process: its replacement fails at once, so the whole
    group restarts; the attempt after it the same, and with no restarts left the job fails."""
    out = tmp_path / "out"
    done = agents.run(*single_node(tmp_path, "--max-restarts", "1"), *worker_args(out, "again", "1", "10"), timeout=180)
    assert done.returncode == 1, done.stderr[-3000:]
    recovered_then_restarted = [
        ("HEALTHY", "HEALTHY", "workers_failed"),
        ("HEALTHY", "HEALTHY", "inprocess_recovered"),
        ("HEALTHY", "STOPPED", "workers_failed"),
    ]
    trace = transitions(tmp_path / "events_agent.jsonl")
    assert trace[1:4] == recovered_then_restarted and trace[4] == ("STOPPED", "HEALTHY", "restart"), trace
    assert trace[-1] == ("HEALTHY", "FAILED", "workers_failed"), trace
    assert "rank 1 failed again within 30s of its replacement" in done.stderr


def test_a_worker_without_the_api_restarts_the_whole_group(agents, tmp_path):
    script = tmp_path / "plain.py"
    script.write_text(
        "import os, sys\n"
        "if os.environ['RANK'] == '1' and not os.path.exists('failed-once'):\n"
        "    open('failed-once', 'w').close()\n"
        "    sys.exit(3)\n"
    )
    done = agents.run(*single_node(tmp_path, "--max-restarts", "1", nproc=2), str(script), timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert transitions(tmp_path / "events_agent.jsonl") == [
        ("INIT", "HEALTHY", "start"),
        ("HEALTHY", "STOPPED", "workers_failed"),
        ("STOPPED", "HEALTHY", "restart"),
        ("HEALTHY", "SUCCEEDED", "workers_succeeded"),
    ]
    assert "not every rank runs fsm_agent.inprocess.run (0 of 2 enrolled)" in done.stderr
