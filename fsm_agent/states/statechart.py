"""Render the worker-group statechart from the one table: Mermaid, Markdown or JSON.

``fsm-agent statechart [--format mermaid|markdown|json]`` (default markdown) prints it;
``docs/statechart.md`` is this module's Markdown output, checked byte for byte by
``tests/states/test_statechart_doc.py``. Regenerate it with::

    fsm-agent statechart --format markdown > docs/statechart.md

The Mermaid text comes from transitions' own renderer (``HierarchicalGraphMachine`` with
``graph_engine="mermaid"``) on a machine built by ``build_machine`` from the table, made
deterministic: a fresh machine in its initial state, without the ``Class``/``classDef`` styling
lines (they encode the current state), with a ``title:`` front matter Mermaid understands.

"Hooks fired" per row comes from ``HOOKS_BY_STEP`` (the hooks each step of the table fires)
plus ``HOOKS_AFTER_EVERY_TRANSITION``; ``hook_map_problems`` cross-checks both against the
hookspecs' "Called from:" sections, and the tests check them against the agent's code.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence

from fsm_agent.argparsing import OneLineParser
from fsm_agent.errors import ConfigError
from fsm_agent.states.checks import TableRow, state_name, table_rows
from fsm_agent.states.facts import markdown_table
from fsm_agent.states.machine import build_machine
from fsm_agent.states.table import AUTO_TRIGGERS, INITIAL, STATES, TERMINAL, TRANSITIONS, Row

FORMATS = ("mermaid", "markdown", "json")
TITLE = "fsm-agent worker-group statechart"
REGENERATE_COMMAND = "fsm-agent statechart --format markdown > docs/statechart.md"
#: Hand-written paragraphs of docs/statechart.md on states that no row shows by itself.
STATE_NOTES = (
    "A hot spare (standby) sits in INIT: with more nodes than `MAX` (`--nnodes MIN:MAX`), the "
    "rendezvous keeps the extra ones waiting inside `_rendezvous`, the `before` step of `start`, "
    "so they run no workers and fire no transition (the `fsm` backend tells the agent, which "
    'logs "standby: the job has MAX nodes", records a `standby` event and shows `standby` in '
    "`/status`; `c10d` and `etcd-v3` keep them in torch's redundancy list). A node lost or excluded "
    "from the running round lets one standby take its seat in the next round: `start` fires on "
    "the standby, while the survivors go HEALTHY -> STOPPED by `membership_changed` and back by "
    "`restart`, not counted against `--max-restarts`. A standby whose job ended (every "
    "participant left) leaves by `rendezvous_not_needed` (INIT -> SUCCEEDED, exit 0). A node "
    "that restarts (STOPPED) and finds every seat taken waits in STOPPED the same way.",
)

#: The hooks each step named in the table fires, in the order it fires them. Every step of the
#: table must be listed, even one that fires none (``hook_map_problems`` checks this and the
#: hookspecs' "Called from:" text; ``tests/states`` checks it against ``ElasticAgent``'s code).
HOOKS_BY_STEP: dict[str, tuple[str, ...]] = {
    "_decide_on_failed_workers": ("fsm_agent_classify_failure", "fsm_agent_record_event", "fsm_agent_restart_policy"),
    "_decide_on_membership_change": ("fsm_agent_record_event", "fsm_agent_restart_policy"),
    "_rendezvous": ("fsm_agent_rendezvous_completed",),
    "_check_nodes": ("fsm_agent_node_check", "fsm_agent_record_event", "fsm_agent_put_metric"),
    "_record_node_check": (),
    "_start_workers": (
        "fsm_agent_worker_env",
        "fsm_agent_workers_started",
        "fsm_agent_put_metric",
        "fsm_agent_record_event",
    ),
    "_stop_workers": (),
    "_count_restart": (),
    "_record_unhealthy": (),
    "_record_return_values": ("fsm_agent_record_event",),
    "_record_error": (),
    "_dump_worker_stacks": (),
    "_exit_barrier": (),
    "_release_exit_barrier": (),
    "_backoff": (),
    "_decide_on_drain": (),
    "_announce_drain": (),
    "_announce_leaving": (),
    "_drain_workers": ("fsm_agent_record_event",),
    "_decide_job_verdict": ("fsm_agent_classify_failure", "fsm_agent_record_event"),
    "_adopt_job_verdict": ("fsm_agent_record_event",),
    "_name_the_lost_store_host": ("fsm_agent_classify_failure", "fsm_agent_record_event"),
    "_replace_failed_workers": ("fsm_agent_worker_env", "fsm_agent_record_event"),
    "_record_inprocess_recovery": ("fsm_agent_record_event",),
    "_decide_on_inprocess_failure": ("fsm_agent_record_event", "fsm_agent_restart_policy"),
}

#: Fired after every transition, once the state has changed, by ``ElasticAgent._after_state_change``.
HOOKS_AFTER_EVERY_TRANSITION: tuple[str, ...] = (
    "fsm_agent_state_changed",
    "fsm_agent_record_event",
    "fsm_agent_put_metric",
)


class _DiagramModel:
    """A bare model for rendering: the machine needs no callbacks until a trigger fires."""


def _backticked(text: str) -> set[str]:
    return set(re.findall(r"``([A-Za-z_][\w.]*)``", text))


def hook_map_problems(transitions: Sequence[Row] | None = None) -> list[str]:
    """Cross-check ``HOOKS_BY_STEP`` and ``HOOKS_AFTER_EVERY_TRANSITION`` with the hookspecs.

    - every step named in the table has an entry, and every entry is a step of the table;
    - every hook listed is a hookspec;
    - a hook whose "Called from:" names a step (````_rendezvous````) is listed for exactly
      those steps, and the transitions it names are exactly the ones whose rows run the step;
    - the hooks whose "Called from:" says "every transition" are the after-every-transition hooks.

    Returns:
        Human-readable problems; empty when the dicts and the docstrings agree.
    """
    from fsm_agent.plugins.hookspec_info import called_from

    rows = table_rows(TRANSITIONS if transitions is None else transitions)
    docs = called_from()
    problems = []
    table_steps = {step for row in rows for step in row.steps}
    for step in sorted(table_steps - HOOKS_BY_STEP.keys()):
        problems.append(f"step {step} is in the table but not in HOOKS_BY_STEP: add it (with the hooks it fires)")
    for step in sorted(HOOKS_BY_STEP.keys() - table_steps):
        problems.append(f"HOOKS_BY_STEP lists {step}, which no row of the table runs")
    listed = {hook for hooks in HOOKS_BY_STEP.values() for hook in hooks} | set(HOOKS_AFTER_EVERY_TRANSITION)
    for hook in sorted(listed - docs.keys()):
        problems.append(f"{hook} is listed in statechart.py but is not a hookspec")
    triggers = {row.trigger for row in rows}
    for hook, text in docs.items():
        mapped = {step for step, hooks in HOOKS_BY_STEP.items() if hook in hooks}
        documented = {name for name in _backticked(text) if name in table_steps | HOOKS_BY_STEP.keys()}
        if mapped != documented:
            problems.append(
                f"{hook}: HOOKS_BY_STEP says it is fired by {sorted(mapped) or 'no step'}, "
                f"its 'Called from:' names {sorted(documented) or 'no step'}"
            )
        if documented:
            named = _backticked(text) & triggers
            running = {row.trigger for row in rows if documented & set(row.steps)}
            if named != running:
                problems.append(
                    f"{hook}: 'Called from:' names transitions {sorted(named)}, but the rows "
                    f"running {sorted(documented)} are {sorted(running)}"
                )
        every = bool(re.search(r"\bevery transition\b", text, re.IGNORECASE))
        if every != (hook in HOOKS_AFTER_EVERY_TRANSITION):
            problems.append(
                f"{hook}: 'Called from:' {'says' if every else 'does not say'} 'every transition', "
                f"but it is {'not ' if every else ''}in HOOKS_AFTER_EVERY_TRANSITION"
            )
    return problems


# ------------------------------------------------------------------------------------------------
# The per-row view shared by the Markdown table and the JSON export
# ------------------------------------------------------------------------------------------------


def hooks_fired(row: TableRow) -> list[str]:
    """The hooks a row fires, in order: its ``prepare`` steps' (the decision), its ``before``
    steps', its ``after`` steps', then the after-every-transition hooks (transitions runs ``after``
    callbacks before ``after_state_change``).

    Raises:
        ValueError: a step of the row is missing from ``HOOKS_BY_STEP``.
    """
    hooks: list[str] = []
    for step in row.steps:
        if step not in HOOKS_BY_STEP:
            raise ValueError(
                f"step {step!r} ({row.describe()}) is not in HOOKS_BY_STEP: add it to "
                f"fsm_agent/states/statechart.py with the hooks it fires"
            )
        hooks.extend(HOOKS_BY_STEP[step])
    return [*hooks, *HOOKS_AFTER_EVERY_TRANSITION]


def _rows(transitions: Sequence[Row] | None) -> list[TableRow]:
    return table_rows(TRANSITIONS if transitions is None else transitions)


# ------------------------------------------------------------------------------------------------
# Renderers
# ------------------------------------------------------------------------------------------------


def render_mermaid(transitions: Sequence[Row] | None = None) -> str:
    """The statechart as deterministic Mermaid ``stateDiagram-v2`` text (ends with a newline)."""
    from transitions.extensions import HierarchicalGraphMachine  # the flat one omits "final --> [*]"

    model = _DiagramModel()
    build_machine(
        model,
        transitions,
        machine_cls=HierarchicalGraphMachine,
        graph_engine="mermaid",
        show_conditions=True,
        show_auto_transitions=False,
    )
    lines = model.get_graph().draw(None).splitlines()  # type: ignore[attr-defined]  # added by the machine
    # transitions writes its title as a bare "---\n<title>\n---" front matter, which Mermaid ignores
    # (not a YAML mapping): drop it, and write a "title:" front matter instead.
    if lines and lines[0].strip() == "---":
        end = next((i for i in range(1, len(lines)) if lines[i].strip() == "---"), 0)
        lines = lines[end + 1 :]
    kept = [line.rstrip() for line in lines if not line.lstrip().startswith(("Class ", "classDef "))]
    return "\n".join(["---", f"title: {TITLE}", "---", *kept]).rstrip() + "\n"


def _code(names: Sequence[str]) -> str:
    return ", ".join(f"`{name}`" for name in names)


def _cell(text: str) -> str:
    """A Markdown table cell: reST double-backtick code becomes single-backtick code; ``|`` is escaped."""
    return re.sub(r"``(.+?)``", r"`\1`", text or "—").replace("|", "\\|")


def _and(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _steps(row: TableRow) -> str:
    parts = []
    if row.prepare:
        parts.append(f"prepare: {_code(row.prepare)}")
    if row.before:
        parts.append(f"before: {_code(row.before)}")
    if row.after:
        parts.append(f"after: {_code(row.after)}")
    return "; ".join(parts)


def render_markdown(transitions: Sequence[Row] | None = None) -> str:
    """``docs/statechart.md``: the diagram, one table line per table row, and every hook's caller."""
    rows = _rows(transitions)
    auto = _and([f"`{trigger}` in {state_name(state)}" for state, trigger in AUTO_TRIGGERS.items()])
    lines = [
        "# Worker-group statechart",
        "",
        "This file is generated from the transition table in `fsm_agent/states/table.py` by",
        "`fsm_agent/states/statechart.py`; do not edit it by hand. Regenerate it with:",
        "",
        "```sh",
        REGENERATE_COMMAND,
        "```",
        "",
        "`tests/states/test_statechart_doc.py` fails when it is out of date.",
        "",
        "```mermaid",
        render_mermaid(transitions).rstrip("\n"),
        "```",
        "",
        f"The group starts in {state_name(INITIAL)}; {_and([state_name(s) for s in TERMINAL])} are "
        f"terminal. The run loop fires {auto} by itself; every other trigger is a fact reported by "
        f"the launcher, the rendezvous, a signal or an error.",
        "",
        *(line for note in STATE_NOTES for line in (note, "")),
        "## Transitions",
        "",
        'One line per row of the table, in table order. A guard `x` means `conditions="x"`, `!x` means '
        '`unless="x"`. Steps are `ElasticAgent` methods: a `prepare` step is the trigger\'s decider '
        "(`DECIDERS` in the table, run by transitions' `prepare_event` once per event, before any guard "
        "reads the decision: it asks the hook that decides), `before` steps run before "
        "the state changes (one that raises leaves the group in its source state), `after` steps once it "
        "has changed. "
        "Hooks fired are the steps' hooks (`HOOKS_BY_STEP` in `fsm_agent/states/statechart.py`), then "
        f"{_code(HOOKS_AFTER_EVERY_TRANSITION)}, fired after every transition by "
        "`ElasticAgent._after_state_change`.",
        "",
        "| Source(s) | Trigger | Destination | Guard | Steps | Hooks fired |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        cells = [
            ", ".join(row.sources),
            f"`{row.trigger}`",
            str(row.dest),
            _code([row.guard]) if row.guard else "",
            _steps(row),
            _code(hooks_fired(row)),
        ]
        lines.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
    lines += [
        "",
        "## Facts",
        "",
        "What each trigger carries: its fact (`fsm_agent/states/facts.py`), which every step of the "
        'row receives as `event.kwargs["fact"]` and every `transition` record of the events file as '
        "`fact` ([events.md](events.md)).",
        "",
        markdown_table().rstrip("\n"),
        "",
        "## Hooks",
        "",
        'Where each hook of `fsm_agent/plugins/hookspecs.py` is called from (its "Called from:" section).',
        "",
        "| Hook | Called from |",
        "|---|---|",
    ]
    from fsm_agent.plugins.hookspec_info import called_from

    for hook, text in called_from().items():
        lines.append(f"| `{hook}` | {_cell(text)} |")
    return "\n".join(lines) + "\n"


def render_json(transitions: Sequence[Row] | None = None) -> str:
    """The statechart as JSON: states, initial, terminal, and one object per table row."""
    doc = {
        "title": TITLE,
        "states": [state_name(s) for s in STATES],
        "initial": state_name(INITIAL),
        "terminal": [state_name(s) for s in TERMINAL],
        "auto_triggers": {state_name(s): trigger for s, trigger in AUTO_TRIGGERS.items()},
        "transitions": [
            {
                "trigger": row.trigger,
                "source": list(row.sources),
                "dest": row.dest,
                "conditions": list(row.conditions),
                "unless": list(row.unless),
                "prepare": list(row.prepare),
                "before": list(row.before),
                "after": list(row.after),
                "hooks": hooks_fired(row),
            }
            for row in _rows(transitions)
        ],
    }
    return json.dumps(doc, indent=2) + "\n"


def render(fmt: str = "markdown", transitions: Sequence[Row] | None = None) -> str:
    """Render the statechart.

    Args:
        fmt: ``"mermaid"``, ``"markdown"`` or ``"json"``.
        transitions: the table to render; defaults to ``TRANSITIONS`` (tests pass modified copies).

    Returns:
        The text, ending with one newline; the same input always gives the same bytes.

    Raises:
        ValueError: unknown format, or a step missing from ``HOOKS_BY_STEP``.
    """
    renderers = {"mermaid": render_mermaid, "markdown": render_markdown, "json": render_json}
    if fmt not in renderers:
        raise ValueError(f"unknown statechart format {fmt!r}: choose one of {', '.join(FORMATS)}")
    return renderers[fmt](transitions)


def cli_main(argv: Sequence[str] | None = None) -> int:
    """``fsm-agent statechart [--format mermaid|markdown|json]``: print the statechart to stdout."""
    parser = OneLineParser(
        prog="fsm-agent statechart",
        description="Print the worker-group statechart, rendered from fsm_agent/states/table.py. "
        f"docs/statechart.md is its Markdown output: {REGENERATE_COMMAND}",
    )
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="markdown",
        help="mermaid: stateDiagram-v2 text; markdown (default): the diagram and the "
        "transition table, as in docs/statechart.md; json: states and transitions",
    )
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    sys.stdout.write(render(args.format))
    return 0


if __name__ == "__main__":  # as ``fsm-agent statechart``: bad input is one line on stderr, exit 2
    try:
        sys.exit(cli_main())
    except ConfigError as exc:
        print(f"fsm-agent statechart: error: {exc}", file=sys.stderr)
        sys.exit(2)
