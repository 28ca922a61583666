"""The distribution as a user sees it: listed by ``fsm-agent plugins``, and gone once uninstalled."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1]


def listed_plugins() -> dict[str, dict]:
    out = subprocess.run(
        [sys.executable, "-m", "fsm_agent", "plugins", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    return {row["name"]: row for row in json.loads(out)}


def pip(*args: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args],
        check=True,
        timeout=600,
        capture_output=True,
    )


def test_listed_with_its_distribution_and_hooks():
    row = listed_plugins()["prometheus"]
    assert (row["distribution"], row["builtin"]) == ("fsm-agent-prometheus", False)
    assert "fsm_agent_configure" in row["hooks"]
    table = subprocess.run(
        [sys.executable, "-m", "fsm_agent", "plugins"], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert any(line.split()[:2] == ["prometheus", "fsm-agent-prometheus"] for line in table.splitlines())


@pytest.mark.slow
def test_uninstall_removes_it_and_reinstall_brings_it_back():
    assert "prometheus" in listed_plugins()
    try:
        pip("uninstall", "-y", "fsm-agent-prometheus")
        assert "prometheus" not in listed_plugins()
    finally:  # leave the environment as it was, whatever happened
        pip("install", "--no-deps", "--no-build-isolation", "-e", str(PACKAGE_DIR))
    assert listed_plugins()["prometheus"]["distribution"] == "fsm-agent-prometheus"
