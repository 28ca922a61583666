"""The agent's last resort, found by the property test: when the error path itself fails.

``ElasticAgent._fire_error``: if the error trigger's own step raises (here ``_stop_workers`` fails
once), the agent stops the workers without grace, lands in UNKNOWN with both errors kept, and
records the change as ``agent_errored`` (the table's edge from every live state to UNKNOWN).
"""

from __future__ import annotations

import pytest

from fsm_agent.testing import Scenario
from fsm_agent.testing.coverage import Edge, table_edges

pytestmark = pytest.mark.property


def store_lost_and_stop_fails_once():
    """The rendezvous store goes away while the workers run, and the first stop fails."""
    return (
        Scenario()
        .rendezvous(waiting_raises="connection")
        .attempt("never", stop_raises=RuntimeError("scripted stop failure"), stop_raises_times=1)
    )


def test_the_last_resort_lands_in_unknown_through_a_table_edge(make_agent):
    run = store_lost_and_stop_fails_once().run(make_agent)
    run.assert_trace(["INIT->HEALTHY (start)", "HEALTHY->UNKNOWN (agent_errored)"])
    assert "then rendezvous_failed failed: RuntimeError: scripted stop failure" in run.result.error
    assert all(Edge(r.source, r.trigger, r.dest) in set(table_edges()) for r in run.agent.transitions)


def test_no_worker_runs_once_run_returns(make_agent):
    run = store_lost_and_stop_fails_once().run(make_agent)
    assert run.launcher.running() == []
