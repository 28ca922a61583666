"""Helpers for tests that start real agents: process-group cleanup, free ports, event files."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_events(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def transitions(path: Path) -> list[tuple[str, str, str]]:
    return [(e["source"], e["dest"], e["trigger"]) for e in read_events(path) if e["kind"] == "transition"]


def assert_excluded_node_left(excluded: Path, survivor: Path) -> None:
    """The excluded node's events end UNHEALTHY -> FAILED; the survivor's first change after is a
    lost node (``membership_changed``, ``node_lost``) and it ends without spending a restart."""
    assert transitions(excluded)[-1] == ("UNHEALTHY", "FAILED", "workers_failed")
    events = read_events(survivor)
    changed = [
        e for e in events if e["kind"] == "transition" and e["trigger"] in ("membership_changed", "workers_failed")
    ]
    assert changed and changed[0]["trigger"] == "membership_changed" and changed[0]["failure_class"] == "node_lost", (
        changed
    )
    assert events[-1]["kind"] == "run_end" and events[-1]["restart_count"] == 0


@pytest.fixture
def agents(agent_processes):
    """Real ``fsm-agent run`` processes in tmp_path (the test kit's AgentProcesses)."""
    return agent_processes
