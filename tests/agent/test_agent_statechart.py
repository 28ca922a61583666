"""The real ElasticAgent, driven through every row of the transition table by the test kit's fakes.

Each case is a scenario with its exact state trace (triggers included); a meta-test checks that
the cases together cover every (trigger, source, dest) edge of ``fsm_agent.states.table``
except the few listed in UNREACHABLE, each with the reason the run loop cannot take it.
"""

from __future__ import annotations

import logging
import signal
import time

import pytest

from fsm_agent.plugins import hookimpl
from fsm_agent.states.table import AUTO_TRIGGERS, TRANSITIONS
from fsm_agent.states.worker_state import WorkerState
from fsm_agent.testing import Scenario
from tests.helpers.events import read_events

pytestmark = pytest.mark.unit

SIGTERM = signal.SIGTERM
START_HOOKS = [
    "rendezvous_completed",
    "node_check",  # the recorder's own implementation answers None: no check, no exchange
    "worker_env",
    "worker_env",
    "workers_started",
    "state_changed",
    "record_event",
    "put_metric*3",
]
AFTER_HOOKS = ["state_changed", "record_event", "put_metric*3"]
#: The ``cycle`` record of the steps that end a restart cycle (before their transition's hooks).
CYCLE_HOOK = "record_event"


def table_edges() -> set[tuple[str, str, str]]:
    edges = set()
    for row in TRANSITIONS:
        sources = row["source"] if isinstance(row["source"], (list, tuple)) else [row["source"]]
        edges |= {(row["trigger"], WorkerState(s).value, WorkerState(row["dest"]).value) for s in sources}
    return edges


def edges_of(expected_trace: list[str]) -> set[tuple[str, str, str]]:
    edges = set()
    for item in expected_trace:
        states, trigger = item.split(" (")
        source, dest = states.split("->")
        edges.add((trigger.rstrip(")"), source, dest))
    return edges


class ListenerBoom:
    @hookimpl
    def fsm_agent_worker_env(self, worker):
        raise ValueError("plugin cannot compute the env")


class FailingHealthCheck:
    """A health-check plugin that reports the node unhealthy on its first ``times`` calls."""

    def __init__(self, times: int = 1):
        self.times = times

    @hookimpl
    def fsm_agent_health_check(self, worker_group):
        if self.times:
            self.times -= 1
            return "GPU 0: uncorrectable ECC error"
        return None


class PolicyOf:
    """A restart policy plugin answering ``RestartDecision(**decision)`` for one failure class."""

    def __init__(self, failure_class: str, **decision):
        self.failure_class, self.decision = failure_class, decision
        self.asked: list[str] = []

    @hookimpl
    def fsm_agent_restart_policy(self, failure_class):
        from fsm_agent.worker import RestartDecision

        self.asked.append(failure_class)
        return RestartDecision(**self.decision) if failure_class == self.failure_class else None


class UnhealthyAfterPeerGaveUp:
    """A health check that fails the node just as a peer gives the job up (the verdict is already in
    the round's store when UNHEALTHY's workers_failed fires)."""

    def __init__(self):
        self.rendezvous = None

    @hookimpl
    def fsm_agent_configure(self, agent):
        self.rendezvous = agent._rdzv_handler

    @hookimpl
    def fsm_agent_health_check(self, worker_group):
        self.rendezvous.peer_gives_up(3)
        return "GPU 0: uncorrectable ECC error"


class FailingNodeCheck:
    """A node check (a fake) that this node fails on its calls number ``on`` (counted from 1)."""

    def __init__(self, *on: int):
        self.on, self.calls = set(on), 0

    @hookimpl
    def fsm_agent_node_check(self, check_round):
        from fsm_agent.node_checks import CheckResult

        self.calls += 1
        if self.calls in self.on:
            return CheckResult(check="fake", ok=False, reason="fake device 3: ECC errors")
        return CheckResult(check="fake", ok=True)


class BlamesThePeer:
    """A node check (a fake) on group rank 0 of 2 that, on its calls number ``on``, also plays the
    peer's report (the fake rendezvous's peer runs no checks) and blames that peer."""

    def __init__(self, *on: int):
        self.on, self.calls = set(on), 0

    @hookimpl
    def fsm_agent_node_check(self, check_round):
        import json

        from fsm_agent import node_checks

        self.calls += 1
        store = check_round.store
        store.set(node_checks.RESULT_KEY.format(1), json.dumps(["peer", []]))
        blamed = {1: "fake link at 20 Mbit/s, median 9 Gbit/s"} if self.calls in self.on else {}
        return node_checks.CheckResult(check="fake", ok=True, blamed=blamed)


def _left_after_the_node_check(run):
    assert run.result.exit_code == 69 and "node check failed (node_check): localhost (" in run.result.error
    assert "): fake: fake device 3: ECC errors" in run.result.error
    assert run.rendezvous.shutdown_calls == 0  # it leaves alone: the others re-form the round without it


def _ended_with_the_peers_verdict(run):
    verdict = run.result.job_verdict
    assert verdict is not None and verdict["root_causes"] == [3], run.result
    assert run.result.exit_code == 1 and run.result.restart_count == 0, run.result
    assert "the job failed: rank 3" in (run.result.verdict or ""), run.result


def _health_failures(run):
    classes = {f.failure_class for f in run.result.failures.values()} or {"health_check"}
    assert classes == {"health_check"}, run.result


# -- one case per way through the table ------------------------------------------------------------
# (id, scenario, exact trace with triggers, extra check(run))


def _drain_config(**options):
    from fsm_agent.config import LaunchConfig

    return LaunchConfig(plugins={"drain": {"signals": "SIGUSR2", "timeout": 0.0, **options}})


def _drained(scope):
    def check(run):
        from fsm_agent.worker import DRAIN_EXIT_CODE

        assert run.result.drain == scope and run.result.exit_code == DRAIN_EXIT_CODE, run.result
        records = run.agent.transitions
        assert len(records) == 1 or records[-1].restart_count == records[-2].restart_count  # no restart spent
        assert "drained" in (run.result.verdict or ""), run.result
        # a node drain leaves the rendezvous open for the others; a job drain closes it
        assert run.rendezvous.shutdown_calls == (1 if scope == "job" else 0)

    return check


def _ok(run):
    assert run.result.exit_code == 0 and run.result.error is None


def _signalled(run):
    assert run.result.signal == SIGTERM and run.result.exit_code == 128 + SIGTERM
    assert run.rendezvous.shutdown_calls == 0  # a signalled agent leaves the rendezvous open for its peers


def _error_contains(*needles):
    def check(run):
        assert run.result.state == WorkerState.UNKNOWN or run.result.state == WorkerState.FAILED
        for needle in needles:
            assert needle in (run.result.error or ""), run.result.error

    return check


CASES = [
    ("all_succeed", Scenario("all succeed"), ["INIT->HEALTHY (start)", "HEALTHY->SUCCEEDED (workers_succeeded)"], _ok),
    (
        "failure_restart_success",
        Scenario("worker 1 exits 1 -> restart -> all succeed", max_restarts=1),
        [
            "INIT->HEALTHY (start)",
            "HEALTHY->STOPPED (workers_failed)",
            "STOPPED->HEALTHY (restart)",
            "HEALTHY->SUCCEEDED (workers_succeeded)",
        ],
        _ok,
    ),
    (
        "failure_without_restarts",
        Scenario("worker 0 exits 3"),
        ["INIT->HEALTHY (start)", "HEALTHY->FAILED (workers_failed)"],
        lambda run: (run.result.exit_code == 3 and list(run.result.failures) == [0]) or pytest.fail(str(run.result)),
    ),
    (
        "restarts_exhausted",
        Scenario("worker 0 exits 1 -> restart -> wait -> worker 1 exits 2", max_restarts=1),
        [
            "INIT->HEALTHY (start)",
            "HEALTHY->STOPPED (workers_failed)",
            "STOPPED->HEALTHY (restart)",
            "HEALTHY->FAILED (workers_failed)",
        ],
        lambda run: (run.result.restart_count == 1 and run.result.exit_code == 2) or pytest.fail(str(run.result)),
    ),
    (
        "membership_changed",
        Scenario("node joins -> restart -> all succeed"),
        [
            "INIT->HEALTHY (start)",
            "HEALTHY->STOPPED (membership_changed)",
            "STOPPED->HEALTHY (restart)",
            "HEALTHY->SUCCEEDED (workers_succeeded)",
        ],
        lambda run: (run.result.restart_count == 0) or pytest.fail("a membership change spent a restart"),
    ),
    (
        "node_lost",
        Scenario("wait -> node lost -> restart -> all succeed"),
        [
            "INIT->HEALTHY (start)",
            "HEALTHY->STOPPED (membership_changed)",
            "STOPPED->HEALTHY (restart)",
            "HEALTHY->SUCCEEDED (workers_succeeded)",
        ],
        lambda run: (run.result.restart_count == 0) or pytest.fail("a lost node spent a restart"),
    ),
    (
        "node_lost_policy_gives_up",
        Scenario("wait -> node lost", plugins=[PolicyOf("node_lost", restart=False, reason="no spare nodes")]),
        ["INIT->HEALTHY (start)", "HEALTHY->FAILED (membership_changed)"],
        lambda run: (
            (run.result.error == "node_lost: no spare nodes" and run.result.verdict == "no spare nodes")
            or pytest.fail(str(run.result))
        ),
    ),
    (
        "peer_gives_up",
        Scenario("rendezvous rank 0 of 2 -> wait -> peer gives up (rank 3) -> wait", max_restarts=3),
        ["INIT->HEALTHY (start)", "HEALTHY->FAILED (job_failed)"],
        _ended_with_the_peers_verdict,
    ),
    (
        "peer_gives_up_while_unhealthy",
        Scenario("rendezvous rank 0 of 2 -> wait", max_restarts=3, plugins=[UnhealthyAfterPeerGaveUp()]),
        ["INIT->HEALTHY (start)", "HEALTHY->UNHEALTHY (health_check_failed)", "UNHEALTHY->FAILED (job_failed)"],
        _ended_with_the_peers_verdict,
    ),
    (
        "health_check_then_restart",
        Scenario("wait -> restart -> all succeed", max_restarts=1, plugins=[FailingHealthCheck()]),
        [
            "INIT->HEALTHY (start)",
            "HEALTHY->UNHEALTHY (health_check_failed)",
            "UNHEALTHY->STOPPED (workers_failed)",
            "STOPPED->HEALTHY (restart)",
            "HEALTHY->SUCCEEDED (workers_succeeded)",
        ],
        _ok,
    ),
    (
        "health_check_excludes_this_node",
        Scenario(
            "wait",
            max_restarts=3,
            plugins=[
                FailingHealthCheck(),
                PolicyOf("health_check", restart=False, exclude_node=True, reason="unhealthy: leaving the job"),
            ],
        ),
        ["INIT->HEALTHY (start)", "HEALTHY->UNHEALTHY (health_check_failed)", "UNHEALTHY->FAILED (workers_failed)"],
        lambda run: (
            _health_failures(run),
            run.result.verdict == "unhealthy: leaving the job"
            and run.result.exit_code == 69
            and run.rendezvous.shutdown_calls == 0
            or pytest.fail(str(run.result)),
        ),
    ),
    (
        "node_check_failed_in_init",
        Scenario("all succeed", plugins=[FailingNodeCheck(1)]),
        ["INIT->FAILED (node_check_failed)"],
        _left_after_the_node_check,
    ),
    (
        "node_check_failed_on_restart",
        Scenario("worker 1 exits 1 -> restart -> all succeed", max_restarts=1, plugins=[FailingNodeCheck(2)]),
        ["INIT->HEALTHY (start)", "HEALTHY->STOPPED (workers_failed)", "STOPPED->FAILED (node_check_failed)"],
        _left_after_the_node_check,
    ),
    (
        "nodes_excluded_in_init",
        Scenario("rendezvous rank 0 of 2 -> all succeed", plugins=[BlamesThePeer(1)]),
        ["INIT->INIT (nodes_excluded)", "INIT->HEALTHY (start)", "HEALTHY->SUCCEEDED (workers_succeeded)"],
        _ok,
    ),
    (
        "nodes_excluded_on_restart",
        Scenario(
            "worker 1 exits 1 -> restart -> rendezvous rank 0 of 2 -> all succeed",
            max_restarts=1,
            plugins=[BlamesThePeer(2)],
        ),
        [
            "INIT->HEALTHY (start)",
            "HEALTHY->STOPPED (workers_failed)",
            "STOPPED->STOPPED (nodes_excluded)",
            "STOPPED->HEALTHY (restart)",
            "HEALTHY->SUCCEEDED (workers_succeeded)",
        ],
        _ok,
    ),
    (
        "rendezvous_failed_in_init",
        Scenario("rendezvous times out"),
        ["INIT->FAILED (rendezvous_failed)"],
        _error_contains("RendezvousTimeoutError", "backend=fake"),
    ),
    (
        "rendezvous_failed_while_healthy",
        Scenario().rendezvous(waiting_raises="connection").attempt("never"),
        ["INIT->HEALTHY (start)", "HEALTHY->FAILED (rendezvous_failed)"],
        _error_contains("RendezvousConnectionError"),
    ),
    (
        "rendezvous_failed_on_restart",
        Scenario("worker 1 exits 1 -> restart -> rendezvous closed", max_restarts=1),
        ["INIT->HEALTHY (start)", "HEALTHY->STOPPED (workers_failed)", "STOPPED->FAILED (rendezvous_failed)"],
        _error_contains("RendezvousClosedError"),
    ),
    (
        "rendezvous_not_needed_in_init",
        Scenario("rendezvous graceful exit"),
        ["INIT->SUCCEEDED (rendezvous_not_needed)"],
        _ok,
    ),
    (
        "rendezvous_not_needed_on_restart",
        Scenario("node joins -> restart -> rendezvous graceful exit"),
        [
            "INIT->HEALTHY (start)",
            "HEALTHY->STOPPED (membership_changed)",
            "STOPPED->SUCCEEDED (rendezvous_not_needed)",
        ],
        _ok,
    ),
    ("stop_requested_in_init", Scenario("SIGTERM during rendezvous"), ["INIT->FAILED (stop_requested)"], _signalled),
    (
        "stop_requested_while_healthy",
        Scenario("wait -> SIGTERM"),
        ["INIT->HEALTHY (start)", "HEALTHY->FAILED (stop_requested)"],
        _signalled,
    ),
    (
        "stop_requested_while_stopped",
        Scenario("worker 1 exits 1 -> restart -> SIGTERM during rendezvous", max_restarts=1),
        ["INIT->HEALTHY (start)", "HEALTHY->STOPPED (workers_failed)", "STOPPED->FAILED (stop_requested)"],
        _signalled,
    ),
    (
        "drain_requested_while_healthy",
        Scenario("wait -> SIGUSR2", config=_drain_config()),
        ["INIT->HEALTHY (start)", "HEALTHY->FAILED (drain_requested)"],
        _drained("node"),
    ),
    (
        "job_drain_requested_while_healthy",
        Scenario("wait -> SIGUSR2", config=_drain_config(scope="job")),
        ["INIT->HEALTHY (start)", "HEALTHY->FAILED (drain_requested)"],
        _drained("job"),
    ),
    (
        "drain_requested_in_init",
        Scenario("all succeed", config=_drain_config(file=__file__, file_at_start="drain")),
        ["INIT->FAILED (drain_requested)"],
        _drained("node"),
    ),
    (
        "drain_requested_during_the_first_rendezvous",
        Scenario("SIGUSR2 during rendezvous", config=_drain_config()),
        ["INIT->FAILED (drain_requested)"],
        _drained("node"),
    ),
    (
        "drain_requested_while_stopped",
        Scenario("worker 1 exits 1 -> restart -> SIGUSR2 during rendezvous", max_restarts=1, config=_drain_config()),
        ["INIT->HEALTHY (start)", "HEALTHY->STOPPED (workers_failed)", "STOPPED->FAILED (drain_requested)"],
        _drained("node"),
    ),
    (
        "agent_errored_in_init",
        Scenario("launcher fails to start"),
        ["INIT->UNKNOWN (agent_errored)"],
        _error_contains("start failed in state INIT", "scripted start failure"),
    ),
    (
        "agent_errored_plugin_in_init",
        Scenario("all succeed", plugins=[ListenerBoom()]),
        ["INIT->UNKNOWN (agent_errored)"],
        _error_contains("plugin cannot compute the env"),
    ),
    (
        "agent_errored_while_healthy",
        Scenario("worker 1 exits 1 and stop fails once"),
        ["INIT->HEALTHY (start)", "HEALTHY->UNKNOWN (agent_errored)"],
        _error_contains("workers_failed failed in state HEALTHY", "scripted stop failure"),
    ),
    (
        "agent_errored_watching_workers",
        Scenario().attempt("never", poll_raises=RuntimeError("launcher lost its workers")),
        ["INIT->HEALTHY (start)", "HEALTHY->UNKNOWN (agent_errored)"],
        _error_contains("watching the workers failed", "launcher lost its workers"),
    ),
    (
        "hang_then_restart",
        Scenario("worker 1 hangs -> restart -> all succeed", max_restarts=1, hang_timeout=1),
        [
            "INIT->HEALTHY (start)",
            "HEALTHY->UNHEALTHY (workers_hung)",
            "UNHEALTHY->STOPPED (workers_failed)",
            "STOPPED->HEALTHY (restart)",
            "HEALTHY->SUCCEEDED (workers_succeeded)",
        ],
        _ok,
    ),
    (
        "hang_without_restarts",
        Scenario("worker 1 hangs", hang_timeout=1),
        ["INIT->HEALTHY (start)", "HEALTHY->UNHEALTHY (workers_hung)", "UNHEALTHY->FAILED (workers_failed)"],
        lambda run: (
            ([f.failure_class for f in run.result.failures.values()] == ["hang"]) or pytest.fail(str(run.result))
        ),
    ),
    (
        "stop_requested_while_unhealthy",
        Scenario("worker 1 hangs -> SIGTERM", hang_timeout=1),
        ["INIT->HEALTHY (start)", "HEALTHY->UNHEALTHY (workers_hung)", "UNHEALTHY->FAILED (stop_requested)"],
        _signalled,
    ),
    (
        "agent_errored_while_unhealthy",
        Scenario("worker 1 hangs and stop fails once", hang_timeout=1),
        ["INIT->HEALTHY (start)", "HEALTHY->UNHEALTHY (workers_hung)", "UNHEALTHY->UNKNOWN (agent_errored)"],
        _error_contains("workers_failed failed in state UNHEALTHY", "scripted stop failure"),
    ),
    (
        "agent_errored_on_restart",
        Scenario("worker 1 exits 1 -> restart -> launcher fails to start", max_restarts=1),
        ["INIT->HEALTHY (start)", "HEALTHY->STOPPED (workers_failed)", "STOPPED->UNKNOWN (agent_errored)"],
        _error_contains("restart failed in state STOPPED"),
    ),
]


@pytest.mark.parametrize("scenario, expected, check", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_statechart_path(make_agent, scenario, expected, check):
    previous = signal.getsignal(SIGTERM)
    run = scenario.run(make_agent)
    run.assert_trace(expected)
    check(run)
    assert run.agent.get_worker_group().state == run.result.state
    assert run.launcher.wait_fds() == {}  # the agent closed its launcher
    assert signal.getsignal(SIGTERM) is previous  # and put the signal handlers back


#: Edges of the table the run loop cannot take, and why. Change the agent, then this list.
UNREACHABLE = {
    (
        "workers_succeeded",
        "UNHEALTHY",
        "SUCCEEDED",
    ): "in UNHEALTHY the run loop fires workers_failed at once: the hung ranks are the failure",
    (
        "rendezvous_failed",
        "UNHEALTHY",
        "FAILED",
    ): "nothing asks the rendezvous anything while UNHEALTHY (no membership check before workers_failed)",
}


#: Edges the kit's fakes cannot take, and the test with real agents and workers that does: an
#: in-process recovery needs workers playing the protocol on the round's TCPStore.
COVERED_BY_REAL_AGENTS = {
    ("workers_failed", "HEALTHY", "HEALTHY"): "tests/inprocess/test_agent_inprocess.py (a failed rank replaced)",
    ("inprocess_recovered", "HEALTHY", "HEALTHY"): "tests/inprocess/test_agent_inprocess.py (a failed rank replaced)",
    ("inprocess_failed", "HEALTHY", "STOPPED"): "tests/inprocess/test_agent_inprocess.py (a survivor never arrives)",
    ("inprocess_failed", "HEALTHY", "FAILED"): "tests/inprocess/test_agent_inprocess.py (... with no restarts left)",
}


def test_cases_cover_every_reachable_edge_of_the_table():
    covered = set().union(*(edges_of(expected) for _, _, expected, _ in CASES)) | set(COVERED_BY_REAL_AGENTS)
    assert covered <= table_edges(), f"cases name edges the table lacks: {covered - table_edges()}"
    assert set(UNREACHABLE) <= table_edges(), f"stale UNREACHABLE entries: {set(UNREACHABLE) - table_edges()}"
    assert not covered & set(UNREACHABLE), f"now covered, drop from UNREACHABLE: {covered & set(UNREACHABLE)}"
    missing = table_edges() - covered - set(UNREACHABLE)
    assert not missing, f"edges of the table no case takes: {sorted(missing)}"


def test_unhealthy_always_moves_on_with_workers_failed():
    """What UNREACHABLE relies on: UNHEALTHY advances by itself with workers_failed (the table's
    AUTO_TRIGGERS), so the run loop never waits for another fact there."""
    assert AUTO_TRIGGERS[WorkerState.UNHEALTHY] == "workers_failed"


# -- exact hooks per transition ------------------------------------------------------------------


def test_hooks_of_start(make_agent, hook_recorder):
    run = Scenario("all succeed").run(make_agent)
    hook_recorder.assert_sequence(START_HOOKS, transition=0)
    group = run.agent.get_worker_group()
    (rdzv_done,) = hook_recorder.calls("rendezvous_completed")
    assert rdzv_done["worker_group"] is group and rdzv_done["duration_s"] >= 0
    assert [c["worker"].local_rank for c in hook_recorder.calls("worker_env")] == [0, 1]
    assert hook_recorder.get("workers_started")["pids"] == run.launcher.started[0].pids
    changed = hook_recorder.segment(0)[5]
    assert changed["transition"] is run.agent.transitions[0]
    metrics = [(c["metric_group"], c["metric_name"], c["metric_value"]) for c in hook_recorder.segment(0)[7:]]
    assert metrics[:2] == [
        ("torchelastic", "workers.default.remaining_restarts", 0),
        ("torchelastic", "workers.default.healthy", 1),
    ]
    assert metrics[2][:2] == ("fsm_agent", "state.INIT.duration_s")
    hook_recorder.assert_sequence(
        [
            "configure",
            *START_HOOKS,
            "worker_exited",
            "record_event",
            "worker_exited",
            "record_event",
            CYCLE_HOOK,
            *AFTER_HOOKS,
            "put_metric*6",
            "record_event",
            "unconfigure",
        ]
    )


def test_hooks_of_failure_then_restart(make_agent, hook_recorder):
    run = Scenario("worker 1 exits 1 -> restart -> all succeed", max_restarts=1).run(make_agent)
    assert [t.label for t in hook_recorder.by_transition()] == [
        "INIT->HEALTHY",
        "HEALTHY->STOPPED",
        "STOPPED->HEALTHY",
        "HEALTHY->SUCCEEDED",
    ]
    hook_recorder.assert_sequence(START_HOOKS, transition=0)
    hook_recorder.assert_sequence(
        ["worker_exited", "record_event", "classify_failure", CYCLE_HOOK, "restart_policy", *AFTER_HOOKS],
        transition=1,
    )
    hook_recorder.assert_sequence(START_HOOKS, transition=2)
    hook_recorder.assert_sequence(["worker_exited", "record_event"] * 2 + [CYCLE_HOOK, *AFTER_HOOKS], transition=3)

    exited, event, classify, cycle, policy = hook_recorder.segment(1)[:5]
    assert (exited["worker"].local_rank, exited["exitcode"]) == (1, 1)
    assert classify["report"].global_rank == 1  # the attribution names the root cause the policy decides on
    assert event["event"]["kind"] == "worker_exit" and event["event"]["exit_code"] == 1
    assert cycle["event"]["kind"] == "cycle" and cycle["event"]["failure_class"] == "exit_code"
    assert list(policy["failures"]) == [1] and policy["restart_count"] == 0
    transition_event = hook_recorder.segment(1)[6]["event"]
    assert (transition_event["source"], transition_event["dest"], transition_event["trigger"]) == (
        "HEALTHY",
        "STOPPED",
        "workers_failed",
    )
    remaining = hook_recorder.segment(1)[7]
    assert (remaining["metric_name"], remaining["metric_value"]) == ("workers.default.remaining_restarts", 0)
    assert [s.stopped for s in run.launcher.stops] == [(0,)]  # the survivor was stopped before the restart
    assert [e[0]["TORCHELASTIC_RESTART_COUNT"] for e in (s.envs for s in run.launcher.started)] == ["0", "1"]
    assert hook_recorder.get("unconfigure")["result"] is not None


def test_hooks_of_a_hang(make_agent, hook_recorder):
    run = Scenario("worker 1 hangs -> restart -> all succeed", max_restarts=1, hang_timeout=1).run(make_agent)
    assert [t.label for t in hook_recorder.by_transition()][1:3] == ["HEALTHY->UNHEALTHY", "UNHEALTHY->STOPPED"]
    hook_recorder.assert_sequence(AFTER_HOOKS, transition=1)
    hook_recorder.assert_sequence(["classify_failure", CYCLE_HOOK, "restart_policy", *AFTER_HOOKS], transition=2)
    (failure,) = hook_recorder.segment(2)[2]["failures"].values()
    assert (failure.local_rank, failure.failure_class) == (1, "hang") and "no heartbeat" in failure.message
    assert [s.stopped for s in run.launcher.stops] == [(0, 1)]  # the hung worker is stopped with the rest


def test_built_in_event_recorder_writes_the_same_trace(make_agent):
    run = Scenario("worker 1 exits 1 -> restart -> all succeed", max_restarts=1).run(make_agent)
    events = read_events(run.agent.events_path)
    assert [f"{e['source']}->{e['dest']}" for e in events if e["kind"] == "transition"] == run.trace
    assert [e["kind"] for e in events].count("worker_exit") == 3 and events[-1]["kind"] == "run_end"


def test_membership_restart_does_not_count(make_agent):
    run = Scenario("node joins -> restart -> all succeed").run(make_agent)
    assert [s.envs[0]["TORCHELASTIC_RESTART_COUNT"] for s in run.launcher.started] == ["0", "0"]
    assert run.rendezvous.calls == 2 and run.rendezvous.num_nodes_waiting() == 0


def test_last_resort_unknown_when_the_error_path_fails_too(make_agent, hook_recorder):
    run = Scenario("worker 1 exits 1 and stop fails").run(make_agent)
    run.assert_trace(["INIT->HEALTHY (start)", "HEALTHY->UNKNOWN (agent_errored)"])
    assert "then agent_errored failed: RuntimeError: scripted stop failure" in run.result.error
    assert run.result.exit_code != 0 and run.launcher.close_calls >= 1
    # outside a trigger the transition's hooks end at its state_changed; its listeners fall into "end"
    assert hook_recorder.transition_names(1)[-1] == "fsm_agent_state_changed"
    assert hook_recorder.transition_names("end")[:4] == ["fsm_agent_record_event"] + ["fsm_agent_put_metric"] * 3


# -- plugins that misbehave ----------------------------------------------------------------------


class RaisingListener:
    @hookimpl
    def fsm_agent_put_metric(self, metric_name):
        raise RuntimeError(f"metrics backend down ({metric_name})")

    @hookimpl
    def fsm_agent_state_changed(self, transition):
        raise RuntimeError("state listener down")


class CollectingListener:
    def __init__(self):
        self.metrics, self.transitions = [], []

    @hookimpl
    def fsm_agent_put_metric(self, metric_group, metric_name, metric_value):
        self.metrics.append(metric_name)

    @hookimpl
    def fsm_agent_state_changed(self, transition):
        self.transitions.append(transition.trigger)


@pytest.mark.parametrize("order", ["raising_first", "raising_last"])
def test_a_raising_listener_does_not_break_the_run(make_agent, hook_recorder, caplog, order):
    raising, collecting = RaisingListener(), CollectingListener()
    plugins = [raising, collecting] if order == "raising_first" else [collecting, raising]
    caplog.set_level(logging.ERROR, logger="fsm_agent.agent")
    run = Scenario("worker 1 exits 1 -> restart -> all succeed", max_restarts=1, plugins=plugins).run(make_agent)
    run.assert_trace(["INIT->HEALTHY", "HEALTHY->STOPPED", "STOPPED->HEALTHY", "HEALTHY->SUCCEEDED"])
    assert run.result.exit_code == 0
    assert collecting.metrics == [c["metric_name"] for c in hook_recorder.calls("put_metric")]
    assert collecting.transitions == ["start", "workers_failed", "restart", "workers_succeeded"]
    assert "failed in fsm_agent_put_metric" in caplog.text and "failed in fsm_agent_state_changed" in caplog.text


# -- more than one node --------------------------------------------------------------------------


def test_second_node_of_two_gets_the_upper_ranks_and_passes_the_exit_barrier(make_agent):
    started = time.monotonic()
    run = Scenario("rendezvous rank 1 of 2 -> all succeed", exit_barrier_timeout=30).run(make_agent)
    run.assert_trace(["INIT->HEALTHY", "HEALTHY->SUCCEEDED"])
    envs = run.launcher.envs()
    assert [(e["RANK"], e["WORLD_SIZE"], e["GROUP_RANK"], e["GROUP_WORLD_SIZE"]) for e in envs.values()] == [
        ("2", "4", "1", "2"),
        ("3", "4", "1", "2"),
    ]
    assert (envs[0]["MASTER_ADDR"], envs[0]["MASTER_PORT"]) == ("127.0.0.1", "29500")
    assert time.monotonic() - started < 10  # the simulated peer checked in: no barrier timeout


def test_return_values_are_keyed_by_global_rank(make_agent):
    run = (
        Scenario(local_world_size=2)
        .rendezvous(rank=1, world_size=2, peer_local_world_size=3)
        .attempt("all_ok", return_values={0: "a", 1: "b"})
        .run(make_agent)
    )
    assert run.result.return_values == {3: "a", 4: "b"}


# -- listener hooks are called one implementation at a time ---------------------------------------


def test_wrapper_listener_is_refused_by_name(make_agent):
    """A wrapper=True listener would never run (listeners are called one by one): refused at build."""
    from fsm_agent.errors import PluginError

    class Timing:
        @hookimpl(wrapper=True)
        def fsm_agent_state_changed(self, transition):
            return (yield)

    with pytest.raises(PluginError, match="fsm_agent_state_changed is a listener hook"):
        Scenario("all succeed", plugins=[Timing()]).run(make_agent)


def test_policy_hears_each_failure_class_and_the_events_record_it(make_agent):
    """membership_change, node_lost and signal reach the policy; the events file keeps them for replay."""
    from fsm_agent.replay import replay

    policy = PolicyOf("none")  # answers nothing: the built-in policy decides, the plugin only listens
    run = Scenario(
        "wait -> 2 nodes join -> restart -> wait -> node lost -> restart -> worker 1 is killed", plugins=[policy]
    ).run(make_agent)
    assert policy.asked == ["membership_change", "node_lost", "signal"]
    events = read_events(run.agent.events_path)
    transitions = [(e["trigger"], e.get("failure_class")) for e in events if e["kind"] == "transition"]
    assert transitions == [
        ("start", None),
        ("membership_changed", "membership_change"),
        ("restart", None),
        ("membership_changed", "node_lost"),
        ("restart", None),
        ("workers_failed", "signal"),
    ]
    assert run.result.restart_count == 0 and run.result.verdict == "no restarts left (max_restarts=0)"
    replay(run.agent.events_path).assert_identical()


def test_health_check_failure_is_replayed_identically(make_agent):
    from fsm_agent.replay import replay

    run = Scenario("wait -> restart -> worker 0 exits 1", max_restarts=1, plugins=[FailingHealthCheck()]).run(
        make_agent
    )
    run.assert_trace(
        [
            "INIT->HEALTHY (start)",
            "HEALTHY->UNHEALTHY (health_check_failed)",
            "UNHEALTHY->STOPPED (workers_failed)",
            "STOPPED->HEALTHY (restart)",
            "HEALTHY->FAILED (workers_failed)",
        ]
    )
    replay(run.agent.events_path).assert_identical()


def test_a_drain_signal_before_the_run_drains_at_its_start(make_agent):
    """A drain signal the CLI's early handlers kept (``_early_signals``) is the agent's first fact."""
    from fsm_agent import _early_signals

    _early_signals._note_drain(signal.SIGUSR2, None)
    run = Scenario("all succeed", config=_drain_config()).run(make_agent)
    run.assert_trace(["INIT->FAILED (drain_requested)"])
    assert run.agent.drain["source"] == "signal" and run.agent.drain["by"] == "SIGUSR2"
    assert _early_signals.take_early_drain() is None  # taken once
