"""fsm_agent.testing.coverage: the table's edges, the run loop's rules (computed from the agent's
source, checked here on the real agent and on edited copies of it), and the report."""

from __future__ import annotations

import inspect
import json
import os
import sys

import pytest

import fsm_agent.agent
import fsm_agent.watcher
from fsm_agent.plugins import coverage_recorder
from fsm_agent.plugins.manager import BUILTIN_PLUGINS, TEST_TOOLING_PLUGINS, get_plugin_manager, plugin_rows
from fsm_agent.states.table import TRANSITIONS
from fsm_agent.states.worker_state import WorkerState as S
from fsm_agent.testing.coverage import (
    COVERAGE_DIR_ENV,
    Edge,
    Observation,
    build_report,
    reachable_edges,
    read_observations,
    run_loop_rules,
    table_edges,
)
from tests.helpers.processes import run_in_session

pytestmark = pytest.mark.unit

UNHEALTHY_SUCCESS = Edge("UNHEALTHY", "workers_succeeded", "SUCCEEDED")
AGENT_SOURCE = inspect.getsource(fsm_agent.agent)
WATCHER_SOURCE = inspect.getsource(fsm_agent.watcher)
AUTO_DISPATCH = "auto = AUTO_TRIGGERS.get(self.state)"


def edited(old: str, new: str) -> str:
    """The agent's source with the first ``old`` replaced by ``new``."""
    assert old in AGENT_SOURCE, f"the agent's source no longer contains {old!r}"
    return AGENT_SOURCE.replace(old, new, 1)


def dispatch_line() -> int:
    """The line of ``_step`` that fires ``AUTO_TRIGGERS[self.state]``."""
    return next(i for i, line in enumerate(AGENT_SOURCE.splitlines()) if AUTO_DISPATCH in line) + 1


# -- edges --------------------------------------------------------------------------------------


def test_every_row_gives_one_edge_per_source_and_all_are_reachable_from_init():
    edges = table_edges()
    # One edge per (source, trigger, destination): guarded rows to the same destination share it.
    expected = {
        (s, row["trigger"], row["dest"])
        for row in TRANSITIONS
        for s in (row["source"] if isinstance(row["source"], list) else [row["source"]])
    }
    assert len(edges) == len(set(edges)) == len(expected) == 39
    assert (
        Edge("HEALTHY", "workers_failed", "STOPPED") in edges and Edge("HEALTHY", "workers_failed", "FAILED") in edges
    )
    assert reachable_edges() == edges
    assert str(edges[0]) == "INIT --start--> HEALTHY"


def test_edges_from_a_state_unreachable_from_init_are_not_counted():
    island = [
        dict(trigger="start", source=S.INIT, dest=S.HEALTHY),
        dict(trigger="workers_succeeded", source=S.HEALTHY, dest=S.SUCCEEDED),
        dict(trigger="restart", source=S.STOPPED, dest=S.HEALTHY),
    ]  # nothing leads to STOPPED
    assert Edge("STOPPED", "restart", "HEALTHY") not in reachable_edges(island)
    report = build_report([], transitions=island)
    assert report.unreachable_states == (Edge("STOPPED", "restart", "HEALTHY"),)
    assert Edge("STOPPED", "restart", "HEALTHY") not in report.counted


# -- the run loop's rules -----------------------------------------------------------------------


def test_the_run_loop_cannot_take_exactly_one_edge_of_the_table_and_says_why():
    rules = run_loop_rules()
    unreachable = rules.unreachable(reachable_edges())
    assert list(unreachable) == [UNHEALTHY_SUCCESS]
    why = unreachable[UNHEALTHY_SUCCESS]
    assert "HealthyWatch.wait (fsm_agent/watcher.py:" in why and f"fsm_agent/agent.py:{dispatch_line()}" in why
    assert "never calls in UNHEALTHY: it fires workers_failed there by itself (AUTO_TRIGGERS" in why
    # what the run loop can do in each live state
    assert sorted(rules.fireable["UNHEALTHY"]) == [
        "agent_errored",
        "drain_requested",
        "job_failed",
        "node_check_failed",  # named by the node-check steps: rule 3 assumes every live state
        "nodes_excluded",
        "rendezvous_failed",
        "rendezvous_not_needed",
        "stop_requested",
        "workers_failed",
    ]
    assert {"workers_succeeded", "workers_hung", "membership_changed"} <= set(rules.fireable["HEALTHY"])
    assert "start" in rules.fireable["INIT"] and "start" not in rules.fireable["STOPPED"]
    assert "AUTO_TRIGGERS" in rules.fireable["STOPPED"]["restart"]


def test_rules_follow_the_table_not_a_list():
    """Without UNHEALTHY's auto trigger, the run loop would wait for facts there and could report
    success while UNHEALTHY: the edge counts."""
    rules = run_loop_rules(auto_triggers={S.INIT: "start", S.STOPPED: "restart"})
    assert rules.unreachable(reachable_edges()) == {}
    assert "workers_succeeded" in rules.fireable["UNHEALTHY"]


def test_a_tightened_table_has_no_edge_the_run_loop_cannot_take():
    tightened = [dict(row, source=S.HEALTHY) if row["trigger"] == "workers_succeeded" else row for row in TRANSITIONS]
    report = build_report([], transitions=tightened)
    assert report.unreachable == {} and len(report.counted) == 38


def test_a_trigger_named_outside_the_fact_analysis_counts_in_every_state():
    source = edited(
        "    def _fire_error(self, fact: RendezvousFailed | AgentErrored) -> None:",
        "    def _succeed_anyway(self) -> None:\n        self._fire(WorkersSucceeded())\n\n"
        "    def _fire_error(self, fact: RendezvousFailed | AgentErrored) -> None:",
    )
    rules = run_loop_rules(source, "agent.py")
    assert rules.unreachable(reachable_edges()) == {}
    assert "assumed possible in every live state" in rules.fireable["UNHEALTHY"]["workers_succeeded"]


def test_a_computed_fact_could_be_any_trigger():
    assert "return StopRequested()" in WATCHER_SOURCE
    watcher = WATCHER_SOURCE.replace("return StopRequested()", "return self._drains.next_fact()", 1)
    rules = run_loop_rules(watcher_source=watcher, watcher_path="watcher.py")
    assert "restart" in rules.fireable["HEALTHY"]
    assert "computed value" in rules.fireable["HEALTHY"]["restart"]


def test_without_the_auto_trigger_dispatch_the_analysis_assumes_the_worst():
    source = edited(AUTO_DISPATCH, "auto = self._auto_trigger()")
    rules = run_loop_rules(source, "agent.py")
    assert rules.unreachable(reachable_edges()) == {}
    assert "restart" in rules.fireable["INIT"]


# -- the report ---------------------------------------------------------------------------------


def observed(*edges: Edge, where: str = "tests/x.py::test_y") -> list[Observation]:
    return [Observation(edge, where) for edge in edges]


def test_report_counts_lists_missing_and_applies_the_threshold():
    start, success = Edge("INIT", "start", "HEALTHY"), Edge("HEALTHY", "workers_succeeded", "SUCCEEDED")
    report = build_report(observed(start, start, success), threshold=50)
    assert report.covered == [start, success] and report.counts[start] == 2
    assert len(report.missing) == 36 and report.percent == pytest.approx(200 / 38)
    assert not report.passed
    text = report.format()
    assert text.splitlines()[0] == "statechart coverage: 2/38 transitions exercised (5.3%)"
    assert "INIT --start--> HEALTHY" in text and "2x  e.g. tests/x.py::test_y" in text
    assert "missing (36):" in text and "    STOPPED --restart--> HEALTHY" in text
    assert f"{UNHEALTHY_SUCCESS}: workers_succeeded comes only from" in text
    assert "required: 50% -> FAILED" in text
    as_json = report.to_json()
    assert as_json["covered"] == 2 and as_json["counted"] == 38 and not as_json["passed"]
    assert json.loads(json.dumps(as_json)) == as_json


def test_full_coverage_passes_100():
    report = build_report(observed(*reachable_edges()), threshold=100)
    assert report.percent == 100 and report.passed and report.missing == []
    assert report.contradictions == [UNHEALTHY_SUCCESS]  # observed although "impossible": flagged
    assert "WARNING: UNHEALTHY --workers_succeeded--> SUCCEEDED was observed 1x" in report.format()


def test_foreign_edges_are_reported_not_counted():
    report = build_report(observed(Edge("HEALTHY", "teleported", "SUCCEEDED")))
    assert report.covered == [] and report.foreign == {Edge("HEALTHY", "teleported", "SUCCEEDED"): 1}
    assert "observed but not in the table (not counted): HEALTHY --teleported--> SUCCEEDED 1x" in report.format()


# -- the recorder (built-in plugin statechart-coverage) ------------------------------------------


def test_the_recorder_is_test_tooling_registered_only_while_coverage_records(monkeypatch, tmp_path):
    assert "statechart-coverage" not in BUILTIN_PLUGINS
    assert TEST_TOOLING_PLUGINS["statechart-coverage"] == ("fsm_agent.plugins.coverage_recorder", COVERAGE_DIR_ENV)
    assert COVERAGE_DIR_ENV == "FSM_STATECHART_COVERAGE_DIR"  # not FSM_AGENT_*: harnesses scrub those
    monkeypatch.setenv(COVERAGE_DIR_ENV, str(tmp_path))
    pm = get_plugin_manager(load_entry_points=False)
    assert pm.get_plugin("statechart-coverage") is coverage_recorder
    assert "statechart-coverage" not in [row["name"] for row in plugin_rows(pm)]  # not listed to users
    assert (
        get_plugin_manager(disabled=["statechart-coverage"], load_entry_points=False).get_plugin("statechart-coverage")
        is None
    )  # its name still works for --disable-plugin
    monkeypatch.delenv(COVERAGE_DIR_ENV)
    assert get_plugin_manager(load_entry_points=False).get_plugin("statechart-coverage") is None


def test_the_recorder_writes_only_when_a_directory_is_set(tmp_path, monkeypatch):
    monkeypatch.delenv(COVERAGE_DIR_ENV, raising=False)
    coverage_recorder.record("INIT", "start", "HEALTHY")
    monkeypatch.setenv(COVERAGE_DIR_ENV, str(tmp_path))
    coverage_recorder.record("INIT", "start", "HEALTHY")
    coverage_recorder.record("HEALTHY", "workers_succeeded", "SUCCEEDED")
    with open(tmp_path / f"transitions-{os.getpid()}.jsonl", "a") as f:
        f.write('{"source": "HEALTHY", "trig')  # a process killed mid-line
    got = read_observations(str(tmp_path))
    assert [o.edge for o in got] == [
        Edge("INIT", "start", "HEALTHY"),
        Edge("HEALTHY", "workers_succeeded", "SUCCEEDED"),
    ]
    assert got[0].where.endswith("test_the_recorder_writes_only_when_a_directory_is_set")


def test_a_forked_child_writes_its_own_file(tmp_path, monkeypatch):
    monkeypatch.setenv(COVERAGE_DIR_ENV, str(tmp_path))
    coverage_recorder.record("INIT", "start", "HEALTHY")
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            coverage_recorder.record("HEALTHY", "stop_requested", "FAILED")
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == sorted([f"transitions-{os.getpid()}.jsonl", f"transitions-{pid}.jsonl"])
    assert len(read_observations(str(tmp_path))) == 2


def test_a_subprocess_agent_records_its_transitions(tmp_path):
    """A real `python -m fsm_agent run` (real worker) records through the inherited variable."""
    script = tmp_path / "ok.py"
    script.write_text("print('hello')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    env[COVERAGE_DIR_ENV] = str(tmp_path / "cov")
    done = run_in_session(
        [
            sys.executable,
            "-m",
            "fsm_agent",
            "run",
            "--standalone",
            "--nproc-per-node",
            "1",
            "--log-dir",
            str(tmp_path / "logs"),
            str(script),
        ],
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    got = read_observations(str(tmp_path / "cov"))
    assert [o.edge for o in got] == [
        Edge("INIT", "start", "HEALTHY"),
        Edge("HEALTHY", "workers_succeeded", "SUCCEEDED"),
    ]
    assert got[0].where == f"pid {done.pid} (__main__.py)"
