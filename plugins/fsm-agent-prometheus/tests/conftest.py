"""Fixtures (the plugins' tests directories are not packages, so helpers are fixtures, not imports).

``scraper``: reads ``/metrics`` over real HTTP and parses it with prometheus_client's parser.
``agents``: ``python -m fsm_agent run`` processes, each in its own session, killed by process
group at teardown.
"""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families


class Scraper:
    """Scrapes one endpoint; each successful scrape is kept as ``{(sample name, labels): value}``."""

    def __init__(self, url: str):
        self.url = url
        self.snapshots: list[dict[tuple[str, frozenset], float]] = []
        self.content_types: set[str] = set()

    def scrape(self) -> dict[tuple[str, frozenset], float] | None:
        try:
            with urllib.request.urlopen(self.url, timeout=5) as answer:
                text = answer.read().decode()
                self.content_types.add(answer.headers.get("Content-Type", ""))
        except (urllib.error.URLError, ConnectionError, OSError):
            return None
        snapshot = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                snapshot[(sample.name, frozenset(sample.labels.items()))] = sample.value
        self.snapshots.append(snapshot)
        return snapshot


def value(snapshot: dict, name: str, **labels) -> float | None:
    return snapshot.get((name, frozenset(labels.items())))


@pytest.fixture
def prom():
    """Helpers: ``prom.free_port()``, ``prom.Scraper(url)``, ``prom.value(snapshot, name, **labels)``."""

    class Helpers:
        Scraper = Scraper

        @staticmethod
        def free_port() -> int:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                return s.getsockname()[1]

        value = staticmethod(value)

    return Helpers


@pytest.fixture
def agents(agent_processes):
    """Real ``fsm-agent run`` processes in tmp_path (fsm-agent's test kit, AgentProcesses)."""
    return agent_processes
