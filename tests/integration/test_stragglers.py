"""Stragglers with real agents and workers (fsm_agent.plugins.straggler, docs/failure-handling.md).

Two agents on loopback, two workers each; every worker calls ``fsm_agent.heartbeat(step=N)``
once per step. Counting is in the judge's windows, not seconds: the straggler event says in which
window of group rank 0 it was found and since which window that rank had a step time.
"""

from __future__ import annotations

import json
import textwrap
import urllib.request

import pytest

from fsm_agent.testing.processes import wait_until

from .conftest import assert_excluded_node_left, free_port, read_events

pytestmark = pytest.mark.slow

WINDOW, FACTOR, WINDOWS = 0.5, 2.0, 3
#: Judge windows allowed beyond WINDOWS before the slow rank must be found: one for the slow
#: agent's first publication, one for a window where the judge reads the slow agent's previous
#: entry again, one for a publication missed under load.
MARGIN = 3

WORKER = """
    import os, sys, time
    import fsm_agent
    slow = os.environ["RANK"] == os.environ.get("SLOW_RANK", "-1") and os.environ["WORLD_SIZE"] == "4"
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 10**9
    open(f"started.{os.environ['WORLD_SIZE']}.{os.environ['RANK']}", "w").close()
    for step in range(1, steps + 1):
        time.sleep(0.3 if slow else 0.03)  # the slow rank takes 10x as long per step
        fsm_agent.heartbeat(step=step)
"""


def _script(tmp_path) -> str:
    path = tmp_path / "w.py"
    path.write_text(textwrap.dedent(WORKER))
    return str(path)


def _common(port: int, run_id: str, *extra: str, host: bool) -> list[str]:
    """Agent A (``host``) hosts the fsm store, so it is group rank 0; B is group rank 1 and runs
    global ranks 2 and 3."""
    return ["--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-backend", "fsm", "--rdzv-endpoint",
            f"127.0.0.1:{port}", "--rdzv-id", run_id, "--local-addr", "127.0.0.1",
            "--rdzv-conf", f"last_call_timeout=1,is_host={int(host)}",
            "--straggler-window", str(WINDOW), "--straggler-factor", str(FACTOR), "--straggler-windows", str(WINDOWS),
            *extra]


def _events(path, kind: str) -> list[dict]:
    return [e for e in read_events(path) if e["kind"] == kind] if path.exists() else []


def test_a_slow_worker_is_found_with_its_rank_and_factor(tmp_path, agents):
    """Global rank 3 (node rank 1, local rank 1) sleeps 10x longer a step: group rank 0 reports
    it once, within WINDOWS + MARGIN windows of its first step time, with host, ranks and a
    factor above FACTOR; /status shows the median and every rank's ratio."""
    script, port, status_port = _script(tmp_path), free_port(), free_port()
    a = agents.start(*_common(port, "slow", "--events-file", str(tmp_path / "a.jsonl"), "--status-port",
                              str(status_port), host=True), script, env={"SLOW_RANK": "3"})
    b = agents.start(*_common(port, "slow", "--events-file", str(tmp_path / "b.jsonl"), host=False), script,
                     env={"SLOW_RANK": "3"})
    assert wait_until(lambda: _events(tmp_path / "a.jsonl", "straggler"), timeout=120), (
        _events(tmp_path / "a.jsonl", "step_times")[-3:])
    status = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{status_port}/status", timeout=10).read())
    # Several windows more: the episode goes on, and is not reported again.
    seen = len(_events(tmp_path / "a.jsonl", "step_times"))
    assert wait_until(lambda: len(_events(tmp_path / "a.jsonl", "step_times")) >= seen + 2 * WINDOWS, timeout=120)
    for proc in (b, a):
        proc.terminate()
        proc.communicate(timeout=60)
    (found,) = _events(tmp_path / "a.jsonl", "straggler")
    assert (found["global_rank"], found["local_rank"], found["node_rank"]) == (3, 1, 1), found
    assert found["host"] and found["factor"] > FACTOR and found["windows"] == WINDOWS, found
    assert found["window"] - found["since_window"] + 1 <= WINDOWS + MARGIN, found
    assert found["group_rank"] == 0
    times = status["step_times"]
    assert times["median_s"] > 0 and {r["global_rank"] for r in times["ranks"]} == {0, 1, 2, 3}, times
    slowest = max(times["ranks"], key=lambda r: r["ratio"])
    assert slowest["global_rank"] == 3 and slowest["ratio"] > FACTOR, times
    # Node rank 1 learns the verdict too: its own ranks, with their ratios.
    b_times = [e for e in _events(tmp_path / "b.jsonl", "step_times") if e["group_rank"] == 1]
    assert b_times and {r["global_rank"] for r in b_times[-1]["ranks"]} == {2, 3}
    assert any(r["straggler"] for e in b_times for r in e["ranks"] if r["global_rank"] == 3)
    assert not _events(tmp_path / "b.jsonl", "straggler")  # reported once, by group rank 0


def test_an_even_job_has_no_straggler(tmp_path, agents):
    """Four even workers for 600 steps (about 40 windows): no straggler event on either agent,
    and every window judged every rank."""
    script, port = _script(tmp_path), free_port()
    procs = [agents.start(*_common(port, "even", "--events-file", str(tmp_path / f"{n}.jsonl"), host=n == "a"),
                          script, "600") for n in "ab"]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
    windows = _events(tmp_path / "a.jsonl", "step_times")
    assert len(windows) >= 20, len(windows)
    assert not _events(tmp_path / "a.jsonl", "straggler") and not _events(tmp_path / "b.jsonl", "straggler")
    judged = [w for w in windows if len(w["ranks"]) == 4]
    assert len(judged) >= len(windows) - 5 and all(not w["stragglers"] for w in windows)
    assert max(r["ratio"] for w in judged for r in w["ranks"]) <= FACTOR


def test_with_exclusion_the_slow_node_leaves_and_the_job_continues(tmp_path, agents):
    """--exclude-node-on straggler on both: node rank 1 hosts the slow rank, fails its health
    check with class straggler and leaves (exit 69, the verdict names the straggler); node rank 0
    re-rendezvouses alone (a lost node, no restart spent) and its workers finish."""
    script, port = _script(tmp_path), free_port()
    a = agents.start(*_common(port, "ex", "--events-file", str(tmp_path / "a.jsonl"), "--exclude-node-on",
                              "straggler", host=True), script, "400", env={"SLOW_RANK": "3"})
    b = agents.start(*_common(port, "ex", "--events-file", str(tmp_path / "b.jsonl"), "--exclude-node-on",
                              "straggler", host=False), script, "400", env={"SLOW_RANK": "3"})
    out_b, err_b = b.communicate(timeout=180)
    out_a, err_a = a.communicate(timeout=180)
    assert b.returncode == 69, err_b
    assert "Verdict: straggler on rank" in err_b and "this node leaves the job" in err_b, err_b
    assert "rank 3 (local_rank 1) is a straggler" in err_b, err_b  # every local worker fails; 3 is the cause
    assert a.returncode == 0, err_a
    assert_excluded_node_left(tmp_path / "b.jsonl", tmp_path / "a.jsonl")
    assert (tmp_path / "started.2.1").exists()  # the job went on with node rank 0 alone
