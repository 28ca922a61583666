"""The built-in restart policy: torchrun's budget, exit code 78, per-class budgets, backoff."""

from __future__ import annotations

import random

import pytest

from fsm_agent.plugins.restart_policy import RestartPolicy, backoff_delay, parse_budgets
from fsm_agent.worker import RendezvousSpec, WorkerFailure, WorkerGroup, WorkerSpec


def group(max_restarts: int) -> WorkerGroup:
    return WorkerGroup(WorkerSpec(role="r", local_world_size=2, entrypoint="x", max_restarts=max_restarts,
                                  rendezvous=RendezvousSpec()))


def failure(rank: int, code: int, kind: str, at: float = 1.0) -> dict[int, WorkerFailure]:
    return {rank: WorkerFailure(local_rank=rank, global_rank=rank, role_rank=rank, pid=100 + rank, exitcode=code,
                                timestamp=at, failure_class=kind)}


def test_torchrun_budget():
    policy = RestartPolicy()
    assert policy.fsm_agent_restart_policy(failure(0, 1, "exit_code"), group(1), 0).restart
    assert not policy.fsm_agent_restart_policy(failure(0, 1, "exit_code"), group(1), 1).restart


def test_exit_code_78_gives_up_at_once():
    decision = RestartPolicy().fsm_agent_restart_policy(failure(1, 78, "exit_code"), group(5), 0)
    assert not decision.restart and "do not restart" in decision.reason


def test_per_class_budget_counts_the_root_cause_class():
    policy = RestartPolicy(budgets={"hang": 1})
    assert policy.fsm_agent_restart_policy(failure(0, 124, "hang"), group(5), 0).restart
    assert policy.fsm_agent_restart_policy(failure(0, 1, "exit_code"), group(5), 1).restart  # other class: free
    second_hang = policy.fsm_agent_restart_policy(failure(0, 124, "hang"), group(5), 2)
    assert not second_hang.restart and "hang" in second_hang.reason


@pytest.mark.parametrize("text", ["hang", "nope=1", "hang=-1", "hang=x"])
def test_bad_budgets_are_refused(text):
    with pytest.raises(ValueError):
        parse_budgets(text)


def test_backoff_grows_exponentially_with_jitter_and_a_cap():
    rng = random.Random(0)
    delays = [backoff_delay(n, 1.0, 5.0, rng) for n in range(5)]
    assert all(0.5 * min(5.0, 2 ** n) <= d < 1.5 * min(5.0, 2 ** n) for n, d in enumerate(delays))
    assert backoff_delay(3, 0.0, 5.0) == 0.0
