"""The configuration file: found, read, checked strictly with cattrs, every error at once with its path."""

from __future__ import annotations

import pytest

from fsm_agent import cli
from fsm_agent.config import KEYS, ConfigFile, LaunchConfig, OptionRegistry, find_config_file, load_file_values
from fsm_agent.errors import ConfigError
from tests.helpers.processes import run_cli

pytestmark = pytest.mark.unit


def load(data: dict, options=(), disabled=()):
    return load_file_values(ConfigFile(path="fsm.toml", table=None, data=data), options, disabled)


def errors_of(data: dict, options=()) -> str:
    with pytest.raises(ConfigError) as err:
        load(data, options)
    return str(err.value)


# ------------------------------------------------------------------ the acceptance check


MALFORMED = """\
max_restarts = "three"

[rendezvous]
join_timeout = "abc"

[logs]
colour = true
"""


def test_malformed_file_prints_all_three_errors_with_paths_and_exits_non_zero(tmp_path, write_toml, script):
    path = write_toml(MALFORMED)
    proc = run_cli(["--config", path, script], tmp_path)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert proc.stderr.splitlines() == [  # one line per error, each naming the file and the key
        "fsm-agent: error: 3 errors:",
        f'  {path}: max_restarts: expected an integer >= 0, got "three"',
        f'  {path}: rendezvous.join_timeout: expected seconds > 0, got "abc"',
        f"  {path}: logs.colour: unknown key in [logs] (see docs/configuration.md for the keys)",
    ]


def test_a_key_with_a_control_character_is_quoted_in_its_error_line(write_toml, capsys):
    """A key such as "\\r" is shown as TOML writes it, so the error stays on its own line (found by
    tests/config/test_config_fuzz.py: a raw carriage return split the message in two)."""
    path = write_toml('"\\u000d" = 0\n0 = 0\n')
    with pytest.raises(SystemExit) as exc:
        cli.main(["config", "--config", path])
    assert exc.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "fsm-agent: error: 2 errors:" and len(lines) == 3
    assert any(f'{path}: "\\r": unknown key' in line for line in lines), lines


def test_the_same_errors_from_fsm_agent_config(write_toml, capsys):
    path = write_toml(MALFORMED)
    with pytest.raises(SystemExit) as exc:
        cli.main(["config", "--config", path])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 4 and err.startswith("fsm-agent: error: 3 errors:\n")


# ------------------------------------------------------------------ strict scalars


@pytest.mark.parametrize(
    "data,message",
    [
        ({"standalone": "false"}, 'standalone: expected true or false, got "false"'),
        ({"standalone": 0}, "standalone: expected true or false, got 0"),
        ({"max_restarts": 2.7}, "max_restarts: expected an integer >= 0, got 2.7"),
        ({"max_restarts": True}, "max_restarts: expected an integer >= 0, got true"),
        ({"max_restarts": -1}, "max_restarts: expected an integer >= 0, got -1"),
        ({"monitor_interval": "3"}, 'monitor_interval: expected seconds > 0, got "3"'),
        ({"monitor_interval": 0}, "monitor_interval: expected seconds > 0, got 0"),
        ({"monitor_interval": float("inf")}, "monitor_interval: expected seconds > 0"),
        ({"role": 3}, "role: expected a string, got 3"),
        ({"nnodes": "3:2"}, 'nnodes: expected a node count > 0 or "MIN:MAX" with 0 < MIN <= MAX, got "3:2"'),
        ({"nnodes": 0}, "nnodes: expected a node count > 0"),
        ({"nproc_per_node": "tpu"}, 'nproc_per_node: expected a worker count > 0 or one of "auto"'),
        ({"nproc_per_node": 0}, "nproc_per_node: expected a worker count > 0"),
        ({"start_method": "thread"}, 'start_method: expected one of "spawn", "fork", "forkserver", got "thread"'),
        ({"signals_to_handle": ["SIGKILL"]}, "signals_to_handle: expected signal names"),
        ({"signals_to_handle": "SIGNOPE"}, "'SIGNOPE' is not a signal"),
        ({"disabled_plugins": "a"}, 'disabled_plugins: expected a list of plugin names, got "a"'),
        ({"rendezvous": {"master_port": 70000}}, "rendezvous.master_port: expected a port number 1-65535, got 70000"),
        ({"rendezvous": {"is_host": "yes"}}, 'rendezvous.is_host: expected true or false, got "yes"'),
        ({"rendezvous": {"keep_alive_max_attempt": 1.5}}, "rendezvous.keep_alive_max_attempt: expected an integer > 0"),
        ({"rendezvous": {"conf": {"x": [1]}}}, "rendezvous.conf: expected a table of backend options"),
        ({"rendezvous": {"conf": {"join_timeout": 5}}}, "set 'join_timeout' as rendezvous.join_timeout"),
        ({"logs": {"tee": 4}}, "logs.tee: expected 0 (none), 1 (stdout), 2 (stderr), 3 (both)"),
        ({"logs": {"redirects": "0:4"}}, "logs.redirects: expected 0 (none)"),
        ({"logs": {"local_ranks_filter": [0, -1]}}, "logs.local_ranks_filter: expected a list of local ranks >= 0"),
        ({"logs": {"duplicate_stdout_filters": ["a", 1]}}, "logs.duplicate_stdout_filters: expected a list of strings"),
        ({"rendezvous": "c10d"}, 'rendezvous: expected a table, got "c10d"'),
        ({"plugins": 3}, "plugins: expected a table of plugin tables, got 3"),
    ],
)
def test_values_are_checked_strictly(data, message):
    text = errors_of(data)
    assert text.startswith("fsm.toml: 1 error: ")
    assert message in text


@pytest.mark.parametrize(
    "data,message",
    [
        ({"max_restart": 1}, "max_restart: unknown key; did you mean max_restarts?"),
        ({"join_timeout": 5}, "join_timeout: unknown key at the top level; did you mean rendezvous.join_timeout?"),
        ({"log_dir": "x"}, "log_dir: unknown key at the top level; did you mean logs.log_dir?"),
        ({"rendezvous": {"backnd": "c10d"}}, "rendezvous.backnd: unknown key; did you mean rendezvous.backend?"),
        ({"logs": {"colour": True}}, "logs.colour: unknown key in [logs] (see docs/configuration.md for the keys)"),
        ({"plugins": {"nope": {"x": 1}}}, "plugins.nope: no loaded plugin named 'nope' declares options"),
        (
            {"tool": {"fsm_agent": {"max_restarts": 1}}},
            "tool: unknown key at the top level; a [tool.fsm_agent] table is read from pyproject.toml only",
        ),
    ],
)
def test_unknown_keys_are_errors_with_a_hint(data, message):
    assert message in errors_of(data)


def test_every_error_is_reported_in_one_pass():
    text = errors_of(
        {
            "max_restarts": "x",
            "standalone": "no",
            "bogus": 1,
            "rendezvous": {"join_timeout": 0, "master_port": "29500"},
            "logs": {"tee": 9, "colour": 1},
        }
    )
    assert text.startswith("fsm.toml: 7 errors: ")
    for path in (
        "max_restarts:",
        "standalone:",
        "bogus:",
        "rendezvous.join_timeout:",
        "rendezvous.master_port:",
        "logs.tee:",
        "logs.colour:",
    ):
        assert path in text
    assert "\n" not in text


def test_valid_file_values_are_converted_to_what_the_flags_store():
    got = load(
        {
            "nnodes": 2,
            "nproc_per_node": "auto",
            "max_restarts": 3,
            "monitor_interval": 1,
            "standalone": True,
            "signals_to_handle": ["SIGTERM", "SIGUSR1"],
            "disabled_plugins": ["a", " b "],
            "rendezvous": {
                "backend": "c10d",
                "run_id": "job",
                "join_timeout": 900,
                "is_host": False,
                "conf": {"store_type": "tcp", "n": 2},
                "master_port": 1234,
            },
            "logs": {
                "tee": 3,
                "redirects": "0:1,1:2",
                "local_ranks_filter": [0, 2],
                "duplicate_stdout_filters": ["a,b"],
            },
        }
    ).values
    assert got == {
        "nnodes": "2",
        "nproc_per_node": "auto",
        "max_restarts": 3,
        "monitor_interval": 1,
        "standalone": True,
        "signals_to_handle": "SIGTERM,SIGUSR1",
        "disabled_plugins": ("a", "b"),
        "rendezvous.backend": "c10d",
        "rendezvous.run_id": "job",
        "rendezvous.join_timeout": 900,
        "rendezvous.is_host": False,
        "rendezvous.conf": {"store_type": "tcp", "n": 2},
        "rendezvous.master_port": 1234,
        "logs.tee": "3",
        "logs.redirects": "0:1,1:2",
        "logs.local_ranks_filter": "0,2",
        "logs.duplicate_stdout_filters": ["a,b"],
    }


def test_every_key_loads_its_own_kind_of_value():
    """Each key accepts a value of its documented TOML type (a smoke test of the generated schema)."""
    samples = {
        "integer": 1,
        "number": 1.5,
        "string": "x",
        "boolean": True,
        "array of strings": ["SIGTERM"],
        "array of integers": [0],
        "table": {"k": "v"},
        'integer or "MIN:MAX"': "1:2",
        "integer or string": 1,
    }
    for key in KEYS:
        value = samples[key.kind.toml]
        if key.key in ("start_method", "numa_binding"):
            value = {"start_method": "fork", "numa_binding": "node"}[key.key]
        section, _, name = key.key.rpartition(".")
        data = {section: {name: value}} if section else {name: value}
        assert key.key in load(data).values, key.key


# ------------------------------------------------------------------ plugin tables


def _options() -> OptionRegistry:
    options = OptionRegistry()
    options.current_plugin = "myplug"
    options.add(
        "level",
        type=int,
        default=1,
        check=lambda v: None if v < 10 else (_ for _ in ()).throw(ValueError("expected a level below 10")),
    )
    options.add("verbose", type=bool, default=False)
    options.add("mode", choices=("fast", "slow"), default="fast")
    return options


def test_plugin_tables_are_checked_against_the_declared_options():
    got = load({"plugins": {"myplug": {"level": 3, "verbose": True}}}, _options())
    assert got.plugins == {"myplug": {"level": 3, "verbose": True}}
    text = errors_of(
        {"plugins": {"myplug": {"level": 30, "verbose": "false", "mode": "medium", "extra": 1}}}, _options()
    )
    assert text.startswith("fsm.toml: 4 errors: ")
    assert "plugins.myplug.level: expected a level below 10, got 30" in text
    assert 'plugins.myplug.verbose: expected true or false, got "false"' in text
    assert 'plugins.myplug.mode: expected one of "fast", "slow", got "medium"' in text
    assert "plugins.myplug.extra: unknown key" in text


def test_a_disabled_plugins_table_is_ignored():
    assert load({"plugins": {"myplug": {"level": "x"}}}, _options(), disabled=["myplug"]).plugins == {}


# ------------------------------------------------------------------ finding and reading


def test_pyproject_in_the_current_directory(tmp_path, write_toml):
    write_toml(
        '[project]\nname = "x"\n[tool.fsm_agent]\nmax_restarts = 2\n[tool.fsm_agent.rendezvous]\nbackend = "c10d"\n',
        "pyproject.toml",
    )
    found = find_config_file(None)
    assert found is not None and found.label == "pyproject.toml [tool.fsm_agent]"
    assert load_file_values(found).values == {"max_restarts": 2, "rendezvous.backend": "c10d"}


def test_pyproject_without_our_table_is_not_a_config(write_toml):
    write_toml('[project]\nname = "x"\n', "pyproject.toml")
    assert find_config_file(None) is None


@pytest.mark.parametrize("name", ["fsm-agent", "fsm_agnet", "FSM_Agent", '"fsm.agent"'])
def test_a_misspelled_or_dashed_tool_table_is_an_error(write_toml, name):
    """Silently ignored before: the job ran without its configuration."""
    write_toml(f'[project]\nname = "x"\n[tool.{name}]\nmax_restarts = 2\n', "pyproject.toml")
    with pytest.raises(ConfigError) as err:
        find_config_file(None)
    assert str(err.value) == (
        f"pyproject.toml: [tool.{name.strip(chr(34))}] is not read; fsm-agent's table is "
        f"[tool.fsm_agent] (an underscore, as in the module name): rename it"
    )


def test_other_tools_tables_are_left_alone(write_toml):
    write_toml("[tool.black]\nline-length = 1\n[tool.fsm-agent-prometheus]\nx = 1\n", "pyproject.toml")
    assert find_config_file(None) is None


def test_no_pyproject_no_config():
    assert find_config_file(None) is None


def test_explicit_pyproject_reads_the_tool_table(write_toml, tmp_path):
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "pyproject.toml").write_text("[tool.fsm_agent]\nrole = 'r'\n")
    found = find_config_file(str(sub / "pyproject.toml"))
    assert found.table == "tool.fsm_agent" and found.data == {"role": "r"}


@pytest.mark.parametrize(
    "text,origin,message",
    [
        (None, "--config", "--config {path}: no such file; check the path"),
        ("max_restarts = = 3\n", "--config", "{path}: not valid TOML: "),
    ],
)
def test_unreadable_files_are_one_line(tmp_path, text, origin, message):
    path = tmp_path / "c.toml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError) as err:
        find_config_file(str(path), origin)
    assert str(err.value).startswith(message.format(path=path))
    assert "\n" not in str(err.value)


def test_tool_table_must_be_a_table(write_toml):
    write_toml("[tool]\nfsm_agent = 3\n", "pyproject.toml")
    with pytest.raises(ConfigError, match=r"\[tool.fsm_agent\] must be a table, got 3"):
        find_config_file(None)


def test_bad_toml_via_the_cli_is_one_line(tmp_path, write_toml, script):
    path = write_toml("max_restarts = \n")
    proc = run_cli(["--config", path, script], tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "not valid TOML" in proc.stderr


# ------------------------------------------------------------------ LaunchConfig.plugin_options


def test_plugin_options_are_read_only_and_default_empty():
    config = LaunchConfig(plugins={"p": {"x": 1}})
    assert dict(config.plugin_options("p")) == {"x": 1}
    assert dict(config.plugin_options("other")) == {}
    with pytest.raises(TypeError):
        config.plugin_options("p")["x"] = 2  # type: ignore[index]
