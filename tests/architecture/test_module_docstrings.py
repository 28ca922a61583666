"""Every module says what its room is for: a module docstring, its first line a sentence of its own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
MODULES = sorted(
    [*ROOT.glob("fsm_agent/**/*.py"), *ROOT.glob("plugins/*/src/**/*.py")],
    key=lambda path: str(path.relative_to(ROOT)),
)


@pytest.mark.parametrize("path", MODULES, ids=lambda path: str(path.relative_to(ROOT)))
def test_the_module_says_what_it_is_for(path):
    doc = ast.get_docstring(ast.parse(path.read_text(), str(path)))
    assert doc, f"{path.relative_to(ROOT)}: no module docstring; say what the module is for"
    assert len(doc.splitlines()[0].split()) >= 3, f"{path.relative_to(ROOT)}: the first line says too little: {doc!r}"
