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


@pytest.fixture
def agents(agent_processes):
    """Real ``fsm-agent run`` processes in tmp_path (the test kit's AgentProcesses)."""
    return agent_processes
