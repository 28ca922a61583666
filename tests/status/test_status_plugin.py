"""The status-http plugin: option, hooks -> /status, /statechart, /healthz, shutdown. Fake runs, real HTTP."""

from __future__ import annotations

import json
import socket

import pytest

from fsm_agent.config import LaunchConfig
from fsm_agent.errors import ConfigError
from fsm_agent.plugins import hookimpl, status_http
from fsm_agent.testing.fakes import FakeLauncher
from tests.status.conftest import get, get_json

pytestmark = pytest.mark.unit

STATUS_CONFIG = LaunchConfig(plugins={"status-http": {"port": 0}})


class Probe:
    """After every transition (after the status plugin has seen it), GET /status over HTTP."""

    def __init__(self):
        self.agent = None
        self.snapshots: list[dict] = []

    @hookimpl
    def fsm_agent_configure(self, config, agent):
        self.agent = agent

    @hookimpl(trylast=True)
    def fsm_agent_state_changed(self, transition):
        server = self.agent.plugin_manager.get_plugin("status-http-server")
        self.snapshots.append(get_json(server.url + "/status?transitions=100"))


def server_of(agent) -> status_http.LiveStatus:
    return agent.plugin_manager.get_plugin("status-http-server")


@pytest.mark.parametrize("config", [LaunchConfig(), None, LaunchConfig(plugins={"status-http": {"port": None}})])
def test_off_unless_a_port_is_configured(make_agent, config):
    assert server_of(make_agent(config=config)) is None


def test_status_follows_a_run_with_a_restart(make_agent):
    probe = Probe()
    agent = make_agent(launcher=FakeLauncher([{1: 3}, "all_ok"]), max_restarts=2, config=STATUS_CONFIG, plugins=[probe])
    status = server_of(agent)
    before = get_json(status.url + "/status")
    assert before["state"] == "INIT" and before["workers"] == [] and before["rendezvous_round"] == 0

    result = agent.run()
    assert result.exit_code == 0

    states = [(s["state"], s["restart_count"], s["remaining_restarts"], s["rendezvous_round"]) for s in probe.snapshots]
    assert states == [("HEALTHY", 0, 2, 1), ("STOPPED", 1, 1, 1), ("HEALTHY", 1, 1, 2), ("SUCCEEDED", 1, 1, 2)]
    first_healthy, stopped, second_healthy, done = probe.snapshots
    started = agent._launcher.started
    assert [w["pid"] for w in first_healthy["workers"]] == [started[0].pids[r] for r in (0, 1)]
    assert [w["state"] for w in first_healthy["workers"]] == ["running", "running"]
    assert [(w["state"], w["exit_code"]) for w in stopped["workers"]] == [("stopped", None), ("failed", 3)]
    assert [w["pid"] for w in second_healthy["workers"]] == [started[1].pids[r] for r in (0, 1)]
    assert [(w["state"], w["exit_code"]) for w in done["workers"]] == [("succeeded", 0), ("succeeded", 0)]
    assert [(t["source"], t["dest"], t["trigger"]) for t in done["transitions"]] == [
        ("INIT", "HEALTHY", "start"),
        ("HEALTHY", "STOPPED", "workers_failed"),
        ("STOPPED", "HEALTHY", "restart"),
        ("HEALTHY", "SUCCEEDED", "workers_succeeded"),
    ]
    assert done["transitions_total"] == 4
    assert done["membership"]["group_rank"] == 0 and done["membership"]["group_world_size"] == 1
    assert done["membership"]["local_world_size"] == 2
    assert done["max_restarts"] == 2 and done["time_in_state_s"] >= 0

    # fsm_agent_unconfigure shut the server down: nothing listens any more
    host, port = status.url.removeprefix("http://").split(":")
    with pytest.raises(OSError), socket.create_connection((host, int(port)), timeout=2):
        pass


def test_the_rendezvous_endpoint_is_the_bound_one(make_agent):
    """A standalone agent's rendezvous (backend fsm on 127.0.0.1:0) binds a free port for its store:
    /status shows that port, not port 0."""
    from fsm_agent.plugins.rendezvous_fsm import FsmRendezvousParameters, create_fsm_handler

    handler = create_fsm_handler(
        FsmRendezvousParameters(backend="fsm", endpoint="127.0.0.1:0", run_id="job", min_nodes=1, max_nodes=1)
    )
    probe = Probe()
    try:
        agent = make_agent(rendezvous=handler, config=STATUS_CONFIG, plugins=[probe])
        assert agent.run().exit_code == 0
    finally:
        handler.shutdown()  # its store server (the agent shut it down already if it ran)
    healthy = probe.snapshots[0]
    assert healthy["state"] == "HEALTHY" and healthy["membership"]["rdzv_backend"] == "fsm"
    assert healthy["membership"]["rdzv_endpoint"] == f"127.0.0.1:{handler.port}" and handler.port > 0


def test_a_handler_without_an_endpoint_shows_the_configured_one(make_agent):
    agent = make_agent(config=STATUS_CONFIG)  # FakeRendezvous: no endpoint of its own
    status = server_of(agent)
    try:
        assert get_json(status.url + "/status")["membership"]["rdzv_endpoint"] == agent.spec.rendezvous.endpoint
    finally:
        status.close()  # the factory releases the agent, which never ran


def test_paths(make_agent):
    agent = make_agent(launcher=FakeLauncher(["never"]), config=STATUS_CONFIG)
    status = server_of(agent)
    try:
        assert get(status.url + "/healthz") == (200, "text/plain; charset=utf-8", "ok\n")
        code, content_type, body = get(status.url + "/statechart")
        assert (code, content_type) == (200, "text/plain; charset=utf-8")
        assert "stateDiagram-v2" in body and "INIT --> HEALTHY: start" in body
        assert body.rstrip().endswith("class INIT current")
        assert "classDef current" in body
        code, _, body = get(status.url + "/nope")
        assert code == 404 and json.loads(body)["paths"] == ["/status", "/statechart", "/healthz"]
        code, _, body = get(status.url + "/status?transitions=x")
        assert code == 400
        assert get_json(status.url + "/status?transitions=0")["transitions"] == []
    finally:
        status.close()  # the factory releases the agent, which never ran


def test_statechart_highlights_the_current_state(make_agent):
    agent = make_agent(config=STATUS_CONFIG)
    status = server_of(agent)
    try:
        status._state = "STOPPED"
        chart = status.statechart()
        assert chart.endswith("  class STOPPED current\n")
        assert [line for line in chart.splitlines() if line.startswith("  class ")] == ["  class STOPPED current"]
    finally:
        status.close()  # the factory releases the agent, which never ran


def test_port_in_use_is_a_config_error(make_agent):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"--status-port {port}: cannot listen on 127.0.0.1:{port}: "):
            make_agent(config=LaunchConfig(plugins={"status-http": {"port": port}}))


def test_binds_loopback_only(make_agent):
    agent = make_agent(config=STATUS_CONFIG)
    status = server_of(agent)
    try:
        assert status._server.server_address[0] == "127.0.0.1"
        assert status._thread.daemon
    finally:
        status.close()  # the factory releases the agent, which never ran


def test_the_option_is_declared():
    from fsm_agent.plugins.manager import collect_options, get_plugin_manager

    option, *others = collect_options(get_plugin_manager(load_entry_points=False)).of("status-http")
    assert [o.name for o in others] == ["host", "token_file", "open_read"]
    open_read = others[-1]
    assert (open_read.flag, open_read.env, open_read.default) == (
        "--status-open-read",
        "FSM_AGENT_STATUS_OPEN_READ",
        False,
    )
    assert open_read.from_string("yes") is True and open_read.from_string("0") is False
    assert (option.name, option.flag, option.env, option.default) == (
        "port",
        "--status-port",
        "FSM_AGENT_STATUS_PORT",
        None,
    )
    assert option.from_string("0") == 0
    with pytest.raises(ValueError, match="expected a port number 0-65535"):
        option.from_string("65536")


def test_highlighted_chart_parses_with_mermaid(make_agent):
    """The highlighted chart (and the table fallback) are valid Mermaid, checked by Mermaid's own
    parser (``tests/states/mermaid_parse.mjs``; skipped when it is not installed)."""
    import os
    import shutil
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    prefix = Path(os.environ.get("MERMAID_NODE_PREFIX", root / ".ci" / "node"))
    node = shutil.which("node")
    if node is None or not (prefix / "node_modules" / "mermaid" / "package.json").exists():
        pytest.skip("Mermaid parser not installed: run .ci/install-mermaid.sh")
    agent = make_agent(config=STATUS_CONFIG)
    status = server_of(agent)
    try:
        texts = {"highlighted": status.statechart()}
    finally:
        status.close()
    proc = subprocess.run(
        [node, str(root / "tests" / "states" / "mermaid_parse.mjs"), "--batch"],
        input=json.dumps(texts),
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MERMAID_NODE_PREFIX": str(prefix)},
    )
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout)
    assert results["highlighted"] == {"diagramType": "stateDiagram"}


def test_status_shows_the_restart_cycles(make_agent):
    agent = make_agent(launcher=FakeLauncher([{1: 3}, "all_ok"]), max_restarts=2, config=STATUS_CONFIG)
    status = server_of(agent)
    snapshots = []

    class AfterEachCycle:
        @hookimpl(trylast=True)
        def fsm_agent_state_changed(self, transition):
            snapshots.append(get_json(status.url + "/status")["cycles"])

    agent.plugin_manager.register(AfterEachCycle())
    assert agent.run().exit_code == 0
    last = snapshots[-1]
    assert [(c["attempt"], c["failure_class"], c["last_step"], c["checkpoint_step"]) for c in last] == [
        (0, "exit_code", None, None),
        (1, None, None, None),
    ]
    assert snapshots[0] == [] and len(snapshots[1]) == 1 and last[0]["start"] <= last[0]["end"]


def test_post_drain_rules_and_the_drain_in_status(make_agent, tmp_path):
    """Who may drain (a loopback client; another only with the token), and that ``/status``
    shows the drain apart from the restarts."""
    from fsm_agent.plugins.status_http import LiveStatus
    from fsm_agent.status_cli import summary_rows

    agent = make_agent()
    tokenless, guarded = LiveStatus(agent), LiveStatus(agent, token="s3cret")
    assert tokenless.drain(None, "10.0.0.7", "Bearer s3cret")[0] == 403
    assert guarded.drain(None, "10.0.0.7", None)[0] == 401
    assert guarded.drain(None, "10.0.0.7", "Bearer wrong")[0] == 401
    assert guarded.drain("rack", "127.0.0.1", None)[0] == 400
    assert agent.drain_request is None  # nothing refused was taken
    code, doc = guarded.drain("job", "::ffff:127.0.0.1", None)  # loopback, whatever the token
    assert code == 202 and doc["drain"] == {"scope": "job", "source": "http", "by": "::ffff:127.0.0.1"}
    assert tokenless.drain(None, "127.0.0.1", None)[0] == 409  # one drain at a time
    snapshot = guarded.snapshot()
    assert snapshot["drain"]["scope"] == "job" and snapshot["restart_count"] == 0
    assert ("drain", "job scope, requested by http ::ffff:127.0.0.1") in summary_rows(snapshot)


def test_a_failed_job_shows_its_verdict(make_agent):
    """The job's verdict (root cause first, the collateral ranks counted) is in /status once the
    job failed, and in `fsm-agent status`'s summary."""
    from fsm_agent.status_cli import summary_rows

    probe = Probe()
    agent = make_agent(launcher=FakeLauncher([{1: 3}]), max_restarts=0, config=STATUS_CONFIG, plugins=[probe])
    result = agent.run()
    assert result.exit_code == 3
    failed = probe.snapshots[-1]
    assert failed["state"] == "FAILED"
    verdict = failed["verdict"]
    assert verdict["root_causes"] == [1] and verdict["exit_code"] == 3 and verdict["classes"] == {"1": "root_cause"}
    assert "reports" not in verdict  # those are in the events file
    label, text = summary_rows(failed)[0]
    assert label == "verdict" and text.startswith("rank 1") and "exit code 3" in text
    assert probe.snapshots[0]["verdict"] is None  # none while the job runs
