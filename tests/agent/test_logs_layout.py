"""LogsLayout: torch's attempt_N layout, and no round's logs lost to a re-rendezvous."""

from __future__ import annotations

import os

import pytest

from fsm_agent.logs import ALL, LogsLayout

pytestmark = pytest.mark.unit


def write_round(layout: LogsLayout, restart_count: int, text: str) -> None:
    for wlogs in layout.reify(restart_count, 2, "trainer", {0: 0, 1: 1}).values():
        with open(wlogs.stdout, "a") as f:
            f.write(text)
        with open(wlogs.error_file, "w") as f:
            f.write("{}")


def test_a_reused_attempt_keeps_the_earlier_rounds_logs(tmp_path):
    """Membership changes are not counted restarts: rounds 2 and 3 reuse attempt_0 (torch deletes it)."""
    layout = LogsLayout(log_dir=str(tmp_path), run_id="job", redirects=ALL)
    write_round(layout, 0, "world 4\n")
    write_round(layout, 0, "world 2\n")
    write_round(layout, 0, "world 3\n")
    write_round(layout, 1, "restarted\n")
    run = layout.run_log_dir
    assert sorted(os.listdir(run)) == ["attempt_0", "attempt_0.1", "attempt_0.2", "attempt_1"]
    read = lambda name: open(os.path.join(run, name, "1", "stdout.log")).read()  # noqa: E731
    assert [read(n) for n in ("attempt_0.1", "attempt_0.2", "attempt_0", "attempt_1")] == [
        "world 4\n",
        "world 2\n",
        "world 3\n",
        "restarted\n",
    ]


def test_each_round_starts_without_the_previous_error_file(tmp_path):
    layout = LogsLayout(log_dir=str(tmp_path), run_id="job", redirects=ALL)
    write_round(layout, 0, "first\n")
    logs = layout.reify(0, 2, "trainer", {0: 0, 1: 1})
    assert not any(os.path.exists(w.error_file) for w in logs.values())  # a stale error.json would be misread


def test_a_temporary_dir_holding_the_only_copy_of_output_is_kept(tmp_path, monkeypatch, caplog):
    """Without --log-dir the temporary dir goes at the end, unless a stream went only to a file there."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    for options, kept in [
        ({}, False),
        ({"tee": ALL}, False),
        ({"redirects": ALL, "tee": ALL}, False),
        ({"redirects": ALL}, True),
        ({"redirects": ALL, "tee": 1}, True),
        ({"redirects": {1: ALL}}, True),
        ({"redirects": {1: ALL}, "tee": {1: ALL}}, False),
        ({"local_ranks_filter": frozenset({0})}, True),
    ]:
        layout = LogsLayout(log_dir=None, run_id="job", **options)
        run_dir = layout.run_log_dir
        caplog.clear()
        layout.cleanup()
        assert os.path.isdir(run_dir) == kept, options
        assert (run_dir in caplog.text) == kept, options
