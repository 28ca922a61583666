"""benchmarks/rendezvous_scale.py runs end to end at a small N: real stores, real handlers of both
backends, every participant ranked 0..N-1, and ``--repeat`` folds its runs into one row per size.

No timing is asserted; the scale table itself (N up to 4,096) is in docs/benchmarks.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.processes import run_in_session

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def run_scale(out: Path, *extra: str) -> tuple[subprocess.CompletedProcess, str]:
    """``rendezvous_scale.py`` at N = 8 and 16 in 2 processes, its rows as JSON in ``out``, in a
    session of its own (past the timeout its whole group goes: the store, the participants).
    Returns the run and its output tails, for messages."""
    args = ["--sizes", "8,16", "--procs", "2", "--limit", "120", "--json", str(out), *extra]
    # no timing is asserted here, and on a loaded machine SCHED_IDLE participants barely run
    args += ["--participant-sched", "normal"]
    done = run_in_session(
        [sys.executable, str(REPO / "benchmarks" / "rendezvous_scale.py"), *args], timeout=280, cwd=REPO
    )
    return done, f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"


@pytest.mark.timeout(300)
def test_scale_benchmark_ranks_everyone_and_folds_repeats(tmp_path):
    out = tmp_path / "scale.json"
    done, report = run_scale(out, "--c10d-sizes", "4", "--repeat", "2")
    assert done.returncode == 0, report
    result = json.loads(out.read_text())
    assert [(r["backend"], r["n"]) for r in result["rows"]] == [("fsm", 8), ("fsm", 16), ("c10d", 4)], report
    for row in result["rows"]:
        assert row["ranks_ok"] and row["n_errors"] == 0, row
        assert row["runs"] == 2, row
        lo, hi = row["seconds_range"]
        assert lo <= row["seconds"] <= hi, row
    for every in result["every_run"]:
        assert len(every["runs"]) == 2 and all(r["ranks_ok"] for r in every["runs"]), every
    # fsm's store answers every participant in a bounded number of requests (its stats op)
    fsm16 = next(r for r in result["rows"] if r["n"] == 16)
    assert 0 < fsm16["requests_per_participant"] <= 6, fsm16
    # the table names the repeat and shows a range
    assert "2 runs per size" in done.stdout and "[" in done.stdout.split("| fsm | 16 |", 1)[1], report


@pytest.mark.timeout(300)
def test_rerendezvous_row_reranks_the_survivors_and_the_spare(tmp_path):
    """``--rerendezvous``: after one participant's process is SIGKILLed, the N-1 survivors and the
    hot spare are ranked 0..N-1 again, without an error (no timing asserted)."""
    out = tmp_path / "rerdzv.json"
    # c10d sizes given, not run: --rerendezvous is fsm's only (said in the notes)
    done, report = run_scale(out, "--c10d-sizes", "4", "--rerendezvous")
    assert done.returncode == 0, report
    rows = json.loads(out.read_text())["rows"]
    assert [(r["backend"], r["n"]) for r in rows] == [("fsm", 8), ("fsm", 16)], report
    for row in rows:
        assert row["ranks_ok"] and row["n_errors"] == 0, row
        assert row["procs"] == 4 and 0 < row["requests_per_participant"] <= 8, row
    assert "all ranked again after (from the SIGKILL)" in done.stdout, report
    assert "c10d not run" in done.stdout, report
