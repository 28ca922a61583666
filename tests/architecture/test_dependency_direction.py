"""The dependency direction of docs/architecture.md, checked on every module's imports.

Every ``import`` and ``from ... import`` of the package and of the shipped plugin packages is
read with ``ast`` (imports inside functions included, ``if TYPE_CHECKING:`` blocks excluded: they
are types, not dependencies), and each rule below names the rooms one room may not reach and the
exact modules it may still import (``room.*``: that room's whole subtree).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from fsm_agent.plugins.manager import BUILTIN_PLUGINS

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]

#: Backends reached only through hooks and the registry: every registered built-in plugin, and the
#: worker containment both launchers share.
BACKENDS = (*BUILTIN_PLUGINS.values(), "fsm_agent.plugins.containment")
#: The commands and what only they use: the run parser, the merge of the sources, the doc generator.
CLI = (
    "fsm_agent.cli",
    "fsm_agent.launch",
    "fsm_agent.status_cli",
    "fsm_agent.docgen",
    "fsm_agent.run_parser",
    "fsm_agent.resolve",
    "fsm_agent.reference",
)

#: (rule, which modules it applies to, the prefixes they may not import, allowed exceptions)
RULES = [
    (
        "the statechart knows no agent, backend, configuration or CLI",
        lambda m: m.startswith("fsm_agent.states"),
        ("fsm_agent.",),
        (
            "fsm_agent.states.*",
            "fsm_agent.plugins.hookspec_info",
            "fsm_agent.plugins.hookspecs",
            "fsm_agent.argparsing",
            "fsm_agent.errors",
            "fsm_agent.worker",  # the worker-group data (DRAIN_SCOPES for the drain fact's check)
        ),
    ),
    (
        "the agent reaches backends only through hooks and the registry, and knows no CLI or configuration",
        lambda m: m == "fsm_agent.agent",
        (*BACKENDS, *CLI, "fsm_agent.config", "fsm_agent.settings", "fsm_agent.plugins.manager", "fsm_agent.testing"),
        (),
    ),
    (
        "the configuration schema knows nothing of fsm-agent but its errors and the signal names",
        lambda m: m == "fsm_agent.settings",
        ("fsm_agent.",),
        ("fsm_agent.errors", "fsm_agent.signal_names"),
    ),
    (
        "no plugin knows the CLI, the launch or the agent's module",
        lambda m: m.startswith("fsm_agent.plugins") or m.startswith("fsm_agent_"),
        (*CLI, "fsm_agent.agent"),
        (),
    ),
    (
        "the product does not depend on its test kit (replay is built on it, by design)",
        lambda m: m.startswith("fsm_agent") and not m.startswith(("fsm_agent.testing", "fsm_agent.replay")),
        ("fsm_agent.testing",),
        (),
    ),
    (
        "the CLI reaches the agent only through the launch API",
        lambda m: m in ("fsm_agent.cli", "fsm_agent.status_cli"),
        ("fsm_agent.agent",),
        (),
    ),
]


def _module_name(path: Path, root: Path) -> str:
    relative = path.relative_to(root).with_suffix("").parts
    parts = relative[3:] if relative[0] == "plugins" else relative  # plugins/<dist>/src/<module>/...
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(root: Path) -> list[Path]:
    return sorted([*(root / "fsm_agent").rglob("*.py"), *root.glob("plugins/*/src/**/*.py")])


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports_of(path: Path) -> list[tuple[int, str]]:
    """``(line, imported module)`` of every import in ``path`` outside ``if TYPE_CHECKING:``."""
    found = []

    def visit(node: ast.AST) -> None:
        if _is_type_checking(node):
            return
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module))
            found.extend((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return found


def _allows(allowance: str, imported: str) -> bool:
    """An exact module (and the names imported from it: ``from M import x`` reads as ``M.x``), or
    ``room.*`` for the room and everything under it."""
    if allowance.endswith(".*"):
        room = allowance[:-2]
        return imported == room or imported.startswith(room + ".")
    return imported == allowance or (imported.startswith(allowance + ".") and "." not in imported[len(allowance) + 1 :])


def violations(rule, root: Path = ROOT) -> list[str]:
    """``path:line imports MODULE`` for each import that breaks ``rule`` (one per import statement)."""
    name, applies, banned, allowed = rule
    problems: dict[tuple[str, int], str] = {}
    for path in _modules(root):
        module = _module_name(path, root)
        if not applies(module):
            continue
        for line, imported in imports_of(path):
            if (str(path), line) in problems:
                continue
            if imported.startswith(module + ".") or imported == module:
                continue  # a room's own modules
            if any(imported.startswith(b) for b in banned) and not any(_allows(a, imported) for a in allowed):
                problems[(str(path), line)] = f"{path.relative_to(root)}:{line} imports {imported}"
    return sorted(problems.values())


@pytest.mark.parametrize("rule", RULES, ids=[rule[0] for rule in RULES])
def test_imports_follow_the_dependency_direction(rule):
    assert violations(rule) == [], f"{rule[0]} (docs/architecture.md)"


def test_the_check_sees_a_violation(tmp_path):
    """An agent that imports a backend directly is caught, inside a function too (the rules are
    not vacuous); a type-only import is not a dependency."""
    fake = tmp_path / "fsm_agent"
    fake.mkdir()
    (fake / "agent.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import fsm_agent.cli\n"
        "def f():\n    from fsm_agent.plugins.rendezvous_c10d import FreshStoreHandler\n"
    )
    agent_rule = RULES[1]
    assert violations(agent_rule, tmp_path) == ["fsm_agent/agent.py:5 imports fsm_agent.plugins.rendezvous_c10d"]


def test_the_statechart_may_import_no_backend(tmp_path):
    """The statechart's allowances are exact: a built-in backend under fsm_agent.plugins is refused."""
    fake = tmp_path / "fsm_agent" / "states"
    fake.mkdir(parents=True)
    (fake / "table.py").write_text("from fsm_agent.plugins.hookspecs import x\nimport fsm_agent.plugins.drain\n")
    assert violations(RULES[0], tmp_path) == ["fsm_agent/states/table.py:2 imports fsm_agent.plugins.drain"]


def test_every_module_is_read():
    names = {_module_name(p, ROOT) for p in _modules(ROOT)}
    assert {
        "fsm_agent.agent",
        "fsm_agent.states.table",
        "fsm_agent.plugins.rendezvous_fsm.planner",
        "fsm_agent_etcd",
    } <= names
