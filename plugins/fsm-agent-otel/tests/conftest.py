"""Fixtures (the plugins' tests directories are not packages, so helpers are fixtures, not imports).

``memory_spans``: an InMemorySpanExporter on the process's global SDK TracerProvider (set once per
process, as OpenTelemetry allows), cleared around each test. ``agents``: ``python -m fsm_agent run``
processes in their own sessions, killed by process group at teardown. ``worker_script``: the
crash-once worker.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

CRASH_ONCE = """
    import os, sys, time
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["LOCAL_RANK"] == "1":
        time.sleep(0.3)
        sys.exit(7)   # attempt 0: rank 1 crashes; the agent stops rank 0 and restarts the group
    time.sleep(0.5 if os.environ["TORCHELASTIC_RESTART_COUNT"] != "0" else 60)
"""


@pytest.fixture(scope="session")
def _memory_exporter():
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


@pytest.fixture
def memory_spans(_memory_exporter):
    _memory_exporter.clear()
    yield _memory_exporter
    _memory_exporter.clear()


@pytest.fixture
def worker_script(tmp_path) -> str:
    path = tmp_path / "crash_once.py"
    path.write_text(textwrap.dedent(CRASH_ONCE))
    return str(path)


class Agents:
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
            proc.wait(timeout=30)
            for pipe in (proc.stdout, proc.stderr):
                if pipe:
                    pipe.close()


@pytest.fixture
def agents(tmp_path):
    group = Agents(tmp_path)
    yield group
    group.kill_all()
