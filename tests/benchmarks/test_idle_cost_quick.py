"""``benchmarks/idle_cost.py`` at CI size (issue #38, the idle per-node cost): 3 real agents against
a store in its own process, measured for 5 s; the row has the store's requests by op (the
keep-alive's membership watch among them) and nothing of the run is left. No rate is asserted:
the figures are in docs/benchmarks.md, with the command."""

from __future__ import annotations

import json

import pytest

from tests.helpers.processes import left_by_benchmark, run_benchmark

pytestmark = pytest.mark.e2e


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_idle_cost_measures_the_stores_requests_per_node_and_leaves_nothing(tmp_path):
    rows_json = tmp_path / "idle.json"
    args = ["--sizes", "3", "--seconds", "5", "--settle", "1", "--json", str(rows_json)]
    returncode, report = run_benchmark("idle_cost.py", args, tmp_path, timeout=540)
    assert returncode == 0, report
    [row] = json.loads(rows_json.read_text())
    assert row["nodes"] == 3 and not row["restarted"], report
    assert row["requests_per_node_s"] > 0 and row["by_op"].get("rdzv_watch", 0) > 0, report
    assert row["store_cpu_share"] >= 0 and row["connections"] >= 3, report
    assert left_by_benchmark(tmp_path) == [], report
