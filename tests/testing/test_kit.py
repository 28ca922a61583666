"""The test kit itself: fakes keep the real interfaces, the recorder sees every hook once,
scenarios read as written, and the fixtures reach third-party test suites through pytest11."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousGracefulExitError,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.utils.store import barrier

from fsm_agent.exit_barrier import EXIT_BARRIER_PREFIX
from fsm_agent.heartbeat import HEARTBEAT_FILE_ENV
from fsm_agent.plugins import hookimpl
from fsm_agent.ranks import assign_ranks
from fsm_agent.testing import (
    AgentFactory,
    Attempt,
    FakeLauncher,
    FakeLauncherError,
    FakeRendezvous,
    HookRecorder,
    Round,
    Scenario,
    assert_trace,
    send_signal,
    trace,
)
from fsm_agent.testing.fakes import PID_BASE

pytestmark = pytest.mark.unit

pytest_plugins = ["pytester"]


def readable(fds, timeout=0.0):
    return select.select(list(fds), [], [], timeout)[0]


# -- FakeRendezvous ------------------------------------------------------------------------------


def test_fake_rendezvous_is_a_torch_rendezvous_handler():
    rdzv = FakeRendezvous(run_id="job7", master_addr="10.0.0.1", master_port=1234)
    assert isinstance(rdzv, RendezvousHandler)
    assert rdzv.get_run_id() == "job7" and rdzv.get_backend() == "fake"
    assert rdzv.use_agent_store is False
    info = rdzv.next_rendezvous()
    assert isinstance(info, RendezvousInfo)
    assert (info.rank, info.world_size) == (0, 1)
    assert (info.bootstrap_store_info.master_addr, info.bootstrap_store_info.master_port) == ("10.0.0.1", 1234)
    info.store.set("k", b"v")
    assert info.store.get("k") == b"v"
    assert assign_ranks(info.store, 0, 1, "trainer", 3)[0] == (0, 3, 0, 3)


def test_fake_rendezvous_follows_its_script_then_repeats_the_last_round():
    rdzv = FakeRendezvous(
        [
            Round(rank=1, world_size=3, peers_reach_exit_barrier=False),
            "timeout",
            RendezvousClosedError,
            "graceful_exit",
            (0, 2),
        ]
    )
    first = rdzv.next_rendezvous()
    assert (first.rank, first.world_size) == (1, 3)
    with pytest.raises(RendezvousTimeoutError):
        rdzv.next_rendezvous()
    with pytest.raises(RendezvousClosedError):
        rdzv.next_rendezvous()
    with pytest.raises(RendezvousGracefulExitError):
        rdzv.next_rendezvous()
    assert [(i.rank, i.world_size) for i in (rdzv.next_rendezvous(), rdzv.next_rendezvous())] == [(0, 2), (0, 2)]
    assert rdzv.calls == 6 and len(rdzv.infos) == 3
    first.store.set("only-in-round-0", b"1")
    assert not rdzv.infos[-1].store.check(["only-in-round-0"])  # each round has its own key space
    rdzv.shutdown()


def test_rounds_reject_a_rank_outside_the_group():
    with pytest.raises(ValueError, match="rank"):
        Round(rank=2, world_size=2)


@pytest.mark.parametrize(
    "rank, world, peer_lws, expected",
    [
        (1, 2, 3, (3, 5, 3, 5)),  # group rank 0 is simulated and assigns the ranks
        (0, 3, None, (0, 6, 0, 6)),  # this node assigns; peers have as many workers as it has
        (2, 3, 1, (2, 4, 2, 4)),
    ],
)
def test_simulated_peers_take_part_in_rank_assignment(rank, world, peer_lws, expected):
    rdzv = FakeRendezvous([Round(rank=rank, world_size=world, peer_local_world_size=peer_lws)], store_timeout=5)
    info = rdzv.next_rendezvous()
    lws = 2
    assert assign_ranks(info.store, info.rank, info.world_size, "trainer", lws)[0] == expected
    rdzv.shutdown()


@pytest.mark.parametrize("rank", [0, 1])
def test_simulated_peers_report_a_restart_count(rank):
    rdzv = FakeRendezvous([Round(rank=rank, world_size=2, peer_restart_count=3)], store_timeout=5)
    info = rdzv.next_rendezvous()
    assert assign_ranks(info.store, rank, 2, "trainer", 1, 1)[1] == 3  # the job-wide count is the highest
    rdzv.shutdown()


def test_simulated_peers_check_in_at_the_exit_barrier():
    rdzv = FakeRendezvous([Round(rank=0, world_size=2)], store_timeout=5)
    info = rdzv.next_rendezvous()
    assign_ranks(info.store, 0, 2, "default", 1)
    barrier(info.store, 2, EXIT_BARRIER_PREFIX, barrier_timeout=2)  # returns at once: the peer is there
    rdzv.shutdown()


def test_waiting_nodes_are_per_round_and_scriptable():
    rdzv = FakeRendezvous([Round(waiting=2), Round(), Round(waiting_raises="connection")])
    rdzv.next_rendezvous()
    assert rdzv.num_nodes_waiting() == 2
    rdzv.next_rendezvous()
    assert rdzv.num_nodes_waiting() == 0
    rdzv.add_waiting()
    assert rdzv.num_nodes_waiting() == 1
    rdzv.next_rendezvous()  # the waiting node joined this round
    with pytest.raises(RendezvousConnectionError):
        rdzv.num_nodes_waiting()
    assert rdzv.waiting_queries == 4


def test_closed_rendezvous_refuses_new_rounds_and_shutdown_closes_it():
    rdzv = FakeRendezvous()
    assert not rdzv.is_closed()
    rdzv.set_closed()
    assert rdzv.is_closed()
    with pytest.raises(RendezvousClosedError):
        rdzv.next_rendezvous()
    other = FakeRendezvous()
    assert other.shutdown() is True and other.is_closed() and other.shutdown_calls == 1


def test_round_action_runs_inside_next_rendezvous():
    seen = []
    rdzv = FakeRendezvous([Round(action=lambda: seen.append("in round"))])
    rdzv.next_rendezvous()
    assert seen == ["in round"]


def test_send_signal_refuses_when_nothing_handles_the_signal():
    previous = signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    try:
        with pytest.raises(RuntimeError, match="no Python handler"):
            send_signal(signal.SIGUSR1)()
    finally:
        signal.signal(signal.SIGUSR1, previous)


# -- FakeLauncher --------------------------------------------------------------------------------


def start(launcher, n=2):
    envs = {r: {"LOCAL_RANK": str(r)} for r in range(n)}
    return launcher.start(None, envs, {r: None for r in range(n)})


def test_fake_launcher_counts_time_in_polls_and_wakes_the_select():
    launcher = FakeLauncher([Attempt(exits={0: 0, 1: 3}, at={1: 2}, return_values={0: "zero", 1: "one"})])
    pids = start(launcher)
    assert pids == {0: PID_BASE, 1: PID_BASE + 1} and launcher.pids() == pids
    with pytest.raises(ProcessLookupError):  # fake pids never name a real process
        os.kill(pids[0], 0)
    fds = launcher.wait_fds()
    assert sorted(fds.values()) == [0, 1]
    assert [fds[fd] for fd in readable(fds)] == [0]  # rank 0 exited at tick 0: its fd is readable already
    assert launcher.poll() == {0: 0}  # poll 1 (tick 1 ends: nothing)
    assert list(launcher.wait_fds().values()) == [1] and readable(launcher.wait_fds()) == []
    assert launcher.poll() == {0: 0}  # poll 2: tick 2 ends with rank 1's exit
    assert readable(launcher.wait_fds()) == list(launcher.wait_fds())
    assert launcher.poll() == {0: 0, 1: 3}
    assert launcher.wait_fds() == {}
    assert set(launcher.exit_times()) == {0, 1}
    assert launcher.return_values() == {0: "zero"}  # only workers that exited 0
    launcher.close()


def test_fake_launcher_stop_stops_what_runs():
    launcher = FakeLauncher([Attempt(exits={1: 1}), Attempt(exits="never", ignores_stop=True)])
    start(launcher)
    assert launcher.poll() == {1: 1} and launcher.running() == [0]
    launcher.stop(signal.SIGTERM, 5.0)
    assert launcher.poll() == {0: -signal.SIGTERM, 1: 1}
    start(launcher)
    launcher.stop(signal.SIGTERM, 5.0)
    assert launcher.poll() == {0: -signal.SIGKILL, 1: -signal.SIGKILL}
    assert [(s.attempt, s.sig, s.timeout, s.stopped) for s in launcher.stops] == [
        (0, signal.SIGTERM, 5.0, (0,)),
        (1, signal.SIGTERM, 5.0, (0, 1)),
    ]
    launcher.close()


def test_fake_launcher_stop_before_any_start_is_recorded():
    launcher = FakeLauncher()
    launcher.stop()
    assert launcher.poll() == {} and launcher.stops[0].attempt is None and launcher.stops[0].stopped == ()


def test_fake_launcher_repeats_the_last_attempt_and_records_starts():
    launcher = FakeLauncher(["never", {0: 2}])
    start(launcher)
    assert launcher.poll() == {}
    for attempt in (1, 2):
        pids = start(launcher)
        assert pids[0] == PID_BASE + 100 * attempt
        assert launcher.poll() == {0: 2}
    assert [s.attempt for s in launcher.started] == [0, 1, 2]
    assert launcher.envs() == {0: {"LOCAL_RANK": "0"}, 1: {"LOCAL_RANK": "1"}}


def test_fake_launcher_scripted_failures():
    launcher = FakeLauncher(
        [
            Attempt(start_raises=OSError("no exec")),
            Attempt(exits="never", stop_raises=RuntimeError("stuck"), stop_raises_times=1),
            Attempt(poll_raises=ValueError("lost"), poll_raises_at=2),
        ]
    )
    with pytest.raises(OSError, match="no exec"):
        start(launcher)
    start(launcher)
    with pytest.raises(RuntimeError, match="stuck"):
        launcher.stop()
    launcher.stop()  # only the first stop raises
    assert launcher.running() == []
    start(launcher)
    launcher.poll()
    with pytest.raises(ValueError, match="lost"):
        launcher.poll()


def test_fake_launcher_gives_up_on_a_script_that_never_ends():
    launcher = FakeLauncher(["never"], max_polls=3)
    start(launcher)
    for _ in range(3):
        launcher.poll()
    with pytest.raises(FakeLauncherError, match="still running after 3 polls"):
        launcher.poll()


def test_fake_launcher_hang_dates_the_heartbeat_file_back(tmp_path):
    launcher = FakeLauncher([Attempt(exits="never", hangs={1: 1})])
    envs = {r: {HEARTBEAT_FILE_ENV: str(tmp_path / f"hb{r}")} for r in range(2)}
    launcher.start(None, envs, {0: None, 1: None})
    assert not (tmp_path / "hb1").exists()
    launcher.poll()
    assert (tmp_path / "hb1").stat().st_mtime == 0 and not (tmp_path / "hb0").exists()
    with pytest.raises(FakeLauncherError, match="hang_timeout"):
        start(FakeLauncher([Attempt(exits="never", hangs={0: 0})]))


def test_fake_launcher_rejects_ranks_outside_the_group():
    with pytest.raises(FakeLauncherError, match="local rank 5"):
        start(FakeLauncher([{5: 1}]))


def test_fake_launcher_actions_run_at_the_end_of_their_tick():
    seen = []
    launcher = FakeLauncher(
        [
            Attempt(
                exits="never",
                actions={0: lambda: seen.append(0), 2: [lambda: seen.append(2), lambda: seen.append("2b")]},
            )
        ]
    )
    start(launcher)
    assert seen == [0]
    launcher.poll()
    assert seen == [0]
    launcher.poll()
    assert seen == [0, 2, "2b"]


def test_fake_launcher_close_releases_the_pipes():
    launcher = FakeLauncher(["never"])
    start(launcher)
    fds = list(launcher.wait_fds())
    launcher.close()
    assert launcher.wait_fds() == {} and launcher.close_calls == 1
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)


# -- HookRecorder --------------------------------------------------------------------------------


def test_recorder_sees_pluggy_calls_and_per_implementation_broadcasts_once(plugin_manager):
    class Listener:
        @hookimpl
        def fsm_agent_put_metric(self, metric_name):
            pass

        @hookimpl
        def fsm_agent_worker_env(self, worker):
            return {"X": "1"}

    plugin_manager.register(Listener(), "listener")
    with HookRecorder(plugin_manager) as recorder:
        assert plugin_manager.hook.fsm_agent_worker_env(worker="w", worker_group="g") == [{"X": "1"}]
        for impl in plugin_manager.hook.fsm_agent_put_metric.get_hookimpls():  # what ElasticAgent._broadcast does
            impl.function(**{n: {"metric_group": "g", "metric_name": "m", "metric_value": 1}[n] for n in impl.argnames})
    assert recorder.names() == ["fsm_agent_worker_env", "fsm_agent_put_metric"]
    assert recorder.get("worker_env").kwargs == {"worker": "w", "worker_group": "g"}
    assert recorder.get("put_metric")["metric_value"] == 1
    recorder.assert_sequence(["worker_env", "fsm_agent_put_metric"])
    plugin_manager.hook.fsm_agent_worker_env(worker="w", worker_group="g")  # closed: not recorded
    assert len(recorder.calls()) == 2
    assert not any(name == "fsm-agent-testing-hook-recorder" for name, _ in plugin_manager.list_name_plugin())


def test_assert_sequence_explains_the_difference(plugin_manager):
    recorder = HookRecorder(plugin_manager)
    plugin_manager.hook.fsm_agent_worker_env(worker=1, worker_group=2)
    with pytest.raises(AssertionError, match=r"(?s)-state_changed.*\+worker_env"):
        recorder.assert_sequence(["state_changed"])
    recorder.assert_sequence([], ignore=["worker_env"])
    recorder.close()


def test_recorder_splits_a_run_into_setup_transitions_and_end(make_agent, hook_recorder):
    agent = make_agent(launcher=FakeLauncher(["all_ok"]))
    agent.run()
    assert [t.label for t in hook_recorder.by_transition()] == ["INIT->HEALTHY", "HEALTHY->SUCCEEDED"]
    hook_recorder.assert_sequence(["configure"], transition="setup")
    hook_recorder.assert_sequence(["put_metric*6", "record_event", "unconfigure"], transition="end")
    assert hook_recorder.calls("record_event")[-1]["event"]["kind"] == "run_end"
    segments = [
        hook_recorder.segment("setup"),
        *(t.calls for t in hook_recorder.by_transition()),
        hook_recorder.segment("end"),
    ]
    assert [c for s in segments for c in s] == hook_recorder.calls()  # nothing lost, nothing twice
    with pytest.raises(LookupError):
        hook_recorder.segment("STOPPED->HEALTHY")


def test_factory_releases_agents_that_never_ran(plugin_manager, hook_recorder):
    factory = AgentFactory(plugin_manager=plugin_manager, recorder=hook_recorder)
    rdzv, launcher = FakeRendezvous(), FakeLauncher()
    agent = factory(rdzv, launcher)
    wake = agent._interrupts.wake_r
    factory.close()
    with pytest.raises(OSError):
        os.fstat(wake)
    assert launcher.close_calls == 1 and rdzv.shutdown_calls == 1 and factory.agents == []


def test_recorder_needs_an_agent_to_split_by_transition(plugin_manager):
    with HookRecorder(plugin_manager) as recorder, pytest.raises(RuntimeError, match="attach"):
        recorder.by_transition()


# -- Scenario ------------------------------------------------------------------------------------


def test_text_scenario_builds_rounds_and_attempts():
    rdzv, launcher = Scenario("worker 1 exits 1 -> restart -> worker 0 exits 0 -> wait -> all succeed").build()
    assert [(r.rank, r.world_size, r.raises) for r in rdzv.rounds] == [(0, 1, None), (0, 1, None)]
    first, second = launcher.attempts
    assert (first.exits, first.at) == ({1: 1}, {1: 0})
    assert (second.exits, second.at) == ({0: 0, 1: 0}, {0: 0, 1: 2})


def test_text_scenario_rendezvous_signals_and_joins():
    rdzv, launcher = Scenario(
        "rendezvous rank 1 of 2 -> node joins -> SIGTERM and worker 0 hangs -> restart -> SIGINT during rendezvous",
        local_world_size=1,
    ).build()
    assert [(r.rank, r.world_size) for r in rdzv.rounds] == [(1, 2), (0, 1)]
    assert rdzv.rounds[1].action.__qualname__ == "send_signal(SIGINT)"
    attempt = launcher.attempts[0]
    assert attempt.exits == "never" and sorted(attempt.actions) == [0, 1] and attempt.hangs == {0: 1}
    attempt.actions[0][0]()
    rdzv.next_rendezvous()
    assert rdzv.num_nodes_waiting() == 0  # the join action was bound to this FakeRendezvous...
    attempt.actions[0][0]()
    assert rdzv.num_nodes_waiting() == 1  # ...and takes effect within the current round
    rdzv.shutdown()


@pytest.mark.parametrize(
    "text, raises",
    [
        ("rendezvous times out", "timeout"),
        ("rendezvous closed", "closed"),
        ("rendezvous graceful exit", "graceful_exit"),
        ("rendezvous fails", "error"),
    ],
)
def test_text_scenario_rendezvous_failures(text, raises):
    rdzv, launcher = Scenario(text).build()
    assert rdzv.rounds[0].raises == raises and launcher.attempts == []


def test_text_scenario_rejects_unknown_steps_with_the_accepted_ones():
    with pytest.raises(ValueError, match=r"(?s)cannot read 'worker one explodes'.*all succeed"):
        Scenario("worker one explodes")


def test_builder_scenario_matches_the_text_form():
    built = Scenario(max_restarts=1).attempt(exits={1: 1}).rendezvous(rank=0, world_size=1).attempt("all_ok")
    _, launcher = built.build()
    assert [a.exits for a in launcher.attempts] == [{1: 1}, "all_ok"]
    with pytest.raises(ValueError, match="attempt"):
        Scenario().join()


def test_scenario_runs_without_pytest_fixtures():
    run = Scenario("worker 0 exits 0 and worker 1 exits 0").expect(["INIT->HEALTHY", "HEALTHY->SUCCEEDED"]).run()
    assert run.result.exit_code == 0 and run.hooks is None


def test_assert_trace_reads_triggers_and_explains():
    run = Scenario("all succeed").run(AgentFactory())
    assert trace(run.agent) == ["INIT->HEALTHY", "HEALTHY->SUCCEEDED"]
    assert_trace(run.agent, ["INIT -> HEALTHY (start)", "HEALTHY->SUCCEEDED"])
    with pytest.raises(AssertionError, match=r"HEALTHY->SUCCEEDED \(workers_succeeded\)"):
        assert_trace(run.agent, ["INIT->HEALTHY (restart)", "HEALTHY->SUCCEEDED"])
    with pytest.raises(AssertionError, match="state trace differs"):
        run.assert_trace(["INIT->HEALTHY"])


# -- the pytest plugin ---------------------------------------------------------------------------


def test_pytest11_entry_point_registers_the_fixtures(request):
    (ep,) = [ep for ep in entry_points(group="pytest11") if ep.name == "fsm_agent"]
    assert ep.value == "fsm_agent.testing.pytest_plugin"
    assert request.config.pluginmanager.get_plugin("fsm_agent") is sys.modules["fsm_agent.testing.pytest_plugin"]
    for name in ("make_agent", "agent_factory", "plugin_manager", "hook_recorder"):
        assert request.getfixturevalue(name) is not None
    assert request.getfixturevalue("agent_factory") is request.getfixturevalue("make_agent")


@pytest.mark.slow
def test_a_plugin_package_gets_the_kit_without_a_conftest(pytester):
    pytester.makepyfile(
        test_my_plugin=textwrap.dedent("""
        from fsm_agent.plugins import hookimpl
        from fsm_agent.testing import Scenario

        class CountTransitions:
            seen = []

            @hookimpl
            def fsm_agent_state_changed(self, transition):
                self.seen.append(transition.trigger)

        def test_my_plugin_sees_a_restart(make_agent, hook_recorder):
            plugin = CountTransitions()
            run = Scenario("worker 1 exits 1 -> restart -> all succeed", max_restarts=1,
                           plugins=[plugin]).run(make_agent)
            run.assert_trace(["INIT->HEALTHY", "HEALTHY->STOPPED", "STOPPED->HEALTHY", "HEALTHY->SUCCEEDED"])
            assert plugin.seen == ["start", "workers_failed", "restart", "workers_succeeded"]
            assert len(hook_recorder.calls("state_changed")) == 4
    """)
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


# -- AgentProcesses ------------------------------------------------------------------------------


@pytest.mark.slow
def test_agent_processes_run_to_the_end_or_kill_the_group_at_the_timeout(tmp_path):
    from fsm_agent.testing import AgentProcesses
    from fsm_agent.testing.conformance import free_port

    (tmp_path / "worker.py").write_text("")
    with AgentProcesses(tmp_path, command=()) as processes:
        done = processes.run("plugins", "--json")
        assert done.returncode == 0 and '"name": "status-http"' in done.stdout, done.stderr
        waits_for_a_second_node = (
            "run",
            "--nnodes",
            "2",
            "--rdzv-backend",
            "fsm",
            "--rdzv-endpoint",
            f"127.0.0.1:{free_port()}",
            "worker.py",
        )
        with pytest.raises(subprocess.TimeoutExpired) as expired:
            processes.run(*waits_for_a_second_node, timeout=3)
        assert processes.procs[-1].returncode == -signal.SIGKILL  # killed with its group and reaped
        assert expired.value.timeout == 3 and isinstance(expired.value.stderr, str)


def test_loading_the_kit_does_not_import_torch():
    code = (
        "import sys, fsm_agent.testing, fsm_agent.testing.pytest_plugin; "
        "assert 'torch' not in sys.modules, 'torch imported'; "
        "assert 'HookRecorder' in fsm_agent.testing.__all__"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
