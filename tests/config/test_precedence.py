"""Precedence, per key: command line > environment (FSM_AGENT_*, then PET_*) > config file > default.

Each case is checked for every source in turn, adding one source at a time from the lowest, so
each layer is seen to win over everything below it, and the reported source follows.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from fsm_agent import cli
from fsm_agent.errors import ConfigError

pytestmark = pytest.mark.unit


@attrs.frozen
class Case:
    """One key: how each source sets it and what LaunchConfig then holds.

    ``file`` is the TOML text; ``pet``/``fsm`` are env values (None: that var does not exist);
    ``cli`` the flags; ``values`` what ``get(config)`` returns for default, file, pet, fsm, cli.
    """

    key: str
    file: str
    pet: str | None
    fsm: str
    cli: tuple[str, ...]
    get: Any
    values: tuple[Any, Any, Any, Any, Any]
    base: tuple[str, ...] = ()

    @property
    def env_suffix(self) -> str:
        return {
            "rendezvous.endpoint": "RDZV_ENDPOINT",
            "rendezvous.backend": "RDZV_BACKEND",
            "rendezvous.run_id": "RDZV_ID",
        }.get(self.key, self.key.rpartition(".")[2].upper())


MULTI = ("--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1")  # no implicit standalone

CASES = [
    Case(
        "max_restarts", "max_restarts = 1", "2", "3", ("--max-restarts", "4"), lambda c: c.max_restarts, (0, 1, 2, 3, 4)
    ),
    Case(
        "monitor_interval",
        "monitor_interval = 1.5",
        "2.5",
        "3.5",
        ("--monitor-interval", "4.5"),
        lambda c: c.monitor_interval,
        (0.1, 1.5, 2.5, 3.5, 4.5),
    ),
    Case(
        "nproc_per_node",
        "nproc_per_node = 2",
        "3",
        "4",
        ("--nproc-per-node", "5"),
        lambda c: c.nproc_per_node,
        (1, 2, 3, 4, 5),
    ),
    Case(
        "nnodes",
        'nnodes = "1:2"',
        "1:3",
        "1:4",
        ("--nnodes", "1:5"),
        lambda c: (c.min_nodes, c.max_nodes),
        ((1, 1), (1, 2), (1, 3), (1, 4), (1, 5)),
        base=("--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1"),
    ),
    Case(
        "role",
        'role = "file"',
        "pet",
        "fsm",
        ("--role", "cli"),
        lambda c: c.role,
        ("default", "file", "pet", "fsm", "cli"),
    ),
    Case(
        "standalone",
        "standalone = true",
        "0",
        "1",
        ("--standalone",),
        lambda c: c.standalone,
        (False, True, False, True, True),
    ),
    Case(
        "rendezvous.endpoint",
        '[rendezvous]\nendpoint = "file:1"',
        "pet:1",
        "fsm:1",
        ("--rdzv-endpoint", "cli:1"),
        lambda c: c.rdzv_endpoint,
        ("", "file:1", "pet:1", "fsm:1", "cli:1"),
        base=("--nnodes", "1:2", "--rdzv-backend", "c10d"),
    ),
    Case(
        "rendezvous.run_id",
        '[rendezvous]\nrun_id = "file"',
        "pet",
        "fsm",
        ("--rdzv-id", "cli"),
        lambda c: c.run_id,
        ("none", "file", "pet", "fsm", "cli"),
        base=MULTI,
    ),
    Case(
        "rendezvous.node_rank",
        "[rendezvous]\nnode_rank = 1",
        "2",
        "3",
        ("--node-rank", "4"),
        lambda c: c.node_rank,
        (0, 1, 2, 3, 4),
        base=("--nnodes", "5", "--master-port", "1234"),
    ),
    Case(
        "logs.log_dir",
        '[logs]\nlog_dir = "/file"',
        "/pet",
        "/fsm",
        ("--log-dir", "/cli"),
        lambda c: c.log_dir,
        (None, "/file", "/pet", "/fsm", "/cli"),
    ),
    Case("logs.tee", "[logs]\ntee = 1", "2", "3", ("--tee", "0:1"), lambda c: c.tee, ("0", "1", "2", "3", "0:1")),
    Case(
        "logs.local_ranks_filter",
        "[logs]\nlocal_ranks_filter = [0]",
        "1",
        "2",
        ("--local-ranks-filter", "3"),
        lambda c: c.local_ranks_filter,
        (None, {0}, {1}, {2}, {3}),
    ),
    Case(
        "logs.duplicate_stdout_filters",
        '[logs]\nduplicate_stdout_filters = ["f"]',
        "p",
        "s",
        ("--duplicate-stdout-filters", "c"),
        lambda c: c.duplicate_stdout_filters,
        ((), ("f",), ("p",), ("s",), ("c",)),
    ),
    # No PET_ variable (torchrun has none): the file, then FSM_AGENT_*, then the flag.
    Case(
        "logs.logs_specs",
        '[logs]\nlogs_specs = "file"',
        None,
        "fsm",
        ("--logs-specs", "cli"),
        lambda c: c.logs_specs,
        (None, "file", "file", "fsm", "cli"),
    ),
    Case(
        "numa_binding",
        'numa_binding = "node"',
        None,
        "socket",
        ("--numa-binding", "exclusive"),
        lambda c: c.numa_binding,
        (None, "node", "node", "socket", "exclusive"),
    ),
    # fsm-agent's own flags: one FSM_AGENT_* variable.
    Case(
        "exit_barrier_timeout",
        "exit_barrier_timeout = 1",
        None,
        "2",
        ("--exit-barrier-timeout", "3"),
        lambda c: c.exit_barrier_timeout,
        (300, 1, 1, 2, 3),
    ),
    Case(
        "logs.events_file",
        '[logs]\nevents_file = "f.jsonl"',
        None,
        "e.jsonl",
        ("--events-file", "c.jsonl"),
        lambda c: c.events_file,
        (None, "f.jsonl", "f.jsonl", "e.jsonl", "c.jsonl"),
    ),
    # A plugin's option: [plugins.status-http] port, FSM_AGENT_STATUS_PORT, --status-port.
    Case(
        "plugins.status-http.port",
        "[plugins.status-http]\nport = 1001",
        None,
        "1002",
        ("--status-port", "1003"),
        lambda c: c.plugin_options("status-http")["port"],
        (None, 1001, 1001, 1002, 1003),
    ),
]


def env_names(case: Case) -> tuple[str | None, str]:
    if case.key == "plugins.status-http.port":
        return None, "FSM_AGENT_STATUS_PORT"
    pet = f"PET_{case.env_suffix}" if case.pet is not None else None
    return pet, f"FSM_AGENT_{case.env_suffix}"


def resolve(argv: list[str]):
    resolved = cli.resolve_run_args(argv)
    config, _, _ = cli.config_from_args(resolved.args)
    return config, resolved.sources


def normalise(value: Any) -> Any:
    return set(value) if isinstance(value, frozenset) else value


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.key)
def test_each_source_wins_over_the_ones_below(case, monkeypatch, write_toml, script):
    pet_var, fsm_var = env_names(case)
    expected_default, expected_file, expected_pet, expected_fsm, expected_cli = case.values
    base = list(case.base)

    config, sources = resolve([*base, script])
    assert normalise(case.get(config)) == expected_default
    assert sources[case.key].kind == "default"

    path = write_toml(case.file)
    config, sources = resolve([*base, "--config", path, script])
    assert normalise(case.get(config)) == expected_file
    assert str(sources[case.key]) == f"file {path}"

    if pet_var:
        monkeypatch.setenv(pet_var, case.pet)
        config, sources = resolve([*base, "--config", path, script])
        assert normalise(case.get(config)) == expected_pet
        assert str(sources[case.key]) == f"env {pet_var}"

    monkeypatch.setenv(fsm_var, case.fsm)
    config, sources = resolve([*base, "--config", path, script])
    assert normalise(case.get(config)) == expected_fsm
    assert str(sources[case.key]) == f"env {fsm_var}"

    config, sources = resolve([*base, "--config", path, *case.cli, script])
    assert normalise(case.get(config)) == expected_cli
    assert sources[case.key].kind == "cli"


def test_the_file_can_come_from_the_environment(monkeypatch, write_toml, script):
    monkeypatch.setenv("FSM_AGENT_CONFIG", write_toml("max_restarts = 7"))
    assert resolve([script])[0].max_restarts == 7


def test_pyproject_in_cwd_is_used_and_config_flag_replaces_it(write_toml, script):
    write_toml("[tool.fsm_agent]\nmax_restarts = 7\nrole = 'p'\n", "pyproject.toml")
    config, sources = resolve([script])
    assert (config.max_restarts, config.role) == (7, "p")
    assert str(sources["max_restarts"]) == "file pyproject.toml [tool.fsm_agent]"
    other = write_toml("max_restarts = 8")
    config, _ = resolve(["--config", other, script])
    assert (config.max_restarts, config.role) == (8, "default")  # only one file is read


def test_script_arguments_are_not_ours(write_toml, script):
    """``--config`` after the script belongs to the script; the pre-scan stops at the script."""
    path = write_toml("max_restarts = 5")
    resolved = cli.resolve_run_args([script, "--config", "model.yaml", "--disable-plugin", "x"])
    assert resolved.config_file is None
    assert resolved.args.training_script_args == ["--config", "model.yaml", "--disable-plugin", "x"]
    resolved = cli.resolve_run_args(["--max_rest", "2", "--config=" + path, "-r", "3", script])
    assert resolved.config_file.path == path and resolved.args.max_restarts == 2


# ------------------------------------------------------------------ keys that combine


def test_disabled_plugins_add_up(monkeypatch, write_toml, script):
    path = write_toml('disabled_plugins = ["metrics-logging"]')
    monkeypatch.setenv("FSM_AGENT_DISABLE_PLUGINS", "events-jsonl")
    config, sources = resolve(["--config", path, "--disable-plugin", "status-http", script])
    assert config.disabled_plugins == ("metrics-logging", "events-jsonl", "status-http")
    assert str(sources["disabled_plugins"]) == f"file {path} + env FSM_AGENT_DISABLE_PLUGINS + cli --disable-plugin"


def test_a_disabled_plugins_options_are_gone(write_toml, script):
    path = write_toml('disabled_plugins = ["status-http"]\n[plugins.status-http]\nport = "not checked"\n')
    resolved = cli.resolve_run_args(["--config", path, script])
    assert "plugins.status-http.port" not in resolved.sources
    with pytest.raises(ConfigError, match="unrecognized arguments: --status-port"):
        cli.resolve_run_args(["--disable-plugin", "status-http", "--status-port", "1", script])


def test_rendezvous_options_merge_per_option(monkeypatch, write_toml, script):
    path = write_toml('[rendezvous]\njoin_timeout = 900\nlast_call_timeout = 10\nconf = { store_type = "tcp" }\n')
    config, sources = resolve([*MULTI, "--config", path, script])
    assert config.rdzv_configs == {"join_timeout": 900, "last_call_timeout": 10, "store_type": "tcp"}
    assert str(sources["rendezvous.join_timeout"]) == f"file {path}"

    monkeypatch.setenv("PET_RDZV_CONF", "join_timeout=5")
    config, sources = resolve([*MULTI, "--config", path, script])
    assert config.rdzv_configs == {"join_timeout": "5", "last_call_timeout": 10, "store_type": "tcp"}
    assert str(sources["rendezvous.join_timeout"]) == "env PET_RDZV_CONF"

    config, sources = resolve([*MULTI, "--config", path, "--rdzv-conf", "last_call_timeout=1", script])
    assert config.rdzv_configs == {"join_timeout": 900, "last_call_timeout": "1", "store_type": "tcp"}
    assert str(sources["rendezvous.last_call_timeout"]) == "cli --rdzv-conf"


def test_torch_shutdown_env_sits_between_ours_and_the_file(monkeypatch, write_toml, script):
    path = write_toml("shutdown_timeout = 5")
    assert resolve(["--config", path, script])[0].shutdown_timeout == 5
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "7")
    config, sources = resolve(["--config", path, script])
    assert config.shutdown_timeout == 7 and str(sources["shutdown_timeout"]) == "env TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
    monkeypatch.setenv("FSM_AGENT_SHUTDOWN_TIMEOUT", "9")
    assert resolve(["--config", path, script])[0].shutdown_timeout == 9
    assert resolve(["--config", path, "--shutdown-timeout", "11", script])[0].shutdown_timeout == 11


def test_file_standalone_is_applied_with_torchrun_semantics(write_toml, script):
    path = write_toml('standalone = true\n[rendezvous]\nbackend = "etcd"\nendpoint = "h:1"\n')
    config, _ = resolve(["--config", path, script])
    assert (config.rdzv_backend, config.rdzv_endpoint) == tuple(
        getattr(cli, "STANDALONE_RENDEZVOUS", ("c10d", "localhost:0"))
    )


def test_file_endpoint_turns_off_implicit_standalone(write_toml, script):
    path = write_toml('[rendezvous]\nbackend = "c10d"\nendpoint = "h:29400"\nrun_id = "job"\n')
    config, _ = resolve(["--config", path, script])
    assert (config.rdzv_backend, config.rdzv_endpoint, config.run_id) == ("c10d", "h:29400", "job")


# ------------------------------------------------------------------ env vars: strict, all at once


@pytest.mark.parametrize(
    "name,raw,message",
    [
        ("FSM_AGENT_STANDALONE", "maybe", "FSM_AGENT_STANDALONE='maybe': not a boolean"),
        ("FSM_AGENT_MAX_RESTARTS", "2.7", "FSM_AGENT_MAX_RESTARTS='2.7': not a valid int for --max-restarts"),
        ("FSM_AGENT_NUMA_BINDING", "all", "FSM_AGENT_NUMA_BINDING='all': choose from node, socket"),
        ("FSM_AGENT_STATUS_PORT", "http", "FSM_AGENT_STATUS_PORT='http': expected an integer, got \"http\""),
        ("FSM_AGENT_STATUS_PORT", "70000", "FSM_AGENT_STATUS_PORT='70000': expected a port number 0-65535"),
    ],
)
def test_bad_env_values_name_the_variable(monkeypatch, script, name, raw, message):
    monkeypatch.setenv(name, raw)
    with pytest.raises(ConfigError) as err:
        cli.resolve_run_args([script])
    assert message in str(err.value)


def test_file_and_env_errors_are_reported_together(monkeypatch, write_toml, script):
    path = write_toml('max_restarts = "x"\nrole = 1\n')
    monkeypatch.setenv("PET_MONITOR_INTERVAL", "fast")
    monkeypatch.setenv("FSM_AGENT_STATUS_PORT", "-1")
    with pytest.raises(ConfigError) as err:
        cli.resolve_run_args(["--config", path, script])
    text = str(err.value)
    assert text.startswith(f"{path}: 2 errors: max_restarts: ")
    assert "role: expected a string, got 1" in text
    assert "PET_MONITOR_INTERVAL='fast'" in text and "FSM_AGENT_STATUS_PORT='-1'" in text
    details = err.value.details  # what the CLI prints, one per line
    assert len(details) == 4 and details[0].startswith(f"{path}: max_restarts: ")
    assert details[2].startswith("PET_MONITOR_INTERVAL='fast'") and details[3].startswith("FSM_AGENT_STATUS_PORT='-1'")


def test_fsm_agent_env_wins_over_pet_even_for_flags(monkeypatch):
    monkeypatch.setenv("PET_MAX_RESTARTS", "1")
    monkeypatch.setenv("FSM_AGENT_MAX_RESTARTS", "2")
    parser = cli.get_run_parser()
    assert parser.parse_args(["x.py"]).max_restarts == 2
    assert parser.env_sources["max_restarts"] == "FSM_AGENT_MAX_RESTARTS"
    assert parser.parse_args(["--max-restarts", "3", "x.py"]).max_restarts == 3


def test_help_lists_both_env_vars_and_plugin_flags():
    from fsm_agent.plugins.manager import collect_options, get_plugin_manager

    parser = cli.get_run_parser("fsm-agent run", collect_options(get_plugin_manager(load_entry_points=False)))
    text = " ".join(parser.format_help().split())
    assert "[env FSM_AGENT_MAX_RESTARTS, PET_MAX_RESTARTS]" in text
    assert "--status-port PORT" in text and "[env FSM_AGENT_STATUS_PORT]" in text
    assert "--config FILE" in text
