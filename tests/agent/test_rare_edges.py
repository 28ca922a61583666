"""Edges of the table that the run loop can take but only through a plugin, exercised here so that
``--statechart-coverage`` of the project's own suite reaches 100%.

The run-loop analysis (``fsm_agent.testing.coverage.run_loop_rules``) counts an edge whenever the
agent's code can fire its trigger in its source state. ``UNHEALTHY --rendezvous_failed--> FAILED``
is such an edge: the agent itself asks the rendezvous nothing while UNHEALTHY, but the restart
policy runs there (the auto trigger ``workers_failed`` -> ``_decide_on_failed_workers``), and a policy that consults the
rendezvous can raise a rendezvous error, which ``_step`` turns into ``rendezvous_failed``.
"""

from __future__ import annotations

import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from fsm_agent.plugins import hookimpl
from fsm_agent.states.worker_state import WorkerState
from fsm_agent.testing import Scenario

pytestmark = pytest.mark.unit


class SharedBudgetPolicy:
    """A restart policy that keeps a job-wide restart budget with the rendezvous; here the
    rendezvous is gone by the time it is asked."""

    def __init__(self):
        self.asked = []

    @hookimpl
    def fsm_agent_restart_policy(self, failures, worker_group, restart_count):
        self.asked.append(sorted(f.failure_class for f in failures.values()))
        raise RendezvousConnectionError("the rendezvous store holding the job's restart budget is unreachable")


def test_rendezvous_lost_while_handling_a_hang(make_agent, hook_recorder):
    policy = SharedBudgetPolicy()
    run = Scenario("worker 1 hangs", max_restarts=3, hang_timeout=1, plugins=[policy]).run(make_agent)
    run.assert_trace(
        ["INIT->HEALTHY (start)", "HEALTHY->UNHEALTHY (workers_hung)", "UNHEALTHY->FAILED (rendezvous_failed)"]
    )
    assert policy.asked == [["hang"]]
    assert run.result.state == WorkerState.FAILED and run.result.restart_count == 0
    assert "RendezvousConnectionError" in run.result.error and "restart budget" in run.result.error
    assert [s.stopped for s in run.launcher.stops] == [(0, 1)]  # the hung group is stopped on the way out
    hook_recorder.assert_sequence(
        ["classify_failure", "record_event", "restart_policy", "state_changed", "record_event", "put_metric*3"],
        transition=2,
    )  # the cycle record, then the decision


def test_rendezvous_lost_while_handling_a_failure(make_agent):
    """The same policy after an ordinary failure: HEALTHY --rendezvous_failed--> FAILED."""
    run = Scenario("worker 0 exits 1", max_restarts=3, plugins=[SharedBudgetPolicy()]).run(make_agent)
    run.assert_trace(["INIT->HEALTHY (start)", "HEALTHY->FAILED (rendezvous_failed)"])
