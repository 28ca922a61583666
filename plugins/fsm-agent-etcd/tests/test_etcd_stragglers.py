"""Stragglers on the etcd-v3 backend: the step times go through the round's store in etcd
(the shared job of ``fsm_agent.testing.stragglers``; fsm and c10d: tests/agent/test_stragglers.py)."""

from __future__ import annotations

import uuid

import pytest

from fsm_agent.testing.processes import wait_until
from fsm_agent.testing.stragglers import check_found, events, straggler_flags, write_worker

pytestmark = pytest.mark.slow


def test_a_slow_worker_is_found_through_etcd(tmp_path, agents, etcd_server):
    """Global rank 3 sleeps 10x longer a step: the agent of group rank 0 reports it once, with
    its ranks and factor, within the windows the shared job allows."""
    script, run_id = write_worker(tmp_path), f"straggler-{uuid.uuid4().hex[:8]}"
    paths = [tmp_path / f"{n}.jsonl" for n in "ab"]
    procs = [
        agents.start(
            "--nnodes",
            "1:2",
            "--rdzv-backend",
            "etcd-v3",
            "--rdzv-endpoint",
            etcd_server.endpoint,
            "--rdzv-id",
            run_id,
            "--local-addr",
            "127.0.0.1",
            "--rdzv-conf",
            "last_call_timeout=1",
            *straggler_flags("--events-file", str(path)),
            script,
            env={"SLOW_RANK": "3"},
        )
        for path in paths
    ]
    assert wait_until(lambda: any(events(p, "straggler") for p in paths), timeout=120), [
        events(p, "step_times")[-2:] for p in paths
    ]
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.communicate(timeout=60)
    check_found(*paths)
    judged = [e for p in paths for e in events(p, "step_times") if e["group_rank"] == 0 and len(e["ranks"]) == 4]
    assert judged and max(judged[-1]["ranks"], key=lambda r: r["ratio"])["global_rank"] == 3
