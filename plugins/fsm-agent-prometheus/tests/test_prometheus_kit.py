"""The exporter on fsm-agent's test kit (fake rendezvous and launcher, real agent and hooks): fast, no HTTP."""

from __future__ import annotations

import pytest
from fsm_agent_prometheus import PrometheusExporter

testing = pytest.importorskip("fsm_agent.testing", reason="fsm-agent's test kit is not installed")


def test_registry_after_a_scripted_crash_and_restart(make_agent):
    exporter = PrometheusExporter(role="default")
    scenario = testing.Scenario(
        "worker 1 exits 1 -> restart -> all succeed", max_restarts=1, plugins={"prometheus-exporter": exporter}
    )
    scenario.run(make_agent).assert_trace(
        ["INIT->HEALTHY", "HEALTHY->STOPPED", "STOPPED->HEALTHY", "HEALTHY->SUCCEEDED"]
    )

    def value(name, **labels):
        return exporter.registry.get_sample_value(name, {"role": "default", **labels})

    assert value("torchelastic_workers_remaining_restarts") == 0
    assert value("torchelastic_workers_run_success_with_retries_total") == 1
    assert value("torchelastic_workers_run_failed_no_retries_total") == 0
    assert value("torchelastic_workers_state_total", state="HEALTHY") == 2
    assert value("fsm_agent_worker_group_state", state="SUCCEEDED") == 1
    assert value("fsm_agent_restart_count") == 1
    assert {st: value("fsm_agent_state_duration_seconds_count", state=st) for st in ("INIT", "HEALTHY", "STOPPED")} == {
        "INIT": 1,
        "HEALTHY": 2,
        "STOPPED": 1,
    }
    assert value("fsm_agent_worker_exits_total", exit_code="1") == 1
    assert value("fsm_agent_transitions_total", source="STOPPED", dest="HEALTHY", trigger="restart") == 1
