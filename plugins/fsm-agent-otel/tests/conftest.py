"""Fixtures (the plugins' tests directories are not packages, so helpers are fixtures, not imports).

``memory_spans``: an InMemorySpanExporter on the process's global SDK TracerProvider (set once per
process, as OpenTelemetry allows), cleared around each test. ``agents``: ``python -m fsm_agent run``
processes in their own sessions, killed by process group at teardown. ``worker_script``: the
crash-once worker.
"""

from __future__ import annotations

import textwrap

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


@pytest.fixture
def agents(agent_processes):
    """Real ``fsm-agent run`` processes in tmp_path (fsm-agent's test kit, AgentProcesses)."""
    return agent_processes
