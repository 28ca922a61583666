"""The span recorder on fsm-agent's test kit (fake rendezvous and launcher, real agent and hooks): fast."""

from __future__ import annotations

import fsm_agent_otel
import pytest

testing = pytest.importorskip("fsm_agent.testing", reason="fsm-agent's test kit is not installed")


def test_spans_follow_the_statechart_of_a_scripted_crash_and_restart(make_agent, memory_spans):
    scenario = testing.Scenario(
        "worker 1 exits 1 -> restart -> all succeed", max_restarts=1, plugins={"otel": fsm_agent_otel}
    )
    result = scenario.run(make_agent)
    result.assert_trace(["INIT->HEALTHY", "HEALTHY->STOPPED", "STOPPED->HEALTHY", "HEALTHY->SUCCEEDED"])

    spans = memory_spans.get_finished_spans()
    states = sorted((s for s in spans if s.name != "fsm-agent run"), key=lambda s: s.start_time)
    assert [s.name for s in states] == ["INIT", "HEALTHY", "STOPPED", "HEALTHY", "SUCCEEDED"]
    assert [s.attributes["fsm_agent.restart_count"] for s in states] == [0, 0, 1, 1, 1]
    assert [e.attributes["exit_code"] for e in states[1].events if e.name == "worker_exit"] == [1]
