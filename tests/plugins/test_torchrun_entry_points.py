"""torchrun's own plugin entry points keep working under fsm-agent, with real workers.

``tests/fixtures/torchrun-compat-plugin`` is a distribution that knows nothing of fsm-agent: a
rendezvous handler registered only as a ``torchrun.handlers`` entry point (``mini``) and a
``LogsSpecs`` registered only as a ``torchrun.logs_specs`` entry point (``mini``). It is
pip-installed into a temporary ``--target`` directory that the agents get on ``PYTHONPATH``, so
the shared environment is not changed; entry points are found through its ``.dist-info``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.helpers.install import FIXTURES, installed_fixtures
from tests.helpers.processes import pythonpath, run_fsm_agent, run_in_session

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

WORKER = FIXTURES / "dist_worker.py"
TIMEOUT_S = 240


@pytest.fixture(scope="module")
def compat_env():
    """The environment of an agent that sees the torchrun-compat-plugin distribution."""
    with installed_fixtures("torchrun-compat-plugin") as site:
        env = dict(os.environ)
        env["PYTHONPATH"] = pythonpath(site)
        for name in ("FSM_AGENT_DISABLE_PLUGINS", "FSM_AGENT_LOGS_SPECS", "PET_RDZV_BACKEND", "PET_NNODES"):
            env.pop(name, None)
        yield env


def reports(out_dir: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(out_dir.glob("try*.rank*.json"))}


def test_the_entry_points_are_visible_to_the_agent(compat_env, tmp_path):
    result = run_fsm_agent(["plugins", "--json"], compat_env, str(tmp_path))
    assert result.returncode == 0, result.stderr
    bridge = next(r for r in json.loads(result.stdout) if r["name"] == "rendezvous-torchrun-handlers")
    assert bridge["backends"] == {"rendezvous": ["mini"]} and bridge["kinds"] == ["rendezvous"]


def test_rdzv_backend_from_a_torchrun_handlers_entry_point(compat_env, tmp_path):
    """``--rdzv-backend mini`` runs the group through the entry point's handler, also on a restart."""
    marker, out_dir = tmp_path / "rounds.jsonl", tmp_path / "out"
    out_dir.mkdir()
    result = run_fsm_agent(
        [
            "run",
            "--rdzv-backend",
            "mini",
            "--rdzv-id",
            "mini-job",
            "--rdzv-conf",
            f"marker={marker}",
            "--nnodes",
            "1",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--monitor-interval",
            "0.1",
            "--log-dir",
            str(tmp_path / "logs"),
            str(WORKER),
            str(out_dir),
            "--crash-first-attempt",
            "1",
        ],
        compat_env,
        str(tmp_path),
    )
    assert result.returncode == 0, result.stderr
    # The handler module imports torch's rendezvous package at its top, as most do: loading it must
    # not reach torch's own entry-point loop half-imported (a logged circular-import traceback).
    assert "out of tree plugin" not in result.stderr and "circular import" not in result.stderr
    rounds = [json.loads(line) for line in marker.read_text().splitlines()]
    # One round per attempt, both from the mini handler, in the agent process (not the workers).
    assert [(r["backend"], r["run_id"], r["round"]) for r in rounds] == [
        ("mini", "mini-job", 0),
        ("mini", "mini-job", 1),
    ]
    assert {r["pid"] for r in rounds} == {result.pid}
    got = reports(out_dir)
    assert sorted(got) == ["try1.rank0", "try1.rank1"], got  # the first attempt failed before reporting
    for report in got.values():
        env = report["env"]
        # The workers met where the handler's RendezvousInfo said, with torch's pure-handler semantics.
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == (rounds[1]["master_addr"], str(rounds[1]["master_port"]))
        assert (env["WORLD_SIZE"], env["GROUP_RANK"], env["TORCHELASTIC_RUN_ID"]) == ("2", "0", "mini-job")
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "False" and env["TORCHELASTIC_RESTART_COUNT"] == "1"
        assert report["all_reduce"] == 3.0  # 1 + 2: a real gloo group formed


def test_logs_specs_from_a_torchrun_logs_specs_entry_point(compat_env, tmp_path):
    """``--logs-specs mini`` lays the worker logs out as the entry point's LogsSpecs says."""
    log_dir, out_dir = tmp_path / "logs", tmp_path / "out"
    out_dir.mkdir()
    result = run_fsm_agent(
        [
            "run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--logs-specs",
            "mini",
            "--log-dir",
            str(log_dir),
            str(WORKER),
            str(out_dir),
        ],
        compat_env,
        str(tmp_path),
    )
    assert result.returncode == 0, result.stderr
    run_id = reports(out_dir)["try0.rank0"]["env"]["TORCHELASTIC_RUN_ID"]
    root = log_dir / "mini-logs"
    for rank in (0, 1):
        stem = root / f"{run_id}.try0.rank{rank}"
        assert f"dist_worker rank {rank} try 0 on stdout" in Path(f"{stem}.out").read_text()
        assert f"dist_worker rank {rank} try 0 on stderr" in Path(f"{stem}.err").read_text()
    # Not torch's default layout (<run_id>_<random>/attempt_0/<rank>/), and not on the console.
    assert not list(log_dir.glob("*/attempt_0")) and not list(log_dir.glob("*/*/attempt_0"))
    assert "dist_worker rank" not in result.stdout + result.stderr
    assert (root / "events.jsonl").is_file()  # the events file follows the LogsSpecs' root_log_dir


def test_torchrun_itself_runs_the_same_fixture(compat_env, tmp_path):
    """Parity: the fixture is a genuine torchrun plugin (torch's own torchrun uses both entry points)."""
    marker, log_dir, out_dir = tmp_path / "rounds.jsonl", tmp_path / "logs", tmp_path / "out"
    out_dir.mkdir()
    result = run_in_session(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--rdzv-backend",
            "mini",
            "--rdzv-id",
            "torchrun-job",
            "--rdzv-conf",
            f"marker={marker}",
            "--nnodes",
            "1",
            "--nproc-per-node",
            "2",
            "--logs-specs",
            "mini",
            "--log-dir",
            str(log_dir),
            str(WORKER),
            str(out_dir),
        ],
        env=compat_env,
        cwd=str(tmp_path),
        timeout=TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr
    assert [json.loads(line)["run_id"] for line in marker.read_text().splitlines()] == ["torchrun-job"]
    assert (log_dir / "mini-logs" / "torchrun-job.try0.rank1.out").is_file()
    assert {r["all_reduce"] for r in reports(out_dir).values()} == {3.0}


def test_unknown_logs_specs_name_is_one_line_naming_the_installed_ones(compat_env, tmp_path):
    result = run_fsm_agent(
        ["run", "--standalone", "--logs-specs", "nope", str(WORKER), str(tmp_path)], compat_env, str(tmp_path)
    )
    assert result.returncode != 0
    assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr
    assert "--logs-specs 'nope'" in result.stderr and "mini" in result.stderr


def test_a_failing_torchrun_handlers_entry_point_is_one_line(tmp_path):
    """Where torch logs a warning with a traceback and carries on, the agent stops with one line
    naming the entry point, its distribution and the cause; disabling the bridge gets past it."""
    site = tmp_path / "site"
    dist_info = site / "broken_handler-0.0.2.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-handler\nVersion: 0.0.2\n")
    (dist_info / "entry_points.txt").write_text("[torchrun.handlers]\nbroken = broken_handler:handler\n")
    (site / "broken_handler.py").write_text("raise ImportError('needs a library that is not installed')\n")
    script = tmp_path / "train.py"
    script.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FSM_AGENT_", "PET_"))}
    env["PYTHONPATH"] = pythonpath(site)

    for argv in (["plugins"], ["run", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", str(script)]):
        result = run_fsm_agent(argv, env, str(tmp_path))
        assert result.returncode != 0
        assert len(result.stderr.splitlines()) == 1, result.stderr
        line = result.stderr.strip()
        assert all(part in line for part in ("'broken'", "broken-handler 0.0.2", "needs a library")), line
        assert "Traceback" not in result.stderr
    assert not (tmp_path / "ran").exists()

    result = run_fsm_agent(
        ["run", "--standalone", "--disable-plugin", "rendezvous-torchrun-handlers", str(script)], env, str(tmp_path)
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "ran").exists()


def test_a_failing_torchrun_logs_specs_entry_point_is_one_line(tmp_path):
    site = tmp_path / "site"
    dist_info = site / "broken_logs-0.0.3.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-logs\nVersion: 0.0.3\n")
    (dist_info / "entry_points.txt").write_text("[torchrun.logs_specs]\nbroken = broken_logs:Specs\n")
    (site / "broken_logs.py").write_text("raise ImportError('needs a library that is not installed')\n")
    script = tmp_path / "train.py"
    script.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FSM_AGENT_", "PET_"))}
    env["PYTHONPATH"] = pythonpath(site)
    result = run_fsm_agent(["run", "--standalone", "--logs-specs", "broken", str(script)], env, str(tmp_path))
    assert result.returncode != 0
    assert len(result.stderr.splitlines()) == 1 and "Traceback" not in result.stderr, result.stderr
    assert all(part in result.stderr for part in ("'broken'", "broken-logs 0.0.3", "ImportError", "needs a library"))
    assert not (tmp_path / "ran").exists()
