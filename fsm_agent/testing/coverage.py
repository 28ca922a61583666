"""Statechart transition coverage: which edges of the transition table a test run exercised.

An *edge* is one ``(source, trigger, dest)`` of ``fsm_agent/states/table.py`` (a row with several
sources gives one edge per source; ``workers_failed`` from HEALTHY has two edges, to STOPPED and to
FAILED). The edges that count are those whose source is reachable from INIT **and** that the run
loop can take. Which triggers the run loop can fire in which state is computed, not declared:
``run_loop_rules`` reads the sources of ``ElasticAgent`` (``_step``, ``_fire``) and of its HEALTHY
activity ``HealthyWatch`` (``fsm_agent/watcher.py``) and applies these rules:

- ``AUTO_TRIGGERS``: ``_step`` fires ``AUTO_TRIGGERS[state]`` by itself in that state, and never
  waits for facts there;
- facts: in the other live states ``_step`` fires what ``HealthyWatch.wait`` returns: every fact
  class (``fsm_agent.states.facts``) the watcher module builds is a trigger it can fire there; a
  ``return`` of a value the analysis cannot read could be any trigger;
- anything else: a trigger the agent module, or a module of its step mixins (``STEP_MODULES``:
  their steps build facts the run loop fires next, e.g. ``_check_nodes``), names itself (a
  trigger's string, or its fact class built: the signal check, the error handlers of
  ``_step``/``_fire``) is assumed to fire in every live state. This is conservative: it can only
  make more edges count, never hide one.

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
WATCHER_MODULE = "fsm_agent.watcher"
#: Modules of ``ElasticAgent``'s step mixins (read as part of the agent module by rule 3).
STEP_MODULES = ("fsm_agent.verdict_steps", "fsm_agent.node_check_steps")


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
        blocked: ``{(state, trigger): reason}`` for the fact triggers that ``HealthyWatch.wait``
            can return, but not in that state (the run loop never waits there).
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


def _module_source(module: str) -> tuple[str, str]:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        raise RuntimeError(f"cannot find the source of {module}")
    with open(spec.origin, encoding="utf-8") as f:
        return spec.origin, f.read()


def _display_path(path: str) -> str:
    """``/site/fsm_agent/agent.py`` -> ``fsm_agent/agent.py`` (relative to the package's parent)."""
    import fsm_agent

    root = os.path.dirname(os.path.dirname(os.path.abspath(fsm_agent.__file__)))
    if os.path.isabs(path) and os.path.abspath(path).startswith(root + os.sep):
        return os.path.relpath(path, root)
    return path


def _fact_triggers() -> dict[str, str]:
    """``{fact class name: its trigger}`` (``fsm_agent.states.facts.FACTS``)."""
    from fsm_agent.states.facts import FACTS

    return {cls.__name__: trigger for trigger, cls in FACTS.items()}


def _called_name(node: ast.AST) -> str | None:
    """``Name(...)`` / ``module.Name(...)`` -> ``"Name"``; anything else -> None."""
    if not isinstance(node, ast.Call):
        return None
    func = node.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def _fired(tree: ast.AST, triggers: set[str]) -> list[tuple[str, int]]:
    """Every ``(trigger, line)`` a module names: a trigger's string, or a call of its fact class."""
    facts = _fact_triggers()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and node.value in triggers:
            found.append((str(node.value), node.lineno))
        elif (name := _called_name(node)) in facts and facts[name] in triggers:
            found.append((facts[name], node.lineno))
    return found


def _computed_returns(tree: ast.AST) -> list[int]:
    """Lines of the watcher's ``return`` statements whose value the analysis cannot read: not
    None, not a fact class called, not one of its own methods (read as part of the module)."""
    facts = _fact_triggers()
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Return) or node.value is None:
            continue
        value = node.value
        own = isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
        own = own and isinstance(value.func.value, ast.Name) and value.func.value.id == "self"
        if not (own or _called_name(value) in facts or (isinstance(value, ast.Constant) and value.value is None)):
            lines.append(node.lineno)
    return lines


def _auto_dispatch_line(step: ast.AST | None) -> int | None:
    """The line where ``_step`` fires ``AUTO_TRIGGERS.get(self.state)``, or None."""
    for node in ast.walk(step) if step is not None else ():
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "AUTO_TRIGGERS"
            and node.args
            and isinstance(node.args[0], ast.Attribute)
            and node.args[0].attr == "state"
        ):
            return node.lineno
    return None


def _watch_line(step: ast.AST | None) -> int | None:
    """The line where ``_step`` calls ``self._watch.wait()`` (HEALTHY's activity), or None."""
    for node in ast.walk(step) if step is not None else ():
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "wait":
            owner = node.func.value
            if isinstance(owner, ast.Attribute) and owner.attr == "_watch":
                return node.lineno
    return None


def run_loop_rules(
    source: str | None = None,
    path: str | None = None,
    auto_triggers: dict[Any, str] | None = None,
    watcher_source: str | None = None,
    watcher_path: str | None = None,
) -> RunLoopRules:
    """Compute which triggers the run loop can fire in each live state (see the module docstring).

    Args:
        source / path: the agent module's source and file name (default: ``fsm_agent/agent.py``).
        auto_triggers: the states that advance by themselves (default: the table's ``AUTO_TRIGGERS``).
        watcher_source / watcher_path: the watcher's (default: ``fsm_agent/watcher.py``).
    """
    if source is None:
        path, source = _module_source(AGENT_MODULE)
    if watcher_source is None:
        watcher_path, watcher_source = _module_source(WATCHER_MODULE)
    where, watcher_where = _display_path(path or "<agent source>"), _display_path(watcher_path or "<watcher>")
    tree, watcher = ast.parse(source), ast.parse(watcher_source)
    triggers = {edge.trigger for edge in table_edges()}
    live = [state_name(s) for s in STATES if s not in TERMINAL]
    auto = {state_name(s): t for s, t in (AUTO_TRIGGERS if auto_triggers is None else auto_triggers).items()}
    fireable: dict[str, dict[str, str]] = {s: {} for s in live}
    agent = next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == AGENT_CLASS), None)
    step = next(
        (n for n in (agent.body if agent else []) if isinstance(n, ast.FunctionDef) and n.name == "_step"), None
    )

    # Rule 1: AUTO_TRIGGERS[state] in its own state, if _step dispatches on AUTO_TRIGGERS.get(self.state).
    auto_line = _auto_dispatch_line(step)
    for state, trigger in auto.items():
        for target in [state] if auto_line is not None else live:
            fireable[target][trigger] = (
                f"the run loop fires it by itself in {state} (AUTO_TRIGGERS, {where}:{auto_line or '?'})"
            )

    # Rule 2: the facts the watcher returns, in the states that wait for facts (all live states if
    # _step does not dispatch the auto triggers first); a computed return could be any trigger.
    waiting = [s for s in live if s not in auto] if auto_line is not None else live
    watched = _fired(watcher, triggers) if _watch_line(step) is not None else []
    for trigger, line in watched:
        for state in waiting:
            fireable[state].setdefault(trigger, f"HealthyWatch.wait returns it ({watcher_where}:{line})")
    for line in _computed_returns(watcher) if watched else ():
        for state in waiting:
            for trigger in triggers:
                fireable[state].setdefault(
                    trigger, f"HealthyWatch.wait returns a computed value ({watcher_where}:{line})"
                )
    blocked: dict[tuple[str, str], str] = {}
    for trigger in {t for t, _ in watched}:
        at = ", ".join(f"{watcher_where}:{n}" for n in sorted({n for t, n in watched if t == trigger}))
        for state in set(live) - set(waiting):
            blocked[(state, trigger)] = (
                f"{trigger} comes only from HealthyWatch.wait ({at}), which the run loop never calls in "
                f"{state}: it fires {auto[state]} there by itself (AUTO_TRIGGERS, {where}:{auto_line})"
            )

    # Rule 3: every trigger the agent module (or a step mixin's) names itself (a string, a fact
    # built): any live state.
    named = [(trigger, f"{where}:{line}") for trigger, line in _fired(tree, triggers)]
    for module in STEP_MODULES:
        step_path, step_source = _module_source(module)
        named += [(t, f"{_display_path(step_path)}:{n}") for t, n in _fired(ast.parse(step_source), triggers)]
    for trigger, at in named:
        for state in live:
            fireable[state].setdefault(
                trigger, f"named at {at}, in no state-specific branch: assumed possible in every live state"
            )
    blocked = {key: why for key, why in blocked.items() if key[1] not in fireable[key[0]]}
    return RunLoopRules(fireable=fireable, blocked=blocked, path=path or "")


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
