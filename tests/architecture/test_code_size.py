"""The shape the redesign set (issue #31), held: the agent module is small, no function is long, and
the agent's rooms never probe a backend for optional members (only ``plugins/protocols.py``'s
adapters do)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "fsm_agent"
#: The agent module's size limit, in lines (the model: steps, guards and deciders).
AGENT_MAX_LINES = 700
#: A function's size limit, in lines from its ``def`` to its last line.
FUNCTION_MAX_LINES = 80
#: Generated-text renderers: one long template each, exempt from the function limit.
RENDERERS = {
    "fsm_agent/reference.py:configuration_reference",
    "fsm_agent/plugins/docs.py:render",
}
#: The rooms of the agent: they reach handlers and launchers through the adapters only.
AGENT_ROOMS = (
    "agent.py",
    "agent_surface.py",
    "watcher.py",
    "failures.py",
    "recording.py",
    "drain.py",
    "interrupts.py",
    "exit_barrier.py",
    "ranks.py",
)
BACKEND_NAMES = ("handler", "launcher", "rdzv")


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def long_functions(path: Path, shown_as: str) -> list[str]:
    """``shown_as:line name: N lines`` for each function of ``path`` over the limit (renderers exempt)."""
    return [
        f"{shown_as}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines"
        for node in _functions(path)
        if node.end_lineno - node.lineno + 1 > FUNCTION_MAX_LINES and f"{shown_as}:{node.name}" not in RENDERERS
    ]


def backend_probes(path: Path, shown_as: str) -> list[str]:
    """``getattr``/``hasattr`` calls in ``path`` whose object names a handler, launcher or rdzv."""
    probes = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
        ):
            continue
        owner = ast.unparse(node.args[0]) if node.args else ""
        if any(word in owner.lower() for word in BACKEND_NAMES):
            probes.append(f"{shown_as}:{node.lineno}: {ast.unparse(node)}")
    return probes


def test_the_agent_module_is_under_its_limit():
    lines = len((PACKAGE / "agent.py").read_text().splitlines())
    assert lines < AGENT_MAX_LINES, f"fsm_agent/agent.py has {lines} lines (limit {AGENT_MAX_LINES})"


def test_no_function_is_longer_than_the_limit():
    long = [hit for path in sorted(PACKAGE.rglob("*.py")) for hit in long_functions(path, str(path.relative_to(ROOT)))]
    assert long == [], f"split these (limit {FUNCTION_MAX_LINES} lines):\n" + "\n".join(long)


def test_the_agent_rooms_do_not_probe_backends():
    """``getattr(self._launcher, "x", ...)`` would be an unwritten protocol again: optional members
    are declared in ``fsm_agent/plugins/protocols.py`` and read through its adapters."""
    assert [hit for name in AGENT_ROOMS for hit in backend_probes(PACKAGE / name, f"fsm_agent/{name}")] == []


def test_the_checks_catch_what_they_exist_for(tmp_path):
    """The two readings above, on a module that breaks both rules (and an exempt renderer's name)."""
    bad = tmp_path / "bad.py"
    body = "\n".join(f"    x{i} = {i}" for i in range(FUNCTION_MAX_LINES))
    bad.write_text(
        f"def long():\n{body}\n\n\ndef render():\n{body}\n\n\n"
        "def probe(self):\n    return getattr(self._launcher, 'leave', None)\n"
    )
    assert long_functions(bad, "fsm_agent/plugins/docs.py") == [
        f"fsm_agent/plugins/docs.py:1 long: {FUNCTION_MAX_LINES + 1} lines"
    ]
    assert backend_probes(bad, "bad.py") == [
        f"bad.py:{2 * FUNCTION_MAX_LINES + 8}: getattr(self._launcher, 'leave', None)"
    ]
