"""benchmarks/node_checks.py runs end to end in its quick mode at a small N: the 8 namespaced hosts
with and without the network check (skipped by the bench itself where namespaces cannot be made)
and simulated nodes running the real checks and exchange against one TCPStore, nobody blamed.

No timing is asserted; the table of the full run is in docs/benchmarks.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_quick_mode_measures_both_parts_and_blames_nobody(tmp_path):
    out = tmp_path / "node_checks.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "node_checks.py"), "--quick", "--nodes", "16", "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
    )
    report = f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"
    assert done.returncode == 0, report
    data = json.loads(out.read_text())

    hosts = data["hosts_summary"]
    if "skipped" not in hosts:  # root and iproute2: one run with the check, one without
        assert len(hosts["with_s"]) == 1 and len(hosts["without_s"]) == 1, report
        assert len(hosts["check_s"]) == 8 and not hosts["failed"], report

    (row,) = data["simulated"]["rounds"]
    assert not data["simulated"]["errors"], report
    assert row["blamed"] == [] and row["excluded"] == [] and row["not_ok"] == 0, row
    assert row["exchange_requests_others"] == [3], row  # set, wait, get
    assert row["check_requests_rank0"] == 7 and row["check_requests_others"] == [6], row  # healthy: round 1 only
