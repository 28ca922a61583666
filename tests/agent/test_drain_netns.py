"""Drain across namespaced hosts (tests/netns.py): a one-node drain the others
survive without a counted restart, a job-wide drain, and every request refused without the
token on a non-loopback address (``--status-open-read``: GET excepted, never ``POST /drain``).

The workers use no torch: each records its start (with its world size) and, on the checkpoint
signal (SIGUSR1), writes a checkpoint record and exits 0; one in the final world exits 0 at once.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from fsm_agent.worker import DRAIN_EXIT_CODE
from tests.netns import NetnsHosts

pytestmark = pytest.mark.multihost

#: argv: OUT_DIR HOST FINAL_WORLD (as the conftest's WORKER).
WORKER = r"""
import glob, json, os, signal, sys, time
out, host, final = sys.argv[1], sys.argv[2], int(sys.argv[3])
world = int(os.environ["WORLD_SIZE"])

def dump(kind, **record):
    record.update(host=host, pid=os.getpid(), world=world, restart_count=int(os.environ["TORCHELASTIC_RESTART_COUNT"]))
    path = os.path.join(out, "%s_%s_%d_%d.json" % (kind, host, world, os.getpid()))
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)

def checkpoint(signum, frame):
    dump("ckpt", signal=signum)
    sys.exit(0)

signal.signal(signal.SIGUSR1, checkpoint)
dump("start")
# With this mark, a worker fails once another host's worker checkpointed (as a collective with the
# departed node would break), and one in the final world finishes only after that (a round that
# formed early, without every host, waits for the next).
fail_on_peer = os.path.exists(os.path.join(out, "fail_on_peer_checkpoint"))

def peer_checkpointed():
    return [p for p in glob.glob(os.path.join(out, "ckpt_*.json")) if "_%s_" % host not in os.path.basename(p)]

while True:
    if world == final and (not fail_on_peer or peer_checkpointed()):
        sys.exit(0)
    if world != final and fail_on_peer and peer_checkpointed():
        dump("peer_gone")
        sys.exit(1)
    time.sleep(0.05)
"""
#: Generous bounds for a loaded 2-core machine.
JOB_TIMEOUT_S = 240
STATUS_PORT = 8080  # a fresh namespace: nothing else can hold it
C10D_CONF = "join_timeout=120,read_timeout=120,last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=5"

#: Run inside a namespace: POST (or GET) URL with an optional bearer token; prints the HTTP code.
CLIENT = r"""
import sys, urllib.error, urllib.request
url, method, token = sys.argv[1], sys.argv[2], sys.argv[3]
request = urllib.request.Request(url, data=b"" if method == "POST" else None, method=method)
if token:
    request.add_header("Authorization", "Bearer " + token)
try:
    with urllib.request.urlopen(request, timeout=30) as reply:
        print(reply.status)
except urllib.error.HTTPError as exc:
    print(exc.code)
"""


def _use_worker(hosts: NetnsHosts) -> None:
    hosts.script.write_text(textwrap.dedent(WORKER))


def _request(hosts: NetnsHosts, host: int, url: str, method: str = "POST", token: str = "") -> int:
    """The HTTP code of ``method url`` sent from inside host ``host``'s namespace."""
    done = subprocess.run(
        ["ip", "netns", "exec", hosts.names[host], sys.executable, "-c", CLIENT, url, method, token],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip())


def _hosts_with(hosts: NetnsHosts, kind: str, world: int) -> set[str]:
    return {r["host"] for r in hosts.records(kind) if r["world"] == world}


def _c10d_flags(hosts: NetnsHosts, i: int, nnodes: str, run_id: str) -> list[str]:
    return [
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        hosts.endpoint(),
        "--rdzv-id",
        run_id,
        "--monitor-interval",
        "0.1",
        "--max-restarts",
        "0",
        "--rdzv-conf",
        f"is_host={1 if i == 0 else 0},{C10D_CONF}",
    ]


def _drain_record(agent) -> dict:
    (drain,) = [e for e in agent.events_list() if e["kind"] == "drain"]
    return drain


def test_one_node_drain_the_others_survive_without_a_counted_restart(netns_hosts):
    """c10d, ``--nnodes 2:3``, ``--max-restarts 0``: host 2 is drained by SIGUSR2. Its worker
    checkpoints, its agent exits 75; the workers of hosts 0 and 1 fail as soon as it checkpointed
    (as a broken collective would), yet their agents count no failure: host 2 announced its leaving
    in the rendezvous store first. They re-rendezvous as 2 (``node_lost``, not counted) and finish."""
    hosts = netns_hosts
    _use_worker(hosts)
    (hosts.out / "fail_on_peer_checkpoint").write_text("")
    agents = [
        hosts.start_agent(
            i,
            *_c10d_flags(hosts, i, "2:3", "netns-drain-node"),
            *(["--drain-signals", "SIGUSR2"] if i == 2 else []),
            final_world=2,
        )
        for i in range(3)
    ]
    hosts.wait_for(
        lambda: _hosts_with(hosts, "start", 3) == {"h0", "h1", "h2"},
        JOB_TIMEOUT_S,
        "three hosts' workers in a world of 3",
        expect_running=agents,
    )
    victim, survivors = agents[2], agents[:2]
    victim.proc.send_signal(signal.SIGUSR2)
    assert victim.wait(JOB_TIMEOUT_S) == DRAIN_EXIT_CODE, hosts.diagnostics()
    assert _hosts_with(hosts, "ckpt", 3) == {"h2"}  # the drained node's worker checkpointed
    drain = _drain_record(victim)
    assert (drain["scope"], drain["source"], drain["checkpointed"]) == ("node", "signal", True), drain
    for agent in survivors:
        assert agent.wait(JOB_TIMEOUT_S) == 0, hosts.diagnostics()
    assert _hosts_with(hosts, "start", 2) == {"h0", "h1"}
    assert _hosts_with(hosts, "peer_gone", 3) <= {"h0", "h1"}  # (a worker may be stopped before it sees it)
    seen = {
        a.name: "failed workers after the announced drain"
        if "after a peer left the job by a drain" in a.stderr.read_text()
        else "membership check"
        for a in survivors
    }
    print(f"\nhow the survivors saw host 2 leave: {seen}")
    for agent in survivors:
        # (a first round may have formed before host 2 joined: one more membership change, not counted either)
        triggers = [t for _, _, t in agent.transitions()]
        assert triggers[-3:] == ["membership_changed", "restart", "workers_succeeded"], agent.output()
        assert set(triggers) == {"start", "membership_changed", "restart", "workers_succeeded"}, agent.output()
        changes = [e for e in agent.events_list() if e["kind"] == "transition" and e["trigger"] == "membership_changed"]
        assert changes[-1].get("failure_class") == "node_lost", changes
        assert all(e["restart_count"] == 0 for e in agent.events_list()), agent.output()  # nothing counted
        assert not [e for e in agent.events_list() if e["kind"] == "drain"]


def test_job_wide_drain_stops_every_node_in_order(netns_hosts):
    """c10d, 2 nodes: ``POST /drain?scope=job`` on host 0 (from its loopback): both workers
    checkpoint, both agents exit 75; host 1 learnt it from the rendezvous store (source ``peer``)."""
    hosts = netns_hosts
    _use_worker(hosts)
    agents = [
        hosts.start_agent(
            i,
            *_c10d_flags(hosts, i, "2", "netns-drain-job"),
            *(["--status-port", str(STATUS_PORT)] if i == 0 else []),
            final_world=99,
        )
        for i in range(2)
    ]
    hosts.wait_for(
        lambda: _hosts_with(hosts, "start", 2) == {"h0", "h1"},
        JOB_TIMEOUT_S,
        "two hosts' workers in a world of 2",
        expect_running=agents,
    )
    assert _request(hosts, 0, f"http://127.0.0.1:{STATUS_PORT}/drain?scope=job") == 202
    for agent in agents:
        assert agent.wait(JOB_TIMEOUT_S) == DRAIN_EXIT_CODE, hosts.diagnostics()
    assert _hosts_with(hosts, "ckpt", 2) == {"h0", "h1"}
    sources = [(_drain_record(a)["scope"], _drain_record(a)["source"]) for a in agents]
    assert sources == [("job", "http"), ("job", "peer")], sources
    for agent in agents:
        assert agent.transitions()[-1] == ("HEALTHY", "FAILED", "drain_requested"), agent.output()
        assert all(e["restart_count"] == 0 for e in agent.events_list())


def test_http_drain_on_a_non_loopback_address_needs_the_token(netns_hosts, tmp_path):
    """``--status-host <the host's IP>``: a GET /status or POST /drain from that address without
    the token is refused (401), and the drain with the token drains; on an agent with no token
    file and ``--status-open-read``, GET /status is open and POST /drain refused (403)."""
    hosts = netns_hosts
    _use_worker(hosts)
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    guarded = hosts.start_agent(
        0,
        "--standalone",
        "--nproc-per-node",
        "1",
        "--status-port",
        str(STATUS_PORT),
        "--status-host",
        hosts.addrs[0],
        "--status-token-file",
        str(token_file),
        final_world=99,
    )
    tokenless = hosts.start_agent(
        1,
        "--standalone",
        "--nproc-per-node",
        "1",
        "--status-port",
        str(STATUS_PORT),
        "--status-host",
        hosts.addrs[1],
        "--status-open-read",
        "true",
        final_world=99,
    )
    hosts.wait_for(
        lambda: {r["host"] for r in hosts.records("start")} == {"h0", "h1"},
        JOB_TIMEOUT_S,
        "both agents' workers",
        expect_running=[guarded, tokenless],
    )
    url0, url1 = (f"http://{hosts.addrs[i]}:{STATUS_PORT}" for i in (0, 1))
    assert _request(hosts, 0, f"{url0}/drain") == 401
    assert _request(hosts, 0, f"{url0}/drain", token="wrong") == 401
    assert _request(hosts, 1, f"{url1}/drain", token="s3cret-token") == 403  # no token file: no drain
    assert _request(hosts, 0, f"{url0}/status", method="GET") == 401
    assert _request(hosts, 0, f"{url0}/status", method="GET", token="s3cret-token") == 200
    assert _request(hosts, 1, f"{url1}/status", method="GET") == 200  # --status-open-read
    assert guarded.poll() is None and tokenless.poll() is None  # nothing drained yet
    assert not hosts.records("ckpt")
    assert _request(hosts, 0, f"{url0}/drain", token="s3cret-token") == 202
    assert guarded.wait(JOB_TIMEOUT_S) == DRAIN_EXIT_CODE, hosts.diagnostics()
    assert {r["host"] for r in hosts.records("ckpt")} == {"h0"}
    assert _drain_record(guarded)["by"] == hosts.addrs[0]
    tokenless.proc.send_signal(signal.SIGTERM)
    assert tokenless.wait(JOB_TIMEOUT_S) == 128 + signal.SIGTERM, hosts.diagnostics()
