"""Build a real ElasticAgent on the fakes, run it in-process, and check its state trace.

- ``build_agent(...)`` / ``AgentFactory``: the real ``ElasticAgent`` with a real plugin manager
  (built-ins registered, entry points not loaded unless asked), real hook dispatch, fake
  rendezvous and launcher. The ``make_agent`` fixture is an AgentFactory.
- ``Scenario``: a test written as a story, with a builder::

      Scenario(max_restarts=1).attempt(exits={1: 1}).attempt(exits="all_ok")

  or as text, steps separated by ``->``::

      Scenario("worker 1 exits 1 -> restart -> all succeed", max_restarts=1)

  ``scenario.run(make_agent)`` returns a ScenarioResult whose ``trace`` is
  ``["INIT->HEALTHY", "HEALTHY->STOPPED", "STOPPED->HEALTHY", "HEALTHY->SUCCEEDED"]``.
- ``trace(agent)`` / ``assert_trace(agent, expected)``: the same check for any agent.
"""

from __future__ import annotations

import functools
import os
import re
import signal as _signal
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from fsm_agent.testing.fakes import Attempt, FakeLauncher, FakeRendezvous, Round, send_signal

__all__ = [
    "AgentFactory",
    "Scenario",
    "ScenarioResult",
    "assert_trace",
    "build_agent",
    "format_transition",
    "trace",
    "PHRASES",
]

DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


# =============================================================================================
# building agents
# =============================================================================================


def build_agent(
    rendezvous: Any = None,
    launcher: Any = None,
    *,
    plugin_manager: Any = None,
    plugins: Iterable[Any] | Mapping[str, Any] = (),
    load_entry_points: bool = False,
    local_world_size: int = 2,
    max_restarts: int = 0,
    role: str = "default",
    entrypoint: Any = "fake_train.py",
    args: tuple = (),
    monitor_interval: float = 0.01,
    exit_barrier_timeout: float = 5.0,
    log_dir: str | None = os.devnull,
    events_path: str | None = None,
    signals_to_handle: str = DEFAULT_SIGNALS,
    config: Any = None,
    recorder: Any = None,
    **spec_fields: Any,
):
    """A real ElasticAgent wired to a fake (or any) rendezvous handler and launcher.

    Args:
        rendezvous: a RendezvousHandler (default ``FakeRendezvous()``: one node, one round).
        launcher: a launcher (default ``FakeLauncher()``: every worker exits 0).
        plugin_manager: default ``get_plugin_manager(load_entry_points=load_entry_points)``.
        plugins: extra plugins to register (a list, or ``{name: plugin}``).
        local_world_size / max_restarts / role / entrypoint / args / monitor_interval /
            exit_barrier_timeout / **spec_fields: the WorkerSpec (``monitor_interval`` defaults
            to 0.01 s so periodic checks are quick).
        log_dir: the run's log directory (default ``os.devnull``: no files at all).
        events_path / signals_to_handle / config: as ``ElasticAgent``.
        recorder: a HookRecorder to ``attach`` to the agent (it should already watch ``plugin_manager``).
    """
    from fsm_agent.agent import ElasticAgent
    from fsm_agent.logs import LogsLayout
    from fsm_agent.plugins.manager import get_plugin_manager
    from fsm_agent.worker import RendezvousSpec, WorkerSpec

    rendezvous = FakeRendezvous() if rendezvous is None else rendezvous
    launcher = FakeLauncher() if launcher is None else launcher
    pm = get_plugin_manager(load_entry_points=load_entry_points) if plugin_manager is None else plugin_manager
    named = plugins.items() if isinstance(plugins, Mapping) else ((None, p) for p in plugins)
    for name, plugin in named:
        pm.register(plugin, name=name)
    run_id = rendezvous.get_run_id()
    spec = WorkerSpec(
        role=role,
        local_world_size=local_world_size,
        entrypoint=entrypoint,
        args=tuple(args),
        rendezvous=RendezvousSpec(backend=rendezvous.get_backend(), run_id=run_id),
        max_restarts=max_restarts,
        monitor_interval=monitor_interval,
        exit_barrier_timeout=exit_barrier_timeout,
        **spec_fields,
    )
    logs = LogsLayout(log_dir=log_dir, run_id=run_id)
    agent = ElasticAgent(
        spec,
        pm,
        rendezvous,
        launcher,
        logs,
        events_path=events_path,
        signals_to_handle=signals_to_handle,
        config=config,
    )
    if recorder is not None:
        recorder.attach(agent)
    return agent


class AgentFactory:
    """``factory(rendezvous=..., launcher=..., **build_agent_kwargs) -> ElasticAgent`` with shared defaults.

    Args:
        plugin_manager: used for every agent it builds; None gives each agent a fresh one. (Build
            one agent per plugin manager: the built-in event recorder registers a per-run plugin
            under a fixed name.)
        recorder: a HookRecorder attached to each agent built.
        log_dir: log directory for the agents (default ``os.devnull``).

    Attributes:
        agents: every agent built, in order.
    """

    def __init__(self, plugin_manager: Any = None, recorder: Any = None, log_dir: str | None = os.devnull):
        self.plugin_manager = plugin_manager
        self.recorder = recorder
        self.log_dir = log_dir
        self.agents: list[Any] = []

    def __call__(self, rendezvous: Any = None, launcher: Any = None, **kwargs: Any):
        kwargs.setdefault("plugin_manager", self.plugin_manager)
        kwargs.setdefault("recorder", self.recorder)
        kwargs.setdefault("log_dir", self.log_dir)
        agent = build_agent(rendezvous, launcher, **kwargs)
        self.agents.append(agent)
        return agent

    def close(self) -> None:
        """Release what agents that were built but never run hold (pipes, temporary files):
        ``run()`` does that on its way out, through ``agent.close()`` (idempotent)."""
        for agent in self.agents:
            agent.close()
        self.agents.clear()


# =============================================================================================
# traces
# =============================================================================================


def format_transition(record: Any, triggers: bool = False) -> str:
    """``"INIT->HEALTHY"``, or ``"INIT->HEALTHY (start)"`` with ``triggers``."""
    text = f"{record.source}->{record.dest}"
    return f"{text} ({record.trigger})" if triggers else text


def _records(agent_or_records: Any) -> list[Any]:
    return list(getattr(agent_or_records, "transitions", agent_or_records))


def trace(agent_or_records: Any, triggers: bool = False) -> list[str]:
    """The state trace of an agent (or a list of TransitionRecords) as ``"SOURCE->DEST"`` strings."""
    return [format_transition(r, triggers) for r in _records(agent_or_records)]


def assert_trace(agent_or_records: Any, expected: Iterable[str]) -> None:
    """Assert the exact state trace. An expected item may name its trigger: ``"HEALTHY->STOPPED (workers_failed)"``."""
    expected = [re.sub(r"\s*->\s*", "->", e.strip()) for e in expected]
    records = _records(agent_or_records)
    got = [format_transition(r, "(" in e) for r, e in zip(records, expected)]
    if len(records) != len(expected) or got != expected:
        full = trace(records, triggers=True)
        errors = [r.error for r in records if r.error]
        raise AssertionError(
            "state trace differs\n  expected: "
            + repr(expected)
            + "\n  recorded: "
            + repr(full)
            + (f"\n  agent error: {errors[-1]}" if errors else "")
        )


# =============================================================================================
# scenarios
# =============================================================================================


@attrs.define
class _Slot:
    """One rendezvous round and the attempt it starts."""

    round: dict[str, Any] = attrs.Factory(dict)
    attempt: dict[str, Any] | None = None
    tick: int = 0  # next tick for a text step

    def ensure_attempt(self, **defaults: Any) -> dict[str, Any]:
        if self.attempt is None:
            self.attempt = dict(defaults)
        self.attempt.setdefault("actions", {})
        return self.attempt


#: The text steps a Scenario understands (case-insensitive; combine clauses in one step with "and").
PHRASES = {
    "all succeed | all ok": "every worker not yet exited exits 0",
    "worker N exits C | worker N fails | worker N is killed by SIGKILL": "local rank N exits (fails: code 1)",
    "worker N hangs": "local rank N stops making progress (hang detection: build with hang_timeout=...)",
    "wait": "one tick passes with no exit",
    "node joins | N nodes join": "late nodes are waiting (membership_changed at the next monitor check)",
    "node lost | N nodes lost": "peers of this round die (membership_changed, class node_lost, at the next check)",
    "peer gives up (rank R)": "a peer of this round gives the job up, rank R its root cause (job_failed at the next look)",
    "SIGTERM | signal SIGINT": "the agent receives the signal at this tick",
    "SIGTERM during rendezvous": "the agent receives the signal inside the next rendezvous call",
    "restart": "what follows happens in the next attempt (after the next rendezvous)",
    "rendezvous rank R of W": "the next round gives group rank R of W nodes",
    "rendezvous times out | rendezvous closed | rendezvous graceful exit | rendezvous fails": "the next rendezvous raises RendezvousTimeoutError / ClosedError / GracefulExitError / RendezvousError",
    "launcher fails to start": "the launcher's start raises (agent_errored)",
    "stop fails | stop fails once": "the launcher's stop raises (every time / only the first time)",
}

_SIG = r"(sig[a-z0-9]+)"


def _signum(name: str) -> int:
    try:
        return int(getattr(_signal, name.upper()))
    except AttributeError:
        raise ValueError(f"unknown signal {name!r}") from None


class Scenario:
    """A run of one agent, scripted attempt by attempt; ``run()`` executes it on the fakes.

    Args:
        text: optional story, steps separated by ``->`` (see ``PHRASES``). Within an attempt the
            k-th step happens at tick k (the first at once); ``restart`` moves to the next attempt.
        **agent_kwargs: passed to the agent factory (``local_world_size`` (default 2),
            ``max_restarts``, ``plugins``, ...).
    """

    def __init__(self, text: str | None = None, **agent_kwargs: Any):
        agent_kwargs.setdefault("local_world_size", 2)
        self.agent_kwargs = agent_kwargs
        self.local_world_size: int = agent_kwargs["local_world_size"]
        self.slots: list[_Slot] = [_Slot()]
        self.expected: list[str] | None = None
        if text:
            self.parse(text)

    # -- builder ---------------------------------------------------------------------------------
    @property
    def _slot(self) -> _Slot:
        return self.slots[-1]

    def _open_slot(self) -> _Slot:
        """The slot whose round/attempt is not scripted yet (a new one once the last has an attempt)."""
        if self._slot.attempt is not None:
            self.slots.append(_Slot())
        return self._slot

    def rendezvous(self, rank: int = 0, world_size: int = 1, **round_fields: Any) -> Scenario:
        """Script the next rendezvous round (see ``Round``)."""
        self._open_slot().round.update(rank=rank, world_size=world_size, **round_fields)
        return self

    def rendezvous_fails(self, kind: Any = "timeout") -> Scenario:
        """The next rendezvous raises: ``timeout``, ``closed``, ``graceful_exit``, ``error`` or an exception."""
        self._open_slot().round["raises"] = kind
        return self

    def signal_in_rendezvous(self, sig: int = _signal.SIGTERM) -> Scenario:
        """The agent receives ``sig`` inside the next rendezvous call."""
        self._open_slot().round["action"] = ("signal", int(sig))
        return self

    def attempt(self, exits: Any = "all_ok", **attempt_fields: Any) -> Scenario:
        """Script the next attempt (see ``Attempt``: ``exits``, ``at``, ``return_values``, ``start_raises``...)."""
        slot = self._open_slot()
        slot.attempt = {"exits": exits, **attempt_fields}
        slot.attempt["actions"] = dict(attempt_fields.get("actions", {}))
        return self

    def _current_attempt(self, what: str) -> dict[str, Any]:
        if self._slot.attempt is None:
            raise ValueError(f"Scenario.{what}: script an attempt() first")
        return self._slot.attempt

    def join(self, at: int = 0, count: int = 1) -> Scenario:
        """``count`` nodes start waiting at tick ``at`` of the last attempt (membership_changed follows)."""
        self._add_action(self._current_attempt("join"), at, ("join", count))
        return self

    def signal(self, sig: int = _signal.SIGTERM, at: int = 0) -> Scenario:
        """The agent receives ``sig`` at tick ``at`` of the last attempt."""
        self._add_action(self._current_attempt("signal"), at, ("signal", int(sig)))
        return self

    def expect(self, expected: Iterable[str]) -> Scenario:
        """The state trace ``run()`` asserts (see ``assert_trace``)."""
        self.expected = list(expected)
        return self

    @staticmethod
    def _add_action(attempt: dict[str, Any], tick: int, action: Any) -> None:
        attempt["actions"].setdefault(tick, []).append(action)

    # -- text ------------------------------------------------------------------------------------
    def parse(self, text: str) -> Scenario:
        """Append the steps of ``text`` (see ``PHRASES``)."""
        for step in (s.strip() for s in text.split("->")):
            if not step:
                raise ValueError(f"empty step in scenario {text!r}")
            clauses = [c.strip() for c in re.split(r"\s*(?:,|\band\b)\s*", step.lower()) if c.strip()]
            advances = [self._clause(c, step) for c in clauses]
            if any(advances):
                self._slot.tick += 1
        return self

    def _events(self) -> tuple[_Slot, dict[str, Any]]:
        slot = self._slot
        if slot.attempt is None:
            slot.ensure_attempt(exits={}, at={}, hangs={})
        return slot, slot.attempt

    def _clause(self, clause: str, step: str) -> bool:
        """Apply one clause; True if it is an event inside an attempt (it takes a tick)."""
        m = None

        def match(pattern: str) -> bool:
            nonlocal m
            m = re.fullmatch(pattern, clause)
            return m is not None

        if match(r"(then )?restarts?"):
            self._open_slot()
            return False
        if match(r"rendezvous (?:gives )?rank (\d+) of (\d+)"):
            self._open_slot().round.update(rank=int(m.group(1)), world_size=int(m.group(2)))
            return False
        if match(
            r"rendezvous (times out|timeout|(?:is )?closed|graceful exit|exits gracefully|not needed|"
            r"fails|connection fails)"
        ):
            kind = {
                "times out": "timeout",
                "timeout": "timeout",
                "closed": "closed",
                "is closed": "closed",
                "graceful exit": "graceful_exit",
                "exits gracefully": "graceful_exit",
                "not needed": "graceful_exit",
                "fails": "error",
                "connection fails": "connection",
            }[m.group(1)]
            self._open_slot().round["raises"] = kind
            return False
        if match(rf"(?:signal )?{_SIG} (?:during|in) (?:the )?rendezvous"):
            self._open_slot().round["action"] = ("signal", _signum(m.group(1)))
            return False
        if match(r"(?:the )?launcher fails to start|start fails"):
            attempt = self._open_slot().ensure_attempt(exits={}, at={}, hangs={})
            attempt["start_raises"] = RuntimeError("scripted start failure")
            return False
        if match(r"stop fails( once)?"):
            attempt = self._events()[1]
            attempt["stop_raises"] = RuntimeError("scripted stop failure")
            attempt["stop_raises_times"] = 1 if m.group(1) else None
            return False
        slot, attempt = self._events()
        tick = slot.tick
        if match(r"(?:all|all workers|workers|everyone) (?:succeed|succeeds|exit 0|ok)|all ok|succeed"):
            attempt["rest_ok_at"] = tick
        elif match(r"(?:worker|rank) (\d+) (?:exits|exit|exits with) (-?\d+)"):
            self._exit(attempt, int(m.group(1)), int(m.group(2)), tick)
        elif match(r"(?:worker|rank) (\d+) fails"):
            self._exit(attempt, int(m.group(1)), 1, tick)
        elif match(rf"(?:worker|rank) (\d+) (?:is )?killed(?: by {_SIG})?"):
            self._exit(attempt, int(m.group(1)), -_signum(m.group(2) or "sigkill"), tick)
        elif match(r"(?:worker|rank) (\d+) (?:hangs|is hung|stops making progress)"):
            attempt["hangs"][int(m.group(1))] = tick
        elif match(r"(?:workers (?:keep )?)?(?:wait|waits|running|run|tick)"):
            pass
        elif match(r"(?:a )?node joins|(\d+) nodes join"):
            self._add_action(attempt, tick, ("join", int(m.group(1) or 1)))
        elif match(r"(?:a )?node (?:is )?lost|(\d+) nodes (?:are )?lost"):
            self._add_action(attempt, tick, ("lost", int(m.group(1) or 1)))
        elif match(r"(?:a )?peer gives (?:the job )?up(?: \(?rank (\d+)\)?)?"):
            self._add_action(attempt, tick, ("peer_gives_up", int(m.group(1) or 2)))
        elif match(rf"(?:signal |agent gets |agent receives )?{_SIG}"):
            self._add_action(attempt, tick, ("signal", _signum(m.group(1))))
        else:
            accepted = "\n  ".join(f"{k}: {v}" for k, v in PHRASES.items())
            raise ValueError(f"scenario step {step!r}: cannot read {clause!r}; accepted steps:\n  {accepted}")
        return True

    @staticmethod
    def _exit(attempt: dict[str, Any], rank: int, code: int, tick: int) -> None:
        attempt["exits"][rank] = code
        attempt["at"][rank] = tick

    # -- running ---------------------------------------------------------------------------------
    def build(self) -> tuple[FakeRendezvous, FakeLauncher]:
        """The scripted FakeRendezvous and FakeLauncher."""
        rendezvous = FakeRendezvous()
        rounds, attempts = [], []
        for slot in self.slots:
            fields = dict(slot.round)
            if "action" in fields:
                fields["action"] = self._bind(fields["action"], rendezvous)
            rounds.append(Round(**fields))
            if slot.attempt is not None:
                attempts.append(self._make_attempt(slot.attempt, rendezvous))
        rendezvous.rounds = rounds
        return rendezvous, FakeLauncher(attempts)

    def _make_attempt(self, fields: dict[str, Any], rendezvous: FakeRendezvous) -> Attempt:
        fields = dict(fields)
        rest_ok_at = fields.pop("rest_ok_at", None)
        actions = {
            tick: [self._bind(a, rendezvous) for a in (acts if isinstance(acts, list) else [acts])]
            for tick, acts in fields.pop("actions", {}).items()
        }
        if rest_ok_at is not None:
            exits = {} if isinstance(fields.get("exits"), str) else dict(fields.get("exits") or {})
            at = dict(fields.get("at") or {})
            for rank in range(self.local_world_size):
                if rank not in exits:
                    exits[rank], at[rank] = 0, rest_ok_at
            fields.update(exits=exits, at=at)
        elif fields.get("exits") == {}:
            fields["exits"] = "never"
        return Attempt(actions=actions, **fields)

    @staticmethod
    def _bind(action: Any, rendezvous: FakeRendezvous) -> Any:
        if isinstance(action, tuple) and action and action[0] == "join":
            return functools.partial(rendezvous.add_waiting, action[1])
        if isinstance(action, tuple) and action and action[0] == "lost":
            return functools.partial(rendezvous.add_lost, action[1])
        if isinstance(action, tuple) and action and action[0] == "signal":
            return send_signal(action[1])
        if isinstance(action, tuple) and action and action[0] == "peer_gives_up":
            return functools.partial(rendezvous.peer_gives_up, action[1])
        return action

    def run(self, factory: Any = None) -> ScenarioResult:
        """Build the fakes, build the agent with ``factory`` (the ``make_agent`` fixture, or a
        fresh ``AgentFactory()``), run it, and check ``expect``'s trace if one was given."""
        rendezvous, launcher = self.build()
        factory = AgentFactory() if factory is None else factory
        agent = factory(rendezvous=rendezvous, launcher=launcher, **self.agent_kwargs)
        result = agent.run()
        outcome = ScenarioResult(
            agent=agent,
            result=result,
            rendezvous=rendezvous,
            launcher=launcher,
            hooks=getattr(factory, "recorder", None),
        )
        if self.expected is not None:
            outcome.assert_trace(self.expected)
        return outcome


@attrs.frozen
class ScenarioResult:
    """What a scenario run left behind.

    Attributes:
        agent: the ElasticAgent (``agent.transitions`` is the full record).
        result: its RunResult.
        rendezvous / launcher: the fakes, with what they recorded.
        hooks: the factory's HookRecorder, if it has one.
    """

    agent: Any
    result: Any
    rendezvous: FakeRendezvous
    launcher: FakeLauncher
    hooks: Any = None

    @property
    def trace(self) -> list[str]:
        return trace(self.agent)

    @property
    def triggers(self) -> list[str]:
        return [r.trigger for r in self.agent.transitions]

    @property
    def state(self) -> Any:
        return self.result.state

    def assert_trace(self, expected: Iterable[str]) -> None:
        assert_trace(self.agent, expected)
