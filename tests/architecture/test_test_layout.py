"""tests/ is laid out by component (tests/README.md): a folder per room, the kind of a test a marker.

The README's table names every folder under tests/, no folder is named after a kind, and no test
module lies at the top of tests/ (it would belong to no component).
"""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

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


def test_the_readme_names_every_folder_and_only_those():
    assert readme_folders() == folders()


def test_no_folder_is_named_after_a_kind():
    assert not folders() & kind_markers(), "a kind is a marker (pytestmark), not a folder"


def test_no_test_module_outside_a_component_folder():
    assert not sorted(p.name for p in TESTS.glob("test_*.py"))
