"""The installed distribution: fsm-agent finds the plugin through its entry point, lists it, and
``fsm-agent run --launcher example`` uses it. Skipped unless ``pip install -e plugins/fsm-agent-example``."""

from __future__ import annotations

import json
import textwrap
from importlib.metadata import PackageNotFoundError, distribution

import fsm_agent_example
import pytest

from fsm_agent.plugins.manager import build_registry, get_plugin_manager
from fsm_agent.testing import AgentProcesses

try:
    distribution("fsm-agent-example")
except PackageNotFoundError:
    pytest.skip("fsm-agent-example is not installed: pip install -e plugins/fsm-agent-example", allow_module_level=True)


@pytest.fixture
def fsm_agent(tmp_path):
    """``python -m fsm_agent ...`` processes in tmp_path (fsm-agent's test kit); groups killed after."""
    with AgentProcesses(tmp_path, command=()) as processes:
        yield processes


def test_the_entry_point_registers_the_plugin_and_its_launcher():
    pm = get_plugin_manager()
    assert pm.get_plugin("example") is fsm_agent_example
    assert "example" in build_registry(pm).names("launcher")


def test_fsm_agent_plugins_lists_it(fsm_agent):
    done = fsm_agent.run("plugins", "--json")
    assert done.returncode == 0, done.stderr
    (row,) = [row for row in json.loads(done.stdout) if row["name"] == "example"]
    assert row["distribution"] == "fsm-agent-example" and not row["builtin"]
    assert {"fsm_agent_register_backends", "fsm_agent_configure"} <= set(row["hooks"])


def test_fsm_agent_run_with_the_example_launcher(fsm_agent, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(
        textwrap.dedent("""
        import os, sys, time
        attempt, rank = os.environ["FSM_EXAMPLE_ATTEMPT"], os.environ["LOCAL_RANK"]
        here = os.path.dirname(__file__)
        open(os.path.join(here, f"seen-{attempt}-{rank}"), "w").close()
        if (attempt, rank) == ("0", "1"):
            # Fail only once rank 0 has recorded itself: the restart stops it otherwise.
            deadline = time.monotonic() + 60
            while not os.path.exists(os.path.join(here, "seen-0-0")) and time.monotonic() < deadline:
                time.sleep(0.01)
            sys.exit(1)
    """)
    )
    events = tmp_path / "events.jsonl"
    done = fsm_agent.run(
        "run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--launcher",
        "example",
        "--example-attempt-env",
        "true",
        "--events-file",
        str(events),
        str(script),
    )
    assert done.returncode == 0, done.stderr
    transitions = [json.loads(line) for line in events.read_text().splitlines()]
    assert [(e["source"], e["dest"]) for e in transitions if e["kind"] == "transition"] == [
        ("INIT", "HEALTHY"),
        ("HEALTHY", "STOPPED"),
        ("STOPPED", "HEALTHY"),
        ("HEALTHY", "SUCCEEDED"),
    ]
    assert sorted(p.name for p in tmp_path.glob("seen-*")) == ["seen-0-0", "seen-0-1", "seen-1-0", "seen-1-1"]
