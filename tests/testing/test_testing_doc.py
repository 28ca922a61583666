"""docs/testing.md: its worked example is the plugin package plugins/fsm-agent-example, quoted byte
for byte, and its tests run; the numbers it states match the code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.conformance

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "testing.md"
QUOTE = re.compile(r"<!-- file: (?P<path>[^ ]+) -->\n```[a-z]*\n(?P<body>.*?)```\n", re.DOTALL)
#: Every file of the worked example the page must quote (the package, the plugin, its tests).
EXAMPLE_FILES = [
    "plugins/fsm-agent-example/pyproject.toml",
    "plugins/fsm-agent-example/src/fsm_agent_example/__init__.py",
    "plugins/fsm-agent-example/src/fsm_agent_example/launcher.py",
    "plugins/fsm-agent-example/tests/test_example_plugin.py",
    "plugins/fsm-agent-example/tests/test_example_launcher.py",
]

pytest_plugins = ["pytester"]


def quotes() -> dict[str, str]:
    return {m["path"]: m["body"] for m in QUOTE.finditer(DOC.read_text())}


def test_the_page_quotes_every_file_of_the_worked_example():
    assert sorted(quotes()) == sorted(EXAMPLE_FILES)


@pytest.mark.parametrize("path", EXAMPLE_FILES)
def test_each_quote_is_the_file_byte_for_byte(path):
    body = quotes()[path]
    assert body == (ROOT / path).read_text(), (
        f"docs/testing.md quotes an outdated {path}: paste the file into the block after <!-- file: {path} -->"
    )


def test_the_worked_example_runs(request, pytester):
    """The quoted tests pass (run here unless this session collects them itself)."""
    files = [ROOT / p for p in EXAMPLE_FILES if "/tests/" in p]
    collected = {Path(str(item.path)) for item in request.session.items}
    if all(f in collected for f in files):
        pytest.skip("the worked example's tests run in this session")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *map(str, files))
    outcomes = result.parseoutcomes()
    assert result.ret == 0 and outcomes.get("passed", 0) >= 20 and not outcomes.get("failed"), result.stdout.str()


def test_the_numbers_the_page_states_are_the_code_s():
    from tests.agent import test_agent_properties as prop

    text = DOC.read_text()
    assert f"seed {prop.SEED}, `derandomize=True`" in text
    assert f"{prop.MAX_EXAMPLES} examples of up to {prop.STEPS} steps each" in text
    from hypothesis import settings

    explore = settings.get_profile(prop.EXPLORE_PROFILE)
    assert f"explores {explore.max_examples}" in text and f"up to {explore.stateful_step_count} steps" in text
