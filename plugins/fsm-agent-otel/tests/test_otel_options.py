"""Option parsing (no agent)."""

from __future__ import annotations

import pytest
from fsm_agent_otel import read_options


def test_defaults_use_the_global_provider():
    assert read_options({}) == {"exporters": (), "jsonl_file": None, "service_name": "fsm-agent"}


def test_exporters_are_a_deduplicated_list_and_service_name_falls_back_to_otel_service_name():
    options = read_options({"FSM_AGENT_OTEL_EXPORTER": "Console, jsonl,console", "OTEL_SERVICE_NAME": "svc"})
    assert options["exporters"] == ("console", "jsonl") and options["service_name"] == "svc"


def test_options_are_flags_env_vars_and_file_keys(tmp_path, monkeypatch, capsys):
    """Declared with fsm_agent_addoption: flag > env var > [plugins.otel] > default, shown by fsm-agent config."""
    import json

    from fsm_agent_otel import run_options

    from fsm_agent import LaunchConfig, cli

    for name in ("EXPORTER", "JSONL_FILE", "SERVICE_NAME"):
        monkeypatch.delenv(f"FSM_AGENT_OTEL_{name}", raising=False)
    monkeypatch.setenv("FSM_AGENT_OTEL_SERVICE_NAME", "from-env")
    (tmp_path / "fsm.toml").write_text('[plugins.otel]\nexporter = "console"\njsonl_file = "/x/spans.jsonl"\n')
    with pytest.raises(SystemExit) as done:
        cli.main(["config", "--json", "--config", str(tmp_path / "fsm.toml"), "--otel-exporter", "jsonl,Console"])
    assert done.value.code == 0
    shown = {
        key.removeprefix("plugins.otel."): (row["value"], row["source"].split()[0])
        for key, row in json.loads(capsys.readouterr().out)["values"].items()
        if key.startswith("plugins.otel.")
    }
    assert shown == {
        "exporter": ("jsonl,Console", "cli"),
        "jsonl_file": ("/x/spans.jsonl", "file"),
        "service_name": ("from-env", "env"),
    }
    config = LaunchConfig(plugins={"otel": {"exporter": "jsonl,Console", "jsonl_file": None, "service_name": None}})
    assert run_options(config) == {"exporters": ("jsonl", "console"), "jsonl_file": None, "service_name": "fsm-agent"}
    with pytest.raises(SystemExit) as done:
        cli.main(["config", "--otel-exporter", "jaeger"])
    assert done.value.code == 2 and "unknown exporter 'jaeger'" in capsys.readouterr().err
    monkeypatch.setenv("FSM_AGENT_OTEL_EXPORTER", "console")  # a config built in Python: the environment
    assert run_options(LaunchConfig())["exporters"] == ("console",)


def test_unknown_exporter_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown exporter 'jaeger'; use a comma-separated list of console, otlp"):
        read_options({"FSM_AGENT_OTEL_EXPORTER": "console,jaeger"})
