"""End to end: the local node checks' options through ``fsm-agent run``: a misconfigured threshold
is one stderr line naming its flag (or variable) before anything starts; switched-on checks that
pass let the workers start, and a failing device command (the fake ``nvidia-smi``) stops the node
before them, its stderr line in the verdict."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest

from tests.conftest import one_error_line

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

FAKE_DEVICE = Path(__file__).resolve().parents[1] / "fixtures" / "fake_device_check.py"

#: id -> (flags, extra env, (the flag or variable named, the check's message))
BAD = {
    "disk-min-free-negative": (
        ["--node-check-disk-min-free-gib", "-1"],
        {},
        ("--node-check-disk-min-free-gib", "expected GiB >= 0, got -1.0"),
    ),
    "disk-min-free-not-a-number": (
        ["--node-check-disk-min-free-gib", "lots"],
        {},
        ("--node-check-disk-min-free-gib", 'expected a number, got "lots"'),
    ),
    "shm-min-negative": (
        ["--node-check-shm-min-gib", "-0.5"],
        {},
        ("--node-check-shm-min-gib", "expected GiB >= 0, got -0.5"),
    ),
    "shm-min-nan": (
        ["--node-check-shm-min-gib", "nan"],
        {},
        ("--node-check-shm-min-gib", "expected a number, got NaN"),
    ),
    "device-timeout-zero": (
        ["--node-check-device-timeout", "0"],
        {},
        ("--node-check-device-timeout", "expected seconds > 0, got 0.0"),
    ),
    "disk-switch-not-a-bool": (
        ["--node-check-disk", "maybe"],
        {},
        ("--node-check-disk", 'expected true or false, got "maybe"'),
    ),
    "env-threshold-negative": (
        [],
        {"FSM_AGENT_NODE_CHECK_DISK_MIN_FREE_GIB": "-2"},
        ("FSM_AGENT_NODE_CHECK_DISK_MIN_FREE_GIB='-2'", "expected GiB >= 0, got -2.0"),
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_misconfigured_threshold_is_one_line(launcher, case):
    flags, env, (named, message) = BAD[case]
    result = launcher.run_fsm(*flags, "--standalone", str(launcher.probe), env=env, timeout=60)
    assert result.returncode != 0
    line = one_error_line(result.stderr)
    assert line.startswith("fsm-agent: error: ") and named in line and message in line, line
    assert result.stdout == ""
    assert launcher.records() == {}, "a worker was started"


def device(mode: str) -> str:
    return shlex.join([sys.executable, str(FAKE_DEVICE), mode])


def test_checks_that_pass_let_the_workers_start(launcher):
    logs = launcher.dir / "logs"
    result = launcher.run_fsm(
        "--standalone",
        "--nproc-per-node",
        "2",
        "--log-dir",
        str(logs),
        "--node-check-disk",
        "true",
        "--node-check-disk-min-free-gib",
        "0.001",
        "--node-check-shm-min-gib",
        "0.001",
        "--node-check-device-command",
        device("ok"),
        str(launcher.probe),
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert sorted(launcher.records()) == [0, 1]


def test_failing_device_command_stops_the_node_before_its_workers(launcher):
    result = launcher.run_fsm(
        "--standalone", "--node-check-device-command", device("fail"), str(launcher.probe), timeout=120
    )
    assert result.returncode != 0
    assert f"device: `{device('fail')}` exited with 1: GPU 3: ECC errors" in result.stderr
    assert "Traceback" not in result.stderr
    assert launcher.records() == {}, "a worker was started"
