"""What a requeue wrapper reads is checked at start, so a job cannot loop (#30.4).

- ``--finished-file`` in a folder that cannot be written: refused at start, one line, exit 2 (it
  was found out only once the job had succeeded: no file, exit 0, and the wrapper ran the
  finished job again).
- ``--drain-file`` already there at start: refused, one line, exit 2 (it drained at once with 75,
  "requeue", on every start while the mark stayed); ``--drain-file-at-start drain`` keeps that.
"""

from __future__ import annotations

import pytest

from tests.conftest import one_error_line, write_script

pytestmark = [pytest.mark.integration]

OK = "print('trained', flush=True)\n"


def test_an_unwritable_finished_file_is_refused_before_any_worker(launcher, tmp_path):
    script = write_script(launcher.dir, "ok.py", OK)
    result = launcher.run_fsm("--standalone", "--nproc-per-node", "1", "--finished-file", tmp_path / "no" / "f", script)
    assert result.returncode == 2, result.stderr
    line = one_error_line(result.stderr)
    assert "--finished-file" in line and "cannot write there" in line, line
    assert "trained" not in result.stdout


def test_a_writable_finished_file_is_written_when_the_job_succeeds(launcher, tmp_path):
    script = write_script(launcher.dir, "ok.py", OK)
    finished = tmp_path / "finished"
    launcher.run_fsm("--standalone", "--nproc-per-node", "1", "--finished-file", finished, script).check()
    assert finished.read_text().startswith("finished run_id=")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".fsm_agent_finished")] == []


def test_a_drain_file_there_at_start_is_refused(launcher, tmp_path):
    script = write_script(launcher.dir, "ok.py", OK)
    mark = tmp_path / "drain-me"
    mark.write_text("maintenance\n")
    result = launcher.run_fsm("--standalone", "--nproc-per-node", "1", "--drain-file", mark, script)
    assert result.returncode == 2, result.stderr
    line = one_error_line(result.stderr)
    assert f"--drain-file {mark}" in line and "exists already" in line and "--drain-file-at-start drain" in line
    assert "trained" not in result.stdout


def test_drain_file_at_start_drain_drains_at_once(launcher, tmp_path):
    script = write_script(launcher.dir, "ok.py", OK)
    mark = tmp_path / "drain-me"
    mark.write_text("maintenance\n")
    flags = ("--drain-file", mark, "--drain-file-at-start", "drain")
    result = launcher.run_fsm("--standalone", "--nproc-per-node", "1", *flags, script)
    assert result.returncode == 75, result.stderr
    assert f"requested by file {mark}" in result.stderr
