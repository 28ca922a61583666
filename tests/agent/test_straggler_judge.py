"""fsm_agent.stragglers: step times from sampled steps, and the judge's episodes (data only)."""

from __future__ import annotations

import pytest

from fsm_agent.stragglers import RankTime, StepClock, StragglerJudge, ratio
from fsm_agent.worker import FailureClass, NodeProblem

pytestmark = pytest.mark.unit


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
    back = _times(0.1, 0.1, 0.1, 0.12)
    assert judge.judge(back, everyone) == [] and set(judge.active) == {3}  # one fast window: still the episode
    assert judge.judge(back, everyone) == [] and judge.judge(back, everyone) == []
    assert judge.active == {}  # back within the factor for W windows: it ends
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


def test_step_clock_gives_compute_seconds_per_step_over_the_same_steps():
    clock = StepClock()
    clock.sample({0: 10, 1: 10}, now=0.0, compute={0: 1.0, 1: 1.0})
    # Lockstep: both did 10 steps in 1 s, but rank 1 computed 0.8 s of it and rank 0 0.1 s.
    assert clock.sample({0: 20, 1: 20}, now=1.0, compute={0: 1.1, 1: 1.8}) == {
        0: pytest.approx(0.1),
        1: pytest.approx(0.1),
    }
    assert clock.compute == {0: pytest.approx(0.01), 1: pytest.approx(0.08)}
    clock.sample({0: 25}, now=2.0)  # a worker that stopped reporting compute keeps its last estimate
    assert clock.compute[0] == pytest.approx(0.01)


def test_the_judge_uses_compute_time_when_every_rank_reports_it_else_step_time():
    judge = StragglerJudge(factor=1.5, windows=1)
    lockstep = [RankTime("h", g // 2, g % 2, g, 0.1, c) for g, c in enumerate((0.02, 0.02, 0.02, 0.08))]
    (found,) = judge.judge(lockstep, {0, 1, 2, 3})
    assert (judge.basis, found.basis, found.global_rank, found.factor) == ("compute", "compute", 3, 4.0)
    assert found.compute_s == 0.08 and found.median_s == pytest.approx(0.02)
    mixed = lockstep[:3] + [RankTime("h", 1, 1, 3, 0.1)]  # one rank without compute time: step times
    assert judge.judge(mixed, {0, 1, 2, 3}) == [] and judge.basis == "step" and judge.active == {}


def test_compute_time_goes_from_the_worker_to_the_heartbeat_file(tmp_path, monkeypatch):
    """The worker side (fsm_agent.heartbeat(compute_s=), fsm_agent.compute()) and the agent's
    reader share one map: steps at offset 0, the compute total after it."""
    import importlib

    hb = importlib.import_module("fsm_agent.heartbeat")  # the module: fsm_agent.heartbeat is also the function

    path = str(tmp_path / "heartbeat_0")
    assert hb.read_compute(path) is None
    monkeypatch.setattr(hb, "_path", path)
    monkeypatch.setattr(hb, "_map", None)
    monkeypatch.setattr(hb, "_compute_total", 0.0)
    monkeypatch.setattr(hb, "_compute_reports", 0)
    hb.heartbeat(step=1)
    assert hb.read_step(path) == 1 and hb.read_compute(path) is None  # no compute reported yet
    hb.heartbeat(step=2, compute_s=0.25)
    with hb.compute():
        pass
    assert hb.read_step(path) == 2 and 0.25 <= hb.read_compute(path) < 0.5


def test_excluding_stragglers_without_a_window_is_a_one_line_error(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fsm_agent",
            "run",
            "--standalone",
            "--nproc-per-node",
            "1",
            "--exclude-node-on",
            "straggler",
            sys.executable,
            "-c",
            "pass",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "--exclude-node-on straggler needs --straggler-window" in proc.stderr, proc.stderr
