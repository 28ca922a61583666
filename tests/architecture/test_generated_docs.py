"""Every generated document matches its renderer byte for byte; one command rewrites them all."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from fsm_agent import docgen

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("path", list(docgen.GENERATED))
def test_generated_doc_is_up_to_date(path):
    assert path not in docgen.stale(), f"{path} is out of date: run {docgen.COMMAND}"


def test_the_one_command_finds_and_rewrites_a_stale_doc(tmp_path, monkeypatch):
    for path in docgen.GENERATED:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(docgen.ROOT / path, tmp_path / path)
    (tmp_path / "docs/statechart.md").write_text("hand-edited\n")
    assert docgen.stale(tmp_path) == ["docs/statechart.md"]
    monkeypatch.setattr(docgen, "ROOT", tmp_path)
    assert docgen.main(["--check"]) == 1
    assert docgen.main([]) == 0
    assert docgen.stale(tmp_path) == [] and docgen.main(["--check"]) == 0


def test_check_from_the_command_line_passes_on_the_checkout():
    done = subprocess.run(
        [sys.executable, "-m", "fsm_agent.docgen", "--check"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=docgen.ROOT,
    )
    assert done.returncode == 0, done.stderr
