"""tests/ is laid out by component (tests/README.md): a folder per room, the kind of a test a marker.

The README's table names every folder under tests/, no folder is named after a kind, no test
module lies at the top of tests/ (it would belong to no component), and every test module names
its kind, one of the markers of pyproject.toml, once in its module-level ``pytestmark``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import tomllib

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"


def readme_folders() -> set[str]:
    rows = re.findall(r"^\| `([\w-]+)/` \|", (TESTS / "README.md").read_text(), flags=re.M)
    return set(rows)


def folders() -> set[str]:
    return {p.name for p in TESTS.iterdir() if p.is_dir() and p.name != "__pycache__"}


def kind_markers() -> set[str]:
    markers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    return {line.split(":", 1)[0].strip() for line in markers}


#: Registered markers that say something other than the kind: ``slow`` goes beside a kind.
NOT_KINDS = {"slow"}


def every_test_module() -> list[Path]:
    return sorted(p for p in TESTS.rglob("test_*.py") if "fixtures" not in p.relative_to(TESTS).parts)


def module_marks(path: Path) -> list[str]:
    """The names of the ``pytest.mark.NAME`` (or ``NAME(...)``) in the module-level ``pytestmark``."""
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            items = node.value.elts if isinstance(node.value, ast.List | ast.Tuple) else [node.value]
            calls = [item.func if isinstance(item, ast.Call) else item for item in items]
            return [c.attr for c in calls if isinstance(c, ast.Attribute) and ast.unparse(c.value) == "pytest.mark"]
    return []


def test_the_readme_names_every_folder_and_only_those():
    assert readme_folders() == folders()


def test_no_folder_is_named_after_a_kind():
    assert not folders() & kind_markers(), "a kind is a marker (pytestmark), not a folder"


def test_no_test_module_outside_a_component_folder():
    assert not sorted(p.name for p in TESTS.glob("test_*.py"))


def test_every_test_module_names_its_kind_once():
    kinds = kind_markers() - NOT_KINDS
    found = {
        str(path.relative_to(TESTS)): [m for m in module_marks(path) if m in kinds] for path in every_test_module()
    }
    wrong = {name: marks for name, marks in found.items() if len(marks) != 1}
    assert not wrong, (
        f"each test module sets one kind ({', '.join(sorted(kinds))}) in its module-level pytestmark "
        f"(tests/README.md, Markers); these have {wrong}"
    )


def test_the_kind_check_reads_every_form_of_pytestmark(tmp_path):
    forms = {
        "pytestmark = pytest.mark.unit\n": ["unit"],
        "pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(9)]\n": ["e2e", "slow", "timeout"],
        "pytestmark = (pytest.mark.model,)\n": ["model"],
        "def test_x():\n    pytestmark = pytest.mark.unit\n": [],
        "import pytest\n": [],
    }
    for text, marks in forms.items():
        path = tmp_path / "test_form.py"
        path.write_text(text)
        assert module_marks(path) == marks, text
