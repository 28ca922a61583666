"""The main job: examples/train_digits.py under `fsm-agent run`, with and without injected crashes."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.helpers.events import read_events

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "train_digits.py"
pytestmark = [pytest.mark.integration, pytest.mark.slow]
TIMEOUT = 240  # seconds one training run may take


def transitions(events_file: Path) -> list[tuple[str, str, str, int]]:
    return [
        (r["source"], r["dest"], r["trigger"], r["restart_count"])
        for r in read_events(events_file)
        if r["kind"] == "transition"
    ]


def test_trains_to_stated_accuracy(agents, tmp_path):
    """The README's first command (with a result file): test accuracy >= 0.95."""
    result = agents.run(
        "--standalone",
        "--nproc-per-node",
        "2",
        str(EXAMPLE),
        "--checkpoint",
        str(tmp_path / "ck.pt"),
        "--result-file",
        str(tmp_path / "res.json"),
        timeout=TIMEOUT,
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "res.json").read_text())
    assert summary["world_size"] == 2
    assert summary["test_accuracy"] >= 0.95
    assert "final test accuracy" in result.stdout


@pytest.mark.parametrize("trial", range(10))
def test_crash_and_restart_resumes_from_checkpoint(agents, tmp_path, trial):
    """Rank 1 crashes in the first attempt; the group restarts, resumes, and the job exits 0 (10 of 10).
    Odd trials hold the checkpoints in the agent's memory too (``--checkpoint-memory``): the restart
    resumes from there."""
    events = tmp_path / "events.jsonl"
    in_memory = ["--checkpoint-memory", "16MiB"] if trial % 2 else []
    result = agents.run(
        *in_memory,
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--events-file",
        str(events),
        "--log-dir",
        str(tmp_path / "logs"),
        str(EXAMPLE),
        "--epochs",
        "4",
        "--crash-rank",
        "1",
        "--crash-epoch",
        "2",
        "--checkpoint",
        str(tmp_path / "ck.pt"),
        "--result-file",
        str(tmp_path / "res.json"),
        timeout=TIMEOUT,
    )
    assert result.returncode == 0, result.stderr
    assert ("resumed from epoch 1 (memory)" if in_memory else "resumed from epoch 1") in result.stdout + result.stderr
    summary = json.loads((tmp_path / "res.json").read_text())
    assert summary["restart_count"] == 1 and summary["resumed_from"] == 1
    assert transitions(events) == [
        ("INIT", "HEALTHY", "start", 0),
        ("HEALTHY", "STOPPED", "workers_failed", 1),
        ("STOPPED", "HEALTHY", "restart", 1),
        ("HEALTHY", "SUCCEEDED", "workers_succeeded", 1),
    ]


def test_no_restarts_left_reports_root_cause_first(agents, tmp_path):
    """--max-restarts 0 with a failing rank: non-zero exit; the summary's first lines name rank, code, traceback."""
    result = agents.run(
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "0",
        str(EXAMPLE),
        "--epochs",
        "3",
        "--crash-rank",
        "1",
        "--crash-epoch",
        "1",
        "--crash-always",
        "--checkpoint",
        str(tmp_path / "ck.pt"),
        timeout=TIMEOUT,
    )
    assert result.returncode == 1, result.stderr[-4000:]  # the root-cause worker's exit code (RuntimeError -> 1)
    report = result.stderr[result.stderr.index("=" * 20) :].splitlines()
    head = "\n".join(report[:12])
    assert "FAILED" in report[1]
    assert "Root Cause (first observed failure):" in head
    assert "rank      : 1 (local_rank: 1" in head
    assert "exitcode  : 1" in head
    assert "traceback :" in head and "RuntimeError: injected crash" in result.stderr


def test_worker_exit_code_becomes_agent_exit_code(agents, tmp_path):
    result = agents.run(
        "--standalone",
        "--nproc-per-node",
        "2",
        str(EXAMPLE),
        "--epochs",
        "2",
        "--crash-rank",
        "0",
        "--crash-epoch",
        "1",
        "--crash-always",
        "--crash-exit-code",
        "7",
        "--checkpoint",
        str(tmp_path / "ck.pt"),
        timeout=TIMEOUT,
    )
    assert result.returncode == 7, result.stderr
    assert "exitcode  : 7" in result.stderr


def test_the_readme_two_node_command_trains_one_job(agents, tmp_path):
    """The README's two-agent loopback command, as written there (a free port and a fresh
    checkpoint in place of 29400 and runs/): two nodes of one job, world size 2, accuracy >= 0.95."""
    readme = (REPO / "README.md").read_text()
    line = next(ln.strip() for ln in readme.splitlines() if "--rdzv-id digits-2n" in ln)
    argv = shlex.split(line.rstrip("&").strip())
    assert argv[:2] == ["fsm-agent", "run"], line
    port = free_port()
    args = [a.replace("127.0.0.1:29400", f"127.0.0.1:{port}") for a in argv[2:]]
    args[args.index("runs/two_nodes.pt")] = str(tmp_path / "two_nodes.pt")
    args[args.index("examples/train_digits.py")] = str(EXAMPLE)
    procs = [agents.start(*args, "--result-file", str(tmp_path / f"res{n}.json")) for n in (0, 1)]
    for proc in procs:
        out, err = proc.communicate(timeout=TIMEOUT)
        assert proc.returncode == 0, err
    summaries = [json.loads(p.read_text()) for p in tmp_path.glob("res*.json")]
    assert summaries and all(s["world_size"] == 2 and s["test_accuracy"] >= 0.95 for s in summaries), summaries
