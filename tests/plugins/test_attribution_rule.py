"""A site's attribution rule (docs/examples/attribution_rule.py, quoted in docs/plugins.md) changes
the job's verdict: asked before the built-in rules, through ``fsm_agent_classify_failure``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from fsm_agent.testing.fakes import FakeLauncher

pytestmark = pytest.mark.unit

RULE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "attribution_rule.py"


def load_rule():
    spec = importlib.util.spec_from_file_location("attribution_rule", RULE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_sites_rule_changes_the_verdict(make_agent):
    # rank 0 exits 17 (the site wrapper's "a peer went away"), rank 1 exits 3: both seen at once,
    # rank 0 first (lower rank), so the built-in rules name rank 0
    without = make_agent(launcher=FakeLauncher([{0: 17, 1: 3}]), max_restarts=0).run()
    assert without.job_verdict["root_causes"] == [0, 1] and without.exit_code == 17

    with_rule = make_agent(launcher=FakeLauncher([{0: 17, 1: 3}]), max_restarts=0, plugins=[load_rule()]).run()
    verdict = with_rule.job_verdict
    assert verdict["root_causes"] == [1]
    assert verdict["classes"] == {"0": "collateral", "1": "root_cause"}
    assert with_rule.exit_code == 3
