"""Hosts as they are in clusters: a hostname that does not resolve, or resolves to a wrong address.

Two namespaced hosts (conftest.py), each agent in a UTS namespace of its own (``unshare --uts``)
with a hostname of its own, without ``--local-addr``, and with a namespace ``/etc/hosts`` that
either lacks the hostname (``unresolvable``: a pod without a ``subdomain``, a container) or maps it
to ``127.0.1.1`` (``wrong-address``: Debian's default, a cluster name on another network); the
resolver answers nothing. On ``static``, ``c10d`` and ``fsm`` (``etcd-v3``:
plugins/fsm-agent-etcd/tests/test_etcd_hostnames.py) the job forms one gloo world of 2, with
MASTER_ADDR an address on the cluster network (the interface that routes to the endpoint), never
a hostname. Workers keep ``GLOO_SOCKET_IFNAME`` (the user's setting: gloo itself binds to what the
hostname resolves to, or loopback).
"""

from __future__ import annotations

import pytest

from tests.agent.test_netns import JOB_TIMEOUT_S, check_world, fsm_flags
from tests.netns import RDZV_PORT, NetnsHosts

pytestmark = [pytest.mark.multihost, pytest.mark.slow]

HOSTNAME_MODES = ("unresolvable", "wrong-address")


def cluster_hosts(hosts: NetnsHosts, mode: str, count: int = 2) -> list[str]:
    """Each host's own hostname and /etc/hosts for ``mode``; returns the hostnames."""
    names = [f"pod-{hosts.prefix}-{i}" for i in range(count)]
    for i, name in enumerate(names):
        lines = "127.0.0.1 localhost\n" + (f"127.0.1.1 {name}\n" if mode == "wrong-address" else "")
        hosts.set_etc(i, lines)
    return names


def backend_flags(hosts: NetnsHosts, backend: str, host: int) -> list[str]:
    if backend == "fsm":
        return fsm_flags(hosts, "2")
    if backend == "static":
        return [
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--master-addr",
            hosts.addrs[0],
            "--master-port",
            str(RDZV_PORT),
            "--node-rank",
            str(host),
            "--rdzv-conf",
            "timeout=120",
            "--max-restarts",
            "0",
        ]
    return [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        backend,
        "--rdzv-endpoint",
        hosts.endpoint(),
        "--rdzv-id",
        f"hostnames-{backend}",
        "--rdzv-conf",
        "join_timeout=120,read_timeout=120",
        "--monitor-interval",
        "0.1",
        "--max-restarts",
        "0",
    ]


def check_cluster_world(hosts: NetnsHosts, names: list[str]) -> list[dict]:
    """One world of ``len(names)`` whose MASTER_ADDR is a host's address on the switch."""
    reduced = hosts.records("reduced")
    masters = {r["env"]["MASTER_ADDR"] for r in reduced}
    assert len(masters) == 1 and masters <= set(hosts.addrs), f"MASTER_ADDR {masters}: not a cluster address"
    return check_world(hosts, len(names), names, master_addr=masters.pop())


@pytest.mark.parametrize("mode", HOSTNAME_MODES)
@pytest.mark.parametrize("backend", ["static", "c10d", "fsm"])
def test_a_job_forms_whatever_the_hostnames_resolve_to(netns_hosts, backend, mode):
    hosts = netns_hosts
    hostnames = cluster_hosts(hosts, mode)
    for i, hostname in enumerate(hostnames):  # the namespaces really say what the test claims
        probe = hosts.run_in(i, ["unshare", "--uts", "sh", "-c", f'hostname {hostname} && getent hosts "$(hostname)"'])
        assert (probe.returncode == 0) == (mode == "wrong-address"), probe
    agents = [
        hosts.start_agent(i, *backend_flags(hosts, backend, i), final_world=2, local_addr=False, hostname=hostnames[i])
        for i in range(2)
    ]
    for agent in agents:
        assert agent.wait(JOB_TIMEOUT_S) == 0, hosts.diagnostics()
    records = check_cluster_world(hosts, ["h0", "h1"])
    if backend != "static":  # static: MASTER_ADDR is --master-addr; the others: group rank 0's own address
        rank0 = next(r for r in records if r["env"]["GROUP_RANK"] == "0")
        assert rank0["env"]["MASTER_ADDR"] == hosts.addrs[int(rank0["host"][1:])]
    for agent in agents:
        assert agent.transitions() == [("INIT", "HEALTHY", "start"), ("HEALTHY", "SUCCEEDED", "workers_succeeded")]
