"""HangDetector's heartbeat directory: made only when something goes in it, removed at close."""

from __future__ import annotations

import os
import tempfile

import pytest

from fsm_agent.hang import ENABLE_FILE_TIMER_ENV, TIMER_FILE_ENV, HangDetector
from fsm_agent.heartbeat import HEARTBEAT_FILE_ENV

pytestmark = pytest.mark.unit


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """The temporary directory HangDetector uses (tempfile's), empty at the start."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv(ENABLE_FILE_TIMER_ENV, raising=False)
    monkeypatch.delenv(TIMER_FILE_ENV, raising=False)
    return tmp_path


def test_no_hang_timeout_and_no_file_timer_makes_no_directory(scratch):
    detector = HangDetector(hang_timeout=None)
    assert not detector.enabled and detector.worker_env(0) == {}
    detector.new_attempt(4)
    assert list(scratch.iterdir()) == []
    detector.close()


def test_hang_timeout_puts_heartbeat_files_in_a_directory_close_removes(scratch):
    detector = HangDetector(hang_timeout=5.0)
    heartbeat = detector.worker_env(1)[HEARTBEAT_FILE_ENV]
    (made,) = scratch.iterdir()
    assert made.name.startswith("fsm_agent_hb_") and os.path.dirname(heartbeat) == str(made)
    detector.close()
    assert list(scratch.iterdir()) == []


def test_file_timer_makes_its_fifo_in_the_directory_unless_torchelastic_timer_file_names_one(scratch, monkeypatch):
    own = HangDetector(hang_timeout=None, file_timer=True)
    (made,) = scratch.iterdir()
    assert own.fifo_path == str(made / "watchdog_timer") and own.worker_env(0) == {TIMER_FILE_ENV: own.fifo_path}
    own.close()
    assert list(scratch.iterdir()) == []

    named = scratch / "given_fifo"
    monkeypatch.setenv(TIMER_FILE_ENV, str(named))
    given = HangDetector(hang_timeout=None, file_timer=True)
    assert given.fifo_path == str(named) and [p.name for p in scratch.iterdir()] == ["given_fifo"]
    given.close()


def test_tracking_steps_hands_out_heartbeat_files_without_a_hang_timeout(scratch):
    from fsm_agent.heartbeat import STEP_FORMAT

    detector = HangDetector(hang_timeout=None)
    detector.track_steps()
    env = detector.worker_env(1)
    assert set(env) == {HEARTBEAT_FILE_ENV}  # no faulthandler: nothing is aborted for a hang
    assert not detector.enabled  # no hang checks, no ticks
    with open(env[HEARTBEAT_FILE_ENV], "wb") as f:
        f.write(STEP_FORMAT.pack(17))
    os.utime(env[HEARTBEAT_FILE_ENV], (0, 0))  # a heartbeat long ago is no hang without a timeout
    assert detector.steps(2) == {1: 17} and detector.hung_workers({0: 1, 1: 2}, set()) == {}
    detector.new_attempt(2)
    assert detector.steps(2) == {}
    detector.close()
    assert list(scratch.iterdir()) == []
