"""A worker that destroys and re-creates its process group (#39.1) across namespaced hosts
(``tests/netns.py``): the workers' store lives on group rank 0's host,
reached over the hosts' own addresses, kept by rank 0 for every later group
(fsm_agent/pg_generations.py), which rank 0 destroys late on purpose. The loopback tests: ``test_reinit_process_group.py``."""

from __future__ import annotations

import pytest

from tests.netns import RDZV_PORT

pytestmark = [pytest.mark.multihost, pytest.mark.slow]

TIMES = 2


def backend_flags(hosts, backend: str, host: int) -> list[str]:
    if backend == "static":
        return ["--master-addr", hosts.addrs[0], "--master-port", str(RDZV_PORT), "--node-rank", str(host)]
    conf = f"is_host={1 if host == 0 else 0},join_timeout=120,read_timeout=120"
    return ["--rdzv-backend", "c10d", "--rdzv-endpoint", hosts.endpoint(), "--rdzv-id", "netns-reinit"] + [
        "--rdzv-conf",
        conf,
    ]


@pytest.mark.parametrize("backend", ["c10d", "static"])
def test_workers_re_create_their_process_group_across_hosts(netns_hosts, backend):
    hosts = netns_hosts
    agents = [
        hosts.start_agent(
            i,
            "--nnodes",
            "3",
            "--nproc-per-node",
            "1",
            "--max-restarts",
            "0",
            *backend_flags(hosts, backend, i),
            final_world=3,
            env={"FSM_TEST_WORKER_REINIT": str(TIMES)},
        )
        for i in range(3)
    ]
    for agent in agents:
        assert agent.wait(150) == 0, hosts.diagnostics()
    for again in range(TIMES):
        records = hosts.records(f"reinit_{again}")
        assert sorted(r["host"] for r in records) == ["h0", "h1", "h2"], (again, records)
        assert all(r["ok"] and r["sum"] == 6.0 for r in records), records
    assert {r["env"]["TORCHELASTIC_USE_AGENT_STORE"] for r in hosts.records("done")} == {"False"}
