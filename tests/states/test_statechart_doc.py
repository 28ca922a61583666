"""docs/statechart.md is the renderer's output, the Mermaid is valid, and "hooks fired" is true.

The Mermaid check runs Mermaid's own parser (the ``mermaid`` npm package, under node, through
``tests/states/mermaid_parse.mjs``), installed by ``.ci/install-mermaid.sh`` into ``.ci/node/``.
Without it the test is skipped locally, but fails when ``$CI`` is set.
"""

from __future__ import annotations

import difflib
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fsm_agent.agent import ElasticAgent
from fsm_agent.states import statechart
from fsm_agent.states.statechart import REGENERATE_COMMAND, render
from fsm_agent.states.table import TERMINAL, TRANSITIONS
from fsm_agent.states.worker_state import WorkerState as S

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "statechart.md"
PARSER = ROOT / "tests" / "states" / "mermaid_parse.mjs"
NODE_PREFIX = Path(os.environ.get("MERMAID_NODE_PREFIX", ROOT / ".ci" / "node"))
INSTALL_HINT = "run .ci/install-mermaid.sh (needs node >= 20 and npm)"


def modified_table() -> list[dict]:
    """A copy of the real table where a failed health check ends the run instead of failing the workers."""
    return [dict(row, dest=S.FAILED) if row["trigger"] == "health_check_failed" else dict(row) for row in TRANSITIONS]


def mermaid_block(markdown: str) -> str:
    blocks = re.findall(r"^```mermaid\n(.*?)^```$", markdown, re.MULTILINE | re.DOTALL)
    assert len(blocks) == 1, "expected exactly one ```mermaid block"
    return blocks[0]


# -- docs/statechart.md in sync ----------------------------------------------------------------


def doc_drift(actual: bytes, expected: str) -> str | None:
    """None when the doc's bytes are ``expected``; otherwise the failure message, with a diff."""
    if actual == expected.encode("utf-8"):
        return None
    diff = "".join(
        list(
            difflib.unified_diff(
                actual.decode("utf-8", errors="replace").splitlines(keepends=True),
                expected.splitlines(keepends=True),
                "docs/statechart.md",
                "render('markdown')",
            )
        )[:40]
    )
    return (
        f"docs/statechart.md is out of date with fsm_agent/states/table.py; regenerate it with:\n"
        f"    {REGENERATE_COMMAND}\n{diff}"
    )


def test_doc_matches_the_renderer_byte_for_byte():
    problem = doc_drift(DOC.read_bytes() if DOC.exists() else b"", render("markdown"))
    if problem:
        pytest.fail(problem, pytrace=False)


def test_a_stale_doc_fails_naming_the_regenerate_command():
    """A doc rendered from the real table no longer matches once one row of a copy changes."""
    problem = doc_drift(render("markdown").encode("utf-8"), render("markdown", modified_table()))
    assert problem is not None
    assert REGENERATE_COMMAND in problem
    assert "`health_check_failed` | FAILED |" in problem


def _edge_label(mermaid: str, source: str, dest: str) -> str:
    """The label of the ``source --> dest`` line of a rendered diagram ("" when there is none)."""
    match = re.search(rf"^  {source} --> {dest}: (.*)$", mermaid, re.MULTILINE)
    return match.group(1) if match else ""


def test_changing_one_row_changes_the_doc():
    changed = render("markdown", modified_table())
    assert changed != render("markdown")
    assert "| `health_check_failed` | FAILED |" in changed
    assert "| `health_check_failed` | FAILED |" not in render("markdown")
    mermaid = render("mermaid", modified_table())
    assert "health_check_failed" in _edge_label(mermaid, "HEALTHY", "FAILED")
    assert "health_check_failed" not in _edge_label(mermaid, "HEALTHY", "UNHEALTHY")
    assert json.loads(render("json", modified_table())) != json.loads(render("json"))


def test_doc_says_how_to_regenerate_it():
    doc = render("markdown")
    assert doc.startswith("# ")
    assert "generated" in doc and REGENERATE_COMMAND in doc
    assert REGENERATE_COMMAND == "fsm-agent statechart --format markdown > docs/statechart.md"


def test_doc_has_one_table_line_per_row():
    doc = render("markdown")
    header = "| Source(s) | Trigger | Destination | Guard | Steps | Hooks fired |\n|---|---|---|---|---|---|\n"
    lines = doc.split(header)[1].split("\n\n")[0].splitlines()
    assert [line.split(" | ")[1] for line in lines] == [f"`{row['trigger']}`" for row in TRANSITIONS]
    cells = {(c[1], c[2]): c for c in (line.strip("|").split(" | ") for line in lines)}
    # Guards: conditions=X is written X, unless=X is !X.
    assert cells["`workers_failed`", "STOPPED"][3] == "`has_restarts_left`"
    rows = {(c[1], c[3]) for c in (line.strip("|").split(" | ") for line in lines) if c[2] == "FAILED"}
    assert ("`workers_failed`", "`!has_restarts_left and !excludes_this_node`") in rows
    assert "after: `_count_restart`" in cells["`workers_failed`", "STOPPED"][4]
    # Hooks: the steps' hooks in step order, then the hooks of every transition.
    assert cells["`start`", "HEALTHY"][5].strip() == (
        "`fsm_agent_rendezvous_completed`, "
        "`fsm_agent_node_check`, `fsm_agent_record_event`, `fsm_agent_put_metric`, "  # with checks switched on
        "`fsm_agent_worker_env`, `fsm_agent_workers_started`, "
        "`fsm_agent_put_metric`, `fsm_agent_record_event`, "  # the launcher's own timings, when it reports them
        "`fsm_agent_state_changed`, `fsm_agent_record_event`, `fsm_agent_put_metric`"
    )


# -- the Mermaid text ----------------------------------------------------------------------------


def test_mermaid_is_deterministic_and_unstyled():
    text = render("mermaid")
    assert text == render("mermaid")
    assert text.startswith("---\ntitle: fsm-agent worker-group statechart\n---\nstateDiagram-v2\n")
    assert not re.search(r"^\s*(Class|classDef)\b", text, re.MULTILINE | re.IGNORECASE)
    assert "[*] --> INIT" in text
    for state in TERMINAL:
        assert f"  {state.value} --> [*]\n" in text
    assert text == mermaid_block(render("markdown"))


def _truthy_env(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


def parse_with_mermaid(texts: dict[str, str]) -> dict[str, dict]:
    """Parse each text with the real Mermaid parser, in one node process.

    Returns:
        ``{name: {"diagramType": ...}}`` for a valid text, ``{name: {"error": message}}`` otherwise.
        Skips the test when the parser is not installed, or fails it when ``$CI`` is set.
    """
    node = shutil.which("node")
    installed = all((NODE_PREFIX / "node_modules" / pkg / "package.json").exists() for pkg in ("mermaid", "jsdom"))
    if node is None or not installed:
        reason = f"Mermaid parser not installed ({'node not found' if node is None else NODE_PREFIX}): {INSTALL_HINT}"
        if _truthy_env("CI"):
            pytest.fail(f"CI is set but the {reason}", pytrace=False)
        pytest.skip(reason)
    proc = subprocess.run(
        [node, str(PARSER), "--batch"],
        input=json.dumps(texts),
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MERMAID_NODE_PREFIX": str(NODE_PREFIX)},
    )
    assert proc.returncode == 0, f"{PARSER.name} exited {proc.returncode}: {proc.stderr.strip()}"
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def mermaid_results() -> dict[str, dict]:
    """The parser's verdicts on the rendered diagram, the doc's block, and two broken variants."""
    text = render("mermaid")
    return parse_with_mermaid(
        {
            "rendered": text,
            "doc": mermaid_block(DOC.read_text(encoding="utf-8")),
            "broken_transition": text.replace("INIT --> HEALTHY: start", "INIT --> : start"),
            "broken_front_matter": text.replace("title: ", "title: [", 1),
        }
    )


def test_mermaid_parses_with_the_real_parser(mermaid_results):
    assert mermaid_results["rendered"] == {"diagramType": "stateDiagram"}
    assert mermaid_results["doc"] == {"diagramType": "stateDiagram"}


def test_the_parser_rejects_invalid_mermaid(mermaid_results):
    """The parser check is not vacuous: a broken transition line and broken front matter fail."""
    assert "Parse error" in mermaid_results["broken_transition"].get("error", "")
    assert mermaid_results["broken_front_matter"].get("error")


# -- JSON and the command line -----------------------------------------------------------------


def test_json_lists_states_and_transitions():
    doc = json.loads(render("json"))
    assert doc["initial"] == "INIT"
    assert doc["states"] == [s.value for s in S]
    assert doc["terminal"] == [s.value for s in TERMINAL]
    assert len(doc["transitions"]) == len(TRANSITIONS)
    failed = [t for t in doc["transitions"] if t["trigger"] == "workers_failed"]
    assert [(t["source"], t["dest"], t["conditions"], t["unless"]) for t in failed] == [
        (["HEALTHY"], "HEALTHY", ["recovers_in_process"], []),
        (["HEALTHY"], "STOPPED", ["has_restarts_left"], ["recovers_in_process"]),
        (["HEALTHY"], "FAILED", ["excludes_this_node"], ["has_restarts_left", "recovers_in_process"]),
        (["HEALTHY"], "FAILED", [], ["has_restarts_left", "excludes_this_node", "recovers_in_process"]),
        (["UNHEALTHY"], "STOPPED", ["has_restarts_left"], []),
        (["UNHEALTHY"], "FAILED", ["excludes_this_node"], ["has_restarts_left"]),
        (["UNHEALTHY"], "FAILED", [], ["has_restarts_left", "excludes_this_node"]),
    ]


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="unknown statechart format 'dot'"):
        render("dot")


@pytest.mark.parametrize("fmt", ["mermaid", "markdown", "json"])
def test_cli_main_prints_the_rendering(fmt, capsys):
    assert statechart.cli_main(["--format", fmt]) == 0
    assert capsys.readouterr().out == render(fmt)


def test_cli_main_defaults_to_markdown(capsys):
    assert statechart.cli_main([]) == 0
    assert capsys.readouterr().out == render("markdown")


def test_fsm_agent_statechart_command(capsys):
    from fsm_agent import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["statechart", "--format", "json"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == render("json")


def test_python_dash_m_regenerates_the_doc():
    proc = subprocess.run(
        [sys.executable, "-m", "fsm_agent.states.statechart", "--format", "markdown"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    assert proc.stdout == render("markdown")


# -- "hooks fired" is true -----------------------------------------------------------------------


def test_hook_map_agrees_with_the_hookspecs_called_from():
    assert statechart.hook_map_problems() == []


def test_hook_map_cross_check_catches_a_stale_entry(monkeypatch):
    monkeypatch.setitem(statechart.HOOKS_BY_STEP, "_stop_workers", ("fsm_agent_workers_started",))
    problems = statechart.hook_map_problems()
    assert any(
        p.startswith("fsm_agent_workers_started: HOOKS_BY_STEP says it is fired by ['_start_workers', '_stop_workers']")
        for p in problems
    ), problems


def test_hook_map_cross_check_catches_a_step_on_a_new_row():
    table = [*TRANSITIONS, dict(trigger="workers_hung", source=S.UNHEALTHY, dest=S.HEALTHY, before="_rendezvous")]
    problems = statechart.hook_map_problems(table)
    assert any(
        "'Called from:' names transitions ['restart', 'start'], but the rows running "
        "['_rendezvous'] are ['restart', 'start', 'workers_hung']" in p
        for p in problems
    ), problems


def test_a_step_missing_from_the_hook_map_is_an_error():
    table = [*TRANSITIONS[:-1], dict(TRANSITIONS[-1], before="_dump_everything")]
    with pytest.raises(ValueError, match="'_dump_everything'.*HOOKS_BY_STEP"):
        render("markdown", table)


def _hooks_in_source(method_name: str, seen: set[str] | None = None) -> set[str]:
    """The ``fsm_agent_*`` hooks an ElasticAgent method names, following its ``self._x(...)`` calls."""
    seen = set() if seen is None else seen
    if method_name in seen:
        return set()
    seen.add(method_name)
    source = inspect.getsource(getattr(ElasticAgent, method_name))
    hooks = set(re.findall(r"\bfsm_agent_\w+", source))
    for callee in re.findall(r"\bself\.(\w+)\(", source):
        if callable(getattr(ElasticAgent, callee, None)):
            hooks |= _hooks_in_source(callee, seen)
    return hooks


@pytest.mark.parametrize("step", sorted(statechart.HOOKS_BY_STEP))
def test_hook_map_agrees_with_the_agent_code(step):
    assert _hooks_in_source(step) == set(statechart.HOOKS_BY_STEP[step]), (
        f"ElasticAgent.{step} fires other hooks than HOOKS_BY_STEP[{step!r}] says: update "
        f"fsm_agent/states/statechart.py, then {REGENERATE_COMMAND}"
    )


def test_after_every_transition_hooks_agree_with_the_agent_code():
    assert _hooks_in_source("_after_state_change") == set(statechart.HOOKS_AFTER_EVERY_TRANSITION)
