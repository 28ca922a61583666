"""fsm-agent replay: the events file of a run re-drives the statechart (fakes) to the same trace;
a tampered file gives its first divergence.

The main case uses a real run: ``python -m fsm_agent run`` with real workers, one of which crashes
in the first attempt (the agent restarts the group, then it succeeds).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fsm_agent import cli
from fsm_agent.config import LaunchConfig
from fsm_agent.errors import ConfigError
from fsm_agent.plugins import hookimpl
from fsm_agent.replay import cli_main, read_events, replay
from fsm_agent.testing import AgentProcesses, Scenario
from fsm_agent.testing.coverage import COVERAGE_DIR_ENV

pytestmark = pytest.mark.integration

CRASH_THEN_SUCCESS = [
    "INIT --start--> HEALTHY",
    "HEALTHY --workers_failed--> STOPPED",
    "STOPPED --restart--> HEALTHY",
    "HEALTHY --workers_succeeded--> SUCCEEDED",
]


@pytest.fixture(scope="module")
def crash_and_restart(tmp_path_factory) -> Path:
    """The events file of a real run: 2 workers, rank 1 crashes in attempt 0, attempt 1 succeeds."""
    tmp_path = tmp_path_factory.mktemp("real-run")
    script = tmp_path / "worker.py"
    script.write_text(
        textwrap.dedent("""
        import os, sys, time
        here = os.path.dirname(os.path.abspath(__file__))
        first, rank = os.environ["TORCHELASTIC_RESTART_COUNT"] == "0", os.environ["LOCAL_RANK"]
        if first and rank == "0":
            with open(os.path.join(here, "pid0.tmp"), "w") as f:
                f.write(str(os.getpid()))
            os.replace(os.path.join(here, "pid0.tmp"), os.path.join(here, "pid0"))
        if first and rank == "1":
            # Crash only once the agent has reaped rank 0 (and so recorded its worker_exit):
            # a rank 0 the restart stops records none, and the test counts four.
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    os.kill(int(open(os.path.join(here, "pid0")).read()), 0)
                except FileNotFoundError:
                    pass
                except ProcessLookupError:
                    break
                time.sleep(0.01)
            sys.exit("rank 1 crashes in the first attempt")
    """)
    )
    events = tmp_path / "events.jsonl"
    with AgentProcesses(tmp_path) as agents:
        done = agents.run(
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--events-file",
            str(events),
            str(script),
            timeout=180,
        )
    assert done.returncode == 0, done.stderr
    return events


def transitions(path: Path) -> list[tuple[int, dict]]:
    """(line number, record) of every transition record."""
    return [(number, record) for _, number, record in read_events(str(path)) if record["kind"] == "transition"]


def tampered(source: Path, target: Path, edit) -> Path:
    lines = source.read_text().splitlines()
    records = [json.loads(line) for line in lines]
    target.write_text("".join(json.dumps(r) + "\n" for r in edit(records)))
    return target


# -- a real run -----------------------------------------------------------------------------------


def test_a_real_crash_and_restart_replays_identically(crash_and_restart, capsys):
    result = replay(str(crash_and_restart))
    assert result.identical and result.divergence is None
    (run,) = result.runs
    assert list(run.recorded) == CRASH_THEN_SUCCESS == list(run.replayed)
    assert sum(r["kind"] == "worker_exit" for _, _, r in read_events(str(crash_and_restart))) == 4
    assert cli_main([str(crash_and_restart)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == "identical trace"
    assert "INIT -> HEALTHY -> STOPPED -> HEALTHY -> SUCCEEDED" in out


def test_a_tampered_destination_is_the_first_divergence(crash_and_restart, tmp_path, capsys):
    ((line, _),) = [(n, r) for n, r in transitions(crash_and_restart) if r["trigger"] == "workers_failed"]

    def fail_instead(records):
        for record in records:
            if record.get("trigger") == "workers_failed":
                record["dest"] = "FAILED"
        return records

    bad = tampered(crash_and_restart, tmp_path / "bad.jsonl", fail_instead)
    divergence = replay(str(bad)).divergence
    assert (divergence.event, divergence.line, divergence.transition) == (line, line, 2)
    assert (divergence.what, divergence.expected, divergence.actual) == ("state", "FAILED", "STOPPED")
    assert cli_main([str(bad)]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"first divergence at event {line} (line {line}, transition 2): "
        f"HEALTHY --workers_failed--> expected FAILED, actual STOPPED"
    )


def test_a_tampered_trigger_shows_in_the_restart_count(crash_and_restart, tmp_path):
    """Recorded as a membership change, the restart would not have been counted (a file without
    the transitions' facts, as written before they were recorded: the fact is rebuilt)."""

    def membership(records):
        for record in records:
            record.pop("fact", None)
            if record.get("trigger") == "workers_failed":
                record["trigger"] = "membership_changed"
        return records

    divergence = replay(str(tampered(crash_and_restart, tmp_path / "bad.jsonl", membership))).divergence
    assert (divergence.what, divergence.trigger, divergence.expected, divergence.actual) == (
        "restart_count",
        "membership_changed",
        "1",
        "0",
    )
    assert "HEALTHY --membership_changed--> STOPPED: expected restart_count 1, actual 0" in str(divergence)


def test_a_recorded_fact_that_does_not_fit_its_trigger_is_refused(crash_and_restart, tmp_path):
    def membership(records):
        for record in records:
            if record.get("trigger") == "workers_failed":
                assert record["fact"]["exits"]  # the failed workers' exits, as the run loop saw them
                record["trigger"] = "membership_changed"
        return records

    divergence = replay(str(tampered(crash_and_restart, tmp_path / "bad.jsonl", membership))).divergence
    assert (divergence.what, divergence.trigger) == ("refused", "membership_changed")
    assert "the recorded fact of membership_changed does not fit MembershipChanged" in divergence.detail


def test_a_missing_transition_is_a_divergence_of_the_source_state(crash_and_restart, tmp_path):
    def drop_restart(records):
        return [r for r in records if r.get("trigger") != "restart"]

    divergence = replay(str(tampered(crash_and_restart, tmp_path / "bad.jsonl", drop_restart))).divergence
    assert (divergence.what, divergence.trigger, divergence.expected, divergence.actual) == (
        "source",
        "workers_succeeded",
        "HEALTHY",
        "STOPPED",
    )


def test_a_transition_the_table_does_not_have_is_refused(crash_and_restart, tmp_path):
    def succeed_from_stopped(records):
        for record in records:
            if record.get("trigger") == "restart":
                record.update(trigger="workers_succeeded", dest="SUCCEEDED")
        return records

    divergence = replay(str(tampered(crash_and_restart, tmp_path / "bad.jsonl", succeed_from_stopped))).divergence
    assert (divergence.what, divergence.expected, divergence.actual) == ("refused", "SUCCEEDED", "STOPPED")
    assert "workers_succeeded cannot fire in STOPPED" in str(divergence)


def test_a_recording_cut_short_replays_identically_and_says_so(crash_and_restart, tmp_path, capsys):
    """The agent was SIGKILLed mid-run: its file stops after the restart; what is there replays, flagged."""

    def cut(records):
        (restart,) = [i for i, r in enumerate(records) if r["kind"] == "transition" and r["trigger"] == "restart"]
        return records[: restart + 1]

    path = tampered(crash_and_restart, tmp_path / "cut.jsonl", cut)
    assert cli_main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "(the recording stops in HEALTHY: the run had not ended, or its agent was killed)" in out
    assert out.splitlines()[-1] == "identical trace"
    assert cli_main([str(crash_and_restart)]) == 0
    assert "recording stops" not in capsys.readouterr().out


def test_a_tampered_end_state(crash_and_restart, tmp_path):
    def failed_end(records):
        records[-1]["state"] = "FAILED"
        return records

    divergence = replay(str(tampered(crash_and_restart, tmp_path / "bad.jsonl", failed_end))).divergence
    assert (divergence.what, divergence.expected, divergence.actual) == ("end", "FAILED", "SUCCEEDED")


def test_an_events_file_appended_to_by_a_rerun_holds_two_runs(crash_and_restart, tmp_path):
    twice = tmp_path / "twice.jsonl"
    twice.write_text(crash_and_restart.read_text() * 2)
    result = replay(str(twice))
    assert len(result.runs) == 2 and result.identical


# -- the statechart's paths, from runs on the test kit's fakes -------------------------------------


class ReachesTheRendezvous:
    """A restart policy that asks the rendezvous and finds it gone (see tests/agent/test_rare_edges.py)."""

    @hookimpl
    def fsm_agent_restart_policy(self, failures, worker_group, restart_count):
        from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

        raise RendezvousConnectionError("gone")


PATHS = {
    "success": lambda: Scenario("all succeed"),
    "restart_then_success": lambda: Scenario("worker 1 exits 1 -> restart -> all succeed", max_restarts=1),
    "restarts_exhausted": lambda: Scenario("worker 0 exits 1 -> restart -> worker 1 exits 2", max_restarts=1),
    "do_not_restart_exit_code": lambda: Scenario("worker 1 exits 78", max_restarts=3),
    "killed_by_signal": lambda: Scenario("worker 0 is killed by SIGKILL -> restart -> all succeed", max_restarts=2),
    "membership_change": lambda: Scenario("node joins -> restart -> all succeed"),
    "hang": lambda: Scenario("worker 1 hangs -> restart -> all succeed", max_restarts=1, hang_timeout=1),
    "hang_no_restart": lambda: Scenario("worker 1 hangs", hang_timeout=1),
    "rendezvous_timeout": lambda: Scenario("rendezvous times out"),
    "rendezvous_not_needed": lambda: Scenario("node joins -> restart -> rendezvous graceful exit"),
    "store_lost_while_healthy": lambda: Scenario().rendezvous(waiting_raises="connection").attempt("never"),
    "sigterm": lambda: Scenario("wait -> SIGTERM"),
    "sigterm_in_rendezvous": lambda: Scenario(
        "worker 1 exits 1 -> restart -> SIGTERM during rendezvous", max_restarts=1
    ),
    "launcher_fails": lambda: Scenario("worker 1 exits 1 -> restart -> launcher fails to start", max_restarts=1),
    "stop_fails_once": lambda: Scenario("worker 1 exits 1 and stop fails once"),
    "last_resort": lambda: Scenario("worker 1 exits 1 and stop fails"),
    "last_resort_outside_the_table": lambda: (
        Scenario()
        .rendezvous(waiting_raises="connection")
        .attempt("never", stop_raises=RuntimeError("stop failed"), stop_raises_times=1)
    ),
    "rendezvous_lost_in_unhealthy": lambda: Scenario(
        "worker 1 hangs", hang_timeout=1, plugins=[ReachesTheRendezvous()]
    ),
    "second_of_two_nodes": lambda: Scenario(
        "rendezvous rank 1 of 2 -> worker 0 exits 1 -> restart -> all succeed", max_restarts=2
    ),
    "node_lost_budget_spent": lambda: Scenario(
        "wait -> node lost", config=LaunchConfig(plugins={"restart-policy": {"budgets": "node_lost=0"}})
    ),
    "adopts_the_job_restart_count": lambda: (
        Scenario(max_restarts=3).rendezvous(rank=1, world_size=2, peer_restart_count=2).attempt("all_ok")
    ),
}


@pytest.mark.parametrize("name", list(PATHS))
def test_every_path_replays_identically(make_agent, name):
    run = PATHS[name]().run(make_agent)
    result = replay(run.agent.events_path)
    assert result.identical, f"{run.trace}: {result.divergence}"
    (replayed,) = result.runs
    assert [r.split(" --")[0] + "->" + r.split("--> ")[1] for r in replayed.replayed] == run.trace


def test_the_job_restart_count_is_adopted_in_the_replay_too(make_agent):
    run = PATHS["adopts_the_job_restart_count"]().run(make_agent)
    assert run.result.restart_count == 2
    assert replay(run.agent.events_path).identical


# -- input, output and the command line ------------------------------------------------------------


def test_bad_input_is_a_config_error_naming_the_line(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        replay(str(tmp_path / "missing.jsonl"))
    (tmp_path / "text.jsonl").write_text(
        '{"kind": "transition", "source": "INIT", "dest": "HEALTHY", "trigger": "start"}\nnot json\n'
    )
    with pytest.raises(ConfigError, match="line 2: not JSON"):
        replay(str(tmp_path / "text.jsonl"))
    (tmp_path / "other.jsonl").write_text('{"level": "info"}\n')
    with pytest.raises(ConfigError, match="line 1: not an fsm-agent event"):
        replay(str(tmp_path / "other.jsonl"))
    (tmp_path / "empty.jsonl").write_text('{"kind": "run_end", "state": "FAILED"}\n')
    with pytest.raises(ConfigError, match="records no transition"):
        replay(str(tmp_path / "empty.jsonl"))


@pytest.mark.parametrize(
    "name, needle",
    [("events.jsonl.gz", "gzip-compressed; decompress it first (gunzip -k"), ("core.bin", "not text (a binary file?)")],
)
def test_a_gzip_or_binary_file_is_one_line(tmp_path, name, needle):
    """Not a ``UnicodeDecodeError`` traceback."""
    import gzip

    path = tmp_path / name
    record = b'{"kind": "transition", "source": "INIT", "dest": "HEALTHY", "trigger": "start"}\n'
    path.write_bytes(gzip.compress(record * 50) if name.endswith(".gz") else bytes(range(256)))
    done = subprocess.run(
        [sys.executable, "-m", "fsm_agent", "replay", str(path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"fsm-agent: error: events file {str(path)!r}: {needle}"), lines


def test_json_output(crash_and_restart, capsys):
    assert cli_main(["--json", str(crash_and_restart)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["identical"] is True and out["divergence"] is None
    assert out["runs"][0]["replayed"] == CRASH_THEN_SUCCESS


def test_replayed_transitions_are_not_statechart_coverage(crash_and_restart, tmp_path, monkeypatch):
    monkeypatch.setenv(COVERAGE_DIR_ENV, str(tmp_path / "cov"))
    assert replay(str(crash_and_restart)).identical
    assert not (tmp_path / "cov").exists()


def test_python_dash_m_fsm_agent_replay(crash_and_restart, tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "fsm_agent.replay", str(crash_and_restart)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "identical trace", done.stderr
    missing = subprocess.run(
        [sys.executable, "-m", "fsm_agent.replay", str(tmp_path / "none.jsonl")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 2 and missing.stderr.startswith("fsm-agent: error: events file")


@pytest.mark.skipif(
    "replay" not in getattr(cli, "_DELEGATES", {}),
    reason="fsm_agent/cli.py does not dispatch `fsm-agent replay` yet (add it to _DELEGATES)",
)
def test_fsm_agent_replay_subcommand(crash_and_restart, tmp_path):
    with AgentProcesses(tmp_path, command=("replay",)) as replays:
        done = replays.run(str(crash_and_restart), timeout=180)
        assert done.returncode == 0 and done.stdout.splitlines()[-1] == "identical trace", done.stderr
        bad = tampered(
            crash_and_restart,
            tmp_path / "bad.jsonl",
            lambda rs: [dict(r, dest="FAILED") if r.get("trigger") == "workers_failed" else r for r in rs],
        )
        done = replays.run(str(bad), timeout=180)
        assert done.returncode == 1 and "expected FAILED, actual STOPPED" in done.stdout


# -- recordings kept in the repository ------------------------------------------------------------

RECORDED = sorted((Path(__file__).parent / "recorded").glob("*.jsonl"))


@pytest.mark.parametrize("path", RECORDED, ids=[p.stem for p in RECORDED])
def test_every_kept_recording_replays_identically(path):
    """Real runs of ``fsm-agent run --standalone --nproc-per-node 2`` (tests/replay/recorded/README.md):
    ``aaa9f7e-*`` recorded by the code before the redesign, whose transitions carry no fact (the
    replay rebuilds it), ``facts-*`` by today's, whose transitions carry the fact it fires again."""
    result = replay(str(path))
    result.assert_identical()
    transitions = [r for _, _, r in read_events(str(path)) if r["kind"] == "transition"]
    assert transitions and all(("fact" in r) == path.stem.startswith("facts-") for r in transitions)
    assert result.runs[0].recorded[-1].endswith(("SUCCEEDED", "FAILED"))
