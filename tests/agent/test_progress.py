"""Progress-aware restarts with real agents and workers (plugin ``progress``, docs/failure-handling.md).

The workers are a toy training loop: they resume from the step in the progress file (the
iteration file a training writes at each checkpoint), report each step with
``fsm_agent.heartbeat(step=N)``, write a checkpoint every ``EVERY`` steps (rank 0) and crash
(the ranks in ``CRASH_RANKS``: rank 0, the checkpoint writer, by default, so no rank can crash
before the checkpoint is written) at step ``CRASH_AT``, or ``CRASH_AFTER`` steps after the one
they resumed from
(``fsm_agent.testing``'s AgentProcesses runs and kills the agents by process group).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from fsm_agent.replay import replay
from fsm_agent.worker import DO_NOT_REQUEUE_EXIT_CODE
from tests.helpers.events import read_events, transitions

pytestmark = pytest.mark.integration

TRAIN = """
    import os, sys, time, fsm_agent
    ckpt, rank = os.environ["CKPT"], int(os.environ["RANK"])
    every, crash_at, crash_after, done = (int(os.environ[k]) for k in ("EVERY", "CRASH_AT", "CRASH_AFTER", "DONE"))
    step = start = int(open(ckpt).read()) if os.path.exists(ckpt) else 0
    while step < done:
        step += 1
        fsm_agent.heartbeat(step=step)
        if step % every == 0 and rank == 0:
            with open(ckpt + ".tmp", "w") as f:
                f.write(f"{step}\\n")
            os.replace(ckpt + ".tmp", ckpt)
        if step in (crash_at, start + crash_after) and str(rank) in os.environ["CRASH_RANKS"].split(","):
            sys.exit(3)
        time.sleep(0.005)
"""


def start(
    tmp_path: Path,
    agents,
    *flags: str,
    every: int,
    crash_at: int = -1,
    crash_after: int = -1,
    done: int = 10**6,
    crash_ranks: str = "0",
):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TRAIN))
    env = {
        "CKPT": str(tmp_path / "ckpt.txt"),
        "EVERY": str(every),
        "CRASH_AT": str(crash_at),
        "CRASH_AFTER": str(crash_after),
        "DONE": str(done),
        "CRASH_RANKS": crash_ranks,
    }
    return agents.start(
        "--standalone",
        "--nproc-per-node",
        "2",
        "--events-file",
        str(tmp_path / "events.jsonl"),
        "--progress-file",
        str(tmp_path / "ckpt.txt"),
        "--finished-file",
        str(tmp_path / "FINISHED"),
        *flags,
        str(script),
        env=env,
    )


def cycles(path: Path) -> list[dict]:
    return [e for e in read_events(path) if e["kind"] == "cycle"]


def test_no_progress_cycles_end_in_the_do_not_requeue_code(tmp_path, agents):
    """Each attempt checkpoints at step 10 and crashes at 15; resumed from 10, it never gets past it."""
    proc = start(tmp_path, agents, "--max-restarts", "10", "--max-no-progress-restarts", "2", every=10, crash_at=15)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == DO_NOT_REQUEUE_EXIT_CODE, err
    events = tmp_path / "events.jsonl"
    recorded = cycles(events)
    assert [(c["attempt"], c["checkpoint_step"], c["progress"], c["no_progress_cycles"]) for c in recorded] == [
        (0, 10, True, 0),
        (1, 10, False, 1),
        (2, 10, False, 2),
    ]
    assert all(c["failure_class"] == "exit_code" and c["max_no_progress_restarts"] == 2 for c in recorded)
    assert all(c["start"] <= c["end"] and c["last_step"] >= 15 for c in recorded)  # rank 1 may be further
    assert transitions(events)[-1] == ("HEALTHY", "FAILED", "workers_failed")
    assert len(transitions(events)) == 6  # 3 attempts: 7 restarts were left, none used
    assert "no progress in 2 cycles in a row (checkpoint step 10" in err and "do not requeue" in err
    assert not (tmp_path / "FINISHED").exists()
    replay(str(events)).assert_identical()
    # The replay really decides on the recorded progress: without the limit the group restarts.
    tampered = tmp_path / "tampered.jsonl"
    tampered.write_text(
        "".join(
            json.dumps({k: v for k, v in e.items() if k != "max_no_progress_restarts"}) + "\n"
            for e in read_events(events)
        )
    )
    divergence = replay(str(tampered)).divergence
    assert (divergence.what, divergence.expected, divergence.actual) == ("state", "FAILED", "STOPPED")


def test_a_job_that_progresses_between_crashes_keeps_restarting_and_finishes_once(tmp_path, agents):
    """Each attempt gets one checkpoint further before it crashes, then the job completes."""
    proc = start(
        tmp_path, agents, "--max-restarts", "5", "--max-no-progress-restarts", "1", every=10, crash_after=15, done=40
    )
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    events = tmp_path / "events.jsonl"
    recorded = cycles(events)
    assert [(c["checkpoint_step"], c["failure_class"], c["progress"]) for c in recorded] == [
        (10, "exit_code", True),
        (20, "exit_code", True),
        (30, "exit_code", True),
        (40, None, True),
    ]
    assert recorded[-1]["last_step"] == 40 and all(c["last_step"] >= c["checkpoint_step"] + 5 for c in recorded[:-1])
    finished = (tmp_path / "FINISHED").read_text()
    assert finished.startswith("finished run_id=") and finished.count("\n") == 1
    replay(str(events)).assert_identical()
    # A rerun that succeeds again (a requeue wrapper that did not look) leaves the flag as it was.
    proc = start(tmp_path, agents, every=10, crash_after=15, done=40)
    proc.communicate(timeout=120)
    assert proc.returncode == 0
    assert (tmp_path / "FINISHED").read_text() == finished


@pytest.mark.parametrize(
    "launcher", [["--launcher", "subprocess"], ["--launcher", "preload", "--preload-modules", "json"]]
)
def test_heartbeat_steps_alone_measure_progress(tmp_path, agents, launcher):
    """Without a checkpoint reported, the last step reached is the progress: the same crash each
    attempt (no progress file is written: EVERY is beyond the crash) is no progress. Workers
    forked from the preload launcher's zygote report their steps too."""
    proc = start(
        tmp_path,
        agents,
        *launcher,
        "--max-restarts",
        "10",
        "--max-no-progress-restarts",
        "1",
        every=1000,
        crash_at=7,
        crash_ranks="0,1",
    )
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == DO_NOT_REQUEUE_EXIT_CODE, err
    recorded = cycles(tmp_path / "events.jsonl")
    assert [(c["last_step"], c["checkpoint_step"], c["progress"]) for c in recorded] == [
        (7, None, True),
        (7, None, False),
    ]


def test_a_worker_exiting_with_the_do_not_requeue_code_is_reported_as_1(tmp_path, agents):
    script = tmp_path / "w.py"
    script.write_text(f"import sys; sys.exit({DO_NOT_REQUEUE_EXIT_CODE})\n")
    proc = agents.start("--standalone", "--events-file", str(tmp_path / "events.jsonl"), str(script))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    run_end = next(e for e in read_events(tmp_path / "events.jsonl") if e["kind"] == "run_end")
    assert run_end["exit_code"] == 1
    assert cycles(tmp_path / "events.jsonl")[0]["failure_class"] == "exit_code"


@pytest.mark.parametrize("flag, value", [("--max-no-progress-restarts", "-1"), ("--max-no-progress-restarts", "x")])
def test_bad_limit_is_one_line(tmp_path, agents, flag, value):
    proc = agents.start("--standalone", flag, value, "x.py")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert flag in err and "Traceback" not in err
