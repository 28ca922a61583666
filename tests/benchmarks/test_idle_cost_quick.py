"""``benchmarks/idle_cost.py`` at CI size (issue #38, the idle per-node cost): 3 real agents, then 16
simulated nodes (2 processes), each job against a store in its own process, measured for 5 s;
the rows have the store's requests by op, nothing of the run is left, and what an idle node no
longer does is not there: no look at the store for a peer's drain (``check``), no ``touch`` (the
held watch keeps the lease). The simulated row's checks say a peer's drain reached every node and
a killed process's nodes were seen lost by every other. No rate is asserted beyond the issue's
generous goal (at most 1 request per second per node): the figures are in docs/benchmarks.md."""

from __future__ import annotations

import json

import pytest

from tests.helpers.processes import left_by_benchmark, run_benchmark

pytestmark = pytest.mark.e2e


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_idle_cost_measures_the_stores_requests_per_node_and_leaves_nothing(tmp_path):
    rows_json = tmp_path / "idle.json"
    args = ["--sizes", "3", "--simulated", "16", "--seconds", "5", "--settle", "1", "--json", str(rows_json)]
    returncode, report = run_benchmark("idle_cost.py", args, tmp_path, timeout=540)
    assert returncode == 0, report
    real, simulated = json.loads(rows_json.read_text())
    assert real["nodes"] == 3 and not real["simulated"] and not real["restarted"], report
    assert simulated["nodes"] == 16 and simulated["simulated"], report
    for row in (real, simulated):
        assert "check" not in row["by_op"] and "touch" not in row["by_op"], report
        assert 0 <= row["requests_per_node_s"] < 1.0, report
        assert row["store_cpu_share"] >= 0 and row["connections"] >= row["nodes"], report
    assert simulated["drain_reached_all_s"] is not None and simulated["loss_seen_by_all_s"] is not None, report
    assert left_by_benchmark(tmp_path) == [], report
