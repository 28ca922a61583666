"""``fsm-agent status URL``: URL forms, rendering, one-line errors (against a stub endpoint)."""

from __future__ import annotations

import json
import os
import select
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from fsm_agent import cli, status_cli
from fsm_agent.errors import ConfigError

pytestmark = pytest.mark.unit

DOC = {
    "state": "HEALTHY",
    "time_in_state_s": 2.5,
    "state_since": 0,
    "restart_count": 1,
    "max_restarts": 3,
    "remaining_restarts": 2,
    "rendezvous_round": 2,
    "membership": {
        "run_id": "job",
        "role": "default",
        "rdzv_backend": "c10d",
        "rdzv_endpoint": "h:1",
        "min_nodes": 1,
        "max_nodes": 2,
        "local_world_size": 2,
        "group_rank": 0,
        "group_world_size": 1,
        "master_addr": "h",
        "master_port": 1234,
    },
    "workers": [
        {
            "local_rank": 0,
            "global_rank": 0,
            "role_rank": 0,
            "world_size": 2,
            "pid": 4242,
            "state": "running",
            "exit_code": None,
        },
        {
            "local_rank": 1,
            "global_rank": 1,
            "role_rank": 1,
            "world_size": 2,
            "pid": 4343,
            "state": "failed",
            "exit_code": 3,
        },
    ],
    "transitions": [
        {
            "source": "HEALTHY",
            "dest": "STOPPED",
            "trigger": "workers_failed",
            "ts": 1.0e9,
            "restart_count": 1,
            "duration_s": 1.5,
            "error": None,
        }
    ],
    "transitions_total": 3,
    "agent": {"pid": 99, "node": "n", "entrypoint": "train.py", "uptime_s": 9.0},
}


@pytest.fixture
def stub():
    """A loopback HTTP server answering GET /status with ``DOC`` (``stub.body`` overrides)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = server.body if self.path.startswith("/status") else None
            self.send_response(200 if body is not None else 404)
            self.end_headers()
            self.wfile.write((body or "").encode())

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.body = json.dumps(DOC)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    server.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield server
    server.shutdown()
    server.server_close()


def run(capsys, *argv):
    with pytest.raises(SystemExit) as exc:
        cli.main(["status", *argv])
    out, err = capsys.readouterr()
    return exc.value.code, out, err


@pytest.mark.parametrize(
    "given,expected",
    [
        ("8600", "http://127.0.0.1:8600/status"),
        (":8600", "http://127.0.0.1:8600/status"),
        ("127.0.0.1:8600", "http://127.0.0.1:8600/status"),
        ("http://127.0.0.1:8600", "http://127.0.0.1:8600/status"),
        ("http://127.0.0.1:8600/", "http://127.0.0.1:8600/status"),
        ("http://127.0.0.1:8600/status?transitions=5", "http://127.0.0.1:8600/status?transitions=5"),
    ],
)
def test_url_forms(given, expected):
    assert status_cli.status_url(given) == expected


@pytest.mark.parametrize("given", ["https://h:1", "ftp://h", "http://", "h:port"])
def test_bad_urls(given):
    with pytest.raises(ConfigError, match="expected the agent's status URL"):
        status_cli.status_url(given)


def test_prints_state_restarts_and_workers(stub, capsys):
    code, out, err = run(capsys, stub.url)
    assert code == 0 and err == ""
    for text in ("HEALTHY", "1 used, 2 left (max 3)", "4242", "4343", "failed", "workers_failed", "job"):
        assert text in out


def test_json(stub, capsys):
    code, out, _ = run(capsys, stub.url, "--json")
    assert code == 0 and json.loads(out) == DOC


def test_plain_rendering_without_rich():
    text = status_cli.render_plain(DOC, "http://x/status")
    assert "state             HEALTHY for 2.5s" in text
    rows = [line.split() for line in text.splitlines()]
    assert ["1", "1", "1", "4343", "failed", "3"] in rows


def test_the_step_times_are_a_table_with_the_median_and_each_ratio():
    """``step_times`` (plugin ``straggler``): a titled table, the straggler marked; absent: none."""
    doc = {
        **DOC,
        "step_times": {
            "window_s": 1.0,
            "factor": 1.5,
            "windows": 3,
            "median_s": 0.05,
            "stragglers": [],
            "ranks": [
                {
                    "global_rank": 0,
                    "local_rank": 0,
                    "node_rank": 0,
                    "host": "n1",
                    "step_time_s": 0.05,
                    "ratio": 1.0,
                    "straggler": False,
                },
                {
                    "global_rank": 1,
                    "local_rank": 1,
                    "node_rank": 0,
                    "host": "n1",
                    "step_time_s": 0.2,
                    "ratio": 4.0,
                    "straggler": True,
                },
            ],
        },
    }
    text = status_cli.render_plain(doc, "http://x/status")
    assert (
        "step times (job median step time 0.0500s; ratio: each rank's step time to it; straggler above 1.5x "
        "for 3 windows)" in text
    )
    assert text.splitlines()[-1].split() == ["1", "1", "0", "n1", "0.2000s", "-", "4.00x", "yes"]
    assert "step times" not in status_cli.render_plain({**DOC, "step_times": None}, "http://x/status")
    # Lockstep training: equal step times, ratios of compute time, and a column that shows it (#30.9).
    lockstep = {**doc["step_times"], "basis": "compute", "median_s": 0.03}
    lockstep["ranks"] = [{**r, "step_time_s": 0.2, "compute_s": c} for r, c in zip(lockstep["ranks"], (0.03, 0.12))]
    text = status_cli.render_plain({**DOC, "step_times": lockstep}, "http://x/status")
    assert "job median compute time per step 0.0300s; ratio: each rank's compute time per step to it" in text
    assert text.splitlines()[-1].split() == ["1", "1", "0", "n1", "0.2000s", "0.1200s", "4.00x", "yes"]
    pytest.importorskip("rich")
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(status_cli.render_rich(doc, "http://x/status"))
    assert "4.00x" in console.export_text()


def test_the_restart_cycles_are_a_table():
    doc = {
        **DOC,
        "cycles": [
            {
                "attempt": 0,
                "start": 1.0e9,
                "end": 1.0e9 + 5,
                "last_step": 15,
                "checkpoint_step": 10,
                "failure_class": "exit_code",
                "progress": True,
                "no_progress_cycles": 0,
            },
            {
                "attempt": 1,
                "start": 1.0e9 + 6,
                "end": 1.0e9 + 9,
                "last_step": 15,
                "checkpoint_step": 10,
                "failure_class": "exit_code",
                "progress": False,
                "no_progress_cycles": 1,
            },
        ],
    }
    text = status_cli.render_plain(doc, "http://x/status")
    assert "cycles" in text.splitlines()
    rows = [line.split() for line in text.splitlines()]
    assert ["1", rows[-1][1], "15", "10", "exit_code", "no", "1"] == rows[-1]
    assert "cycles" not in status_cli.render_plain(DOC, "http://x/status").splitlines()
    pytest.importorskip("rich")
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(status_cli.render_rich(doc, "http://x/status"))
    assert "restart cycles" in console.export_text()


def test_unreachable_is_one_line(capsys):
    from tests.conftest import free_port

    code, out, err = run(capsys, f"127.0.0.1:{free_port()}")
    assert code == 1 and out == ""
    assert err.startswith("fsm-agent: error: cannot reach http://127.0.0.1:") and err.count("\n") == 1
    assert "--status-port" in err


def test_not_a_status_endpoint(stub, capsys):
    stub.body = "[1, 2]"
    code, _, err = run(capsys, stub.url)
    assert code == 1 and "has no 'state'" in err
    code, _, err = run(capsys, stub.url + "/other")
    assert code == 1 and "HTTP 404" in err


@pytest.mark.parametrize(
    "argv,message",
    [(["--interval", "0", "1"], "expected seconds > 0"), ([], "the following arguments are required: url")],
)
def test_usage_errors(capsys, argv, message):
    code, _, err = run(capsys, *argv)
    assert code == 2 and message in err and err.count("\n") == 1


def test_watch_stops_when_the_agent_goes_away(stub, capsys, monkeypatch):
    calls = []

    def fake_sleep(seconds):
        calls.append(seconds)
        if len(calls) == 2:
            stub.shutdown()
            stub.server_close()

    monkeypatch.setattr(status_cli.time, "sleep", fake_sleep)
    code, out, _ = run(capsys, stub.url, "--watch", "--interval", "0.5", "--json")
    assert code == 0 and calls[:2] == [0.5, 0.5]
    assert out.count('"state": "HEALTHY"') >= 2
    assert "stopped answering; the last state it reported was HEALTHY (the agent ended or died after that" in out


@pytest.mark.slow
def test_watch_into_a_pipe_prints_each_redraw_and_ctrl_c_exits_130(stub, processes):
    """``fsm-agent status URL --watch | tee f``: the tables arrive at each redraw, not when the watch
    ends (rich's live display prints nothing into a pipe); Ctrl-C exits 130, as every command."""
    watch = processes.start("status", stub.url, "--watch", "--interval", "0.2")
    seen, deadline = "", time.monotonic() + 60
    while seen.count("HEALTHY") < 2 and time.monotonic() < deadline and watch.poll() is None:
        if select.select([watch.stdout], [], [], 0.5)[0]:
            seen += os.read(watch.stdout.fileno(), 65536).decode()
    assert seen.count("HEALTHY") >= 2, f"two redraws did not arrive while the watch ran: {seen!r}"
    os.kill(watch.pid, signal.SIGINT)
    _, err = watch.communicate(timeout=60)
    assert watch.returncode == 130 and "Traceback" not in err, err
