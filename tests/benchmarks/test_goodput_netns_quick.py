"""``benchmarks/goodput.py --quick --netns``: the goodput job with every host in a network namespace
of its own (2 agents and the spare, veths on one bridge) recovers a node's loss and a node's
preemption, each replacement agent starting in the lost node's namespace at its address, and
leaves nothing behind: no process, temporary directory, /dev/shm checkpoint directory or
namespace. No timing is asserted. Skipped, with the reason, where ``ip netns add`` is not permitted.
"""

from __future__ import annotations

import json
import secrets
import subprocess
from pathlib import Path

import pytest

from tests.helpers.processes import left_by_benchmark, run_benchmark

pytestmark = pytest.mark.e2e


def netns_refused() -> str | None:
    """Why this machine refuses ``ip netns add`` (None: it allows it); the probe is removed."""
    name = f"fsmprobe{secrets.token_hex(3)}"
    try:
        added = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, timeout=30)
    except OSError as exc:  # no iproute2
        return str(exc)
    if added.returncode != 0:
        return added.stderr.strip() or f"exit code {added.returncode}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
    return None


def namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_goodput_quick_in_network_namespaces_recovers_node_faults_and_leaves_nothing(tmp_path):
    reason = netns_refused()
    if reason:
        pytest.skip(f"ip netns add is not permitted here: {reason}")
    report_json = tmp_path / "goodput.json"
    args = ["--quick", "--netns", "--modes", "fsm-memory", "--kinds", "node_kill,node_sigterm"]
    args += ["--fault-interval", "12", "--fault-count", "2", "--all-faults", "--json", str(report_json)]
    returncode, report = run_benchmark("goodput.py", args, tmp_path, timeout=840)
    assert returncode == 0, report

    (result,) = json.loads(report_json.read_text())["results"]
    assert result["settings"]["netns"] and result["settings"]["nodes"] == 2, report
    assert result["failed_to_recover"] is None, report
    assert sorted(f["kind"] for f in result["faults"]) == ["agent_sigkill", "node_sigterm"], report
    assert all(f.get("recovery_s") is not None for f in result["faults"]), report

    # Nothing left: processes, temporary directories, the agents' shared memory, the namespaces (the
    # calibration's job: 2 hosts and the switch; the measured one: 2 hosts, the spare's and the switch).
    assert left_by_benchmark(tmp_path) == [], report
    assert result["shm_dirs"], f"the run saw no /dev/shm checkpoint directory\n{report}"
    assert [path for path in result["shm_dirs"] if Path(path).exists()] == [], report
    made = {"calibration": result["calibration"]["namespaces"], "measured": result["namespaces"]}
    assert [len(names) for names in made.values()] == [3, 4], f"namespaces made: {made}\n{report}"
    assert not {*made["calibration"], *made["measured"]} & namespaces(), report
