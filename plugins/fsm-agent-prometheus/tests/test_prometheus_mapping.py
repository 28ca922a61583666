"""The documented name mapping and the option parsing (no server, no agent)."""

from __future__ import annotations

import fsm_agent_prometheus
import pytest
from fsm_agent_prometheus import metric_for, read_options


@pytest.mark.parametrize(
    "group, name, expected",
    [
        (
            "torchelastic",
            "workers.default.remaining_restarts",
            ("gauge", "torchelastic_workers_remaining_restarts", {}),
        ),
        ("torchelastic", "workers.trainer.flakiness", ("gauge", "torchelastic_workers_flakiness", {})),
        ("torchelastic", "workers.default.healthy", ("counter", "torchelastic_workers_state", {"state": "HEALTHY"})),
        ("torchelastic", "workers.default.stopped", ("counter", "torchelastic_workers_state", {"state": "STOPPED"})),
        ("torchelastic", "workers.default.run_total", ("counter", "torchelastic_workers_run", {})),
        (
            "torchelastic",
            "workers.default.run_failed_no_retries",
            ("counter", "torchelastic_workers_run_failed_no_retries", {}),
        ),
        ("torchelastic", "workers.default.something_new", ("gauge", "torchelastic_workers_something_new", {})),
        (
            "torchelastic",
            "SimpleElasticAgent._rendezvous.duration.ms",
            ("gauge", "torchelastic_simpleelasticagent__rendezvous_duration_ms", {}),
        ),
        (
            "fsm_agent",
            "state.HEALTHY.duration_s",
            ("histogram", "fsm_agent_state_duration_seconds", {"state": "HEALTHY"}),
        ),
        ("fsm_agent", "hang.detected", ("gauge", "fsm_agent_hang_detected", {})),
        ("fsm_agent", "step_time.median_s", ("gauge", "fsm_agent_step_time_median_seconds", {})),
        ("fsm_agent", "step_time.3.seconds", ("gauge", "fsm_agent_step_time_seconds", {"global_rank": "3"})),
        ("fsm_agent", "step_time.12.ratio", ("gauge", "fsm_agent_step_time_ratio", {"global_rank": "12"})),
        ("fsm_agent", "stragglers", ("gauge", "fsm_agent_stragglers", {})),
        # drains are counted apart from failures
        ("fsm_agent", "drains", ("counter", "fsm_agent_drains", {})),
        ("torchelastic", "workers.default.run_drained", ("counter", "torchelastic_workers_run_drained", {})),
    ],
)
def test_metric_for(group, name, expected):
    assert metric_for(group, name) == expected


def test_off_by_default_and_when_zero():
    assert read_options({})["port"] == 0
    assert read_options({"FSM_AGENT_PROMETHEUS_PORT": "0"})["port"] == 0
    assert read_options({"FSM_AGENT_PROMETHEUS_PORT": "9464"}) == {"port": 9464, "addr": "127.0.0.1", "linger_s": 0.0}


def test_options_are_flags_env_vars_and_file_keys(tmp_path, monkeypatch):
    """Declared with fsm_agent_addoption: flag > env var > [plugins.prometheus] > default, as fsm-agent config shows."""
    from fsm_agent import cli

    for name in ("PORT", "ADDR", "LINGER_S"):
        monkeypatch.delenv(f"FSM_AGENT_PROMETHEUS_{name}", raising=False)
    monkeypatch.setenv("FSM_AGENT_PROMETHEUS_LINGER_S", "5")
    path = tmp_path / "fsm.toml"
    path.write_text('[plugins.prometheus]\nport = 9100\naddr = "0.0.0.0"\nlinger_s = 1\n')
    resolved = cli.resolve_run_args(
        ["--config", str(path), "--prometheus-port", "9464"], "fsm-agent config", for_config=True
    )
    config, _, _ = cli.config_from_args(resolved.args, set_omp_num_threads=False)
    assert fsm_agent_prometheus.run_options(config) == {"port": 9464, "addr": "0.0.0.0", "linger_s": 5.0}
    sources = {name: str(resolved.sources[f"plugins.prometheus.{name}"]) for name in ("port", "addr", "linger_s")}
    assert sources == {
        "port": "cli --prometheus-port",
        "addr": f"file {path}",
        "linger_s": "env FSM_AGENT_PROMETHEUS_LINGER_S",
    }


def test_a_config_built_in_python_reads_the_environment(monkeypatch):
    from fsm_agent import LaunchConfig

    monkeypatch.setenv("FSM_AGENT_PROMETHEUS_PORT", "9464")
    assert fsm_agent_prometheus.run_options(LaunchConfig())["port"] == 9464
    assert fsm_agent_prometheus.run_options(LaunchConfig(plugins={"prometheus": {"port": 9000}}))["port"] == 9000


@pytest.mark.parametrize(
    "env, message",
    [
        ({"FSM_AGENT_PROMETHEUS_PORT": "http"}, "expected a number"),
        ({"FSM_AGENT_PROMETHEUS_PORT": "70000"}, "must be 0 \\(off\\) or a TCP port"),
        ({"FSM_AGENT_PROMETHEUS_LINGER_S": "-1"}, "must be >= 0 seconds"),
    ],
)
def test_bad_options_name_the_variable(env, message):
    with pytest.raises(ValueError, match=message):
        read_options(env)


def test_importing_the_plugin_does_not_import_prometheus_client_until_needed():
    assert callable(fsm_agent_prometheus.fsm_agent_configure)
    assert fsm_agent_prometheus.PrometheusExporter.__name__ == "PrometheusExporter"
