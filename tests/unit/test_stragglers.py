"""fsm_agent.stragglers: step times from sampled steps, and the judge's episodes (data only)."""

from __future__ import annotations

import pytest

from fsm_agent.stragglers import RankTime, StepClock, StragglerJudge, ratio
from fsm_agent.worker import FailureClass, NodeProblem


def test_step_clock_divides_the_time_by_the_steps_done():
    clock = StepClock()
    assert clock.sample({0: 10, 1: 10}, now=100.0) == {}  # a first sample gives no estimate
    assert clock.sample({0: 30, 1: 12}, now=101.0) == {0: pytest.approx(0.05), 1: pytest.approx(0.5)}


def test_step_clock_shows_a_rank_slower_than_a_window_and_forgets_a_reset_counter():
    clock = StepClock()
    clock.sample({0: 1}, now=0.0)
    clock.sample({0: 2}, now=1.0)  # 1 s a step
    assert clock.sample({0: 2}, now=2.0) == {0: pytest.approx(1.0)}
    assert clock.sample({0: 2}, now=4.0) == {0: pytest.approx(3.0)}  # no step for 3 s: at least 3 s a step
    assert clock.sample({0: 3}, now=5.0) == {0: pytest.approx(4.0)}
    assert clock.sample({0: 1}, now=6.0) == {}  # a new worker's counter: start over


def _times(*seconds: float) -> list[RankTime]:
    return [RankTime("h", g // 2, g % 2, g, s) for g, s in enumerate(seconds)]


def test_a_rank_above_the_factor_for_w_windows_is_reported_once_per_episode():
    judge = StragglerJudge(factor=1.5, windows=3)
    slow = _times(0.1, 0.1, 0.1, 0.4)
    everyone = {0, 1, 2, 3}
    assert judge.judge(slow, everyone) == [] and judge.judge(slow, everyone) == []
    (found,) = judge.judge(slow, everyone)
    assert (found.global_rank, found.node_rank, found.local_rank, found.factor) == (3, 1, 1, 4.0)
    assert (found.windows, found.window, found.since_window, found.median_s) == (3, 3, 1, pytest.approx(0.1))
    assert judge.judge(slow, everyone) == [] and set(judge.active) == {3}  # the same episode
    assert judge.judge(_times(0.1, 0.1, 0.1, 0.12), everyone) == [] and judge.active == {}  # back: it ends
    for _ in range(2):
        assert judge.judge(slow, everyone) == []
    assert [s.global_rank for s in judge.judge(slow, everyone)] == [3]  # a new episode


def test_a_stale_entry_does_not_count_a_window_and_an_even_job_has_none():
    judge = StragglerJudge(factor=1.5, windows=2)
    slow = _times(0.1, 0.1, 0.1, 0.4)
    assert judge.judge(slow, {0, 1, 2, 3}) == []
    assert judge.judge(slow, {0, 1}) == []  # node rank 1 did not publish again: no new window for 3
    assert [s.global_rank for s in judge.judge(slow, {0, 1, 2, 3})] == [3]
    even = StragglerJudge(factor=1.5, windows=1)
    assert all(even.judge(_times(0.1, 0.11, 0.09, 0.12), {0, 1, 2, 3}) == [] for _ in range(50))
    assert StragglerJudge(1.5, 1).judge([], set()) == []


def test_ratio_and_node_problem():
    assert ratio(0.3, 0.1) == 3.0 and ratio(0.3, None) is None
    problem = NodeProblem("slow", FailureClass.STRAGGLER)
    assert problem == "slow" and problem.failure_class == "straggler"
    assert NodeProblem("disk").failure_class == FailureClass.HEALTH_CHECK
