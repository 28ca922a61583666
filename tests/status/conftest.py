"""Helpers for the live-status tests: HTTP GET, polling, agents in their own process groups."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from tests.helpers.processes import checkout_env


def get(url: str, timeout: float = 5.0) -> tuple[int, str, str]:
    """(status code, content type, body) of a GET; HTTP errors are answers too."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read().decode()


def get_json(url: str) -> dict:
    code, _, body = get(url)
    assert code == 200, body
    return json.loads(body)


def wait_for(predicate, timeout: float = 60.0, interval: float = 0.1, what: str = "condition"):
    """Poll ``predicate()`` until it returns something truthy (returned) or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    last_error = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except OSError as exc:  # not listening yet
            last_error, value = exc, None
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last error: {last_error})")


@pytest.fixture
def processes(tmp_path):
    """``python -m fsm_agent ...`` processes (any subcommand) with a clean env; groups killed after."""
    from fsm_agent.testing import AgentProcesses

    group = AgentProcesses(tmp_path, command=(), env=checkout_env())
    yield group
    group.kill_all()
