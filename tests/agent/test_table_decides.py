"""The table decides: the restart decision is a step of the table's rows, made once per event from
the trigger's data; replay and the test kit drive the machine only through public triggers."""

from __future__ import annotations

import ast
import pathlib

import pytest
from transitions.core import MachineError

import fsm_agent
from fsm_agent.plugins import hookimpl
from fsm_agent.states.statechart import render
from fsm_agent.testing import Scenario
from fsm_agent.worker import RestartDecision

pytestmark = pytest.mark.unit

PACKAGE = pathlib.Path(fsm_agent.__file__).parent


class CountingPolicy:
    """Gives up every time, so transitions tries all three workers_failed rows before one is enabled."""

    def __init__(self):
        self.calls = []

    @hookimpl(tryfirst=True)
    def fsm_agent_restart_policy(self, failures, restart_count, failure_class):
        self.calls.append((sorted(failures), failure_class))
        return RestartDecision(False, reason="counting policy gives up")


def test_the_restart_policy_is_asked_once_per_event(make_agent):
    policy = CountingPolicy()
    run = Scenario("worker 1 exits 1", max_restarts=3).run(lambda **kw: make_agent(plugins=[policy], **kw))
    assert run.trace == ["INIT->HEALTHY", "HEALTHY->FAILED"]
    assert policy.calls == [([1], "exit_code")]
    assert run.result.verdict == "counting policy gives up"


def test_a_membership_change_is_decided_once_and_recorded_with_its_class(make_agent, tmp_path):
    policy = CountingPolicy()
    events = tmp_path / "events.jsonl"
    run = Scenario("node lost", max_restarts=1).run(
        lambda **kw: make_agent(plugins=[policy], events_path=str(events), **kw)
    )
    assert run.trace[-1] == "HEALTHY->FAILED"
    assert policy.calls == [([], "node_lost")]
    assert '"failure_class": "node_lost"' in events.read_text()


def test_fire_takes_the_facts_as_data_and_refuses_what_the_state_cannot_do(make_agent):
    agent = make_agent(max_restarts=1)
    with pytest.raises(MachineError):
        agent.fire("workers_failed", exits={0: 1})  # INIT: nothing runs yet
    agent.fire("start")
    agent.fire("workers_failed", exits={1: 3}, exit_times={1: 100.0})
    assert agent.state.value == "STOPPED" and agent.restart_count == 1
    agent.fire("restart")
    agent.fire("workers_hung", hung={0: "no heartbeat for 9s"})
    agent.fire("workers_failed")  # UNHEALTHY: the hung worker is the failure
    assert agent.state.value == "FAILED"
    assert agent.transitions[-1].trigger == "workers_failed"
    agent.close()


def test_a_failing_step_takes_the_tables_error_row(make_agent):
    agent = make_agent()
    agent.fire("start")
    agent.fire("workers_failed")  # no exits from HEALTHY: the decision step refuses it
    assert [t.trigger for t in agent.transitions] == ["start", "agent_errored"]
    assert "workers_failed needs the failed workers' exits" in agent.transitions[-1].error
    agent.close()


def test_the_statechart_shows_which_hook_decides_each_row():
    doc = render("markdown")
    transitions = doc.split("## Facts")[0]  # the Transitions table, not the facts' table after it
    rows = [
        line
        for line in transitions.splitlines()
        if "| `workers_failed` |" in line or "| `membership_changed` |" in line
    ]
    assert len(rows) == 10  # workers_failed: in process, and three decisions from HEALTHY and from UNHEALTHY
    assert all("prepare: `_decide_on" in row and "`fsm_agent_restart_policy`" in row for row in rows)
    assert "`workers_failed` in UNHEALTHY" in doc  # UNHEALTHY's way out is an auto trigger of the table


def _private_agent_accesses(path: pathlib.Path) -> list[str]:
    """``agent._x`` / ``self.agent._x`` / ``self._agent._x`` / ``run.agent._x`` attribute reads in one module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        owner = node.value
        name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
        if name in ("agent", "_agent"):
            found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: agent.{node.attr}")
    return found


def test_nothing_outside_agent_py_touches_the_agents_private_attributes():
    modules = [p for p in PACKAGE.rglob("*.py") if p.name != "agent.py"]
    modules += list((PACKAGE.parent / "plugins").rglob("src/**/*.py"))
    found = [hit for module in modules for hit in _private_agent_accesses(module)]
    assert found == []
