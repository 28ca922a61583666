"""/status during a real run: the right state, pids and restart count; after a worker crash, the restart."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from fsm_agent import cli
from tests.conftest import free_port
from tests.helpers.processes import checkout_env
from tests.status.conftest import get, get_json, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

WORKER = """\
import pathlib, sys, time
stop = pathlib.Path(sys.argv[1])
while not stop.exists():
    time.sleep(0.05)
"""


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def running(url: str, restart_count: int):
    """The /status document once the group is HEALTHY with every worker running, after
    ``restart_count`` restarts; None before."""
    doc = get_json(url)
    workers = doc["workers"]
    if (
        doc["state"] == "HEALTHY"
        and doc["restart_count"] == restart_count
        and len(workers) == 2
        and all(w["state"] == "running" and w["pid"] for w in workers)
    ):
        return doc
    return None


def test_status_during_a_real_run_and_after_a_crash(processes, tmp_path):
    (tmp_path / "worker.py").write_text(WORKER)
    stop = tmp_path / "stop"
    port = free_port()
    agent = processes.start(
        "run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "2",
        "--status-port",
        str(port),
        "--log-dir",
        str(tmp_path / "logs"),
        "worker.py",
        str(stop),
    )
    base = f"http://127.0.0.1:{port}"
    url = base + "/status"

    def running_or_agent_ended(restart_count: int):
        if agent.poll() is not None:  # say why at once instead of waiting out the timeout
            raise AssertionError(f"the agent exited {agent.returncode}: {agent.communicate()[1][-2000:]}")
        return running(url, restart_count)

    # -- first attempt: HEALTHY, two live workers that are the agent's children
    doc = wait_for(lambda: running_or_agent_ended(0), what="HEALTHY with two running workers")
    assert doc["agent"]["pid"] == agent.pid
    assert (doc["max_restarts"], doc["remaining_restarts"], doc["rendezvous_round"]) == (2, 2, 1)
    assert doc["membership"]["group_world_size"] == 1
    assert doc["membership"]["rdzv_backend"] == getattr(cli, "STANDALONE_RENDEZVOUS", ("c10d",))[0]
    endpoint = doc["membership"]["rdzv_endpoint"]  # the free port --standalone bound, not 127.0.0.1:0
    host, rdzv_port = endpoint.rsplit(":", 1)
    assert host == "127.0.0.1" and int(rdzv_port) > 0, endpoint
    socket.create_connection((host, int(rdzv_port)), timeout=5).close()  # the rendezvous store listens there
    pids = [w["pid"] for w in doc["workers"]]
    assert [w["global_rank"] for w in doc["workers"]] == [0, 1]
    for pid in pids:
        process = psutil.Process(pid)
        assert agent.pid in [p.pid for p in process.parents()]
        assert "worker.py" in " ".join(process.cmdline())
    assert [(t["source"], t["dest"]) for t in doc["transitions"]] == [("INIT", "HEALTHY")]
    assert get(base + "/healthz")[0] == 200
    assert get(base + "/statechart")[2].rstrip().endswith("class HEALTHY current")

    # -- fsm-agent status URL shows the same
    shown = subprocess.run(
        [sys.executable, "-m", "fsm_agent", "status", f"127.0.0.1:{port}"],
        capture_output=True,
        text=True,
        timeout=60,
        env=checkout_env(),
    )
    assert shown.returncode == 0, shown.stderr
    assert "HEALTHY" in shown.stdout and "0 used, 2 left (max 2)" in shown.stdout
    assert endpoint in shown.stdout
    assert all(str(pid) in shown.stdout for pid in pids)

    # -- crash rank 1: the agent restarts the group, and /status shows it
    os.kill(pids[1], signal.SIGKILL)
    doc = wait_for(lambda: running(url, 1), what="the restarted group")
    new_pids = [w["pid"] for w in doc["workers"]]
    assert set(new_pids).isdisjoint(pids) and all(alive(pid) for pid in new_pids)
    assert not alive(pids[0]) and not alive(pids[1])
    assert (doc["remaining_restarts"], doc["rendezvous_round"]) == (1, 2)
    assert [(t["source"], t["dest"], t["trigger"]) for t in doc["transitions"]] == [
        ("INIT", "HEALTHY", "start"),
        ("HEALTHY", "STOPPED", "workers_failed"),
        ("STOPPED", "HEALTHY", "restart"),
    ]
    assert doc["transitions"][1]["restart_count"] == 1
    shown = subprocess.run(
        [sys.executable, "-m", "fsm_agent", "status", "--json", base],
        capture_output=True,
        text=True,
        timeout=60,
        env=checkout_env(),
    )
    assert '"restart_count": 1' in shown.stdout

    # -- the workers finish: the agent succeeds and the endpoint goes away with it
    stop.write_text("")
    out, err = agent.communicate(timeout=120)
    assert agent.returncode == 0, err
    assert f"fsm-agent: status at {url}" in err
    with pytest.raises(OSError):
        get(url, timeout=2)


def test_watch_of_a_run_that_succeeds_ends_on_succeeded(processes, tmp_path):
    """Not "stopped answering (last state HEALTHY)": the server waits (bounded) for a watcher to read the end."""
    (tmp_path / "worker.py").write_text(WORKER)
    stop = tmp_path / "stop"
    port = free_port()
    agent = processes.start("run", "--standalone", "--status-port", str(port), "worker.py", str(stop))
    url = f"http://127.0.0.1:{port}/status"
    assert wait_for(lambda: get_json(url)["state"] == "HEALTHY", what="HEALTHY")
    watch = processes.start("status", url, "--watch", "--interval", "1", "--json")
    time.sleep(1.5)  # the watcher has polled at least once
    stop.write_text("")
    agent.communicate(timeout=120)
    out, err = watch.communicate(timeout=60)
    assert agent.returncode == 0 and watch.returncode == 0, err
    assert out.splitlines()[-1] == f"fsm-agent status: {url}: the run ended SUCCEEDED"


def test_status_port_zero_picks_a_free_port_and_prints_it(processes, tmp_path):
    (tmp_path / "worker.py").write_text(WORKER)
    stop = tmp_path / "stop"
    agent = processes.start("run", "--standalone", "--status-port", "0", "worker.py", str(stop))
    line = ""
    deadline = time.monotonic() + 60
    while "status at" not in line and time.monotonic() < deadline:
        line = agent.stderr.readline()
    assert line.startswith("fsm-agent: status at http://127.0.0.1:"), line
    url = line.split()[-1]
    assert wait_for(lambda: get_json(url)["state"] == "HEALTHY", what="HEALTHY")
    stop.write_text("")
    agent.communicate(timeout=120)
    assert agent.returncode == 0


def test_busy_port_is_a_one_line_error(processes, tmp_path):
    (tmp_path / "worker.py").write_text(WORKER)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        agent = processes.start("run", "--standalone", "--status-port", str(port), "worker.py", "x")
        out, err = agent.communicate(timeout=120)
    assert agent.returncode == 2
    assert err.splitlines()[-1].startswith(f"fsm-agent: error: --status-port {port}: cannot listen on ")
    assert "Traceback" not in err


def _stderr_lines(agent) -> list[str]:
    """The agent's stderr lines as a thread reads them (so that a missing line fails, never hangs)."""
    import threading

    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(agent.stderr.readline, "")), daemon=True).start()
    return lines


def _status_lines(agent, lines: list[str], timeout: float = 60.0) -> tuple[str, str]:
    """The ``status at URL`` line among ``lines`` and the line after it ("" when none came in time
    or the agent ended first)."""

    def found():
        at = [i for i, line in enumerate(lines) if "status at" in line]
        if at and len(lines) > at[0] + 1:
            return lines[at[0]].rstrip("\n"), lines[at[0] + 1].rstrip("\n")
        return ("", "") if agent.poll() is not None else None

    try:
        return wait_for(found, timeout=timeout, what="the status lines on stderr")
    except AssertionError:
        at = [line for line in lines if "status at" in line]
        return (at[0].rstrip("\n") if at else "", "")


def _answer(url: str, method: str = "GET", token: str | None = None) -> int:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, data=b"" if method == "POST" else None, method=method)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=5) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.mark.parametrize("open_read", [False, True], ids=["guarded", "open-read"])
def test_a_wildcard_bind_needs_the_token_and_prints_a_usable_address(processes, tmp_path, open_read):
    """``--status-host 0.0.0.0``: not ``http://0.0.0.0:P`` printed but this host's name, with a line
    saying the token is needed and where it is; every request without the token is refused (401),
    with it answered; ``--status-open-read yes`` opens GET, never POST /drain."""
    (tmp_path / "worker.py").write_text(WORKER)
    stop = tmp_path / "stop"
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    agent = processes.start(
        "run",
        "--standalone",
        "--status-port",
        "0",
        "--status-host",
        "0.0.0.0",
        "--status-token-file",
        str(token_file),
        *(["--status-open-read", "yes"] if open_read else []),
        "worker.py",
        str(stop),
    )
    stderr = _stderr_lines(agent)
    line, note = _status_lines(agent, stderr)
    assert line.startswith("fsm-agent: status at http://"), "".join(stderr)
    url = line.split()[-1]
    host, _, port = url.removeprefix("http://").removesuffix("/status").rpartition(":")
    assert host and host not in ("0.0.0.0", "[::]") and int(port) > 0, line
    assert "Authorization: Bearer" in note and str(token_file) in note, note
    local = f"http://127.0.0.1:{port}"  # tests reach it through loopback only
    assert wait_for(lambda: _answer(local + "/healthz", token="s3cret-token") == 200, what="the endpoint")
    assert _answer(local + "/status") == (200 if open_read else 401)
    assert _answer(local + "/status", token="wrong") == (200 if open_read else 401)
    assert _answer(local + "/status", token="s3cret-token") == 200
    assert _answer(local + "/drain", "POST") == 401
    assert _answer(local + "/drain", "POST", token="wrong") == 401
    stop.write_text("")
    assert agent.wait(timeout=120) == 0, "".join(stderr)  # (no drain was taken: a drained run exits 75)
