"""Helpers for tests that start real agents: process-group cleanup, free ports, event files."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
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


class Agents:
    """Starts `python -m fsm_agent run ...` processes, each in its own process group; kills the groups."""

    def __init__(self, cwd: Path):
        self.cwd, self.procs = cwd, []

    def start(self, *args: str, env: dict | None = None) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-m", "fsm_agent", "run", *args], cwd=self.cwd, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                env={**os.environ, **(env or {})})
        self.procs.append(proc)
        return proc

    def kill_all(self) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.communicate()


@pytest.fixture
def agents(tmp_path):
    group = Agents(tmp_path)
    yield group
    group.kill_all()
