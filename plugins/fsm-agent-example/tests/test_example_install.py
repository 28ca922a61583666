"""The installed distribution: fsm-agent finds the plugin through its entry point, lists it, and
``fsm-agent run --launcher example`` uses it. Skipped unless ``pip install -e plugins/fsm-agent-example``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from importlib.metadata import PackageNotFoundError, distribution

import pytest

import fsm_agent_example
from fsm_agent.plugins.manager import build_registry, get_plugin_manager

try:
    distribution("fsm-agent-example")
except PackageNotFoundError:
    pytest.skip("fsm-agent-example is not installed: pip install -e plugins/fsm-agent-example",
                allow_module_level=True)


def fsm_agent(*args, cwd, timeout=120):
    proc = subprocess.Popen([sys.executable, "-m", "fsm_agent", *args], cwd=cwd, text=True, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    return proc.returncode, out, err


def test_the_entry_point_registers_the_plugin_and_its_launcher():
    pm = get_plugin_manager()
    assert pm.get_plugin("example") is fsm_agent_example
    assert "example" in build_registry(pm).names("launcher")


def test_fsm_agent_plugins_lists_it(tmp_path):
    code, out, err = fsm_agent("plugins", "--json", cwd=tmp_path)
    assert code == 0, err
    (row,) = [row for row in json.loads(out) if row["name"] == "example"]
    assert row["distribution"] == "fsm-agent-example" and not row["builtin"]
    assert {"fsm_agent_register_backends", "fsm_agent_configure"} <= set(row["hooks"])


def test_fsm_agent_run_with_the_example_launcher(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent("""
        import os, sys
        attempt, rank = os.environ["FSM_EXAMPLE_ATTEMPT"], os.environ["LOCAL_RANK"]
        open(os.path.join(os.path.dirname(__file__), f"seen-{attempt}-{rank}"), "w").close()
        sys.exit(1 if (attempt, rank) == ("0", "1") else 0)
    """))
    events = tmp_path / "events.jsonl"
    code, out, err = fsm_agent("run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                               "--launcher", "example", "--example-attempt-env", "true", "--events-file", str(events), str(script), cwd=tmp_path)
    assert code == 0, err
    transitions = [json.loads(line) for line in events.read_text().splitlines()]
    assert [(e["source"], e["dest"]) for e in transitions if e["kind"] == "transition"] == [
        ("INIT", "HEALTHY"), ("HEALTHY", "STOPPED"), ("STOPPED", "HEALTHY"), ("HEALTHY", "SUCCEEDED")]
    assert sorted(p.name for p in tmp_path.glob("seen-*")) == ["seen-0-0", "seen-0-1", "seen-1-0", "seen-1-1"]
