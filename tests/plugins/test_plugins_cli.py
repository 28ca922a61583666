"""``fsm-agent plugins``: every loaded plugin with its kinds, backends, distribution, version, hooks
and whether it is built-in; a plugin that fails to load is one line and a non-zero exit, for
``plugins`` and ``run`` alike; ``--disable-plugin`` / ``FSM_AGENT_DISABLE_PLUGINS`` remove it.

The failing plugin is ``tests/fixtures/broken-plugin`` (distribution ``fsm-agent-broken-fixture``,
entry point ``broken-fixture``, whose module imports a package that does not exist), pip-installed
into a temporary ``--target`` directory given to the subprocesses on ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from fsm_agent.errors import ConfigError, PluginError
from fsm_agent.plugins import hookimpl
from fsm_agent.plugins.manager import (
    BUILTIN_PLUGINS,
    PLUGIN_KINDS,
    TEST_TOOLING_PLUGINS,
    build_registry,
    cli_main,
    collect_options,
    get_plugin_manager,
    plugin_rows,
)
from tests.helpers.install import installed_fixtures
from tests.helpers.processes import pythonpath, run_fsm_agent

pytestmark = pytest.mark.unit

BROKEN = (
    "broken-fixture",
    "fsm-agent-broken-fixture",
    "ModuleNotFoundError",
    "No module named 'fsm_agent_fixture_missing_dependency'",
)
ROW_KEYS = {"name", "kinds", "backends", "hooks", "builtin", "distribution", "version"}


# ------------------------------------------------------------------------------------------------
# Rows and kinds, in process
# ------------------------------------------------------------------------------------------------


class Backends:
    @hookimpl
    def fsm_agent_register_backends(self, registry):
        registry.add_rendezvous("t-rdzv", lambda params: None)
        registry.add_launcher("t-launch", lambda agent: None)


class Listener:
    @hookimpl
    def fsm_agent_put_metric(self, metric_group, metric_name, metric_value):
        pass

    @hookimpl
    def fsm_agent_record_event(self, event):
        pass

    @hookimpl
    def fsm_agent_configure(self, config, agent):
        pass


class Lifecycle:
    @hookimpl
    def fsm_agent_state_changed(self, transition):
        pass


class Declared:
    """Registers its metrics sink in configure, so it declares its kind."""

    FSM_AGENT_KINDS = ("metrics",)

    @hookimpl
    def fsm_agent_configure(self, config, agent):
        pass


@pytest.fixture
def rows_by_name():
    pm = get_plugin_manager(load_entry_points=False)
    for name, plugin in (
        ("t-backends", Backends()),
        ("t-listener", Listener()),
        ("t-lifecycle", Lifecycle()),
        ("t-declared", Declared()),
    ):
        pm.register(plugin, name)
    return {row["name"]: row for row in plugin_rows(pm)}


def test_kinds_are_derived_from_the_hooks(rows_by_name):
    assert rows_by_name["t-backends"]["kinds"] == ["rendezvous", "launcher"]
    assert rows_by_name["t-backends"]["backends"] == {"rendezvous": ["t-rdzv"], "launcher": ["t-launch"]}
    assert rows_by_name["t-listener"]["kinds"] == ["metrics", "event recording"]
    assert rows_by_name["t-listener"]["backends"] == {}
    assert rows_by_name["t-lifecycle"]["kinds"] == ["lifecycle"]
    assert rows_by_name["t-declared"]["kinds"] == ["metrics"]


def test_builtin_rows(rows_by_name):
    assert set(BUILTIN_PLUGINS) <= set(rows_by_name)
    for name in BUILTIN_PLUGINS:
        row = rows_by_name[name]
        assert set(row) == ROW_KEYS
        assert (row["builtin"], row["distribution"]) == (True, "fsm-agent") and row["version"]
        assert row["hooks"] and all(h.startswith("fsm_agent_") for h in row["hooks"])
        assert row["kinds"] and set(row["kinds"]) <= set(PLUGIN_KINDS)
    assert rows_by_name["rendezvous-c10d"]["backends"] == {"rendezvous": ["c10d"]}
    assert rows_by_name["launcher-subprocess"]["kinds"] == ["launcher"]
    assert rows_by_name["metrics-logging"]["kinds"] == ["metrics"]
    assert rows_by_name["events-jsonl"]["kinds"] == ["event recording"]
    assert not rows_by_name["t-backends"]["builtin"]


def test_a_setup_hook_that_raises_is_a_plugin_error_naming_the_plugin():
    class Bad:
        @hookimpl
        def fsm_agent_register_backends(self, registry):
            raise RuntimeError("boom")

        @hookimpl
        def fsm_agent_addoption(self, options):
            raise KeyError("nope")

    pm = get_plugin_manager(load_entry_points=False)
    pm.register(Bad(), "bad")
    with pytest.raises(PluginError, match=r"plugin 'bad' .*fsm_agent_register_backends: RuntimeError: boom"):
        build_registry(pm)
    with pytest.raises(PluginError, match=r"plugin 'bad' .*fsm_agent_addoption: KeyError"):
        collect_options(pm)


# ------------------------------------------------------------------------------------------------
# The command, in process (the installed plugins of this environment are loaded too)
# ------------------------------------------------------------------------------------------------


def listed(capsys, *argv: str) -> dict[str, dict]:
    assert cli_main(["--json", *argv]) == 0
    return {row["name"]: row for row in json.loads(capsys.readouterr().out)}


def test_json_lists_every_loaded_plugin(capsys, monkeypatch):
    monkeypatch.delenv("FSM_AGENT_DISABLE_PLUGINS", raising=False)
    rows = listed(capsys)
    pm = get_plugin_manager()
    assert list(rows) == [
        name for name, plugin in pm.list_name_plugin() if plugin is not None and name not in TEST_TOOLING_PLUGINS
    ]
    assert "statechart-coverage" not in rows  # test tooling, registered while pytest records coverage
    assert all(set(row) == ROW_KEYS for row in rows.values())
    for row in rows.values():
        if not row["builtin"]:  # an installed distribution: its own name and version
            assert row["distribution"] != "fsm-agent" and row["version"], row


def test_table_has_one_line_per_plugin_with_every_column(capsys, monkeypatch):
    monkeypatch.delenv("FSM_AGENT_DISABLE_PLUGINS", raising=False)
    rows = listed(capsys)
    assert cli_main([]) == 0
    header, *lines = capsys.readouterr().out.splitlines()
    assert header.split() == ["NAME", "DISTRIBUTION", "VERSION", "BUILT-IN", "KINDS", "BACKENDS", "HOOKS"]
    assert [line.split()[0] for line in lines] == list(rows)
    c10d = next(line for line in lines if line.startswith("rendezvous-c10d "))
    assert c10d.split()[1:6] == ["fsm-agent", rows["rendezvous-c10d"]["version"], "yes", "rendezvous", "c10d"]
    assert "register_backends" in c10d
    events = next(line for line in lines if line.startswith("events-jsonl "))
    assert "event recording" in events


def test_disable_plugin_flag_and_env_remove_plugins(capsys, monkeypatch):
    monkeypatch.delenv("FSM_AGENT_DISABLE_PLUGINS", raising=False)
    assert {"metrics-logging", "status-http", "events-jsonl"} <= set(listed(capsys))
    assert "metrics-logging" not in listed(capsys, "--disable-plugin", "metrics-logging")
    rows = listed(capsys, "--disable-plugin", "metrics-logging,status-http", "--disable-plugin", "events-jsonl")
    assert not {"metrics-logging", "status-http", "events-jsonl"} & set(rows)
    monkeypatch.setenv("FSM_AGENT_DISABLE_PLUGINS", "metrics-logging, status-http")
    rows = listed(capsys)
    assert not {"metrics-logging", "status-http"} & set(rows) and "events-jsonl" in rows


def test_an_essential_plugin_cannot_be_disabled():
    with pytest.raises(ConfigError, match="launcher-subprocess.*essential"):
        cli_main(["--disable-plugin", "launcher-subprocess"])


def test_a_name_no_plugin_has_cannot_be_disabled(monkeypatch):
    """A typo is refused, naming where it was given and the known names (the built-ins among them)."""
    monkeypatch.delenv("FSM_AGENT_DISABLE_PLUGINS", raising=False)
    with pytest.raises(
        ConfigError,
        match=r"unknown plugin 'nope' in --disable-plugin: known plugins are .*"
        r"events-jsonl, .*; fix --disable-plugin$",
    ):
        cli_main(["--disable-plugin", "metrics-logging,nope"])
    monkeypatch.setenv("FSM_AGENT_DISABLE_PLUGINS", "nope")
    with pytest.raises(ConfigError, match="unknown plugin 'nope' in FSM_AGENT_DISABLE_PLUGINS: known plugins are "):
        cli_main([])


# ------------------------------------------------------------------------------------------------
# A distribution whose plugin fails to import, in subprocesses
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def broken_env():
    """The environment of an agent that sees the broken-plugin distribution."""
    with installed_fixtures("broken-plugin") as site:
        env = dict(os.environ)
        env["PYTHONPATH"] = pythonpath(site)
        env.pop("FSM_AGENT_DISABLE_PLUGINS", None)
        yield env


@pytest.fixture
def script(tmp_path) -> tuple[Path, Path]:
    """A training script that leaves a marker file when it runs (torch-free, so it is quick)."""
    marker = tmp_path / "ran"
    path = tmp_path / "train.py"
    path.write_text(f"open({str(marker)!r}, 'a').write('ran\\n')\n")
    return path, marker


def assert_one_line_naming_the_broken_plugin(result: subprocess.CompletedProcess) -> None:
    assert result.returncode != 0
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("fsm-agent: error: ")
    assert all(part in lines[0] for part in BROKEN), lines[0]
    assert "Traceback" not in result.stderr + result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("argv", [["plugins"], ["plugins", "--json"]])
def test_plugins_command_with_a_broken_plugin_is_one_line(broken_env, tmp_path, argv):
    result = run_fsm_agent(argv, broken_env, tmp_path)
    assert_one_line_naming_the_broken_plugin(result)
    assert result.stdout == ""


@pytest.mark.slow
def test_run_with_a_broken_plugin_is_one_line_and_does_not_start(broken_env, tmp_path, script):
    path, marker = script
    result = run_fsm_agent(["run", "--standalone", "--nproc-per-node", "1", str(path)], broken_env, tmp_path)
    assert_one_line_naming_the_broken_plugin(result)
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.parametrize("command", ["run", "config"])
def test_help_with_a_broken_plugin_still_helps(broken_env, tmp_path, command):
    """``fsm-agent run --help`` answers, the broken plugin named in one warning line on stderr."""
    result = run_fsm_agent([command, "--nproc_per", "2", "--help"], broken_env, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "--nproc-per-node" in result.stdout and "--health-check-interval" in result.stdout
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and all(part in lines[0] for part in BROKEN), result.stderr
    assert lines[0].endswith("; --help leaves its options out")


@pytest.mark.slow
def test_a_disabled_broken_plugin_is_not_loaded(broken_env, tmp_path, script):
    result = run_fsm_agent(["plugins", "--json", "--disable-plugin", "broken-fixture"], broken_env, tmp_path)
    assert result.returncode == 0, result.stderr
    names = {row["name"] for row in json.loads(result.stdout)}
    assert "broken-fixture" not in names and set(BUILTIN_PLUGINS) <= names

    env = {**broken_env, "FSM_AGENT_DISABLE_PLUGINS": "broken-fixture"}
    result = run_fsm_agent(["plugins", "--json"], env, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "broken-fixture" not in {row["name"] for row in json.loads(result.stdout)}

    path, marker = script
    result = run_fsm_agent(
        ["run", "--standalone", "--disable-plugin", "broken-fixture", str(path)], broken_env, tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert marker.read_text() == "ran\n"
    result = run_fsm_agent(["run", "--standalone", str(path)], env, tmp_path)
    assert result.returncode == 0, result.stderr
    assert marker.read_text() == "ran\nran\n"
