"""Real runs scraped over real HTTP while they run; parsed with prometheus_client's own parser."""

from __future__ import annotations

import socket
import sys
import textwrap
import threading
import time
import urllib.request

import pytest

from fsm_agent import LaunchConfig, run_agent

pytestmark = pytest.mark.slow

# Workers run at least 2 s, and until the test has scraped them running (it creates RELEASE_FILE),
# so a slow machine cannot make the test miss the HEALTHY window.
WAIT_FOR_RELEASE = """
    import os, time
    def run_until_released(at_least=2.0, cap=60.0):
        started = time.time()
        while not os.path.exists(os.environ["RELEASE_FILE"]) and time.time() - started < cap:
            time.sleep(0.05)
        time.sleep(max(0.0, at_least - (time.time() - started)))
"""

CRASH_THEN_RUN = (
    WAIT_FOR_RELEASE
    + """
    import sys
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        if os.environ["LOCAL_RANK"] == "1":
            time.sleep(0.5)
            sys.exit(1)          # attempt 0: rank 1 crashes, the agent restarts the group
        time.sleep(60)
    run_until_released()         # attempt 1: both ranks run >= 2 s and succeed
"""
)


def scrape_until_exit(proc, scraper, release, running, interval=0.1, timeout=120):
    """Scrape every ``interval`` s until the agent exits; create ``release`` once ``running(snapshot)``."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        snapshot = scraper.scrape()
        if snapshot is not None and running(snapshot):
            release.touch()
        time.sleep(interval)
    return proc.communicate(timeout=60)


def test_metrics_scraped_during_a_run_with_a_crash_and_a_restart(tmp_path, agents, prom):
    script = tmp_path / "w.py"
    script.write_text(textwrap.dedent(CRASH_THEN_RUN))
    port, release = prom.free_port(), tmp_path / "release"
    scraper = prom.Scraper(f"http://127.0.0.1:{port}/metrics")
    v = prom.value

    def restarted_and_healthy(s) -> bool:
        return (
            v(s, "fsm_agent_worker_group_state", role="trainer", state="HEALTHY") == 1
            and v(s, "fsm_agent_restart_count", role="trainer") == 1
        )

    proc = agents.start(
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--role",
        "trainer",
        str(script),
        env={
            "FSM_AGENT_PROMETHEUS_PORT": str(port),
            "RELEASE_FILE": str(release),
            "FSM_AGENT_PROMETHEUS_LINGER_S": "30",
        },
    )
    out, err = scrape_until_exit(proc, scraper, release, restarted_and_healthy)
    assert proc.returncode == 0, err
    assert f"prometheus metrics at http://127.0.0.1:{port}/metrics" in err
    assert len(scraper.snapshots) >= 10, "too few scrapes during a run of more than 2 s"
    assert all(ct.startswith("text/plain; version=0.0.4") for ct in scraper.content_types)

    # While attempt 1 ran: HEALTHY, one restart used, none left (torch's name and meaning).
    running = [s for s in scraper.snapshots if restarted_and_healthy(s)]
    assert running, "no scrape saw the restarted group HEALTHY"
    assert v(running[-1], "torchelastic_workers_remaining_restarts", role="trainer") == 0
    assert v(running[-1], "fsm_agent_state_duration_seconds_count", role="trainer", state="STOPPED") == 1

    # The last scrape (the exporter lingers for it) has the run's verdict in torch's names.
    final = scraper.snapshots[-1]
    assert v(final, "fsm_agent_worker_group_state", role="trainer", state="SUCCEEDED") == 1
    assert v(final, "fsm_agent_worker_group_state", role="trainer", state="HEALTHY") == 0
    assert v(final, "torchelastic_workers_run_total", role="trainer") == 1
    assert v(final, "torchelastic_workers_run_success_with_retries_total", role="trainer") == 1
    assert v(final, "torchelastic_workers_run_success_no_retries_total", role="trainer") == 0
    assert v(final, "torchelastic_workers_run_failed_with_retries_total", role="trainer") == 0
    assert v(final, "torchelastic_workers_flakiness", role="trainer") == 50.0  # 100 - 100 * (0 + 1) / (1 + 1)
    assert v(final, "torchelastic_workers_state_total", role="trainer", state="HEALTHY") == 2
    assert v(final, "torchelastic_workers_state_total", role="trainer", state="STOPPED") == 1
    assert v(final, "torchelastic_workers_state_total", role="trainer", state="SUCCEEDED") == 1

    # Per-state durations: one INIT, two HEALTHY visits (the second ~2 s), one STOPPED.
    count = {
        st: v(final, "fsm_agent_state_duration_seconds_count", role="trainer", state=st)
        for st in ("INIT", "HEALTHY", "STOPPED")
    }
    assert count == {"INIT": 1, "HEALTHY": 2, "STOPPED": 1}
    assert v(final, "fsm_agent_state_duration_seconds_sum", role="trainer", state="HEALTHY") >= 2.0
    assert v(final, "fsm_agent_state_duration_seconds_bucket", role="trainer", state="HEALTHY", le="+Inf") == 2
    assert (
        v(
            final,
            "fsm_agent_transitions_total",
            role="trainer",
            source="HEALTHY",
            dest="STOPPED",
            trigger="workers_failed",
        )
        == 1
    )
    assert v(final, "fsm_agent_worker_exits_total", role="trainer", exit_code="1") == 1
    assert v(final, "fsm_agent_rendezvous_duration_seconds_count", role="trainer") == 2
    assert v(final, "fsm_agent_group_world_size", role="trainer") == 1
    info = [labels for (name, labels) in final if name == "fsm_agent_info"]
    assert info and dict(info[0])["rdzv_backend"] and dict(info[0])["run_id"]  # --standalone's backend and run id

    # The run is over: nothing listens any more.
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_python_api_run_is_scraped_too(tmp_path, monkeypatch, prom):
    """run_agent in this process; a thread scrapes while the agent runs in the main thread."""
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(WAIT_FOR_RELEASE + "\n    run_until_released()\n"))
    port, release = prom.free_port(), tmp_path / "release"
    monkeypatch.setenv("FSM_AGENT_PROMETHEUS_PORT", str(port))
    monkeypatch.setenv("FSM_AGENT_PROMETHEUS_LINGER_S", "20")
    monkeypatch.setenv("RELEASE_FILE", str(release))
    scraper = prom.Scraper(f"http://127.0.0.1:{port}/metrics")
    done = threading.Event()

    def scrape_loop():
        while not done.is_set():
            snapshot = scraper.scrape()
            if snapshot and prom.value(snapshot, "fsm_agent_worker_group_state", role="default", state="HEALTHY") == 1:
                release.touch()
            time.sleep(0.1)

    thread = threading.Thread(target=scrape_loop, daemon=True)
    thread.start()
    try:
        config = LaunchConfig(
            nproc_per_node=1,
            rdzv_backend="c10d",
            rdzv_endpoint="localhost:0",
            run_id="prom-api",
            log_dir=str(tmp_path / "logs"),
        )
        result = run_agent(config, sys.executable, (str(script),))
    finally:
        done.set()
        thread.join(timeout=10)
    assert result.exit_code == 0
    healthy = [
        s
        for s in scraper.snapshots
        if prom.value(s, "fsm_agent_worker_group_state", role="default", state="HEALTHY") == 1
    ]
    assert healthy, "no scrape while the worker ran"
    final = scraper.snapshots[-1]
    assert prom.value(final, "torchelastic_workers_run_success_no_retries_total", role="default") == 1
    assert prom.value(final, "torchelastic_workers_remaining_restarts", role="default") == 0
    assert prom.value(final, "fsm_agent_state_duration_seconds_sum", role="default", state="HEALTHY") >= 2.0


@pytest.mark.parametrize("given", ["env", "flag", "file"])
def test_a_busy_port_warns_and_the_job_still_runs(tmp_path, agents, prom, given):
    """The port reaches the exporter from the env var, the flag and the config file alike."""
    script = tmp_path / "ok.py"
    script.write_text("print('ok')\n")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        (tmp_path / "fsm.toml").write_text(f"[plugins.prometheus]\nport = {port}\n")
        flags = {"env": [], "flag": ["--prometheus-port", str(port)], "file": ["--config", "fsm.toml"]}[given]
        proc = agents.start(
            "--standalone",
            "--nproc-per-node",
            "1",
            *flags,
            str(script),
            env={"FSM_AGENT_PROMETHEUS_PORT": str(port) if given == "env" else ""},
        )
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert f"prometheus: cannot serve on 127.0.0.1:{port}" in err


def test_off_unless_a_port_is_set(tmp_path, agents):
    script = tmp_path / "ok.py"
    script.write_text("print('ok')\n")
    proc = agents.start("--standalone", "--nproc-per-node", "1", str(script), env={"FSM_AGENT_PROMETHEUS_PORT": ""})
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "prometheus" not in err


def test_endpoint_answers_with_plain_http_get(tmp_path, agents, prom):
    """No client library: a bare GET with the scrape Accept header gets the text format."""
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(WAIT_FOR_RELEASE + "\n    run_until_released(at_least=0)\n"))
    port, release = prom.free_port(), tmp_path / "release"
    proc = agents.start(
        "--standalone",
        "--nproc-per-node",
        "1",
        str(script),
        env={"FSM_AGENT_PROMETHEUS_PORT": str(port), "RELEASE_FILE": str(release)},
    )
    healthy = 'fsm_agent_worker_group_state{role="default",state="HEALTHY"} 1.0'
    histogram = "# TYPE fsm_agent_state_duration_seconds histogram"
    deadline, body = time.monotonic() + 60, ""
    # The state gauge changes with the state, the duration histogram a moment later in the same
    # transition's hooks: a scrape in between sees the one without the other.
    while proc.poll() is None and time.monotonic() < deadline and not (healthy in body and histogram in body):
        try:
            request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Accept": "text/plain"})
            with urllib.request.urlopen(request, timeout=5) as answer:
                body = answer.read().decode()
        except OSError:
            pass
        time.sleep(0.1)
    release.touch()
    proc.communicate(timeout=60)
    assert healthy in body
    assert histogram in body


def test_a_malformed_port_is_a_one_line_error(tmp_path, agents):
    script = tmp_path / "ok.py"
    script.write_text("print('ok')\n")
    proc = agents.start("--standalone", str(script), env={"FSM_AGENT_PROMETHEUS_PORT": "http"})
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert err.strip().splitlines() == [
        "fsm-agent: error: FSM_AGENT_PROMETHEUS_PORT='http': expected an integer, got \"http\""
    ]
