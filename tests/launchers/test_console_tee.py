"""The console copy of the workers' output (``--tee``), under both built-in launchers."""

from __future__ import annotations

import pytest

from tests.launchers.test_preload_launcher import write

pytestmark = [pytest.mark.integration]


@pytest.mark.parametrize("launcher", ["subprocess", "preload"])
def test_a_console_closed_by_its_reader_leaves_the_workers_and_their_log_files_be(tmp_path, agents, launcher):
    """``fsm-agent run -t 3 ... | head -3``: the tee's console is gone after 3 lines. The workers go
    on, their log files get every line, the agent prints no traceback and exits 0. Before, the tee
    thread died of BrokenPipeError with a traceback and closed the worker's pipe, which failed it."""
    write(
        tmp_path / "chat.py",
        """
        import os, time
        for i in range(60):
            print(f"rank {os.environ['RANK']} line {i}", flush=True)
            time.sleep(0.01)
    """,
    )
    proc = agents.start(
        "--standalone", "--nproc-per-node", "2", "-t", "3", "--log-dir", "logs", "--launcher", launcher, "chat.py"
    )
    first = [proc.stdout.readline() for _ in range(3)]
    proc.stdout.close()  # as `head -3` does
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0, err
    assert all("line" in line for line in first), first
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    logs = sorted(tmp_path.glob("logs/**/stdout.log"))
    assert len(logs) == 2 and all(len(log.read_text().splitlines()) == 60 for log in logs), logs
