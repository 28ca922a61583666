"""``fsm-agent config``: the effective configuration and each value's source; the reference doc."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsm_agent import cli
from tests.helpers.processes import checkout_env, run_fsm_agent

pytestmark = pytest.mark.unit

REPO_ROOT = Path(__file__).resolve().parents[2]
DOC = REPO_ROOT / "docs" / "configuration.md"
#: (backend, endpoint) that --standalone turns the rendezvous into.
STANDALONE = getattr(cli, "STANDALONE_RENDEZVOUS", ("c10d", "localhost:0"))


def run_config(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        cli.main(["config", *argv])
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def test_json_shows_every_key_with_value_and_source(capsys, monkeypatch, write_toml, script):
    path = write_toml(
        'max_restarts = 3\nrole = "file"\n[rendezvous]\njoin_timeout = 900\n[plugins.status-http]\nport = 8600\n'
    )
    monkeypatch.setenv("PET_ROLE", "pet")
    code, out, err = run_config(capsys, "--config", path, "--json", "--nproc-per-node", "2", script)
    assert code == 0 and err == ""
    doc = json.loads(out)
    values = doc["values"]
    assert doc["config_file"] == path
    assert values["nproc_per_node"] == {"value": 2, "source": "cli --nproc-per-node"}
    assert values["max_restarts"] == {"value": 3, "source": f"file {path}"}
    assert values["role"] == {"value": "pet", "source": "env PET_ROLE"}
    assert values["monitor_interval"] == {"value": 0.1, "source": "default"}
    assert values["rendezvous.join_timeout"] == {"value": 900, "source": f"file {path}"}
    assert values["plugins.status-http.port"] == {"value": 8600, "source": f"file {path}"}
    # implicit standalone: the rendezvous settings are derived, not the defaults
    assert values["rendezvous.backend"] == {
        "value": STANDALONE[0],
        "source": "derived implicit --standalone (one node, no endpoint, no --master-port)",
    }


def test_needs_no_script_and_does_not_touch_omp(capsys, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS")
    code, out, err = run_config(capsys, "--nproc-per-node", "4", "--json")
    assert code == 0 and err == ""
    assert json.loads(out)["values"]["nproc_per_node"]["value"] == 4
    import os

    assert "OMP_NUM_THREADS" not in os.environ


def test_table_output(capsys, write_toml):
    path = write_toml("max_restarts = 3\n")
    code, out, _ = run_config(capsys, "--config", path)
    assert code == 0
    assert "max_restarts" in out and "config file:" in out
    row = next(line for line in out.splitlines() if "max_restarts" in line)
    assert "3" in row and "file" in row
    assert "plugins.status-http.port" in out


def test_piped_table_keeps_every_value_whole(tmp_path):
    """``fsm-agent config | grep``: one line per key, no value wrapped mid-token at 80 columns."""
    log_dir = str(tmp_path / ("a-rather-long-directory-name-for-the-logs-of-this-job" * 2))
    done = run_fsm_agent(["config", "--log-dir", log_dir], checkout_env(COLUMNS="80"), tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    (row,) = [line for line in done.stdout.splitlines() if line.startswith("logs.log_dir ")]
    assert row.split() == ["logs.log_dir", log_dir, "cli", "--log-dir"]
    assert any(line.split()[:2] == ["max_restarts", "0"] for line in done.stdout.splitlines())


def test_bad_flag_is_one_line(capsys):
    code, out, err = run_config(capsys, "--nnodes", "3:2")
    assert code == 2 and out == ""
    assert err.startswith("fsm-agent: error: --nnodes '3:2'") and err.count("\n") == 1


#: A multi-node static job (no implicit standalone): the backend is ``static``.
STATIC = ["--nnodes", "2", "--master-port", "29500"]


@pytest.mark.parametrize(
    "where, argv, env, toml",
    [
        ("--rdzv-conf join_timout=5", ["--rdzv-conf", "join_timout=5"], {}, ""),
        ("PET_RDZV_CONF join_timout=5", [], {"PET_RDZV_CONF": "join_timout=5"}, ""),
        ("{path} rendezvous join_timout=5", [], {}, "[rendezvous]\nconf = { join_timout = 5 }\n"),
    ],
)
def test_a_rendezvous_option_no_backend_reads_is_an_error_with_a_suggestion(
    capsys, monkeypatch, write_toml, where, argv, env, toml
):
    """torch ignores ``join_timout=5`` silently (and waits 600 s); the same typo as a typed file key is caught."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = ["--config", write_toml(toml)] if toml else []
    code, out, err = run_config(capsys, *config, "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:1", *argv)
    where = where.format(path=config[1] if toml else "")
    assert (code, out) == (2, "")
    assert err == (
        f"fsm-agent: error: {where}: no loaded rendezvous backend reads 'join_timout'; did you mean join_timeout?\n"
    )


def test_a_rendezvous_option_another_backend_reads_is_a_warning(capsys, caplog, monkeypatch):
    """Job files set PET_RDZV_CONF for several backends: static does not read join_timeout, c10d does."""
    monkeypatch.setenv("PET_RDZV_CONF", "join_timeout=5,timeout=7")
    code, out, err = run_config(capsys, *STATIC, "--json")
    assert code == 0 and err == ""
    assert json.loads(out)["values"]["rendezvous.timeout"]["value"] == "7"
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and warnings[0].startswith(
        "PET_RDZV_CONF join_timeout=5: backend static does not read 'join_timeout' (c10d, "
    ), warnings
    assert warnings[0].endswith(" do); ignored")


def test_an_undeclared_backend_gets_any_rendezvous_option():
    from fsm_agent.errors import ConfigError
    from fsm_agent.plugins.registry import BackendRegistry

    registry = BackendRegistry()
    registry.add_rendezvous("mine", lambda params: None)
    registry.add_rendezvous("static", lambda params: None, conf_keys=("timeout",))
    assert registry.check_rdzv_conf("mine", ["anything"], str) == []
    assert registry.check_rdzv_conf("static", ["timeout"], str) == []
    with pytest.raises(ConfigError, match="x: no loaded rendezvous backend reads 'x'; backend static reads timeout"):
        registry.check_rdzv_conf("static", ["x"], str)


def test_reference_doc_is_up_to_date():
    """docs/configuration.md is ``fsm-agent config --reference``; regenerate it when this fails:
    ``fsm-agent config --reference > docs/configuration.md``."""
    assert DOC.read_text() == cli.configuration_reference()


def test_reference_lists_every_key_and_plugin_option():
    from fsm_agent.config import KEYS

    text = cli.configuration_reference()
    for key in KEYS:
        assert f"| `{key.name}` |" in text, key.key
    assert "| `plugins.status-http.port` | integer | `--status-port` | `FSM_AGENT_STATUS_PORT` |" in text


def test_reference_flag_prints_the_doc(capsys):
    code, out, _ = run_config(capsys, "--reference")
    assert code == 0 and out == cli.configuration_reference()


def test_every_config_key_names_a_real_flag_and_field():
    import attrs

    from fsm_agent.config import KEYS, LaunchConfig

    dests = {a.dest for a in cli.get_run_parser()._actions}
    fields = {f.name for f in attrs.fields(LaunchConfig)}
    for key in KEYS:
        assert key.dest is None or key.dest in dests, key.key
        for field in key.field.split(","):
            assert field.strip() in fields, key.key


def test_every_torchrun_flag_is_a_key_or_per_command():
    """Nothing configurable is left out of the file schema."""
    from fsm_agent.config import CONFIG_DESTS

    per_command = {"help", "module", "no_python", "run_path", "training_script", "training_script_args", "config"}
    dests = {a.dest for a in cli.get_run_parser()._actions}
    assert dests - per_command == set(CONFIG_DESTS)
