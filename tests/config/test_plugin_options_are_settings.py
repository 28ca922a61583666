"""A plugin's option *is* a ``Setting`` (``fsm_agent.settings.plugin_option``, what ``options.add``
returns): the parser, the environment reader, the file's loader, the merge and the reference read
it with the code that reads fsm-agent's own settings."""

from __future__ import annotations

import pytest

from fsm_agent import cli, config, settings
from fsm_agent.errors import ConfigError
from fsm_agent.plugins.manager import load_plugins
from fsm_agent.run_parser import _spellings

pytestmark = pytest.mark.unit


def demo_options() -> config.OptionRegistry:
    options = config.OptionRegistry(current_plugin="demo")
    options.add("level", type=int, default=1, help="a level")
    options.add("mode", choices=("fast", "slow"), default="fast", help="a mode")
    options.add("name", default=None, help="a name", flag="--demo-nm", env="DEMO_NAME")
    return options


def test_options_add_returns_a_setting():
    level, mode, name = demo_options()
    assert all(isinstance(option, settings.Setting) for option in (level, mode, name))
    assert (level.dest, level.flags, level.envs, level.key, level.field, level.plugin, level.type) == (
        "plugin:demo:level",
        ("--demo-level",),
        ("FSM_AGENT_DEMO_LEVEL",),
        "plugins.demo.level",
        "plugins",
        "demo",
        int,
    )
    assert (level.section, level.name, level.metavar, level.own) == ("plugins.demo", "level", "LEVEL", False)
    assert (name.flag, name.envs) == ("--demo-nm", ("DEMO_NAME",))
    # One check for the three sources: the text of a flag or variable, and the file's typed value.
    assert level.from_string(" 7 ") == 7 and level.kind.structure(7) == 7
    with pytest.raises(settings.Rejected, match='expected one of "fast", "slow", got "medium"'):
        mode.from_string("medium")
    with pytest.raises(settings.Rejected, match='expected one of "fast", "slow", got "medium"'):
        mode.kind.structure("medium")


def test_the_environment_reader_reads_plugin_options_as_any_setting():
    values, sources, errors = settings.read_environment(
        demo_options(), {"FSM_AGENT_DEMO_LEVEL": "3", "DEMO_NAME": "n", "FSM_AGENT_DEMO_MODE": "medium"}
    )
    assert values == {"plugin:demo:level": 3, "plugin:demo:name": "n"}
    assert sources == {"plugin:demo:level": "FSM_AGENT_DEMO_LEVEL", "plugin:demo:name": "DEMO_NAME"}
    assert errors == ['FSM_AGENT_DEMO_MODE=\'medium\': expected one of "fast", "slow", got "medium"']


def test_the_parser_adds_plugin_options_as_settings(monkeypatch):
    """The same function adds every flag: spellings, default, metavar and the variable read in the
    parser's environment pass (a plugin option's help says its plugin and default)."""
    options = load_plugins(load_entry_points=False).options
    parser = cli.get_run_parser(options=options)
    actions = {a.dest: a for a in parser._actions}
    for option in options:
        action = actions[option.dest]
        assert action.option_strings == _spellings(*option.flags), option.key
        assert action.default == option.default and action.metavar == option.metavar, option.key
        assert action.help.startswith(f"{option.plugin}: {option.help}"), option.key
        assert action.help.endswith(f"[env {', '.join(option.envs)}]"), option.key
    monkeypatch.setenv("FSM_AGENT_STATUS_PORT", "8600")
    args = parser.parse_args(["x.py"])
    assert getattr(args, "plugin:status-http:port") == 8600
    assert parser.env_sources == {"plugin:status-http:port": "FSM_AGENT_STATUS_PORT"}


def test_a_bad_variable_is_an_error_even_under_its_flag(monkeypatch, script):
    """A plugin option's variable follows the rule of every variable: a bad value is reported (with
    the file's and the other variables' errors), whichever source wins."""
    monkeypatch.setenv("FSM_AGENT_MAX_RESTARTS", "x")
    monkeypatch.setenv("FSM_AGENT_STATUS_PORT", "abc")
    with pytest.raises(ConfigError) as err:
        cli.resolve_run_args(["--max-restarts", "1", "--status-port", "5", script], load_entry_points=False)
    assert str(err.value) == (
        "FSM_AGENT_MAX_RESTARTS='x': not a valid int for --max-restarts; fix or unset it; "
        "FSM_AGENT_STATUS_PORT='abc': expected an integer, got \"abc\""
    )


def test_the_merge_treats_plugin_options_as_settings(monkeypatch, write_toml, script):
    """flag > variable > file > default, per option, with the sources ``fsm-agent config`` shows."""
    path = write_toml("[plugins.status-http]\nport = 8600\nhost = '127.0.0.2'\n")
    monkeypatch.setenv("FSM_AGENT_STATUS_HOST", "127.0.0.3")
    resolved = cli.resolve_run_args(["--config", path, "--status-token-file", "/t", script], load_entry_points=False)
    config_, _, _ = cli.config_from_args(resolved.args, set_omp_num_threads=False)
    assert dict(config_.plugin_options("status-http")) == {
        "port": 8600,
        "host": "127.0.0.3",
        "token_file": "/t",
        "open_read": False,
    }
    assert {k: str(v) for k, v in resolved.sources.items() if k.startswith("plugins.status-http.")} == {
        "plugins.status-http.port": f"file {path}",
        "plugins.status-http.host": "env FSM_AGENT_STATUS_HOST",
        "plugins.status-http.token_file": "cli --status-token-file",
        "plugins.status-http.open_read": "default",
    }
