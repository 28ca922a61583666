"""build_machine(): the one place the transitions Machine options are fixed."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from transitions import EventData, Machine

from fsm_agent.states.table import DECIDERS, INITIAL, STATES, TERMINAL, TRANSITIONS, Row

MACHINE_OPTIONS: dict[str, Any] = dict(
    auto_transitions=False,  # no to_<state>(): only the table moves the state
    queued=True,  # a trigger fired from a callback runs after the current transition
    send_event=True,  # every callback gets one EventData
    ignore_invalid_triggers=False,
)


def machine_states() -> list[dict[str, Any]]:
    return [{"name": s, "final": s in TERMINAL} for s in STATES]


def deciding_step(deciders: Mapping[str, str]) -> Callable[[EventData], None]:
    """The machine's ``prepare_event``: run the model's decider of the event's trigger, if it has
    one. transitions calls it once per event, before any row's guards (a row's own ``prepare``
    would run once for each row tried)."""

    def decide(event: EventData) -> None:
        name = deciders.get(event.event.name)
        if name is not None:
            getattr(event.model, name)(event)

    return decide


def build_machine(
    model: Any,
    transitions: Sequence[Row] | None = None,
    deciders: Mapping[str, str] | None = None,
    **options: Any,
) -> Machine:
    """Attach the statechart to ``model`` (an ElasticAgent or a test double).

    Args:
        model: object providing the callbacks and guards the table names, plus
            ``_after_state_change(event)`` which dispatches the per-transition hooks.
        transitions: the table to use; defaults to ``TRANSITIONS`` (tests pass broken tables).
        deciders: ``{trigger: model method}`` run once per event first; defaults to ``DECIDERS``.
        options: overrides of MACHINE_OPTIONS (e.g. a GraphMachine's ``graph_engine``).

    Returns:
        The ``transitions.Machine``; ``model.state`` holds the current WorkerState.
    """
    opts = dict(MACHINE_OPTIONS)
    opts["prepare_event"] = deciding_step(DECIDERS if deciders is None else deciders)
    if hasattr(model, "_after_state_change"):
        opts["after_state_change"] = "_after_state_change"
    opts.update(options)
    machine_cls: type[Machine] = opts.pop("machine_cls", Machine)
    return machine_cls(
        model=model,
        states=machine_states(),
        transitions=[dict(row) for row in (TRANSITIONS if transitions is None else transitions)],
        initial=INITIAL,
        **opts,
    )
