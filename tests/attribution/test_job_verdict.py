"""The job's verdict across nodes (``fsm_agent.job_verdict``) on a real TCPStore on 127.0.0.1:
nodes that give up together agree on one verdict decided on every node's reports; a node whose
failures were collateral waits for a peer's decision, bounded; the peers' existing job-wide look
finds the verdict and counts itself, which is what the decider waits for before leaving."""

from __future__ import annotations

import datetime
import os
import threading
import time
import types

import pytest

from fsm_agent import job_verdict
from fsm_agent.attribution import COLLATERAL, ROOT_CAUSE, FailureReport, builtin_class
from fsm_agent.drain import JOB_DRAIN_KEY, JOB_DRAIN_LOOK_MAX_S, NodeDrain
from fsm_agent.worker import Worker, WorkerFailure, WorkerGroup, WorkerSpec

pytestmark = pytest.mark.unit

CLOSED = "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:4242"


@pytest.fixture
def store():
    import torch.distributed as dist

    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=10)
    )
    yield server


def client(server):
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=10))


@pytest.fixture
def pipe():
    r, w = os.pipe()
    os.set_blocking(r, False)  # as the agent's wake-up pipe
    yield r
    os.close(r)
    os.close(w)


def group_of(store, group_rank, world=2):
    group = WorkerGroup(WorkerSpec(role="trainer", local_world_size=1, entrypoint="train.py"))
    group.store, group.group_rank, group.group_world_size = store, group_rank, world
    return group


def test_nodes_that_give_up_together_agree_on_one_verdict_decided_on_both_reports(store):
    root = FailureReport(global_rank=1, group_rank=1, time=10.0, message="RuntimeError: injected")
    victim = FailureReport(global_rank=0, group_rank=0, time=10.1, message=CLOSED)
    answers = {}

    def node(rank, own):  # as an agent: its reports with its decision first, then the job's verdict
        mine = client(store)
        job_verdict.publish_reports(mine, [own], "give_up", f"node{rank}")
        answers[rank] = job_verdict.decide(mine, [own], 2, f"node{rank}", builtin_class, None, nodes=2)

    threads = [threading.Thread(target=node, args=args) for args in ((0, victim), (1, root))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert answers[0] == answers[1]  # one verdict: the first to claim it published, the other adopted
    verdict = answers[0]
    assert verdict["root_causes"] == [1]
    assert verdict["classes"] == {"0": COLLATERAL, "1": ROOT_CAUSE}
    assert verdict["decided_by"] in ("node0", "node1")
    assert [r["global_rank"] for r in verdict["reports"]] == [0, 1]


def test_a_collateral_node_waits_for_the_peers_verdict(store, pipe):
    record = {"root_causes": [1], "summary": "rank 1: boom", "decided_by": "node1"}

    def peer_gives_up():
        time.sleep(0.3)
        other = client(store)
        other.set(job_verdict.VERDICT_KEY, __import__("json").dumps(record))

    threading.Thread(target=peer_gives_up).start()
    assert job_verdict.wait_for_peer_decision(client(store), pipe, lambda: False) == record


def test_a_collateral_node_goes_on_at_once_when_the_root_cause_node_restarts(store, pipe):
    report = FailureReport(global_rank=1, time=1.0, message="RuntimeError: boom")
    job_verdict.publish_reports(client(store), [report], "restart", "node1")
    started = time.monotonic()
    assert job_verdict.wait_for_peer_decision(client(store), pipe, lambda: False) is None
    assert time.monotonic() - started < job_verdict.GATHER_S


def test_a_collateral_node_waits_no_longer_than_the_gather_time(store, pipe):
    started = time.monotonic()
    assert job_verdict.wait_for_peer_decision(client(store), pipe, lambda: False) is None
    assert job_verdict.GATHER_S <= time.monotonic() - started < job_verdict.GATHER_S + 10  # generous: a loaded CI


def test_the_peers_job_wide_look_finds_the_verdict_and_counts_itself(store, pipe):
    decider, peer = group_of(client(store), 1), group_of(client(store), 0)
    record = job_verdict.decide(
        decider.store, [FailureReport(global_rank=1, message="RuntimeError: boom")], 2, "node1", builtin_class, 79
    )
    assert record["exit_code"] == 79  # the restart policy's own code travels with the verdict
    job_verdict.announce(decider.store, record, JOB_DRAIN_KEY)
    r, w = os.pipe()
    try:
        drain = NodeDrain("trainer", w)
        drain.look(peer, healthy=True)
        assert drain.peer_verdict == record
        assert drain.request is None  # a failed job is not a drain
    finally:
        os.close(r)
        os.close(w)
    started = time.monotonic()
    job_verdict.wait_until_seen(decider, pipe, lambda: False, "trainer")
    assert time.monotonic() - started < job_verdict.SEEN_WAIT_S


def test_every_peer_looks_well_within_the_deciders_wait():
    # the slowest look (10,000+ nodes), jittered by up to +50 %, still comes before the decider leaves
    assert 1.5 * JOB_DRAIN_LOOK_MAX_S < job_verdict.SEEN_WAIT_S


def test_the_decider_does_not_wait_for_a_lost_node_to_see_the_verdict(store, pipe):
    # two nodes, the other one lost: nobody is left to see it, so no wait (it waited 30 s before)
    decider = group_of(client(store), 0)
    started = time.monotonic()
    job_verdict.wait_until_seen(decider, pipe, lambda: False, "trainer", lost_ranks=[1])
    assert time.monotonic() - started < 1.0


def test_a_survivor_names_the_store_hosts_ranks_when_the_store_is_gone(pipe):
    """The round's store (hosted by group rank 0's agent, global rank 0) is gone: node 1 decides
    alone, and names rank 0 lost with it, its own collateral failure classed so, whether it gives
    up on its failed workers (``decide_and_share``) or on the store itself (``store_host_lost``)."""
    import torch.distributed as dist

    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=2)
    )
    group = group_of(client(server), 1, world=3)
    group.workers = [Worker(local_rank=0, global_rank=1, world_size=3)]
    group.store_host_ranks = (0,)
    del server  # the store's host is gone
    interrupts = types.SimpleNamespace(abandoned_call=None, wake_r=pipe, signalled=lambda: False, signal=None)
    verdicts = job_verdict.NodeVerdicts(group, "node1", "trainer", interrupts, lambda name, call: call())
    failure = WorkerFailure(local_rank=0, global_rank=1, role_rank=1, pid=1, exitcode=1, timestamp=10.0, message=CLOSED)
    for record in (
        verdicts.decide_and_share({1: failure}, None, builtin_class),
        verdicts.store_host_lost({1: failure}, builtin_class),
    ):
        assert record["root_causes"] == [0], record
        assert record["classes"] == {"0": ROOT_CAUSE, "1": COLLATERAL}, record
        assert record["reasons"]["0"] == job_verdict.STORE_HOST_LOST and record["lost_ranks"] == [0]
        assert job_verdict.recompute(record).root_causes == (0,)  # replay decides the same


def test_the_store_host_itself_names_no_one_lost(store):
    group = group_of(store, 0, world=2)
    group.workers = [Worker(local_rank=0, global_rank=0, world_size=2)]
    group.store_host_ranks = (0,)
    verdicts = job_verdict.NodeVerdicts(group, "node0", "trainer", None, None)
    assert verdicts.store_host_lost({}, builtin_class) is None
