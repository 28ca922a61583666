"""c10d (#39.2) across hosts: the store-hosting host starts after the others (namespaced hosts,
see ``tests/netns.py``); the early hosts wait for it up to ``join_timeout`` instead of giving up
after ``read_timeout``. The loopback tests: ``test_c10d_late_store_host.py``."""

from __future__ import annotations

import time

import pytest

pytestmark = [pytest.mark.multihost, pytest.mark.slow]

#: The store host starts this long after the others: well past read_timeout (5 s) + torch's margin.
LATE_S = 20.0


def test_early_hosts_wait_for_a_store_host_that_starts_late(netns_hosts):
    hosts = netns_hosts

    def start(i: int):
        conf = f"is_host={1 if i == 0 else 0},join_timeout=90,read_timeout=5"
        flags = ["--nnodes", "3", "--nproc-per-node", "1", "--rdzv-backend", "c10d"]
        flags += ["--rdzv-endpoint", hosts.endpoint(), "--rdzv-id", "netns-late", "--rdzv-conf", conf]
        return hosts.start_agent(i, *flags, final_world=3)

    early = [start(1), start(2)]
    time.sleep(LATE_S)
    assert all(agent.poll() is None for agent in early), hosts.diagnostics()
    agents = [start(0), *early]
    for agent in agents:
        assert agent.wait(150) == 0, hosts.diagnostics()
    records = hosts.records("reduced")
    assert sorted(r["host"] for r in records) == ["h0", "h1", "h2"], records
    assert all(r["ok"] and r["pg_world"] == 3 for r in records), records
