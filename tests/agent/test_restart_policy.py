"""The built-in restart policy: torchrun's budget, exit code 78, per-class budgets, backoff."""

from __future__ import annotations

import logging
import random

import pytest

from fsm_agent.plugins.restart_policy import RestartPolicy, backoff_delay, parse_budgets, parse_exclude_node_on
from fsm_agent.testing import Scenario
from fsm_agent.worker import RendezvousSpec, RestartDecision, WorkerFailure, WorkerGroup, WorkerSpec, first_failure

pytestmark = pytest.mark.unit


def group(max_restarts: int) -> WorkerGroup:
    return WorkerGroup(
        WorkerSpec(role="r", local_world_size=2, entrypoint="x", max_restarts=max_restarts, rendezvous=RendezvousSpec())
    )


def failure(rank: int, code: int, kind: str, at: float = 1.0) -> dict[int, WorkerFailure]:
    return {
        rank: WorkerFailure(
            local_rank=rank,
            global_rank=rank,
            role_rank=rank,
            pid=100 + rank,
            exitcode=code,
            timestamp=at,
            failure_class=kind,
        )
    }


def decide(
    policy: RestartPolicy, failures: dict, max_restarts: int, restart_count: int, failure_class: str | None = None
) -> RestartDecision:
    """Ask the policy as the agent does: the class is the root cause's unless given (membership)."""
    failure_class = failure_class or first_failure(failures).failure_class
    return policy.fsm_agent_restart_policy(
        failures=failures, worker_group=group(max_restarts), restart_count=restart_count, failure_class=failure_class
    )


def test_torchrun_budget():
    policy = RestartPolicy()
    assert decide(policy, failure(0, 1, "exit_code"), 1, 0).restart
    assert not decide(policy, failure(0, 1, "exit_code"), 1, 1).restart


def test_exit_code_78_gives_up_at_once():
    decision = decide(RestartPolicy(), failure(1, 78, "exit_code"), 5, 0)
    assert not decision.restart and not decision.exclude_node and "do not restart" in decision.reason


def test_per_class_budget_counts_the_root_cause_class():
    policy = RestartPolicy(budgets={"hang": 1})
    assert decide(policy, failure(0, 124, "hang"), 5, 0).restart
    assert decide(policy, failure(0, 1, "exit_code"), 5, 1).restart  # other class: free
    second_hang = decide(policy, failure(0, 124, "hang"), 5, 2)
    assert not second_hang.restart and "hang" in second_hang.reason


def test_membership_changes_restart_uncounted_until_their_budget_is_spent():
    policy = RestartPolicy(budgets={"node_lost": 1})
    scale_up = decide(policy, {}, 0, 0, "membership_change")  # max_restarts=0 does not stop a re-rendezvous
    assert scale_up.restart and "not counted" in scale_up.reason
    assert decide(policy, {}, 0, 0, "node_lost").restart
    second_loss = decide(policy, {}, 0, 0, "node_lost")
    assert not second_loss.restart and "node_lost" in second_loss.reason


def test_exclude_node_on_takes_this_node_out_whatever_restarts_are_left():
    policy = RestartPolicy(exclude_node_on=("health_check",))
    decision = decide(policy, failure(1, 69, "health_check"), 5, 0)
    assert not decision.restart and decision.exclude_node
    assert "health_check on rank 1" in decision.reason and "leaves the job" in decision.reason
    assert decide(policy, failure(0, 1, "exit_code"), 5, 0).restart  # other classes: the budget as usual
    refusing = decide(policy, {**failure(0, 69, "health_check"), **failure(1, 78, "exit_code", at=2.0)}, 5, 0)
    assert not refusing.exclude_node and "do not restart" in refusing.reason  # exit 78 gives up the job


@pytest.mark.parametrize("text", ["node_lost", "membership_change", "agent_error", "gpu"])
def test_only_this_nodes_failures_can_exclude_it(text):
    with pytest.raises(ValueError, match="exit_code, signal, hang, health_check"):
        parse_exclude_node_on(text)


def test_restart_decision_refuses_contradictions():
    with pytest.raises(ValueError, match="cannot both"):
        RestartDecision(True, exclude_node=True)
    with pytest.raises(ValueError, match="delay_s"):
        RestartDecision(True, delay_s=-1.0)


@pytest.mark.parametrize("text", ["hang", "nope=1", "hang=-1", "hang=x"])
def test_bad_budgets_are_refused(text):
    with pytest.raises(ValueError):
        parse_budgets(text)


def test_backoff_grows_exponentially_with_jitter_and_a_cap():
    rng = random.Random(0)
    delays = [backoff_delay(n, 1.0, 5.0, rng) for n in range(5)]
    assert all(0.5 * min(5.0, 2**n) <= d < 1.5 * min(5.0, 2**n) for n, d in enumerate(delays))
    assert backoff_delay(3, 0.0, 5.0) == 0.0


@pytest.mark.parametrize(
    "scenario, what",
    [
        ("node joins -> restart -> all succeed", "membership change"),
        ("wait -> node lost -> restart -> all succeed", "node lost"),
    ],
)
def test_the_re_rendezvous_warning_names_the_class_once(make_agent, caplog, scenario, what):
    """Not ``membership change: membership change: re-rendezvous``."""
    caplog.set_level(logging.WARNING, logger="fsm_agent.agent")
    Scenario(scenario).run(make_agent)
    lines = [r.getMessage() for r in caplog.records if what in r.getMessage()]
    assert lines == [f"[default] {what}: re-rendezvous (not counted against max_restarts)"]
