"""Statechart transition coverage: which edges of the transition table a test run exercised.

An *edge* is one ``(source, trigger, dest)`` of ``fsm_agent/states/table.py`` (a row with several
sources gives one edge per source; ``workers_failed`` from HEALTHY has two edges, to STOPPED and to
FAILED). The edges that count are those whose source is reachable from INIT **and** that the run
loop can take. Which triggers the run loop can fire in which state is computed, not declared:
``run_loop_rules`` reads ``ElasticAgent``'s source (``_step``, ``_fire``, ``_wait_for_fact``) and
applies these rules:

- ``AUTO_TRIGGERS``: ``_step`` fires ``AUTO_TRIGGERS[state]`` by itself in that state, and never
  waits for facts there;
- facts: in the other live states ``_step`` fires what ``_wait_for_fact`` returns (a trigger name,
  alone or as the first item of ``(trigger, data)``); a flow analysis of that method tells which
  literal it can return in which state (an ``if self.state == S.X:`` branch that always returns
  ends the method for X);
- anything else: a trigger named anywhere else in the agent module (the signal check, the error
  handlers of ``_step``/``_fire``) is assumed to fire in every live state. This is conservative:
  it can only make more edges count, never hide one.

An edge of the table whose trigger the run loop cannot fire in its source is listed as
"cannot be taken by the run loop", with the reason (file and line), and is not counted; if such
an edge is nevertheless observed the analysis is wrong and the report says so.

Observations come from the built-in plugin ``statechart-coverage``
(``fsm_agent/plugins/coverage_recorder.py``): every agent, in the test process or a subprocess,
appends its transitions to the directory named by ``FSM_STATECHART_COVERAGE_DIR``.
``pytest --statechart-coverage`` (``fsm_agent.testing.pytest_plugin``) sets that directory up
and prints ``CoverageReport.format()`` at the end of the run.
"""

from __future__ import annotations

import ast
import glob
import importlib.util
import json
import os
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import attrs

from fsm_agent.plugins.coverage_recorder import COVERAGE_DIR_ENV
from fsm_agent.states.checks import state_name, table_rows
from fsm_agent.states.table import AUTO_TRIGGERS, INITIAL, STATES, TERMINAL, TRANSITIONS

__all__ = [
    "COVERAGE_DIR_ENV",
    "CoverageReport",
    "Edge",
    "Observation",
    "RunLoopRules",
    "build_report",
    "read_observations",
    "reachable_edges",
    "run_loop_rules",
    "table_edges",
]

AGENT_MODULE = "fsm_agent.agent"
AGENT_CLASS = "ElasticAgent"


class Edge(NamedTuple):
    """One ``(source, trigger, dest)`` edge of the statechart."""

    source: str
    trigger: str
    dest: str

    def __str__(self) -> str:
        return f"{self.source} --{self.trigger}--> {self.dest}"


# ------------------------------------------------------------------------------------------------
# The table's edges
# ------------------------------------------------------------------------------------------------


def table_edges(transitions: Sequence[dict] | None = None) -> list[Edge]:
    """Every edge of the table, in table order, each once."""
    edges: dict[Edge, None] = {}
    for row in table_rows(TRANSITIONS if transitions is None else transitions):
        for source in row.sources:
            edges[Edge(source, row.trigger, row.targets(source))] = None
    return list(edges)


def reachable_edges(transitions: Sequence[dict] | None = None, initial: Any = INITIAL) -> list[Edge]:
    """The edges whose source state is reachable from ``initial`` (guards ignored)."""
    edges = table_edges(transitions)
    seen, queue = {state_name(initial)}, deque([state_name(initial)])
    while queue:
        state = queue.popleft()
        for edge in edges:
            if edge.source == state and edge.dest not in seen:
                seen.add(edge.dest)
                queue.append(edge.dest)
    return [edge for edge in edges if edge.source in seen]


# ------------------------------------------------------------------------------------------------
# The run loop's rules, computed from ElasticAgent's source
# ------------------------------------------------------------------------------------------------


@attrs.frozen
class RunLoopRules:
    """Which triggers the run loop can fire in each live state, and why.

    Attributes:
        fireable: ``{state: {trigger: reason}}`` for every live (non-terminal) state.
        blocked: ``{(state, trigger): reason}`` for the fact triggers that ``_wait_for_fact`` can
            return, but not in that state (the line that returns first).
        path: the agent module's file.
    """

    fireable: dict[str, dict[str, str]]
    blocked: dict[tuple[str, str], str] = attrs.field(factory=dict)
    path: str = ""

    def can_fire(self, state: str, trigger: str) -> bool:
        return trigger in self.fireable.get(state, {})

    def why_not(self, state: str, trigger: str) -> str:
        """Why the run loop cannot fire ``trigger`` in ``state`` (only meaningful when it cannot)."""
        if state in (state_name(s) for s in TERMINAL):
            return f"{state} is terminal: the run loop stops there"
        if (state, trigger) in self.blocked:
            return self.blocked[(state, trigger)]
        return f"no code of {os.path.basename(self.path) or AGENT_MODULE} fires {trigger} in {state}"

    def unreachable(self, edges: Iterable[Edge]) -> dict[Edge, str]:
        """The ``edges`` the run loop cannot take, with the reason for each."""
        return {
            edge: self.why_not(edge.source, edge.trigger)
            for edge in edges
            if not self.can_fire(edge.source, edge.trigger)
        }


def _agent_source() -> tuple[str, str]:
    spec = importlib.util.find_spec(AGENT_MODULE)
    if spec is None or not spec.origin:
        raise RuntimeError(f"cannot find the source of {AGENT_MODULE}")
    with open(spec.origin, encoding="utf-8") as f:
        return spec.origin, f.read()


def _display_path(path: str) -> str:
    """``/site/fsm_agent/agent.py`` -> ``fsm_agent/agent.py`` (relative to the package's parent)."""
    import fsm_agent

    root = os.path.dirname(os.path.dirname(os.path.abspath(fsm_agent.__file__)))
    if os.path.isabs(path) and os.path.abspath(path).startswith(root + os.sep):
        return os.path.relpath(path, root)
    return path


def _is_self_state(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "state"
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    )


def _state_constant(node: ast.AST, states: set[str]) -> str | None:
    """``S.HEALTHY`` / ``WorkerState.HEALTHY`` / ``"HEALTHY"`` -> ``"HEALTHY"``."""
    if isinstance(node, ast.Attribute) and node.attr in states:
        return node.attr
    if isinstance(node, ast.Constant) and node.value in states:
        return node.value
    return None


def _state_test(test: ast.AST, states: set[str]) -> tuple[set[str] | None, bool]:
    """What an ``if`` test says about ``self.state``: (the states it admits, whether that is all it tests).

    ``self.state == S.X`` -> ({X}, True); ``self.state in (S.X, S.Y)`` -> ({X, Y}, True);
    ``self.state == S.X and more`` -> ({X}, False); anything else -> (None, False).
    """
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and _is_self_state(test.left):
        op, right = test.ops[0], test.comparators[0]
        if isinstance(op, ast.Eq) and _state_constant(right, states):
            return {_state_constant(right, states)}, True
        if isinstance(op, ast.In) and isinstance(right, (ast.Tuple, ast.List, ast.Set)):
            names = {_state_constant(e, states) for e in right.elts}
            if None not in names:
                return names, True
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        admitted = None
        for value in test.values:
            only, _ = _state_test(value, states)
            if only is not None:
                admitted = only if admitted is None else admitted & only
        return admitted, False
    return None, False


def _always_leaves(body: list[ast.stmt]) -> bool:
    if not body:
        return False
    last = body[-1]
    if isinstance(last, (ast.Return, ast.Raise)):
        return True
    if isinstance(last, ast.If):
        return _always_leaves(last.body) and _always_leaves(last.orelse)
    return False


class _FactFlow:
    """Which string literal ``_wait_for_fact`` can return in which state."""

    def __init__(self, all_states: set[str], triggers: set[str]):
        self.all_states, self.triggers = all_states, triggers
        self.returns: dict[str, dict[str, int]] = {}  # trigger -> {state: line}
        self.exits: dict[str, tuple[int, str]] = {}  # state -> (line, test) of the branch that returned for it
        self.unknown: dict[str, int] = {}  # state -> line of a return the analysis cannot read
        self.return_lines: set[int] = set()

    def walk(self, body: list[ast.stmt], states: set[str], source: str) -> set[str]:
        """Follow ``body`` for ``states``; returns the states that can fall off its end."""
        for stmt in body:
            if not states:
                return states
            if isinstance(stmt, ast.Return):
                self.return_lines.add(stmt.lineno)
                value = stmt.value
                if isinstance(value, ast.Tuple) and value.elts:  # (trigger, data)
                    value = value.elts[0]
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    for state in states:
                        self.returns.setdefault(value.value, {}).setdefault(state, stmt.lineno)
                elif not (value is None or (isinstance(value, ast.Constant) and value.value is None)):
                    for state in states:
                        self.unknown.setdefault(state, stmt.lineno)
                return set()
            if isinstance(stmt, ast.Raise):
                return set()
            if isinstance(stmt, ast.If):
                only, exact = _state_test(stmt.test, self.all_states)
                inside = states if only is None else states & only
                outside = states - only if (only is not None and exact) else states
                after_body = self.walk(stmt.body, set(inside), source)
                after_else = self.walk(stmt.orelse, set(outside), source)
                if exact and only is not None and not after_body:
                    test = ast.get_source_segment(source, stmt.test) or ast.unparse(stmt.test)
                    for state in inside:
                        self.exits.setdefault(state, (stmt.lineno, test))
                states = after_body | after_else
                continue
            for field in ("body", "orelse", "finalbody"):
                inner = getattr(stmt, field, None)
                if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
                    self.walk(inner, set(states), source)
            for handler in getattr(stmt, "handlers", ()) or ():
                self.walk(handler.body, set(states), source)
        return states


def run_loop_rules(
    source: str | None = None, path: str | None = None, auto_triggers: dict[Any, str] | None = None
) -> RunLoopRules:
    """Compute which triggers the run loop can fire in each live state (see the module docstring).

    Args:
        source: the agent module's source (default: ``fsm_agent/agent.py`` as installed).
        path: its file name, for the reasons' ``file:line``.
        auto_triggers: the states that advance by themselves (default: the table's ``AUTO_TRIGGERS``).
    """
    if source is None:
        path, source = _agent_source()
    path = path or "<agent source>"
    where = _display_path(path)
    tree = ast.parse(source)
    triggers = {edge.trigger for edge in table_edges()}
    all_states = {state_name(s) for s in STATES}
    live = [state_name(s) for s in STATES if s not in TERMINAL]
    auto = {state_name(s): t for s, t in (AUTO_TRIGGERS if auto_triggers is None else auto_triggers).items()}
    waiting = {s for s in live if s not in auto}
    fireable: dict[str, dict[str, str]] = {s: {} for s in live}

    agent = next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == AGENT_CLASS), None)
    methods = {n.name: n for n in (agent.body if agent else []) if isinstance(n, ast.FunctionDef)}
    step, facts = methods.get("_step"), methods.get("_wait_for_fact")

    # Rule 1: AUTO_TRIGGERS[state] in its own state, if _step dispatches on AUTO_TRIGGERS.get(self.state).
    auto_line = None
    for node in ast.walk(step) if step else ():
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "AUTO_TRIGGERS"
            and node.args
            and _is_self_state(node.args[0])
        ):
            auto_line = node.lineno
    for state, trigger in auto.items():
        targets = [state] if auto_line is not None else live
        for target in targets:
            fireable[target][trigger] = (
                f"the run loop fires it by itself in {state} (AUTO_TRIGGERS, {where}:{auto_line or '?'})"
            )

    # Rule 2: the facts _wait_for_fact returns, per waiting state (all live states if it cannot be read).
    blocked: dict[tuple[str, str], str] = {}
    flow = _FactFlow(all_states, triggers)
    if facts is not None and auto_line is not None:
        flow.walk(facts.body, set(waiting), source)
        for trigger, lines in flow.returns.items():
            if trigger not in triggers:
                continue
            for state, line in lines.items():
                fireable[state][trigger] = f"ElasticAgent._wait_for_fact returns it ({where}:{line})"
        for state, line in flow.unknown.items():  # a computed return value: it could be any trigger
            for trigger in triggers:
                fireable[state].setdefault(
                    trigger, f"ElasticAgent._wait_for_fact returns a computed value ({where}:{line})"
                )
        for trigger, lines in flow.returns.items():
            at = ", ".join(f"{where}:{n}" for n in sorted(set(lines.values())))
            for state in set(auto) - {state_name(s) for s in TERMINAL}:
                if trigger != auto[state]:
                    blocked[(state, trigger)] = (
                        f"{trigger} comes only from ElasticAgent._wait_for_fact ({at}), which the run loop "
                        f"never calls in {state}: it fires {auto[state]} there by itself "
                        f"(AUTO_TRIGGERS, {where}:{auto_line})"
                    )
            for state in waiting - set(lines):
                if state in flow.exits:
                    line, test = flow.exits[state]
                    blocked[(state, trigger)] = (
                        f"{trigger} comes only from ElasticAgent._wait_for_fact "
                        f"({', '.join(f'{where}:{n}' for n in sorted(set(lines.values())))}), which in {state} "
                        f"has already returned at {where}:{line} (`if {test}:`)"
                    )
    elif facts is not None:
        flow.walk(facts.body, set(live), source)

    # Rule 3: every other mention of a trigger name in the agent module: any live state.
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and node.value in triggers:
            returned = (
                facts is not None
                and auto_line is not None
                and node.lineno in flow.return_lines
                and facts.lineno <= node.lineno <= (facts.end_lineno or node.lineno)
            )
            if returned:
                continue
            for state in live:
                fireable[state].setdefault(
                    node.value,
                    f"named at {where}:{node.lineno}, in no "
                    f"state-specific branch: assumed possible in every live state",
                )
    for state, trigger in list(blocked):
        if trigger in fireable[state]:
            del blocked[(state, trigger)]
    return RunLoopRules(fireable=fireable, blocked=blocked, path=path)


# ------------------------------------------------------------------------------------------------
# Observations and the report
# ------------------------------------------------------------------------------------------------


@attrs.frozen
class Observation:
    """One transition an agent reported: the edge and where it ran (a test id or a subprocess)."""

    edge: Edge
    where: str = ""


def read_observations(directory: str) -> list[Observation]:
    """Every transition recorded under ``directory`` (``transitions-*.jsonl``); torn lines are skipped.

    Files forwarded by nested pytest runs (``transitions-nested-*``) come last, so that the first
    place an edge was seen is, where possible, a test of the session itself.
    """
    observations = []
    paths = glob.glob(os.path.join(directory, "transitions-*.jsonl"))
    for path in sorted(paths, key=lambda p: (os.path.basename(p).startswith("transitions-nested-"), p)):
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    record = json.loads(line)
                    edge = Edge(str(record["source"]), str(record["trigger"]), str(record["dest"]))
                except (ValueError, KeyError, TypeError):
                    continue  # a process killed mid-write
                observations.append(Observation(edge, str(record.get("where") or "")))
    return observations


@attrs.frozen
class CoverageReport:
    """What a run exercised of the statechart.

    Attributes:
        counted: the edges that count: reachable from INIT and takeable by the run loop, table order.
        counts: times each edge of the table was observed.
        examples: for each observed edge, the first place (test id or subprocess) that took it.
        unreachable: edges reachable from INIT that the run loop cannot take, with the reason.
        unreachable_states: edges whose source is not reachable from INIT at all.
        foreign: observed edges that are not in the table (an agent built on another table).
        observations: how many transitions were recorded in all.
        threshold: the fail-under percentage, if any.
    """

    counted: tuple[Edge, ...]
    counts: dict[Edge, int]
    examples: dict[Edge, str]
    unreachable: dict[Edge, str]
    unreachable_states: tuple[Edge, ...] = ()
    foreign: dict[Edge, int] = attrs.field(factory=dict)
    observations: int = 0
    threshold: float | None = None

    @property
    def covered(self) -> list[Edge]:
        return [edge for edge in self.counted if self.counts.get(edge)]

    @property
    def missing(self) -> list[Edge]:
        return [edge for edge in self.counted if not self.counts.get(edge)]

    @property
    def contradictions(self) -> list[Edge]:
        """Edges the analysis says the run loop cannot take, yet an agent took: the analysis is wrong."""
        return [edge for edge in self.unreachable if self.counts.get(edge)]

    @property
    def percent(self) -> float:
        return 100.0 * len(self.covered) / len(self.counted) if self.counted else 100.0

    @property
    def passed(self) -> bool:
        return self.threshold is None or self.percent + 1e-9 >= self.threshold

    def summary(self) -> str:
        return (
            f"statechart coverage: {len(self.covered)}/{len(self.counted)} transitions exercised ({self.percent:.1f}%)"
        )

    def format(self) -> str:
        """The report printed at the end of ``pytest --statechart-coverage``."""
        total = len(self.counted) + len(self.unreachable)
        lines = [
            self.summary(),
            f"  edges: the {total} (source, trigger, dest) edges of fsm_agent/states/table.py reachable from "
            f"{state_name(INITIAL)}, less {len(self.unreachable)} the run loop cannot take (listed below)",
            f"  observed: {self.observations} transitions of in-process and subprocess agents",
        ]
        width = max((len(str(edge)) for edge in self.counted), default=0)
        lines.append("  exercised:" if self.covered else "  exercised: none")
        for edge in self.covered:
            lines.append(f"    {str(edge):<{width}}  {self.counts[edge]:>6}x  e.g. {self.examples.get(edge, '?')}")
        lines.append("  missing: none" if not self.missing else f"  missing ({len(self.missing)}):")
        for edge in self.missing:
            lines.append(f"    {edge}")
        if self.unreachable:
            lines.append("  cannot be taken by the run loop (not counted):")
            for edge, why in self.unreachable.items():
                lines.append(f"    {edge}: {why}")
        for edge in self.contradictions:
            lines.append(
                f"  WARNING: {edge} was observed {self.counts[edge]}x, although the run-loop analysis says "
                f"it cannot be taken: fix fsm_agent.testing.coverage.run_loop_rules"
            )
        for edge in self.unreachable_states:
            lines.append(f"  not reachable from {state_name(INITIAL)} (not counted): {edge}")
        for edge, count in self.foreign.items():
            lines.append(f"  observed but not in the table (not counted): {edge} {count}x")
        if self.threshold is not None:
            verdict = "passed" if self.passed else "FAILED"
            lines.append(f"  required: {self.threshold:g}% -> {verdict}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "percent": round(self.percent, 2),
            "covered": len(self.covered),
            "counted": len(self.counted),
            "threshold": self.threshold,
            "passed": self.passed,
            "observations": self.observations,
            "edges": [
                {
                    "source": e.source,
                    "trigger": e.trigger,
                    "dest": e.dest,
                    "count": self.counts.get(e, 0),
                    "example": self.examples.get(e),
                }
                for e in self.counted
            ],
            "missing": [str(e) for e in self.missing],
            "unreachable": {str(e): why for e, why in self.unreachable.items()},
            "foreign": {str(e): n for e, n in self.foreign.items()},
        }


def build_report(
    observations: Iterable[Observation],
    *,
    transitions: Sequence[dict] | None = None,
    rules: RunLoopRules | None = None,
    threshold: float | None = None,
) -> CoverageReport:
    """Compare ``observations`` with the table's edges (see the module docstring)."""
    observations = list(observations)
    edges = table_edges(transitions)
    reachable = reachable_edges(transitions)
    rules = run_loop_rules() if rules is None else rules
    unreachable = rules.unreachable(reachable)
    counts = Counter(o.edge for o in observations)
    examples: dict[Edge, str] = {}
    for o in observations:
        examples.setdefault(o.edge, o.where)
    known = set(edges)
    return CoverageReport(
        counted=tuple(e for e in reachable if e not in unreachable),
        counts={e: counts[e] for e in edges if counts[e]},
        examples={e: w for e, w in examples.items() if e in known},
        unreachable=unreachable,
        unreachable_states=tuple(e for e in edges if e not in set(reachable)),
        foreign={e: n for e, n in counts.items() if e not in known},
        observations=len(observations),
        threshold=threshold,
    )
