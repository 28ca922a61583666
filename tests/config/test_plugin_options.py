"""Plugin options: declared in ``fsm_agent_addoption``, set by flag, env var or ``[plugins.<name>]``,
read back with ``config.plugin_options(name)``."""

from __future__ import annotations

import pytest

from fsm_agent import cli
from fsm_agent.config import OptionRegistry
from fsm_agent.errors import ConfigError, PluginError
from fsm_agent.plugins import hookimpl
from fsm_agent.plugins import manager as manager_module

pytestmark = pytest.mark.unit


class OptionsPlugin:
    """A plugin declaring one option of each type; records what it reads in fsm_agent_configure."""

    def __init__(self, declare=None):
        self.declare = declare
        self.seen = None

    @hookimpl
    def fsm_agent_addoption(self, options):
        if self.declare is not None:
            return self.declare(options)
        options.add("level", type=int, default=1, help="a level")
        options.add("ratio", type=float, default=0.5, help="a ratio")
        options.add("verbose", type=bool, default=False, help="talk more")
        options.add("name", default=None, help="a name", flag="--myplug-nm", env="MYPLUG_NAME")
        options.add("mode", choices=("fast", "slow"), default="fast", help="a mode")

    @hookimpl
    def fsm_agent_configure(self, config, agent):
        self.seen = dict(config.plugin_options("myplug"))


@pytest.fixture
def with_plugin(monkeypatch):
    """Make every plugin manager resolve_run_args builds also hold ``plugin`` under "myplug" (a
    name ``--disable-plugin`` knows, as an installed plugin's)."""

    def install(plugin):
        real = manager_module.get_plugin_manager
        real_names = manager_module.plugin_names

        def get_plugin_manager(disabled=(), load_entry_points=True):
            pm = real(disabled=disabled, load_entry_points=False)
            if not pm.is_blocked("myplug"):
                pm.register(plugin, "myplug")
            return pm

        monkeypatch.setattr(manager_module, "get_plugin_manager", get_plugin_manager)
        monkeypatch.setattr(manager_module, "plugin_names", lambda: sorted({*real_names(), "myplug"}))
        return plugin

    return install


def resolve(*argv: str):
    resolved = cli.resolve_run_args(list(argv))
    return cli.config_from_args(resolved.args)[0], resolved


def test_defaults_flags_env_and_file(with_plugin, monkeypatch, write_toml, script):
    with_plugin(OptionsPlugin())
    config, _ = resolve(script)
    assert dict(config.plugin_options("myplug")) == {
        "level": 1,
        "ratio": 0.5,
        "verbose": False,
        "name": None,
        "mode": "fast",
    }
    path = write_toml('[plugins.myplug]\nlevel = 2\nverbose = true\nname = "file"\n')
    monkeypatch.setenv("FSM_AGENT_MYPLUG_RATIO", "0.25")
    monkeypatch.setenv("MYPLUG_NAME", "env")
    config, resolved = resolve("--config", path, "--myplug-verbose", "false", "--myplug-mode", "slow", script)
    assert dict(config.plugin_options("myplug")) == {
        "level": 2,
        "ratio": 0.25,
        "verbose": False,
        "name": "env",
        "mode": "slow",
    }
    sources = {k: str(v) for k, v in resolved.sources.items() if k.startswith("plugins.myplug.")}
    assert sources == {
        "plugins.myplug.level": f"file {path}",
        "plugins.myplug.ratio": "env FSM_AGENT_MYPLUG_RATIO",
        "plugins.myplug.verbose": "cli --myplug-verbose",
        "plugins.myplug.name": "env MYPLUG_NAME",
        "plugins.myplug.mode": "cli --myplug-mode",
    }


def test_the_plugin_reads_its_values_in_configure(with_plugin, script):
    plugin = with_plugin(OptionsPlugin())
    config, _ = resolve("--myplug-level", "7", script)
    from fsm_agent.testing.scenario import build_agent

    agent = build_agent(plugin_manager=manager_module.get_plugin_manager(), config=config)
    try:
        assert plugin.seen["level"] == 7
    finally:
        agent.close()


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--myplug-level", "2.5"], 'argument --myplug-level/--myplug_level: expected an integer, got "2.5"'),
        (
            ["--myplug-verbose", "maybe"],
            'argument --myplug-verbose/--myplug_verbose: expected true or false, got "maybe"',
        ),
        (
            ["--myplug-mode", "medium"],
            'argument --myplug-mode/--myplug_mode: expected one of "fast", "slow", got "medium"',
        ),
    ],
)
def test_flag_values_are_strict(with_plugin, script, argv, message):
    with_plugin(OptionsPlugin())
    with pytest.raises(ConfigError) as err:
        resolve(*argv, script)
    assert str(err.value) == f"{message} (see fsm-agent run --help)"


def test_env_values_are_strict(with_plugin, monkeypatch, script):
    with_plugin(OptionsPlugin())
    monkeypatch.setenv("FSM_AGENT_MYPLUG_VERBOSE", "nope")
    monkeypatch.setenv("FSM_AGENT_MYPLUG_LEVEL", "1e3")
    with pytest.raises(ConfigError) as err:
        resolve(script)
    assert "FSM_AGENT_MYPLUG_LEVEL='1e3': expected an integer" in str(err.value)
    assert "FSM_AGENT_MYPLUG_VERBOSE='nope': expected true or false" in str(err.value)


def test_unknown_option_in_the_plugins_table(with_plugin, write_toml, script):
    with_plugin(OptionsPlugin())
    path = write_toml("[plugins.myplug]\nlevle = 2\n")
    with pytest.raises(ConfigError, match=r"plugins.myplug.levle: unknown key; did you mean plugins.myplug.level\?"):
        resolve("--config", path, script)


def test_disabling_the_plugin_drops_its_flags_and_table(with_plugin, write_toml, script):
    with_plugin(OptionsPlugin())
    path = write_toml("[plugins.myplug]\nlevel = 'not checked'\n")
    config, _ = resolve("--disable-plugin", "myplug", "--config", path, script)
    assert dict(config.plugin_options("myplug")) == {}


@pytest.mark.parametrize(
    "declare,message",
    [
        (lambda o: o.add("Bad-Name"), "plugin 'myplug' declared option 'Bad-Name': names are snake_case"),
        (lambda o: o.add("x", type=list), "plugin 'myplug' option 'x': type must be str, int, float or bool"),
        (lambda o: o.add("x", flag="-x"), "flag '-x' must start with '--'"),
        (lambda o: (o.add("x"), o.add("x")), "plugin 'myplug' declares key 'plugins.myplug.x', already declared"),
        (
            lambda o: o.add("x", flag="--status-port"),
            "declares flag '--status-port', already declared by plugin 'status-http'",
        ),
        (lambda o: o.add("x", flag="--max-restarts"), "plugin 'myplug' option 'x': argument --max-restarts"),
    ],
)
def test_bad_declarations_are_plugin_errors(with_plugin, script, declare, message):
    with_plugin(OptionsPlugin(declare))
    with pytest.raises(PluginError) as err:
        resolve(script)
    assert message in str(err.value)


def test_registry_defaults_and_lookup():
    options = OptionRegistry()
    options.current_plugin = "a"
    options.add("x", type=int, default=3)
    options.current_plugin = "b-c"
    option = options.add("y_z", type=bool, default=True)
    assert (option.flag, option.env, option.key) == ("--b-c-y-z", "FSM_AGENT_B_C_Y_Z", "plugins.b-c.y_z")
    assert options.plugins() == ["a", "b-c"]
    assert options.defaults() == {"a": {"x": 3}, "b-c": {"y_z": True}}
    assert [o.name for o in options.of("a")] == ["x"]
