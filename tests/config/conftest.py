"""Fixtures for the configuration tests: a clean environment, a cwd without pyproject.toml, a script."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    """No FSM_AGENT_*/PET_* or torch knobs from outside; cwd is an empty tmp dir; OMP preset."""
    for name in list(os.environ):
        if name.startswith(("PET_", "FSM_AGENT_")):
            monkeypatch.delenv(name)
    for name in ("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "PYTHON_EXEC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def script(tmp_path) -> str:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


@pytest.fixture
def write_toml(tmp_path):
    """``write_toml(text, name="fsm.toml") -> path``."""

    def write(text: str, name: str = "fsm.toml") -> str:
        path = Path(tmp_path) / name
        path.write_text(text)
        return str(path)

    return write
