"""A three-member etcd cluster (conftest.py's ``etcd_cluster``): no single member, and no single
compute node, takes the rendezvous down.

``--rdzv-endpoint a:2379,b:2379,c:2379`` lists the members; each request goes to the member that
answered last and, when that one cannot be reached, to the next (``EtcdConnection.post``).
"""

from __future__ import annotations

import datetime
import signal
import time
import uuid

import fsm_agent_etcd
import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from fsm_agent.testing.node_loss import NodeLossJob


def params(endpoint: str, run_id: str, **conf) -> RendezvousParameters:
    return RendezvousParameters(backend="etcd-v3", endpoint=endpoint, run_id=run_id, min_nodes=1, max_nodes=2, **conf)


def leader_first(cluster) -> list:
    """The members, the raft leader first: the one every client asks first is then the one whose
    loss also costs the cluster an election."""
    leader = cluster.leader()
    return [leader] + [m for m in cluster.members if m is not leader]


def test_endpoint_lists_every_member():
    assert fsm_agent_etcd.parse_endpoints("a:1,b, c:3") == [("a", 1), ("b", 2379), ("c", 3)]
    assert fsm_agent_etcd.parse_endpoints("") == [("localhost", 2379)]
    with pytest.raises(ValueError, match="an empty etcd member"):
        fsm_agent_etcd.parse_endpoints("a:1,,b:2")


@pytest.mark.parametrize("victim", ["leader", "follower"])
def test_backend_and_store_go_on_when_the_member_they_use_is_lost(etcd_cluster, victim):
    members = leader_first(etcd_cluster)
    if victim == "follower":
        members = members[1:] + members[:1]  # a follower first: it is the one lost, no election
    endpoint = ",".join(m.endpoint for m in members)
    run_id = uuid.uuid4().hex
    backend, store = fsm_agent_etcd.create_backend(params(endpoint, run_id, read_timeout="30", ttl="60"))
    store.set_timeout(datetime.timedelta(seconds=30))
    _, token, _ = backend.set_state(b"before")
    store.set("k", "v")
    assert store.add("n", 1) == 1

    members[0].stop()  # every request so far went to it

    assert backend.get_state() == (b"before", token)
    state, new_token, won = backend.set_state(b"after", token)
    assert (state, won) == (b"after", True) and new_token > token
    assert store.get("k") == b"v" and store.add("n", 1) == 2
    assert store.compare_set("k", "v", "w") == b"w"
    # a new agent given the same list, its first member dead, still joins
    again, again_store = fsm_agent_etcd.create_backend(params(endpoint, run_id, read_timeout="30"))
    assert again.get_state() == (b"after", new_token)
    assert again_store.get("n") == b"2"
    assert etcd_cluster.leader() in members[1:]  # two members are a quorum: a leader (again)


def test_unreachable_members_are_named_in_one_line():
    with pytest.raises(
        RendezvousConnectionError, match=r"etcd at http://127\.0\.0\.1:1, http://127\.0\.0\.1:2 does not answer"
    ):
        fsm_agent_etcd.create_backend(params("127.0.0.1:1,127.0.0.1:2", "nowhere", read_timeout="5"))


def test_tls_options_apply_to_every_member(etcd_tls_cluster):
    """https with a client certificate (``--rdzv-conf protocol=https,ca_cert=...,ssl_cert=...,ssl_cert_key=...``),
    as for one member: the same files for each, and the failover keeps them."""
    tls, run_id = etcd_tls_cluster.tls, uuid.uuid4().hex
    conf = {"protocol": "https", "ca_cert": str(tls.ca), "read_timeout": "30"}
    client_cert = {"ssl_cert": str(tls.cert), "ssl_cert_key": str(tls.key)}
    backend, store = fsm_agent_etcd.create_backend(params(etcd_tls_cluster.endpoint, run_id, **conf, **client_cert))
    _, token, _ = backend.set_state(b"over tls")
    etcd_tls_cluster.members[0].stop()
    assert backend.get_state() == (b"over tls", token)
    store.set("k", "v")
    assert store.get("k") == b"v"
    # no client certificate: the members that are left refuse the handshake (the files did reach each one)
    with pytest.raises(RendezvousConnectionError, match="https://127.0.0.1:.*, https://127.0.0.1:.* does not answer"):
        fsm_agent_etcd.create_backend(params(etcd_tls_cluster.endpoint, run_id, **conf))


KEEP_ALIVE_S = 10  # keep_alive_interval=1 x keep_alive_max_attempt=10: room for a loaded 2-core machine


@pytest.mark.slow
def test_job_survives_an_etcd_member_then_its_first_node(tmp_path, etcd_cluster):
    """Three agents (``--nnodes 2:3``, real worker processes) on a three-member etcd: the etcd leader,
    the member every agent talks to, is SIGKILLed, and the job goes on; then the first agent started
    is SIGKILLed with its workers (a machine dying), and the other two re-rendezvous without it and
    finish as a world of 2. Nothing is left running (NodeLossJob.close, conftest)."""
    members = leader_first(etcd_cluster)
    flags = [
        "--nnodes",
        "2:3",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "etcd-v3",
        "--rdzv-endpoint",
        ",".join(m.endpoint for m in members),
        "--rdzv-id",
        f"ha-{uuid.uuid4().hex[:8]}",
        "--local-addr",
        "127.0.0.1",
        "--monitor-interval",
        "0.1",
        "--max-restarts",
        "0",
        "--rdzv-conf",
        "join_timeout=120,last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=10,read_timeout=30",
    ]
    job = NodeLossJob(tmp_path, flags)
    try:
        for name in ("a", "b", "c"):
            job.start(name)
        job.wait_for_world(3, {"a", "b", "c"}, timeout=240)
        world_of_3 = {r["name"]: r for r in job.records() if r["world"] == 3}

        member_lost_at = time.time()
        members[0].stop()
        time.sleep(KEEP_ALIVE_S + 2)  # long enough for a keep-alive to have expired, had it failed
        assert all(job.agent(n).poll() is None for n in "abc"), job.diagnostics()
        changes = {n: job.transitions(n, since=member_lost_at) for n in "abc"}
        # Expected: none (the member's loss is invisible to the job). A machine so loaded that
        # heartbeats miss the keep-alive may re-rendezvous; the three agents must still form one world.
        if any(changes.values()):
            print(f"\nre-rendezvous after the etcd member's loss: {changes}")
            job.wait_for_world(3, {"a", "b", "c"}, since=member_lost_at, timeout=240)

        job.finish_next_world()
        node_lost_at = job.lose("a", signal.SIGKILL)  # the first agent started
        job.wait_for_world(2, {"b", "c"}, since=node_lost_at, timeout=240, running=set())
        assert job.agent("b").wait(240) == 0, job.diagnostics()
        assert job.agent("c").wait(240) == 0, job.diagnostics()

        world_of_2 = [r for r in job.records() if r["ts"] >= node_lost_at]
        assert {r["name"] for r in world_of_2} == {"b", "c"}
        assert all(r["world"] == 2 and r["group_world"] == 2 for r in world_of_2)
        last = {r["name"]: r for r in sorted(world_of_2, key=lambda r: r["ts"])}  # the world that finished
        assert sorted(r["group_rank"] for r in last.values()) == [0, 1]
        for name in ("b", "c"):
            change = job.first_transition(name, "membership_changed", node_lost_at)
            assert change["failure_class"] == "node_lost", change
            assert all(e["restart_count"] == 0 for e in job.events(name))
            assert job.transitions(name)[-1] == ("HEALTHY", "SUCCEEDED", "workers_succeeded")
        print(
            f"\nfirst node (group rank {world_of_3['a']['group_rank']}) lost -> survivors running again "
            f"{min(r['ts'] for r in last.values()) - node_lost_at:.2f} s"
        )
    finally:
        job.close()
