"""Option parsing (no agent)."""

from __future__ import annotations

import pytest

from fsm_agent_otel import read_options


def test_defaults_use_the_global_provider():
    assert read_options({}) == {"exporters": (), "jsonl_file": None, "service_name": "fsm-agent"}


def test_exporters_are_a_deduplicated_list_and_service_name_falls_back_to_otel_service_name():
    options = read_options({"FSM_AGENT_OTEL_EXPORTER": "Console, jsonl,console", "OTEL_SERVICE_NAME": "svc"})
    assert options["exporters"] == ("console", "jsonl") and options["service_name"] == "svc"


def test_unknown_exporter_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown exporter 'jaeger'; use a comma-separated list of console, otlp"):
        read_options({"FSM_AGENT_OTEL_EXPORTER": "console,jaeger"})
