"""One configuration schema: every setting is declared once (``fsm_agent.settings.SETTINGS``) and the
parser, the environment reader, the file's keys and the reference are built from that declaration;
backend-specific rules are what the backend declares in the registry."""

from __future__ import annotations

import sys
import types

import pytest

from fsm_agent import cli, config, settings
from fsm_agent.errors import ConfigError, PluginError
from fsm_agent.plugins.registry import BackendRegistry
from fsm_agent.run_parser import _spellings

pytestmark = pytest.mark.unit

POSITIONALS = {"help", "training_script", "training_script_args"}


def test_the_parser_is_the_settings():
    """Every flag of ``fsm-agent run`` is one Setting: its spellings, default, choices, metavar and help
    (with the variables it reads) come from the declaration, and there is no flag besides them."""
    actions = {a.dest: a for a in cli.get_run_parser()._actions}
    assert set(actions) - POSITIONALS == set(settings.BY_DEST)
    for dest, setting in settings.BY_DEST.items():
        action = actions[dest]
        assert action.option_strings == _spellings(*setting.flags), dest
        assert action.default == setting.default, dest
        assert tuple(action.choices or ()) == tuple(setting.choices or ()), dest
        prefix = "fsm-agent: " if setting.own else ""
        assert action.help == f"{prefix}{setting.help} [env {', '.join(setting.envs)}]", dest
        assert cli.env_vars(action) == list(setting.envs), dest


def test_the_file_keys_are_the_settings_keys():
    """The TOML loader's keys are the settings' (one lookup by key), each with a kind and a field."""
    assert config.KEYS is settings.KEYS
    assert [s.key for s in settings.KEYS] == list(settings.BY_KEY)
    for setting in settings.KEYS:
        assert setting.kind is not None and setting.field, setting.key
        assert (setting.dest is None) == (
            setting.section == "rendezvous" and setting.name in settings.RENDEZVOUS_OPTIONS
        )


def test_variables_follow_the_declaration():
    """A file key reads FSM_AGENT_<DEST> before torchrun's PET_<DEST>; fsm-agent's own flag its one
    variable; torchrun's plain flags (no PET_ variable in torch) only FSM_AGENT_<DEST>."""
    assert settings.BY_DEST["nnodes"].envs == ("FSM_AGENT_NNODES", "PET_NNODES")
    assert settings.BY_DEST["module"].envs == ("PET_MODULE",)
    assert settings.BY_DEST["logs_specs"].envs == ("FSM_AGENT_LOGS_SPECS",)
    assert settings.BY_DEST["disabled_plugins"].envs == ("FSM_AGENT_DISABLE_PLUGINS",)
    assert settings.BY_DEST["shutdown_timeout"].fallback_env == "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"


def test_the_environment_reader_checks_like_the_flag_and_names_the_variable():
    chosen = [settings.BY_DEST[d] for d in ("nnodes", "standalone", "start_method", "max_restarts", "rdzv_id")]
    values, sources, errors = settings.read_environment(
        chosen,
        {
            "FSM_AGENT_NNODES": "1:2",
            "PET_NNODES": "garbage",  # the first set variable wins, unchecked the rest
            "PET_STANDALONE": "yes",
            "PET_START_METHOD": "thread",
            "PET_MAX_RESTARTS": "three",
            "PET_RDZV_ID": "",
        },
    )
    assert values == {"nnodes": "1:2", "standalone": True}
    assert sources == {"nnodes": "FSM_AGENT_NNODES", "standalone": "PET_STANDALONE"}
    assert errors == [
        "PET_START_METHOD='thread': choose from spawn, fork, forkserver",
        "PET_MAX_RESTARTS='three': not a valid int for --max-restarts; fix or unset it",
    ]
    _, _, errors = settings.read_environment([settings.BY_DEST["nnodes"]], {"PET_NNODES": "0"})
    assert errors == ["PET_NNODES='0': node counts must be > 0 (e.g. --nnodes 1 or --nnodes 1:4)"]


def test_plugin_options_share_the_kinds_and_the_boolean_words():
    options = config.OptionRegistry(current_plugin="demo")
    flag = options.add("verbose", type=bool, default=False)
    assert flag.kind is settings.BOOL
    for word in settings.TRUE_WORDS:
        assert flag.from_string(word.upper()) is True
    for word in settings.FALSE_WORDS:
        assert flag.from_string(f" {word} ") is False
    with pytest.raises(ValueError, match='expected true or false, got "maybe"'):
        flag.from_string("maybe")


def _registry(**declared) -> BackendRegistry:
    registry = BackendRegistry()
    registry.add_rendezvous("mine", lambda params: None, **declared)
    return registry


def _config(registry, *argv):
    args = cli.get_run_parser().parse_args(["--rdzv-backend", "mine", "--nnodes", "2", *argv, sys.executable])
    return cli.config_from_args(args, set_omp_num_threads=False, registry=registry)[0]


def test_a_backend_declares_what_it_does_with_the_node_rank():
    """``node_rank="rank"``: this node's rank, checked within --nnodes and passed as the rank option
    (torch's static backend); ``"hint"`` or undeclared: not checked, not passed."""
    assert _config(_registry(node_rank="rank"), "--node-rank", "1").rdzv_configs == {"rank": 1}
    with pytest.raises(ConfigError, match=r"--node-rank 2: with --nnodes 2 the node ranks are 0\.\.1"):
        _config(_registry(node_rank="rank"), "--node-rank", "2")
    assert _config(_registry(node_rank="hint"), "--node-rank", "5").rdzv_configs == {}
    assert _config(_registry(), "--node-rank", "5").rdzv_configs == {}
    with pytest.raises(PluginError, match="node_rank='first'"):
        _registry(node_rank="first")


def test_a_backend_declares_a_host_port_endpoint():
    """Only a backend that reads its endpoint with torch's ``parse_rendezvous_endpoint`` gets the
    early check of the port."""
    with pytest.raises(ConfigError, match="the port 'abc' is not a TCP port"):
        _config(_registry(host_port_endpoint=True), "--rdzv-endpoint", "node0:abc")
    assert _config(_registry(), "--rdzv-endpoint", "node0:abc").rdzv_endpoint == "node0:abc"


def test_the_builtin_backends_declare_their_rules():
    from fsm_agent.plugins.manager import build_registry, get_plugin_manager

    registry = build_registry(get_plugin_manager(load_entry_points=False))
    assert registry.node_rank_backends() == ["fsm", "static"]
    assert (registry.node_rank_use("static"), registry.node_rank_use("fsm")) == ("rank", "hint")
    assert [n for n in ("c10d", "fsm", "static") if registry.host_port_endpoint(n)] == ["c10d", "static"]


def test_the_cli_hands_its_plugin_manager_down(monkeypatch, script):
    """``fsm-agent run`` loads the plugins once (to read their options) and gives that manager to
    the launch, which then loads none of its own."""
    from fsm_agent.plugins import manager

    built = []
    real = manager.get_plugin_manager

    def counting(*args, **kwargs):
        built.append(real(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(manager, "get_plugin_manager", counting)
    calls = []
    fake = types.SimpleNamespace(
        run_agent=lambda config, entrypoint, args, plugins=None: (
            calls.append(plugins.pm) or types.SimpleNamespace(exit_code=0)
        )
    )
    monkeypatch.setitem(sys.modules, "fsm_agent.launch", fake)
    assert cli.run_command([script]) == 0
    assert len(built) == 1 and calls == [built[0]]


def test_a_value_shown_in_an_error_stays_on_one_line():
    """NEL and the Unicode line and paragraph separators (json leaves them as they are) are
    escaped: an error naming a key ``"\\x85"`` is still one line (found by the file fuzzer)."""
    from fsm_agent.settings import show

    shown = show({"\x85": 0, "a\u2028b\u2029": [1]})
    assert len(shown.splitlines()) == 1 and shown == '{"\\u0085": 0, "a\\u2028b\\u2029": [1]}'
