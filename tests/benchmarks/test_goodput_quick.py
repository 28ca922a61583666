"""``benchmarks/goodput.py --quick`` (issue #34 part 1) runs every mode and leaves nothing behind.

No timing or goodput figure is asserted (CI machines are noisy): the run completes, every mode
(torchrun, fsm-disk, fsm-memory; fsm-inprocess in its own test, with the faults of issue #33)
reports a goodput, faults and their recoveries, and afterwards no process of the run, no temporary
directory and none of the /dev/shm checkpoint directories its agents used is left.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.helpers.processes import left_by_benchmark, run_benchmark

pytestmark = pytest.mark.e2e

MODES = ("torchrun", "fsm-disk", "fsm-memory")


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_goodput_quick_run_reports_every_mode_and_leaves_nothing(tmp_path):
    markdown, report_json = tmp_path / "goodput.md", tmp_path / "goodput.json"
    returncode, report = run_benchmark(
        "goodput.py",
        ["--quick", "--modes", ",".join(MODES), "--markdown", str(markdown), "--json", str(report_json)],
        tmp_path,
        timeout=1440,
    )
    assert returncode == 0, report

    # Every mode has a row with a goodput and a recovery figure.
    rows = {}
    for line in markdown.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] in MODES:
            rows.setdefault(cells[0], cells)  # the first table's row (the per-kind table follows)
    assert set(rows) == set(MODES), report
    for mode, cells in rows.items():
        assert re.fullmatch(r"\d+\.\d{3}", cells[2]), f"{mode}: no goodput in {cells}\n{report}"
        assert int(cells[3]) > 0, f"{mode}: no useful step\n{report}"
        assert re.fullmatch(r"\d+ of \d+", cells[9]), f"{mode}: no fault count in {cells}\n{report}"
        assert cells[8] == "0", f"{mode}: a process repeated a step it had completed\n{report}"

    data = json.loads(report_json.read_text())
    assert [r["mode"] for r in data["results"]] == list(MODES), report
    for result in data["results"]:
        assert result["calibration"]["step_s"] > 0, report
        assert result["k"] >= 1, report
        assert result["faults"], f"{result['mode']}: no fault injected\n{report}"
        assert any(f.get("recovery_s") is not None for f in result["faults"]), (
            f"{result['mode']}: no recovery\n{report}"
        )

    # Nothing left: processes, temporary directories, the agents' shared memory.
    assert left_by_benchmark(tmp_path) == [], report
    memory = next(r for r in data["results"] if r["mode"] == "fsm-memory")
    assert memory["shm_dirs"], f"the fsm-memory run saw no /dev/shm checkpoint directory\n{report}"
    left = [path for r in data["results"] for path in r["shm_dirs"] if Path(path).exists()]
    assert left == [], report


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_goodput_quick_inprocess_recovers_every_fault_and_leaves_nothing(tmp_path):
    """fsm-inprocess (issue #33): a worker's exception and SIGKILL are recovered by replacing that
    worker alone (its survivors repeat no step), a node's SIGKILL by a whole-group restart onto the
    spare; every fault recovered, nothing left."""
    report_json = tmp_path / "goodput.json"
    args = ["--quick", "--modes", "fsm-inprocess", "--kinds", "exception,kill,node_kill", "--fault-interval", "12"]
    args += ["--fault-count", "3", "--all-faults", "--json", str(report_json)]
    returncode, report = run_benchmark("goodput.py", args, tmp_path, timeout=840)
    assert returncode == 0, report

    (result,) = json.loads(report_json.read_text())["results"]
    assert result["mode"] == "fsm-inprocess", report
    assert result["failed_to_recover"] is None, report
    assert sorted(f["kind"] for f in result["faults"]) == ["agent_sigkill", "worker_exception", "worker_sigkill"]
    assert all(f.get("recovery_s") is not None for f in result["faults"]), report
    assert result["replaced_alone"] >= 2, f"the two worker faults were not recovered in process\n{report}"
    assert result["repeats_by_survivors"] == 0, report

    assert left_by_benchmark(tmp_path) == [], report
    assert result["shm_dirs"], f"the run saw no /dev/shm checkpoint directory\n{report}"
    assert [path for path in result["shm_dirs"] if Path(path).exists()] == [], report
