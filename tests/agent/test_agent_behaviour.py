"""Agent behaviours with real workers: fresh store per attempt, exit detection, re-rendezvous, Python API."""

from __future__ import annotations

import json
import textwrap
import time

import pytest

from fsm_agent import LaunchConfig, elastic_launch
from fsm_agent.launch import WorkerGroupFailedError
from tests.conftest import free_port
from tests.helpers.events import read_events, transitions

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.usefixtures("own_tempdir")]


def write(path, body: str):
    path.write_text(textwrap.dedent(body))
    return str(path)


@pytest.mark.parametrize(
    "backend", [["--standalone"], ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0"]], ids=["fsm", "c10d"]
)
def test_each_attempt_meets_in_an_empty_store(tmp_path, agents, backend):
    """Attempt 0 leaves a key in its workers' store; attempt 1's store must not have it (torch#135712)."""
    script = write(
        tmp_path / "w.py",
        """
        import os, sys, json, time
        from datetime import timedelta
        from torch.distributed import TCPStore
        # As init_process_group("env://") does: an agent hosts the store, or else worker rank 0.
        hosts = os.environ["TORCHELASTIC_USE_AGENT_STORE"] != "True" and os.environ["RANK"] == "0"
        store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=hosts,
                         world_size=2, timeout=timedelta(seconds=30))
        attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        rank = os.environ["RANK"]
        with open(f"seen_{attempt}_{rank}.tmp", "w") as f:  # whole or not at all: a stop may come any time
            json.dump({"stale": store.check(["left_by_attempt_0"]), "port": os.environ["MASTER_PORT"],
                       "use_agent_store": os.environ["TORCHELASTIC_USE_AGENT_STORE"]}, f)
        os.replace(f"seen_{attempt}_{rank}.tmp", f"seen_{attempt}_{rank}.json")
        if attempt == 0:
            store.set("left_by_attempt_0", "x")
            if rank == "1":
                # Fail only once rank 0 has recorded itself: the restart stops it otherwise.
                deadline = time.monotonic() + 60
                while not os.path.exists("seen_0_0.json") and time.monotonic() < deadline:
                    time.sleep(0.01)
                sys.exit(1)
            time.sleep(30)  # rank 0 (maybe the store's host) stays until the agent stops it
    """,
    )
    proc = agents.start(*backend, "--nproc-per-node", "2", "--max-restarts", "1", script)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    first = json.loads((tmp_path / "seen_0_0.json").read_text())
    second = [json.loads((tmp_path / f"seen_1_{r}.json").read_text()) for r in "01"]
    assert all(s["stale"] is False for s in second)
    assert all(s["port"] != first["port"] for s in second)


def test_exit_noticed_at_once_whatever_the_monitor_interval(tmp_path, agents):
    """With --monitor-interval 30, a worker's exit is still seen within a fraction of a second."""
    script = write(
        tmp_path / "w.py",
        """
        import os, sys, time
        if os.environ["RANK"] == "1":
            time.sleep(0.5)
            with open("exit_time", "w") as f:
                f.write(repr(time.time()))
            sys.exit(4)
        time.sleep(60)
    """,
    )
    events = tmp_path / "events.jsonl"
    proc = agents.start(
        "--standalone", "--nproc-per-node", "2", "--monitor-interval", "30", "--events-file", str(events), script
    )
    started = time.monotonic()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 4, err
    assert time.monotonic() - started < 20  # nowhere near one 30 s interval
    exit_record = next(e for e in read_events(events) if e["kind"] == "worker_exit")
    latency = exit_record["ts"] - float((tmp_path / "exit_time").read_text())
    assert latency < 1.0, f"exit seen {latency:.3f}s after the worker left"  # generous: measured ~ms


def test_new_node_triggers_one_rerendezvous_not_counted(tmp_path, agents):
    """--nnodes 1:2: agent A runs alone; agent B joins; A re-rendezvouses (restart_count stays 0)."""
    script = write(
        tmp_path / "w.py",
        """
        import os, time, json
        ws = int(os.environ["WORLD_SIZE"])
        with open(f"world_{os.environ['GROUP_RANK']}_{os.environ['LOCAL_RANK']}_{ws}_{os.getpid()}", "w") as f:
            f.write(os.environ["TORCHELASTIC_RESTART_COUNT"])
        time.sleep(60 if ws == 1 else 2)
    """,
    )
    port = free_port()
    common = [
        "--nnodes",
        "1:2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "grow",
        "--monitor-interval",
        "0.2",
        "--rdzv-conf",
        "last_call_timeout=1,join_timeout=60",
    ]
    events_a = tmp_path / "a.jsonl"
    a = agents.start(*common, "--local-addr", "127.0.0.1", "--events-file", str(events_a), script)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob("world_*_1_*")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert list(tmp_path.glob("world_*_1_*")), "agent A never started its single-node attempt"
    b = agents.start(*common, "--local-addr", "127.0.0.1", "--events-file", str(tmp_path / "b.jsonl"), script)
    out_b, err_b = b.communicate(timeout=90)
    out_a, err_a = a.communicate(timeout=90)
    assert a.returncode == 0 and b.returncode == 0, err_a + err_b
    assert len(list(tmp_path.glob("world_*_2_*"))) == 2
    assert transitions(events_a) == [
        ("INIT", "HEALTHY", "start"),
        ("HEALTHY", "STOPPED", "membership_changed"),
        ("STOPPED", "HEALTHY", "restart"),
        ("HEALTHY", "SUCCEEDED", "workers_succeeded"),
    ]
    assert all(e["restart_count"] == 0 for e in read_events(events_a))


def _square_rank(offset):
    import os

    return int(os.environ["RANK"]) ** 2 + offset


def _fail_on_rank_one():
    import os

    if os.environ["RANK"] == "1":
        raise ValueError("rank one refuses")
    return "ok"


def test_elastic_launch_returns_values_by_global_rank(tmp_path):
    config = LaunchConfig(
        nproc_per_node=3,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        run_id="api",
        log_dir=str(tmp_path),
        start_method="spawn",
    )
    assert elastic_launch(config, _square_rank)(10) == {0: 10, 1: 11, 2: 14}


def _root_cause_of(fn, tmp_path, nproc_per_node: int):
    """``elastic_launch(config, fn)()`` must fail: its root cause."""
    config = LaunchConfig(
        nproc_per_node=nproc_per_node,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        run_id="api",
        log_dir=str(tmp_path),
    )
    with pytest.raises(WorkerGroupFailedError) as info:
        elastic_launch(config, fn)()
    return info.value.result.root_cause


def test_elastic_launch_raises_with_the_root_cause(tmp_path):
    cause = _root_cause_of(_fail_on_rank_one, tmp_path, 2)
    assert cause.global_rank == 1 and "ValueError: rank one refuses" in cause.message
    assert "refuses" in cause.traceback


def _return_a_lock():
    import threading

    return threading.Lock()


def test_an_unpicklable_return_value_is_named_as_the_cause(tmp_path):
    """Not "exited with code 1": the worker ran to the end, its value could not come back."""
    cause = _root_cause_of(_return_a_lock, tmp_path, 1)
    assert cause.message.startswith(
        "TypeError: the return value of _return_a_lock (lock) cannot be pickled, so "
        "the agent cannot hand it back: TypeError: cannot pickle '_thread.lock' object"
    ), cause.message


def test_restart_count_identical_on_every_node(tmp_path, agents):
    """A failure on one node: both nodes' next attempt sees TORCHELASTIC_RESTART_COUNT=1 (torch: 0 and 1)."""
    script = write(
        tmp_path / "w.py",
        """
        import os, sys, time
        count = os.environ["TORCHELASTIC_RESTART_COUNT"]
        with open(f"seen_{os.environ['GROUP_RANK']}_{count}_{os.getpid()}", "w"):
            pass
        if count == "0":
            if os.environ["RANK"] == "1":
                time.sleep(0.5)
                sys.exit(2)
            time.sleep(60)  # the healthy node's worker would sit here; the re-rendezvous stops it
    """,
    )
    port = free_port()
    common = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--max-restarts",
        "1",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "count",
        "--monitor-interval",
        "0.2",
        "--local-addr",
        "127.0.0.1",
    ]
    a = agents.start(*common, "--events-file", str(tmp_path / "a.jsonl"), script)
    b = agents.start(*common, "--events-file", str(tmp_path / "b.jsonl"), script)
    out_a, err_a = a.communicate(timeout=120)
    out_b, err_b = b.communicate(timeout=120)
    assert a.returncode == 0 and b.returncode == 0, err_a + err_b
    second = sorted(p.name.split("_")[1:3] for p in tmp_path.glob("seen_*_1_*"))
    assert second == [["0", "1"], ["1", "1"]], list(tmp_path.glob("seen_*"))
