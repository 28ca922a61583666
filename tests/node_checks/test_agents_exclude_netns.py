"""Real agents on 9 hosts made of network namespaces (``tests/netns.py``): 8 run the job
(``--nnodes 8:8``, ``--node-check-network true``), the ninth joins as the round forms; host 3's
veth is rate-limited with ``tc qdisc ... tbf`` (netem is not available on these kernels). The
network check finds host 3, host 3 leaves with exit 69 before any worker starts on it, and the
ninth host takes its seat: the job trains on 8 nodes without it.

The ninth agent is started once host 0 logged its round complete: it waits as a standby while the
round is checked, or, on a loaded machine, joins the re-formed round late; either way it takes the
free seat (the test records which)."""

from __future__ import annotations

import subprocess

import pytest

from tests.netns import IFNAME, NetnsHosts, namespaced_hosts

pytestmark = [pytest.mark.multihost, pytest.mark.slow]

HOSTS = 9
BAD = 3
TBF = ["tbf", "rate", "20mbit", "burst", "32kbit", "latency", "50ms"]
#: The issue's bound: found, excluded and the seat taken within this many seconds (2 check rounds).
FOUND_AND_REPLACED_S = 10.0


@pytest.fixture
def hosts9(tmp_path):
    """Nine namespaced hosts, removed at teardown (with every process started in them)."""
    yield from namespaced_hosts(tmp_path, HOSTS)


def flags(hosts: NetnsHosts) -> list[str]:
    return [
        "--nnodes", "8:8", "--nproc-per-node", "1", "--max-restarts", "0", "--monitor-interval", "0.1",
        "--rdzv-backend", "fsm", "--rdzv-endpoint", hosts.endpoint(), "--rdzv-id", "netns-node-checks",
        "--rdzv-conf", "join_timeout=120", "--node-check-network", "true", "--node-check-timeout", "20",
    ]  # fmt: skip


def test_a_rate_limited_host_is_excluded_and_the_spare_takes_its_seat(hosts9, record_property):
    hosts = hosts9
    subprocess.run(
        ["ip", "netns", "exec", hosts.names[BAD], "tc", "qdisc", "add", "dev", IFNAME, "root", *TBF],
        check=True,
        capture_output=True,
        timeout=30,
    )
    # host 0 hosts the store at the endpoint (only it has that address); the others retry until it listens
    active = [hosts.start_agent(i, *flags(hosts), final_world=8) for i in range(8)]
    hosts.wait_for(lambda: "rendezvous complete" in active[0].output(), 120, "the first round", expect_running=active)
    spare = hosts.start_agent(8, *flags(hosts), final_world=8)
    assert active[BAD].wait(120) == 69, hosts.diagnostics()
    bad_err = active[BAD].output()
    assert "node check failed (node_check)" in bad_err and ": network" in bad_err, bad_err
    assert not any(r["host"] == f"h{BAD}" for r in hosts.records("start")), "a worker started on the bad host"
    for agent in [*active[:BAD], *active[BAD + 1 :], spare]:
        assert agent.wait(120) == 0, hosts.diagnostics()
    finals = [r for r in hosts.records("reduced") if r["env"]["WORLD_SIZE"] == "8"]
    assert sorted(r["host"] for r in finals) == sorted(f"h{i}" for i in range(HOSTS) if i != BAD), finals
    checks = [e for e in active[0].events_list() if e["kind"] == "node_check"]
    assert len(checks) == 2, checks  # found in the first check round, the re-formed round passes the second
    # one node (host 3: the one that exited 69), found in the first check round; the second passes
    assert len(checks[0]["excluded"]) == 1 and checks[1]["excluded"] == {}, checks
    assert list(checks[0]["excluded"].values())[0].startswith("network"), checks[0]
    first_check_began = checks[0]["ts"] - checks[0]["seconds"]
    started = max(r["ts"] for r in hosts.records("start") if r["env"]["WORLD_SIZE"] == "8")
    standby = any(e["kind"] == "standby" for e in spare.events_list())
    record_property("found_and_replaced_s", round(started - first_check_began, 3))
    print(
        f"\nchecks {checks[0]['seconds']:.2f}s + {checks[1]['seconds']:.2f}s; first check -> the world of 8 "
        f"without h{BAD} running: {started - first_check_began:.2f}s; the ninth host was "
        f"{'a standby' if standby else 'a late joiner'}"
    )
    assert started - first_check_began <= FOUND_AND_REPLACED_S
