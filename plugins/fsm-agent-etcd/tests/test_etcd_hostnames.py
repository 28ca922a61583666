"""etcd-v3 on hosts whose hostnames do not resolve, or resolve to a wrong address (as in clusters).

The same two namespaced hosts as tests/schedulers/test_hostnames.py (its helpers, and the
``netns_hosts`` fixture of tests/netns.py), each agent in a UTS namespace of its own
with an unresolvable or wrongly resolving hostname and no ``--local-addr``; a real etcd (Debian's
``etcd-server``, .ci/install-etcd.sh) listens in host 0 on the switch address. The job forms one
gloo world of 2 whose MASTER_ADDR is group rank 0's address on the switch (fsm-agent's address
selection, ``fsm_agent.hosts``: torch would hand out ``socket.getfqdn()``, the unresolvable name).
"""

from __future__ import annotations

import shutil
import sys
import time

import pytest

from tests.agent.test_netns import JOB_TIMEOUT_S
from tests.netns import netns_hosts  # noqa: F401  (the fixture)
from tests.schedulers.test_hostnames import HOSTNAME_MODES, check_cluster_world, cluster_hosts

pytestmark = [pytest.mark.multihost, pytest.mark.slow]

ETCD_PORT = 2379
HEALTH = "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=1)"


def start_etcd(hosts) -> str:
    """A one-member etcd in host 0, clients on the switch address; returns its endpoint once healthy."""
    etcd = shutil.which("etcd") or "/usr/bin/etcd"
    url, peer = f"http://{hosts.addrs[0]}:{ETCD_PORT}", "http://127.0.0.1:2380"
    proc = hosts.start_process(
        0,
        [
            etcd,
            "--name",
            "m0",
            "--data-dir",
            str(hosts.workdir / "etcd-data"),
            "--listen-client-urls",
            url,
            "--advertise-client-urls",
            url,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            f"m0={peer}",
            "--initial-cluster-state",
            "new",
        ],
        "etcd",
    )
    deadline = time.monotonic() + 60
    while hosts.run_in(0, [sys.executable, "-c", HEALTH, f"{url}/health"]).returncode != 0:
        assert proc.poll() is None and time.monotonic() < deadline, (hosts.workdir / "etcd.log").read_text()[-3000:]
        time.sleep(0.2)
    return f"{hosts.addrs[0]}:{ETCD_PORT}"


@pytest.mark.parametrize("mode", HOSTNAME_MODES)
def test_etcd_v3_job_forms_whatever_the_hostnames_resolve_to(netns_hosts, mode):  # noqa: F811
    hosts = netns_hosts
    hostnames = cluster_hosts(hosts, mode)
    endpoint = start_etcd(hosts)
    flags = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "etcd-v3",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        f"hostnames-{mode}",
        "--rdzv-conf",
        "join_timeout=120",
        "--monitor-interval",
        "0.1",
        "--max-restarts",
        "0",
    ]
    agents = [hosts.start_agent(i, *flags, final_world=2, local_addr=False, hostname=hostnames[i]) for i in range(2)]
    for agent in agents:
        assert agent.wait(JOB_TIMEOUT_S) == 0, hosts.diagnostics()
    records = check_cluster_world(hosts, ["h0", "h1"])
    rank0 = next(r for r in records if r["env"]["GROUP_RANK"] == "0")
    assert rank0["env"]["MASTER_ADDR"] == hosts.addrs[int(rank0["host"][1:])]
