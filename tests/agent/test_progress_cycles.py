"""Restart cycles: progress judged across cycles, the heartbeat step, the progress and finished files."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fsm_agent.heartbeat import HEARTBEAT_FILE_ENV, read_step
from fsm_agent.progress import next_cycle, read_progress_file, write_finished_file
from fsm_agent.worker import DO_NOT_REQUEUE_EXIT_CODE, RunResult, WorkerFailure, WorkerState

pytestmark = pytest.mark.unit


def cycles(*reports):
    """Cycles from (last_step, checkpoint_step, failure_class) reports, oldest first."""
    made = []
    for attempt, (step, checkpoint, kind) in enumerate(reports):
        made.append(
            next_cycle(
                made,
                attempt=attempt,
                start=attempt,
                end=attempt + 0.5,
                last_step=step,
                checkpoint_step=checkpoint,
                failure_class=kind,
            )
        )
    return [(c.progress, c.no_progress_cycles) for c in made]


def test_a_checkpoint_beyond_every_earlier_one_is_progress():
    assert cycles((15, 10, "exit_code"), (15, 10, "signal"), (25, 20, "hang"), (25, 20, "exit_code")) == [
        (True, 0),
        (False, 1),
        (True, 0),
        (False, 1),
    ]


def test_without_checkpoints_the_last_step_is_the_progress():
    assert cycles((7, None, "exit_code"), (7, None, "exit_code"), (9, None, "exit_code")) == [
        (True, 0),
        (False, 1),
        (True, 0),
    ]


def test_once_a_checkpoint_is_reported_steps_alone_are_no_progress():
    assert cycles((15, 10, "exit_code"), (99, None, "exit_code")) == [(True, 0), (False, 1)]


def test_a_cycle_that_reports_nothing_makes_no_progress():
    assert cycles((None, None, "exit_code"), (None, None, "exit_code")) == [(False, 1), (False, 2)]


def test_a_membership_change_neither_counts_nor_resets():
    assert cycles((5, None, "exit_code"), (5, None, "exit_code"), (5, None, "node_lost"), (5, None, "exit_code")) == [
        (True, 0),
        (False, 1),
        (False, 1),
        (False, 2),
    ]


def test_heartbeat_step_reaches_the_agent_after_the_worker_died(tmp_path):
    path = tmp_path / "heartbeat_0"
    code = "import fsm_agent\nfor s in range(1, 1001):\n    fsm_agent.heartbeat(step=s)\nimport os; os._exit(3)\n"
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, HEARTBEAT_FILE_ENV: str(path)})
    assert done.returncode == 3
    assert read_step(str(path)) == 1000
    assert read_step(str(tmp_path / "none")) is None


def test_heartbeat_without_step_keeps_its_old_meaning(tmp_path):
    path = tmp_path / "heartbeat_0"
    code = "import fsm_agent\nfsm_agent.heartbeat(0.01)\n"
    subprocess.run([sys.executable, "-c", code], env={**os.environ, HEARTBEAT_FILE_ENV: str(path)}, check=True)
    assert path.exists() and read_step(str(path)) is None


@pytest.mark.parametrize("text, step", [("120\n", 120), (" 7 ", 7), ("release\n", None), ("", None)])
def test_progress_file(tmp_path, text, step):
    path = tmp_path / "latest_checkpointed_iteration.txt"
    path.write_text(text)
    assert read_progress_file(str(path)) == step


def test_no_progress_file():
    assert read_progress_file(None) is None and read_progress_file("/nonexistent/ckpt.txt") is None


def test_the_finished_file_is_written_once(tmp_path):
    path = tmp_path / "FINISHED"
    assert write_finished_file(str(path), "job") is True
    first = path.read_text()
    assert first.startswith("finished run_id=job ts=")
    assert write_finished_file(str(path), "other") is False
    assert path.read_text() == first and os.listdir(tmp_path) == ["FINISHED"]


def failed(code: int) -> RunResult:
    failure = WorkerFailure(local_rank=0, global_rank=0, role_rank=0, pid=1, exitcode=code, timestamp=1.0)
    return RunResult(state=WorkerState.FAILED, failures={0: failure})


def test_exit_codes():
    assert failed(DO_NOT_REQUEUE_EXIT_CODE).exit_code == 1  # a worker's 79 is not the agent's verdict
    assert failed(3).exit_code == 3
    gave_up = RunResult(
        state=WorkerState.FAILED, failures=failed(3).failures, verdict_exit_code=DO_NOT_REQUEUE_EXIT_CODE
    )
    assert gave_up.exit_code == DO_NOT_REQUEUE_EXIT_CODE


def test_an_exit_code_needs_a_give_up():
    from fsm_agent.worker import RestartDecision

    with pytest.raises(ValueError, match="exit_code needs restart=False"):
        RestartDecision(True, exit_code=DO_NOT_REQUEUE_EXIT_CODE)


def test_a_process_forked_after_the_import_reads_its_own_variable(tmp_path):
    """As the preload launcher's zygote: fsm_agent imported without the variable, a child forked
    and given it, then reporting steps."""
    path = tmp_path / "heartbeat_0"
    code = (
        f"import os, fsm_agent\nfsm_agent.heartbeat(step=1)\npid = os.fork()\nif pid == 0:\n"
        f"    os.environ[{HEARTBEAT_FILE_ENV!r}] = {str(path)!r}\n    fsm_agent.heartbeat(step=42)\n    os._exit(0)\n"
        f"os.waitpid(pid, 0)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != HEARTBEAT_FILE_ENV}
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    assert read_step(str(path)) == 42
