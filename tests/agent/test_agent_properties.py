"""Property-based exploration of the agent: a hypothesis stateful test drives random sequences of
rendezvous results, worker exits, hangs, membership changes, signals and launcher faults through
the real ElasticAgent (fake rendezvous, ManualLauncher) and checks the invariants after every
step of the agent's run loop.

The agent is driven one run-loop step at a time (``ElasticAgent._step``, what ``run()`` loops on)
from the test's main thread, with the agent's own signal handlers installed, so signals are real
``os.kill`` calls. At the end of each example ``agent.run()`` finishes the run through the
public API (a live agent first gets SIGTERM).

Invariants, checked after every step:

- restart_count never exceeds max_restarts, and it moves only on ``workers_failed -> STOPPED``;
  the restart policy's verdict is the budget (or exit code 78);
- a terminal state is final: no transition leaves it, the machine offers no trigger there;
- every start of the workers is preceded by its own rendezvous (in particular after STOPPED);
- no worker is left running in STOPPED or in a terminal state;
- the events file and the state trace agree (same transitions, same restart counts), and the
  worker group's state mirrors the machine's;
- every transition is an edge of the table.

Known gap, allowed explicitly (``LAST_RESORT``) and counted in the terminal summary: when the
error path itself fails (its ``_stop_workers`` raises, e.g. a launcher whose ``stop`` fails once),
``ElasticAgent._fire_error`` sets UNKNOWN directly. It then records the failed error trigger
(``HEALTHY --rendezvous_failed--> UNKNOWN`` is no edge of the table), and it only ``close()``s
the launcher, which leaves live workers running (SubprocessLauncher.close spares live workers;
they die with the agent's process through PDEATHSIG). Every other run must satisfy the
invariants above without exception.

CI runs the profile ``fsm-agent-ci``: seed SEED (fixed), MAX_EXAMPLES examples of up to
STEPS rules each. ``FSM_AGENT_HYPOTHESIS_PROFILE=fsm-agent-explore`` runs a longer, randomly
seeded exploration (and prints the seed of any failure to reproduce it).
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile

import pytest
from hypothesis import HealthCheck, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
from transitions.core import MachineError

from fsm_agent.plugins import hookimpl
from fsm_agent.states.worker_state import WorkerState as S
from fsm_agent.testing import FakeRendezvous, Round, build_agent, send_signal
from fsm_agent.testing.coverage import Edge, table_edges
from tests.helpers.events import read_events

from .manual_launcher import ManualLauncher

pytestmark = pytest.mark.property

SEED = 20251130
MAX_EXAMPLES = 100
STEPS = 30
CI_PROFILE = "fsm-agent-ci"
EXPLORE_PROFILE = "fsm-agent-explore"
PROFILE_ENV = "FSM_AGENT_HYPOTHESIS_PROFILE"

_COMMON = dict(
    deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much], print_blob=True
)
settings.register_profile(
    CI_PROFILE, max_examples=MAX_EXAMPLES, stateful_step_count=STEPS, derandomize=True, database=None, **_COMMON
)
settings.register_profile(EXPLORE_PROFILE, max_examples=500, stateful_step_count=50, **_COMMON)

TERMINAL = (S.SUCCEEDED, S.FAILED, S.UNKNOWN)
EDGES = set(table_edges())
DO_NOT_RESTART = 78
MAX_AGENT_STEPS = 400  # run-loop steps one event may take to show (each waits at most one 10 ms tick)
TRIGGERS = sorted({edge.trigger for edge in EDGES})

#: How often the known gap (see the module docstring) was hit, for the terminal summary.
LAST_RESORT = {"examples": 0, "edges outside the table": set(), "ended with live workers": 0}

#: What the next rendezvous does.
ROUNDS = {
    "ok": lambda: Round(),
    "ok, second of two nodes": lambda: Round(rank=1, world_size=2),
    "times out": lambda: Round(raises="timeout"),
    "is closed": lambda: Round(raises="closed"),
    "graceful exit": lambda: Round(raises="graceful_exit"),
    "store unreachable": lambda: Round(raises="connection"),
    "SIGTERM meanwhile": lambda: Round(action=send_signal(signal.SIGTERM)),
}
ROUND_KINDS = st.sampled_from(["ok"] * 12 + sorted(set(ROUNDS) - {"ok"}))  # mostly ok: longer runs


class ScriptedRendezvous(FakeRendezvous):
    """FakeRendezvous whose next round is whatever the test queued last; ``lost`` breaks the store."""

    def __init__(self):
        super().__init__(store_timeout=10.0)
        self.queue: list[str] = []
        self.lost = False

    def round_for(self, index: int) -> Round:
        return ROUNDS[self.queue.pop(0) if self.queue else "ok"]()

    def num_nodes_waiting(self) -> int:
        if self.lost:
            raise RendezvousConnectionError("scripted: the rendezvous store went away")
        return super().num_nodes_waiting()


class Observations:
    """Every rendezvous, start, exit and state change, in the order the hooks fired."""

    def __init__(self):
        self.events: list[tuple] = []

    @hookimpl
    def fsm_agent_rendezvous_completed(self, worker_group, duration_s):
        self.events.append(("rendezvous",))

    @hookimpl
    def fsm_agent_workers_started(self, worker_group, pids):
        self.events.append(("started",))

    @hookimpl
    def fsm_agent_worker_exited(self, worker, worker_group, exitcode):
        self.events.append(("exit", worker.local_rank, exitcode))

    @hookimpl
    def fsm_agent_state_changed(self, transition):
        self.events.append(("state", transition.source, transition.dest, transition.trigger))


class AgentRuns(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.agent = None
        self.terminal_at: int | None = None

    # -- setup and teardown ----------------------------------------------------------------------
    @initialize(
        max_restarts=st.sampled_from([0, 1, 2, 3, 3]),
        local_world_size=st.integers(1, 3),
        hang_detection=st.booleans(),
        first_round=ROUND_KINDS,
    )
    def build(self, max_restarts, local_world_size, hang_detection, first_round):
        self.tmp = tempfile.mkdtemp(prefix="fsm_agent_property_")
        self.max_restarts, self.hang_detection = max_restarts, hang_detection
        self.rdzv, self.launcher, self.seen = ScriptedRendezvous(), ManualLauncher(), Observations()
        self.rdzv.queue.append(first_round)
        self.events_path = os.path.join(self.tmp, "events.jsonl")
        self.agent = build_agent(
            self.rdzv,
            self.launcher,
            plugins=[self.seen],
            max_restarts=max_restarts,
            local_world_size=local_world_size,
            hang_timeout=1.0 if hang_detection else None,
            log_dir=self.tmp,
            events_path=self.events_path,
            exit_barrier_timeout=10.0,
        )
        self.previous_handlers = self.agent._interrupts.install()
        self.settle()

    def teardown(self):
        if self.agent is None:
            return
        try:
            if not self.terminal:
                os.kill(os.getpid(), signal.SIGTERM)
                self.settle()
            result = self.agent.run()  # terminal already: run() only finishes (releases, run_end)
            assert result.state == self.agent.state and result.restart_count == self.agent.restart_count
            last = self.records()[-1]
            assert (last["kind"], last["state"]) == ("run_end", result.state.value)
            self.check()
            if self.last_resort() is not None:
                LAST_RESORT["examples"] += 1
                LAST_RESORT["ended with live workers"] += bool(self.launcher.running())
        finally:
            self.agent._interrupts.restore(self.previous_handlers)
            shutil.rmtree(self.tmp, ignore_errors=True)

    # -- driving the run loop --------------------------------------------------------------------
    @property
    def state(self) -> S:
        return self.agent.state

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def step(self) -> None:
        self.agent._step()
        self.check()

    def settle(self) -> None:
        """Let the states that move by themselves move: INIT/STOPPED (start, restart), UNHEALTHY
        (the hang is the failure), and any state once a signal is pending."""
        for _ in range(MAX_AGENT_STEPS):
            if self.terminal or not (self.state in (S.INIT, S.STOPPED, S.UNHEALTHY) or self.agent._interrupts.signal):
                return
            self.step()
        raise AssertionError(f"the agent did not settle: still {self.state.value}")

    def advance(self, event: str, expect_change: bool = True) -> None:
        """After an event: step until the agent reacts (a transition), then settle."""
        before = len(self.agent.transitions)
        for _ in range(MAX_AGENT_STEPS if expect_change else 2):
            if self.terminal or len(self.agent.transitions) > before:
                break
            self.step()
        if expect_change:
            assert len(self.agent.transitions) > before, f"the agent ignored: {event} (state {self.state.value})"
        else:
            assert len(self.agent.transitions) == before, f"{event} changed the state: {self.trace()[before:]}"
        self.settle()

    def healthy(self) -> bool:
        return self.agent is not None and self.state == S.HEALTHY and bool(self.launcher.running())

    def live(self) -> bool:
        return self.agent is not None and not self.terminal

    def pick(self, index: int) -> int:
        running = self.launcher.running()
        return running[index % len(running)]

    # -- rules: what happens next ----------------------------------------------------------------
    @precondition(live)
    @rule(kind=ROUND_KINDS)
    def next_rendezvous(self, kind):
        self.rdzv.queue.append(kind)

    @precondition(healthy)
    @rule(index=st.integers(0, 2), code=st.sampled_from([0, 0, 1, 2, DO_NOT_RESTART, -9, -15]))
    def worker_exits(self, index, code):
        last_one = len(self.launcher.running()) == 1
        self.launcher.exit(self.pick(index), code)
        self.advance(f"a worker exited {code}", expect_change=code != 0 or last_one)

    @precondition(healthy)
    @rule()
    def all_workers_succeed(self):
        for rank in self.launcher.running():
            self.launcher.exit(rank, 0)
        self.advance("every worker exited 0")

    @precondition(lambda self: self.healthy() and self.hang_detection)
    @rule(index=st.integers(0, 2))
    def worker_hangs(self, index):
        self.launcher.hang(self.pick(index))
        self.advance("a worker hung")

    @precondition(healthy)
    @rule(count=st.integers(1, 3))
    def nodes_join(self, count):
        self.rdzv.add_waiting(count)
        self.advance(f"{count} node(s) waiting to join")

    @precondition(live)
    @rule(
        kind=st.sampled_from(
            [
                "SIGTERM",
                "SIGINT",
                "rendezvous store lost",
                "launcher loses track",
                "next stop fails once",
                "next start fails",
            ]
        )
    )
    def fault(self, kind):
        """Something goes wrong that is not the workers' doing (one rule, so that faults stay rare)."""
        if kind in ("SIGTERM", "SIGINT"):
            os.kill(os.getpid(), getattr(signal, kind))
            self.advance(f"{kind} to the agent")
        elif kind == "next stop fails once":
            self.launcher.stop_errors = 1
        elif kind == "next start fails":
            self.launcher.start_error = RuntimeError("scripted: cannot spawn workers")
        elif self.healthy():  # the two below are noticed only while the workers run
            if kind == "rendezvous store lost":
                self.rdzv.lost = True
            else:
                self.launcher.poll_error = RuntimeError("scripted: the launcher lost its workers")
            self.advance(kind)

    @precondition(healthy)
    @rule()
    def time_passes(self):
        self.advance("nothing", expect_change=False)

    @precondition(lambda self: self.agent is not None and self.terminal)
    @rule(trigger=st.sampled_from(TRIGGERS))
    def terminal_state_refuses(self, trigger):
        """A terminal state is final: every trigger is refused and nothing changes."""
        before, state = len(self.agent.transitions), self.state
        try:
            self.agent.trigger(trigger)
        except MachineError:
            pass
        else:
            raise AssertionError(f"{trigger} was accepted in terminal state {state.value}")
        assert self.state == state and len(self.agent.transitions) == before

    # -- invariants ------------------------------------------------------------------------------
    def trace(self) -> list[str]:
        return [f"{r.source}->{r.dest} ({r.trigger})" for r in self.agent.transitions]

    def last_resort(self):
        """The transition made by ElasticAgent._fire_error's last resort (the error path failed), if any."""
        records = self.agent.transitions
        if (
            records
            and records[-1].dest == S.UNKNOWN.value
            and f"; then {records[-1].trigger} failed:" in (records[-1].error or "")
        ):
            return records[-1]
        return None

    def records(self) -> list[dict]:
        return read_events(self.events_path)

    @invariant()
    def invariants_hold(self):
        if self.agent is not None:
            self.check()

    def check(self) -> None:
        agent, records = self.agent, self.agent.transitions
        # restart budget
        assert agent.restart_count <= self.max_restarts, (agent.restart_count, self.max_restarts, self.trace())
        # a terminal state is final
        if self.terminal_at is None and self.terminal:
            self.terminal_at = len(records)
            assert agent.machine.get_triggers(self.state.value) == [], "a terminal state offers triggers"
        if self.terminal_at is not None:
            assert len(records) == self.terminal_at and records[-1].dest == self.state.value, self.trace()
        # every transition is an edge of the table; the restart count moves only on workers_failed -> STOPPED
        count = 0
        last_resort = self.last_resort()
        for record in records:
            edge = Edge(record.source, record.trigger, record.dest)
            if edge not in EDGES:
                assert record is last_resort, f"{edge} is no edge of the table: {self.trace()}"
                LAST_RESORT["edges outside the table"].add(str(edge))
            if (record.trigger, record.dest) == ("workers_failed", "STOPPED"):
                count += 1
            assert record.restart_count == count, self.trace()
        assert agent.restart_count == count
        # the restart policy's verdict: the budget, or a worker asking not to be restarted (exit 78)
        budget_used, attempt_exits = 0, []
        for event in self.seen.events:
            if event[0] == "started":
                attempt_exits = []
            elif event[0] == "exit":
                attempt_exits.append(event[2])
            elif event[0] == "state" and event[3] == "workers_failed":
                refused = DO_NOT_RESTART in attempt_exits
                if event[2] == "STOPPED":
                    assert budget_used < self.max_restarts and not refused, self.trace()
                    budget_used += 1
                else:
                    assert budget_used == self.max_restarts or refused, self.trace()
        # every start of the workers comes after its own rendezvous (after STOPPED in particular)
        need_rendezvous = True
        for event in self.seen.events:
            if event[0] == "rendezvous":
                need_rendezvous = False
            elif event[0] == "started":
                assert not need_rendezvous, f"workers started without a rendezvous: {self.seen.events}"
                need_rendezvous = True
            elif event[0] == "state" and event[2] == "STOPPED":
                need_rendezvous = True
        assert len(self.launcher.attempts) == sum(1 for e in self.seen.events if e[0] == "started")
        # nobody runs in STOPPED or in a terminal state
        if self.state == S.STOPPED or self.terminal:
            if last_resort is None:
                assert self.launcher.running() == [], f"workers {self.launcher.running()} run in {self.state.value}"
            else:  # the known gap: the launcher was closed, not stopped
                assert self.launcher.close_calls >= 1
        # the events file and the state trace agree
        recorded = [
            (r["source"], r["dest"], r["trigger"], r["restart_count"])
            for r in self.records()
            if r["kind"] == "transition"
        ]
        assert recorded == [(r.source, r.dest, r.trigger, r.restart_count) for r in records]
        assert agent.get_worker_group().state == self.state


def test_random_runs_keep_the_invariants():
    profile = os.environ.get(PROFILE_ENV, CI_PROFILE)
    machine = AgentRuns
    if profile == CI_PROFILE:
        machine = seed(SEED)(type("AgentRunsFixedSeed", (AgentRuns,), {}))
    run_state_machine_as_test(machine, settings=settings.get_profile(profile))
