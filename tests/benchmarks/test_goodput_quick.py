"""``benchmarks/goodput.py --quick`` (issue #34 part 1) runs every mode and leaves nothing behind.

No timing or goodput figure is asserted (CI machines are noisy): the run completes, every mode
(torchrun, fsm-disk, fsm-memory) reports a goodput, faults and their recoveries, and afterwards no
process of the run, no temporary directory and none of the /dev/shm checkpoint directories its
agents used is left.
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
        "goodput.py", ["--quick", "--markdown", str(markdown), "--json", str(report_json)], tmp_path, timeout=1440
    )
    assert returncode == 0, report

    # Every mode has a row with a goodput and a recovery figure.
    rows = {}
    for line in markdown.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] in MODES:
            rows[cells[0]] = cells
    assert set(rows) == set(MODES), report
    for mode, cells in rows.items():
        assert re.fullmatch(r"\d+\.\d{3}", cells[2]), f"{mode}: no goodput in {cells}\n{report}"
        assert int(cells[3]) > 0, f"{mode}: no useful step\n{report}"
        assert re.fullmatch(r"\d+ of \d+", cells[7]), f"{mode}: no fault count in {cells}\n{report}"

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
