"""``fsm-agent replay EVENTS.jsonl``: re-drive the statechart through the triggers a run recorded.

The events file of a real run (docs/events.md) holds every state change with its trigger. Replay
builds a fresh ``ElasticAgent`` on fakes (``fsm_agent.testing``'s FakeRendezvous, a launcher
without processes), fires the recorded triggers one by one and compares, at every transition,
the state the machine reaches (and the restart count) with the recorded one. The verdict is
either "identical trace" or the first divergence: the event number, what was expected and what
the machine did. This is how a production incident becomes a regression test::

    from fsm_agent.replay import replay

    def test_incident_1234_still_replays():
        replay("tests/incidents/1234-events.jsonl").assert_identical()

What the replay reproduces, so that it is the table, the guards and the steps of today's code
that are checked against the recorded run:

- ``start``/``restart``: a rendezvous round with the recorded group rank and size (and, for
  several nodes, peers reporting the recorded restart count, which the agent adopts);
- ``workers_failed``: the restart policy (built-in plugins; ``--load-plugins`` adds the installed
  ones) decides on the failures the ``worker_exit`` records of the attempt show (exit code 78
  included), a hang when the group was UNHEALTHY; backoff delays are skipped;
- progress-aware restarts: each ``cycle`` record gives the step and checkpoint step the agent
  read (the data ``progress=`` of the trigger that ended the cycle), and its
  ``max_no_progress_restarts`` the limit the ``progress`` plugin applies again;
- a transition the agent made through its last resort (its error path failed: the recorded error
  reads ``...; then <trigger> failed: ...``) is replayed the same way, with a failing stop.

Replayed transitions are not counted by ``pytest --statechart-coverage`` (the plugin
``statechart-coverage`` is disabled here): they are the recorded run's, not the run loop's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import sys
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from fsm_agent.argparsing import OneLineParser
from fsm_agent.config import LaunchConfig
from fsm_agent.errors import ConfigError, FsmAgentError
from fsm_agent.plugins import hookimpl
from fsm_agent.states.facts import FACTS, Fact, Progress, fact_for

if TYPE_CHECKING:
    from fsm_agent.testing.fakes import FakeRendezvous

__all__ = ["Divergence", "ReplayResult", "RunReplay", "cli_main", "read_events", "replay"]

#: Built-in plugins a replay never loads: coverage counts only the run loop's own transitions.
NOT_REPLAYED_PLUGINS = ("statechart-coverage",)


@attrs.frozen
class Divergence:
    """Where the replayed machine first parted from the recorded run.

    Attributes:
        event: the record's number in the file (1-based, blank lines not counted).
        line: its line number.
        transition: the transition's number in its run (1-based).
        what: ``state`` (another destination), ``restart_count``, ``source`` (the record starts
            from another state than the machine is in), ``refused`` (the trigger cannot fire
            there), ``error`` (a step raised), ``end`` (the run ended in another state),
            ``verdict`` (today's attribution classes the recorded reports differently).
        source / trigger / dest: the recorded transition (for ``end``: the final state and "run_end").
        expected / actual: the recorded value and the replayed one (states, or restart counts).
        detail: more words, when there are any.
    """

    event: int
    line: int
    transition: int
    what: str
    source: str
    trigger: str
    expected: str
    actual: str
    detail: str = ""
    dest: str = ""

    def __str__(self) -> str:
        where = f"first divergence at event {self.event} (line {self.line}, transition {self.transition})"
        if self.what == "state":
            text = f"{self.source} --{self.trigger}--> expected {self.expected}, actual {self.actual}"
        elif self.what == "restart_count":
            text = (
                f"{self.source} --{self.trigger}--> {self.dest}: expected restart_count "
                f"{self.expected}, actual {self.actual}"
            )
        elif self.what == "source":
            text = f"{self.trigger} recorded from {self.expected}, but the replayed group is in {self.actual}"
        elif self.what == "refused":
            text = (
                f"{self.source} --{self.trigger}--> expected {self.expected}, actual: {self.trigger} cannot "
                f"fire in {self.actual}"
            )
        elif self.what == "end":
            text = f"the run ended in {self.expected}, the replay in {self.actual}"
        elif self.what == "verdict":
            text = f"the job's verdict recorded {self.expected}, the replay decides {self.actual}"
        else:
            text = f"{self.source} --{self.trigger}--> expected {self.expected}, actual: {self.actual}"
        return f"{where}: {text}" + (f" ({self.detail})" if self.detail else "")


@attrs.frozen
class RunReplay:
    """The replay of one agent's run (an events file may hold several: one per run, appended)."""

    run_id: str
    node: str
    pid: Any
    transitions: int
    recorded: tuple[str, ...]
    replayed: tuple[str, ...]
    divergence: Divergence | None

    @property
    def identical(self) -> bool:
        return self.divergence is None


@attrs.frozen
class ReplayResult:
    """What ``replay`` found: one RunReplay per run in the file."""

    path: str
    runs: tuple[RunReplay, ...]

    @property
    def identical(self) -> bool:
        return all(run.identical for run in self.runs)

    @property
    def divergence(self) -> Divergence | None:
        return next((run.divergence for run in self.runs if run.divergence is not None), None)

    def assert_identical(self) -> None:
        """AssertionError naming the first divergence, unless the trace is identical."""
        if not self.identical:
            raise AssertionError(f"replay of {self.path}: {self.divergence}")

    def format(self, verbose: bool = False) -> str:
        lines = []
        for run in self.runs:
            lines.append(
                f"{self.path}: run {run.run_id} on {run.node} (agent pid {run.pid}): {run.transitions} transitions"
            )
            if verbose or not run.identical:
                lines.append("  recorded: " + _chain(run.recorded))
                lines.append("  replayed: " + _chain(run.replayed))
            else:
                lines.append("  " + _chain(run.recorded))
            if run.recorded and (last := run.recorded[-1].split(" ")[-1]) not in _TERMINAL:
                lines.append(f"  (the recording stops in {last}: the run had not ended, or its agent was killed)")
            if not run.identical:
                lines.append(str(run.divergence))
                break
        if self.identical:
            lines.append("identical trace")
        return "\n".join(lines)


_TERMINAL = ("SUCCEEDED", "FAILED", "UNKNOWN")


def _chain(trace: Sequence[str]) -> str:
    if not trace:
        return "(no transition)"
    states = [trace[0].split(" ")[0]] + [t.split(" ")[-1] for t in trace]
    return " -> ".join(states)


# ------------------------------------------------------------------------------------------------
# Reading
# ------------------------------------------------------------------------------------------------


def read_events(path: str) -> list[tuple[int, int, dict[str, Any]]]:
    """``(event number, line number, record)`` for every record of an events file.

    Raises:
        ConfigError: the file is missing, or a line is not an fsm-agent event record.
    """
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise ConfigError(
            f"events file {path!r}: no such file (an agent writes it with --events-file PATH, "
            f"or events.jsonl in its log directory)"
        ) from None
    except OSError as exc:
        raise ConfigError(f"events file {path!r}: cannot read it: {exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"events file {path!r}: {_not_text(path)}") from None
    records = []
    for number, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except ValueError as exc:
            raise ConfigError(
                f"events file {path!r} line {number}: not JSON ({exc}); an events file has one "
                f"JSON object per line (docs/events.md)"
            ) from None
        if not isinstance(record, dict) or "kind" not in record:
            raise ConfigError(
                f"events file {path!r} line {number}: not an fsm-agent event (no 'kind' field; see docs/events.md)"
            )
        if record["kind"] == "transition" and not {"source", "dest", "trigger"} <= set(record):
            raise ConfigError(f"events file {path!r} line {number}: a transition record needs source, dest and trigger")
        records.append((len(records) + 1, number, record))
    return records


def _not_text(path: str) -> str:
    with open(path, "rb") as f:
        gzipped = f.read(2) == b"\x1f\x8b"
    if gzipped:
        return f"gzip-compressed; decompress it first (gunzip -k {path}) and replay the .jsonl file"
    return "not text (a binary file?); an events file has one JSON object per line (docs/events.md)"


def _split_runs(records: list[tuple[int, int, dict]]) -> list[list[tuple[int, int, dict]]]:
    """One list per agent run: a new run starts when node or run_id change, after run_end, or at a
    transition out of INIT once the run has transitions (a file appended to by a rerun).

    (``pid`` cannot tell runs apart: in ``worker_exit`` records it is the worker's.)
    """
    runs: list[list[tuple[int, int, dict]]] = []
    key, ended, moved = None, True, False
    for item in records:
        record = item[2]
        this = (record.get("node"), record.get("run_id"))
        restarted = record["kind"] == "transition" and record.get("source") == "INIT" and moved
        if ended or this != key or restarted:
            runs.append([])
            key, ended, moved = this, False, False
        runs[-1].append(item)
        ended = record["kind"] == "run_end"
        moved = moved or record["kind"] == "transition"
    return [run for run in runs if any(r["kind"] == "transition" for _, _, r in run)]


# ------------------------------------------------------------------------------------------------
# Replaying
# ------------------------------------------------------------------------------------------------


class _ReplayLauncher:
    """The launcher interface without processes; ``fail_next_stop`` makes the next stop raise."""

    PID_BASE = 2**22 + 500_000  # beyond Linux's PID_MAX_LIMIT: no real process

    def __init__(self):
        self.fail_next_stop = False
        self._pids: dict[int, int] = {}
        self._starts = 0

    def start(self, spec, envs, logs, filtered=(None, None)):
        self._pids = {rank: self.PID_BASE + 100 * self._starts + rank for rank in sorted(envs)}
        self._starts += 1
        return dict(self._pids)

    def wait_fds(self):
        return {}

    def poll(self):
        return {}

    def exit_times(self):
        return {}

    def pids(self):
        return dict(self._pids)

    def signal_worker(self, local_rank, sig):
        pass

    def return_values(self):
        return {}

    def stop(self, sig=signal.SIGTERM, timeout=30.0):
        if self.fail_next_stop:
            self.fail_next_stop = False
            raise RuntimeError("replayed: the recorded error path failed here")

    def close(self):
        pass


class _NoBackoff:
    """Replay skips the restart policy's backoff: each decision stands, without its delay."""

    @hookimpl(wrapper=True)
    def fsm_agent_restart_policy(self):
        decision = yield
        return attrs.evolve(decision, delay_s=0.0) if decision is not None else None


def _recorded_fact(record: dict, source: str, exits: list[dict], cycle: dict | None) -> Fact:
    """The fact a recorded transition fired: its ``fact`` field (``Fact.record()``), or, in files
    written before transitions carried one, rebuilt from the record and the attempt's
    ``worker_exit`` records. The ``cycle`` record the transition ended, if any, gives the progress
    the agent read.

    Raises:
        ValueError: the recorded trigger has no fact, or its fields do not fit it.
    """
    trigger = record["trigger"]
    if trigger not in FACTS:
        raise ValueError(f"{trigger!r} is no trigger of today's table")
    if isinstance(record.get("fact"), dict):
        try:
            fact = FACTS[trigger].from_record(record["fact"])
        except TypeError as exc:
            raise ValueError(f"the recorded fact of {trigger} does not fit {FACTS[trigger].__name__}: {exc}") from None
    else:
        fact = fact_for(trigger, **_rebuilt_fields(record, source, exits))
    if cycle is not None and "progress" in attrs.fields_dict(type(fact)):
        fact = attrs.evolve(
            fact, progress=Progress(last_step=cycle.get("last_step"), checkpoint_step=cycle.get("checkpoint_step"))
        )
    return fact


def _verdict_fields(record: dict) -> dict[str, Any]:
    """A ``verdict`` event as the job's verdict record (the event's common fields left out)."""
    keys = (
        "root_causes",
        "classes",
        "reasons",
        "exit_code",
        "summary",
        "decided_by",
        "decided_at",
        "world_size",
        "reports",
    )
    return {key: record[key] for key in keys if key in record}


def _rebuilt_fields(record: dict, source: str, exits: list[dict]) -> dict[str, Any]:
    """A fact's fields rebuilt from a transition record without a ``fact`` field (older files)."""
    trigger = record["trigger"]
    if trigger == "workers_failed" and source == "HEALTHY":
        failed = {
            int(e.get("local_rank", 0)): int(e.get("exit_code", 1)) for e in exits if int(e.get("exit_code", 1)) != 0
        }
        times = {int(e.get("local_rank", 0)): float(e["ts"]) for e in exits if "ts" in e}
        # A failure whose exit records are missing (a file cut short): one worker that exited 1.
        return {"exits": failed or {0: 1}, "exit_times": {r: t for r, t in times.items() if r in failed}}
    rebuilt: dict[str, dict[str, Any]] = {
        "workers_hung": {"hung": {0: "replayed hang"}},
        "health_check_failed": {"problem": "replayed health check"},
        "membership_changed": {
            "change": "node_lost" if record.get("failure_class") == "node_lost" else "membership_change"
        },
        "drain_requested": {
            "scope": record.get("drain_scope") or "node",
            "source": record.get("drain_source") or "replay",
            "by": "replay",
        },
        "rendezvous_failed": {"error": str(record.get("error") or "replayed rendezvous_failed")},
        "agent_errored": {"error": str(record.get("error") or "replayed agent_errored")},
    }
    return rebuilt.get(trigger, {})


def _last_resort(record: dict) -> bool:
    return record.get("dest") == "UNKNOWN" and f"; then {record['trigger']} failed:" in str(record.get("error") or "")


def _replayer(run: list[tuple[int, int, dict]], *, load_plugins: bool, disabled: Iterable[str]) -> _Replayer:
    """A replayer of ``run`` on a fresh agent on fakes, configured as the run's first record says."""
    from fsm_agent.plugins.manager import get_plugin_manager
    from fsm_agent.testing.fakes import FakeRendezvous
    from fsm_agent.testing.scenario import build_agent

    first = run[0][2]
    limits = [
        int(r["max_no_progress_restarts"])
        for _, _, r in run
        if r["kind"] == "cycle" and r.get("max_no_progress_restarts")
    ]
    # A replayed drain does not wait for the workers' checkpoint: there are none.
    plugin_options: dict[str, dict[str, Any]] = {"drain": {"timeout": 0.0}}
    if limits:
        plugin_options["progress"] = {"max_no_progress_restarts": limits[0]}
    policies = [r["restart_policy"] for _, _, r in run if r["kind"] == "cycle" and r.get("restart_policy")]
    if policies:  # the restart policy's own options (--restart-budgets, --exclude-node-on)
        plugin_options["restart-policy"] = dict(policies[0])
    pm = get_plugin_manager(disabled=(*NOT_REPLAYED_PLUGINS, *disabled), load_entry_points=load_plugins)
    pm.register(_NoBackoff(), "replay-no-backoff")
    rendezvous, launcher = (
        FakeRendezvous(run_id=str(first.get("run_id") or "replay"), store_timeout=10.0),
        _ReplayLauncher(),
    )
    agent = build_agent(
        rendezvous,
        launcher,
        plugin_manager=pm,
        local_world_size=int(first.get("local_world_size") or 1),
        max_restarts=int(first.get("max_restarts") or 0),
        role=str(first.get("role") or "default"),
        entrypoint=str(first.get("entrypoint") or "replay"),
        exit_barrier_timeout=10.0,
        config=LaunchConfig(plugins=plugin_options),
    )
    return _Replayer(agent, rendezvous, launcher)


class _Replayer:
    """Fires one run's recorded transitions into a fresh agent, stopping at the first divergence."""

    def __init__(self, agent: Any, rendezvous: FakeRendezvous, launcher: _ReplayLauncher) -> None:
        self.agent, self._rendezvous, self._launcher = agent, rendezvous, launcher
        self.replayed: list[str] = []
        self.count = 0  # transitions replayed so far, the current one included
        self._exits: list[dict] = []  # the attempt's worker_exit records
        self._cycle: dict | None = None  # the cycle record the next transition ends, if any
        self._verdict: dict | None = None  # the verdict record the next transition gave the job up with

    def diverged(self, event: int, line: int, what: str, record: dict, expected: Any, actual: Any, detail: str = ""):
        return Divergence(
            event=event,
            line=line,
            transition=self.count,
            what=what,
            source=str(record.get("source")),
            trigger=str(record.get("trigger")),
            expected=str(expected),
            actual=str(actual),
            detail=detail,
            dest=str(record.get("dest")),
        )

    def feed(self, event: int, line: int, record: dict) -> Divergence | None:
        """Take one record; the divergence it shows, or None."""
        kind, state = record["kind"], self.agent.state.value
        if kind == "worker_exit":
            self._exits.append(record)
        elif kind == "cycle":
            self._cycle = record
        elif kind == "verdict":
            self._verdict = record
            return self._check_verdict(event, line, record)
        elif kind == "run_end" and record.get("state") and record["state"] != state:
            return Divergence(event, line, self.count, "end", state, "run_end", record["state"], state)
        elif kind == "transition":  # a record kind this version does not know is not part of the trace
            self.count += 1
            return self._transition(event, line, record)
        return None

    def _check_verdict(self, event: int, line: int, record: dict) -> Divergence | None:
        """The attribution today's rules (and the loaded plugins' ``fsm_agent_classify_failure``)
        give on the verdict's own reports must name the same root causes and classes."""
        from fsm_agent.job_verdict import recompute

        if "reports" not in record:  # decided by an older agent
            return None
        again = recompute(record, self.agent.failure_classifier()).record()
        for key in ("root_causes", "classes"):
            if again[key] != record.get(key):
                return Divergence(
                    event=event,
                    line=line,
                    transition=self.count,
                    what="verdict",
                    source=self.agent.state.value,
                    trigger="verdict",
                    expected=json.dumps(record.get(key)),
                    actual=json.dumps(again[key]),
                    detail=f"today's attribution rules class the recorded reports differently ({key})",
                )
        return None

    def _transition(self, event: int, line: int, record: dict) -> Divergence | None:
        from transitions.core import MachineError

        agent = self.agent
        source, trigger, dest = record["source"], record["trigger"], record["dest"]
        if agent.state.value != source:
            return self.diverged(event, line, "source", record, source, agent.state.value)
        if trigger in ("start", "restart"):
            self._next_round(record)
        if _last_resort(record):
            self._launcher.fail_next_stop = True  # the recorded error path failed at its stop
        fired = len(agent.transitions)
        verdict, self._verdict = self._verdict, None
        try:
            fact = _recorded_fact(record, source, self._exits, self._cycle)
            if trigger in ("workers_failed", "inprocess_failed", "membership_changed") and verdict:
                fact = attrs.evolve(fact, job_verdict=_verdict_fields(verdict))  # decided with the peers: as recorded
            if trigger == "workers_failed" and source == "HEALTHY":  # in process or not: decided live, as recorded
                fact = attrs.evolve(fact, in_process=dest == "HEALTHY")
            agent.fire_fact(fact)
        except MachineError:
            return self.diverged(event, line, "refused", record, dest, agent.state.value)
        except ValueError as exc:  # the recorded fact does not fit its trigger
            return self.diverged(event, line, "refused", record, dest, agent.state.value, str(exc))
        taken = agent.transitions[fired:]
        if taken and taken[-1].trigger != trigger and not _last_resort(record):
            detail = f"a step of {trigger} raised in the replay"
            return self.diverged(event, line, "error", record, dest, str(taken[-1].error), detail)
        self._cycle = None
        self.replayed.append(f"{source} --{trigger}--> {agent.state.value}")
        if agent.state.value != dest:
            detail = ""
            if dest == "UNKNOWN" and "; then " in str(record.get("error") or ""):
                detail = "the recorded run took the agent's last resort"
            return self.diverged(event, line, "state", record, dest, agent.state.value, detail)
        if "restart_count" in record and int(record["restart_count"]) != agent.restart_count:
            return self.diverged(event, line, "restart_count", record, record["restart_count"], agent.restart_count)
        return None

    def _next_round(self, record: dict) -> None:
        """The rendezvous round the recorded start or restart joined: its group rank and size."""
        from fsm_agent.testing.fakes import Round

        world = int(record.get("group_world_size") or 1)
        rank = int(record.get("group_rank") or 0)
        self._rendezvous.rounds = [
            Round(
                rank=rank if 0 <= rank < world else 0,
                world_size=world,
                peer_restart_count=record.get("restart_count") if world > 1 else None,
            )
        ]
        self._exits = []


def _replay_run(run: list[tuple[int, int, dict]], *, load_plugins: bool, disabled: Iterable[str]) -> RunReplay:
    first = run[0][2]
    transitions = [r for _, _, r in run if r["kind"] == "transition"]
    replayer = _replayer(run, load_plugins=load_plugins, disabled=disabled)
    divergence = None
    try:
        for event, line, record in run:
            divergence = replayer.feed(event, line, record)
            if divergence is not None:
                break
    finally:
        replayer.agent.close()
    return RunReplay(
        run_id=str(first.get("run_id")),
        node=str(first.get("node")),
        pid=transitions[0].get("pid"),
        transitions=len(transitions),
        recorded=tuple(f"{r['source']} --{r['trigger']}--> {r['dest']}" for r in transitions),
        replayed=tuple(replayer.replayed),
        divergence=divergence,
    )


@contextlib.contextmanager
def _quiet_agent_logs():
    logger = logging.getLogger("fsm_agent")
    previous = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(previous)


def replay(path: str, *, load_plugins: bool = False, disabled: Iterable[str] = ()) -> ReplayResult:
    """Replay the events file ``path``; see the module docstring.

    Args:
        load_plugins: also load the installed plugins (entry points), e.g. the restart policy the
            recorded run used; by default only fsm-agent's built-ins decide.
        disabled: plugin names not to load.

    Raises:
        ConfigError: the file is missing, is not an events file, or records no transition.
    """
    runs = _split_runs(read_events(path))
    if not runs:
        raise ConfigError(f"events file {path!r} records no transition: nothing to replay")
    return ReplayResult(
        path=path, runs=tuple(_replay_run(run, load_plugins=load_plugins, disabled=disabled) for run in runs)
    )


def cli_main(argv: Sequence[str] | None = None) -> int:
    """``fsm-agent replay EVENTS.jsonl``: 0 if the trace is identical, 1 at the first divergence."""
    parser = OneLineParser(
        prog="fsm-agent replay",
        description="Re-drive the worker-group statechart through the triggers an events file recorded "
        "(fakes, no processes) and report 'identical trace' or the first divergence.",
    )
    parser.add_argument("events", metavar="EVENTS.jsonl", help="an agent's events file (docs/events.md)")
    parser.add_argument("-v", "--verbose", action="store_true", help="show the recorded and the replayed trace")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument(
        "--load-plugins",
        action="store_true",
        help="also load the installed plugins (e.g. the restart policy the run used)",
    )
    parser.add_argument(
        "--disable-plugin", action="append", default=[], metavar="NAME", help="do not load this plugin (repeatable)"
    )
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    with _quiet_agent_logs():
        result = replay(args.events, load_plugins=args.load_plugins, disabled=args.disable_plugin)
    if args.json:
        print(
            json.dumps(
                {
                    "path": result.path,
                    "identical": result.identical,
                    "divergence": attrs.asdict(result.divergence) if result.divergence else None,
                    "runs": [
                        {
                            "run_id": r.run_id,
                            "node": r.node,
                            "pid": r.pid,
                            "recorded": list(r.recorded),
                            "replayed": list(r.replayed),
                            "identical": r.identical,
                        }
                        for r in result.runs
                    ],
                },
                indent=2,
            )
        )
    else:
        print(result.format(verbose=args.verbose))
    return 0 if result.identical else 1


def main() -> None:
    """``python -m fsm_agent.replay``: as ``fsm-agent replay``, errors as one line on stderr."""
    try:
        code = cli_main()
    except FsmAgentError as exc:
        print(f"fsm-agent: error: {exc}", file=sys.stderr)
        code = exc.exit_code
    sys.exit(code)


if __name__ == "__main__":
    main()
