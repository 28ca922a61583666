"""The benchmark suite's quick mode works: every scenario runs and reports both launchers.

No timing is asserted (CI machines are noisy); ``benchmarks/run.py`` and its full mode are
described in ``benchmarks/README.md``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = "abcdefghij"
#: A cell with a result: a median, or "never"/"not ..." for an event that did not happen in time.
RESULT = re.compile(r"\d|never|not ")


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_quick_mode_runs_every_scenario_with_both_launchers(tmp_path):
    markdown = tmp_path / "bench.md"
    done = subprocess.run(
        # --tmp-dir: the bench's directory (its trials', and TMPDIR of every launcher it starts) is
        # made under tmp_path, so nothing of it stays in /tmp even if the bench dies before removing it.
        [
            sys.executable,
            str(REPO / "benchmarks" / "run.py"),
            "--quick",
            "--markdown",
            str(markdown),
            "--tmp-dir",
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1140,
    )
    report = f"stdout:\n{done.stdout[-6000:]}\nstderr:\n{done.stderr[-6000:]}"
    assert done.returncode == 0, report

    # The final table on stdout names every scenario.
    final = done.stdout.split("== fsm-agent vs torchrun", 1)
    assert len(final) == 2, report
    for sid in SCENARIOS:
        assert f"({sid}) " in final[1], f"scenario ({sid}) missing from the table\n{report}"

    # Every row of the Markdown table has a result for fsm-agent and for torchrun.
    rows = [line for line in markdown.read_text().splitlines() if re.match(rf"\| \([{SCENARIOS}]\) ", line)]
    assert {row[3] for row in rows} == set(SCENARIOS), report
    for row in rows:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]]
        scenario, fsm_cell, torchrun_cell = cells[:3]
        assert RESULT.search(fsm_cell), f"no fsm-agent result in {scenario!r}: {fsm_cell!r}\n{report}"
        assert RESULT.search(torchrun_cell), f"no torchrun result in {scenario!r}: {torchrun_cell!r}\n{report}"
        assert "failed" not in fsm_cell + torchrun_cell, f"failed trials in {scenario!r}\n{report}"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_checkpoint_benchmark_quick_run_reports_every_part(tmp_path):
    """``benchmarks/checkpoint.py --quick`` (issue #32): save, restore, memory and replication
    rows, each with a number; its files go under ``tmp_path``."""
    markdown = tmp_path / "checkpoint.md"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "checkpoint.py"),
            "--quick",
            "--markdown",
            str(markdown),
            "--dir",
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=540,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = markdown.read_text()
    for row in ("| fsm_agent.checkpoint.save |", "| torch.save + fsync |", "load(into=prealloc)", "| loopback"):
        line = next((line for line in report.splitlines() if row in line), "")
        assert RESULT.search(line.split("|", 2)[-1]), (row, report)
    assert "Restored from: memory" in report
