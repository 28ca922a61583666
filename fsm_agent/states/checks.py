"""Model checks over a transition table (rows like ``fsm_agent.states.table.TRANSITIONS``).

Each ``check_*`` function reads the table as plain data (no machine is built) and returns a list
of human-readable problems; an empty list means the check passed. ``check_all`` runs them all.
``tests/states/test_model_checks.py`` runs them on the real table and on broken copies.

The checks, after the structural checks of python-statemachine's ``smcheck``:

- every declared state is reachable from the initial state;
- every non-terminal state can reach a success or failure state (no trap states);
- terminal states have no exits;
- every callback and guard name is a method of the model class (transitions resolves names
  lazily: a typo would raise only when the row fires, possibly after the state changed);
- no trigger name shadows a model attribute (transitions then silently skips binding it);
- for each (state, trigger), exactly one row is enabled whatever the guards' values;
- one decider per trigger (``DECIDERS``): every trigger whose rows are guarded has one, each
  names a trigger of the table, and no row declares a ``prepare`` step of its own;
- every trigger has its fact class (``fsm_agent.states.facts.FACTS``), and every fact its trigger.

Reachability ignores guards (any row may fire); graph searches are plain breadth-first searches.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs

from fsm_agent.states.table import DECIDERS, INITIAL, STATES, TERMINAL, Row
from fsm_agent.states.worker_state import WorkerState

#: Transition keys whose values name model callbacks (strings) or are callables.
CALLBACK_KEYS = ("prepare", "conditions", "unless", "before", "after")
#: Where a run may legitimately end: every non-terminal state must be able to reach one of these.
OUTCOMES = (WorkerState.SUCCEEDED, WorkerState.FAILED)

Problems = list[str]


def state_name(state: Any) -> str:
    """The plain name of a state given as a WorkerState (or other enum) or a string."""
    return str(getattr(state, "value", state))


def callback_name(callback: Any) -> str:
    """The name of a callback given as a string or a callable."""
    return callback if isinstance(callback, str) else getattr(callback, "__name__", repr(callback))


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


@attrs.frozen
class TableRow:
    """One table row with its fields normalised: names only, lists everywhere.

    Attributes:
        index: the row's position in the table (0-based), for messages.
        trigger: the trigger name.
        sources: source state names (``"*"`` expanded to every state).
        dest: destination state name (``None`` for an internal transition, which stays put).
        conditions / unless: guard names (callables by ``__name__``).
        before / after: step names.
        prepare: prepare-callback names.
        callbacks: every raw callback value of the row, with its key, for name resolution.
    """

    index: int
    trigger: str
    sources: tuple[str, ...]
    dest: str | None
    conditions: tuple[str, ...] = ()
    unless: tuple[str, ...] = ()
    before: tuple[str, ...] = ()
    after: tuple[str, ...] = ()
    prepare: tuple[str, ...] = ()
    callbacks: tuple[tuple[str, Any], ...] = ()

    @property
    def steps(self) -> tuple[str, ...]:
        """Every step the row runs, in the order transitions runs them: prepare, before, after."""
        return (*self.prepare, *self.before, *self.after)

    def targets(self, source: str) -> str:
        """Where this row leads from ``source`` (``"="`` and internal rows stay in ``source``)."""
        return source if self.dest in (None, "=") else self.dest

    @property
    def guard(self) -> str:
        """The guard as ``statechart.md`` and the Mermaid labels write it (``has_x``, ``!has_x``)."""
        return " and ".join([*self.conditions, *(f"!{name}" for name in self.unless)])

    def describe(self) -> str:
        guard = f" [{self.guard}]" if self.guard else ""
        return f"row {self.index} ({self.trigger}: {', '.join(self.sources)} -> {self.dest}{guard})"


def table_rows(
    table: Sequence[Row], states: Iterable[Any] = STATES, deciders: Mapping[str, str] | None = None
) -> list[TableRow]:
    """Normalise every row of ``table``; ``states`` is what a ``"*"`` source stands for. A row's
    ``prepare`` is its trigger's decider (``deciders``, default ``DECIDERS``), run first."""
    deciders = DECIDERS if deciders is None else deciders
    all_states = [state_name(s) for s in states]
    rows = []
    for index, row in enumerate(table):
        sources = _as_list(row.get("source"))
        names = all_states if "*" in sources else [state_name(s) for s in sources]
        dest = row.get("dest")
        if str(row["trigger"]) in deciders and not row.get("prepare"):
            row = {**row, "prepare": deciders[str(row["trigger"])]}
        callbacks = tuple((key, cb) for key in CALLBACK_KEYS for cb in _as_list(row.get(key)))
        rows.append(
            TableRow(
                index=index,
                trigger=str(row["trigger"]),
                sources=tuple(names),
                dest=None if dest is None else state_name(dest),
                callbacks=callbacks,
                **{key: tuple(callback_name(cb) for cb in _as_list(row.get(key))) for key in CALLBACK_KEYS},
            )
        )
    return rows


def _edges(rows: list[TableRow]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for row in rows:
        for source in row.sources:
            edges.setdefault(source, set()).add(row.targets(source))
    return edges


def _reachable(start: Iterable[str], edges: dict[str, set[str]]) -> set[str]:
    """Every state reachable from ``start`` (included) along ``edges``: breadth-first search."""
    seen = set(start)
    queue = deque(seen)
    while queue:
        for nxt in edges.get(queue.popleft(), ()):
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return seen


def check_states_declared(table: Sequence[Row], states: Iterable[Any] = STATES) -> Problems:
    """Every source and destination of the table is a declared state."""
    declared = [state_name(s) for s in states]
    problems = []
    for row in table_rows(table, declared):
        for name in [*row.sources, *([row.dest] if row.dest not in (None, "=") else [])]:
            if name not in declared:
                problems.append(f"{row.describe()}: state {name!r} is not declared (declared: {', '.join(declared)})")
    return problems


def check_reachable(table: Sequence[Row], initial: Any = INITIAL, states: Iterable[Any] = STATES) -> Problems:
    """Every declared state is reachable from ``initial`` (guards ignored)."""
    declared = [state_name(s) for s in states]
    reached = _reachable([state_name(initial)], _edges(table_rows(table, declared)))
    return [
        f"state {name} is unreachable from {state_name(initial)}: no chain of rows leads to it"
        for name in declared
        if name not in reached
    ]


def check_can_terminate(
    table: Sequence[Row],
    states: Iterable[Any] = STATES,
    terminal: Iterable[Any] = TERMINAL,
    outcomes: Iterable[Any] = OUTCOMES,
) -> Problems:
    """Every non-terminal state can reach one of ``outcomes`` (SUCCEEDED or FAILED)."""
    declared = [state_name(s) for s in states]
    terminal_names = {state_name(s) for s in terminal}
    goals = [state_name(s) for s in outcomes]
    reverse: dict[str, set[str]] = {}
    for source, dests in _edges(table_rows(table, declared)).items():
        for dest in dests:
            reverse.setdefault(dest, set()).add(source)
    can_finish = _reachable(goals, reverse)
    return [
        f"state {name} cannot reach {' or '.join(goals)}: a run entering it never ends"
        for name in declared
        if name not in terminal_names and name not in can_finish
    ]


def check_terminal_absorbing(
    table: Sequence[Row], terminal: Iterable[Any] = TERMINAL, states: Iterable[Any] = STATES
) -> Problems:
    """No row leaves a terminal state (a ``"*"`` source counts as leaving every state)."""
    terminal_names = [state_name(s) for s in terminal]
    return [
        f"{row.describe()} leaves terminal state {source}; terminal states have no exits"
        for row in table_rows(table, states)
        for source in row.sources
        if source in terminal_names
    ]


def check_callbacks_resolve(table: Sequence[Row], model_cls: type) -> Problems:
    """Every callback and guard named by a string is a method of ``model_cls``."""
    problems = []
    for row in table_rows(table):
        for key, callback in row.callbacks:
            if not isinstance(callback, str):
                if not callable(callback):
                    problems.append(f"{row.describe()}: {key}={callback!r} is neither a name nor callable")
                continue
            attribute = getattr(model_cls, callback, None)
            if attribute is None:
                problems.append(f"{row.describe()}: {key}={callback!r} is not an attribute of {model_cls.__name__}")
            elif not callable(attribute):
                problems.append(
                    f"{row.describe()}: {key}={callback!r} is not a method of "
                    f"{model_cls.__name__} (found {type(attribute).__name__})"
                )
    return problems


def check_triggers_bindable(table: Sequence[Row], model_cls: type) -> Problems:
    """No trigger is already an attribute of ``model_cls``: transitions would skip binding it."""
    triggers = dict.fromkeys(row.trigger for row in table_rows(table))
    return [
        f"trigger {trigger!r} is already an attribute of {model_cls.__name__}: transitions would "
        f"not bind it (only a warning) and firing it would call the attribute instead"
        for trigger in triggers
        if hasattr(model_cls, trigger)
    ]


def _enabled(row: TableRow, truth: dict[str, bool]) -> bool:
    return all(truth[g] for g in row.conditions) and not any(truth[g] for g in row.unless)


def _rows_by_source_and_trigger(table: Sequence[Row], states: Iterable[Any]) -> dict[tuple[str, str], list[TableRow]]:
    groups: dict[tuple[str, str], list[TableRow]] = {}
    for row in table_rows(table, states):
        for source in row.sources:
            groups.setdefault((source, row.trigger), []).append(row)
    return groups


def check_deterministic(table: Sequence[Row], states: Iterable[Any] = STATES) -> Problems:
    """For each (state, trigger), exactly one row is enabled whatever values the guards take.

    Rows are grouped by source state and trigger. Every combination of the group's guard
    values is tried: two rows enabled at once means the table order silently decides (at most
    one unguarded row, and guarded rows must exclude each other, like a ``conditions=X`` row
    paired with an ``unless=X`` row); no row enabled means a guarded row lacks its complement,
    so the trigger would do nothing.
    """
    problems = []
    for (source, trigger), rows in _rows_by_source_and_trigger(table, states).items():
        guards = sorted({g for row in rows for g in (*row.conditions, *row.unless)})
        for values in itertools.product((True, False), repeat=len(guards)):
            truth = dict(zip(guards, values))
            enabled = [row for row in rows if _enabled(row, truth)]
            if len(enabled) == 1:
                continue
            when = ", ".join(f"{g}={v}" for g, v in truth.items()) or "always"
            if enabled:
                problems.append(
                    f"{source} --{trigger}--> is ambiguous when {when}: "
                    + " and ".join(row.describe() for row in enabled)
                    + " are all enabled"
                )
            else:
                problems.append(
                    f"{source} --{trigger}--> has no enabled row when {when}: add the "
                    f"complementary row (conditions=X paired with unless=X)"
                )
            break  # one counter-example per (state, trigger) is enough
    return problems


def check_deciders(table: Sequence[Row], deciders: Mapping[str, str] | None = None) -> Problems:
    """One decider per trigger, in one place (``DECIDERS``, run by transitions' ``prepare_event``
    once per event): a trigger whose rows are guarded has one (the guards read what it decided),
    every decider names a trigger of the table, and no row declares a ``prepare`` of its own
    (transitions would run it once for each row it tries)."""
    deciders = DECIDERS if deciders is None else deciders
    triggers = {str(row["trigger"]) for row in table}
    problems = [
        f"row {index} ({row['trigger']}) declares prepare={row['prepare']!r}: name the trigger's decider "
        f"in DECIDERS instead"
        for index, row in enumerate(table)
        if row.get("prepare")
    ]
    guarded = sorted({str(row["trigger"]) for row in table if row.get("conditions") or row.get("unless")})
    problems += [
        f"{trigger}'s rows are guarded but no step decides for them: add it to DECIDERS"
        for trigger in guarded
        if trigger not in deciders
    ]
    problems += [
        f"DECIDERS names {trigger!r}, which is no trigger of the table"
        for trigger in deciders
        if trigger not in triggers
    ]
    return problems


def check_facts(table: Sequence[Row], facts: Mapping[str, type] | None = None) -> Problems:
    """Every trigger of the table has its fact class, and every fact class names a trigger of it
    (``fsm_agent.states.facts.FACTS``): a fact cannot drift from the trigger it fires."""
    from fsm_agent.states.facts import FACTS

    facts = FACTS if facts is None else facts
    triggers = {str(row["trigger"]) for row in table}
    problems = [f"trigger {t!r} has no fact class in fsm_agent.states.facts" for t in sorted(triggers - set(facts))]
    problems += [
        f"fact {facts[t].__name__} names trigger {t!r}, which the table lacks" for t in sorted(set(facts) - triggers)
    ]
    problems += [
        f"FACTS[{t!r}] is {cls.__name__}, whose trigger is {getattr(cls, 'trigger', None)!r}"
        for t, cls in facts.items()
        if getattr(cls, "trigger", None) != t
    ]
    return problems


def check_all(
    table: Sequence[Row],
    model_cls: type,
    *,
    states: Iterable[Any] = STATES,
    initial: Any = INITIAL,
    terminal: Iterable[Any] = TERMINAL,
) -> Problems:
    """Every check above; returns all their problems (empty: the table is sound)."""
    states = list(states)
    checks: list[Callable[[], Problems]] = [
        lambda: check_states_declared(table, states),
        lambda: check_reachable(table, initial, states),
        lambda: check_can_terminate(table, states, terminal),
        lambda: check_terminal_absorbing(table, terminal, states),
        lambda: check_callbacks_resolve(table, model_cls),
        lambda: check_triggers_bindable(table, model_cls),
        lambda: check_deterministic(table, states),
        lambda: check_deciders(table),
        lambda: check_facts(table),
    ]
    return [problem for check in checks for problem in check()]
