"""The example launcher passes fsm-agent's launcher conformance suite, then runs a real job."""

from __future__ import annotations

import sys
import textwrap

import fsm_agent_example
from fsm_agent_example import ExampleLauncher

from fsm_agent.config import LaunchConfig
from fsm_agent.testing import trace
from fsm_agent.testing.conformance import LauncherConformance


class TestExampleLauncher(LauncherConformance):
    callables = False  # programs only
    sweeps_daemons = False  # kills each worker's process group, not daemons that left it

    def make_launcher(self):
        return ExampleLauncher()


def test_a_crash_and_a_restart_with_real_workers(make_agent, tmp_path):
    """The agent, the example launcher and real worker processes (the rendezvous is the fake one)."""
    script = tmp_path / "worker.py"
    script.write_text(
        textwrap.dedent("""
        import os, sys
        attempt, rank = os.environ["FSM_EXAMPLE_ATTEMPT"], os.environ["LOCAL_RANK"]
        print(f"attempt {attempt} rank {rank}")
        sys.exit(1 if (attempt, rank) == ("0", "1") else 0)
    """)
    )
    agent = make_agent(
        launcher=ExampleLauncher(),
        entrypoint=sys.executable,
        args=("-u", str(script)),
        max_restarts=1,
        plugins=[fsm_agent_example],
        config=LaunchConfig(plugins={"example": {"attempt_env": True}}),
    )
    result = agent.run()
    assert trace(agent, triggers=True) == [
        "INIT->HEALTHY (start)",
        "HEALTHY->STOPPED (workers_failed)",
        "STOPPED->HEALTHY (restart)",
        "HEALTHY->SUCCEEDED (workers_succeeded)",
    ]
    assert result.exit_code == 0 and result.restart_count == 1
