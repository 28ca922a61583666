"""Rank assignment against torch's own ``SimpleElasticAgent._assign_worker_ranks``, same inputs."""

from __future__ import annotations

import json
import threading

import pytest
from torch.distributed import HashStore
from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
from torch.distributed.elastic.agent.server.api import WorkerSpec as TorchWorkerSpec

from fsm_agent.ranks import assign_ranks, compute_assignments

pytestmark = pytest.mark.unit

CASES = {
    "one role": [("trainer", 2), ("trainer", 2), ("trainer", 2)],
    "several roles": [("trainer", 2), ("reader", 1), ("trainer", 3), ("reader", 2)],
    "uneven local_world_size": [("default", 1), ("default", 4), ("default", 3)],
    "single agent": [("default", 8)],
}


def _run_agents(fn, agents):
    """Run fn(store, group_rank) for every agent concurrently (rank 0 blocks until all have written)."""
    store, results, errors = HashStore(), {}, []

    def body(rank):
        try:
            results[rank] = fn(store, rank)
        except Exception as exc:  # surface in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(len(agents))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    return [results[r] for r in range(len(agents))]


def _torch_ranks(agents):
    class _Dummy:  # _assign_worker_ranks uses no agent state
        pass

    def fn(store, rank):
        role, size = agents[rank]
        spec = TorchWorkerSpec(role=role, local_world_size=size, rdzv_handler=None, entrypoint="x")
        workers = SimpleElasticAgent._assign_worker_ranks(_Dummy(), store, rank, len(agents), spec)
        return [(w.local_rank, w.global_rank, w.role_rank, w.world_size, w.role_world_size) for w in workers]

    return _run_agents(fn, agents)


def _our_ranks(agents):
    def fn(store, rank):
        role, size = agents[rank]
        (base, world, role_base, role_world), _, _ = assign_ranks(store, rank, len(agents), role, size)
        return [(lr, base + lr, role_base + lr, world, role_world) for lr in range(size)]

    return _run_agents(fn, agents)


@pytest.mark.parametrize("agents", list(CASES.values()), ids=list(CASES))
def test_rank_assignment_matches_torch(agents):
    assert _our_ranks(agents) == _torch_ranks(agents)


def test_compute_assignments_several_roles():
    # trainer agents get role ranks 0-1 and 2-4; reader agents 0 and 1-2; global ranks follow group rank.
    assert compute_assignments([("trainer", 2), ("reader", 1), ("trainer", 3), ("reader", 2)]) == [
        (0, 8, 0, 5),
        (2, 8, 0, 3),
        (3, 8, 2, 5),
        (6, 8, 1, 3),
    ]


def test_job_wide_restart_count_is_the_maximum():
    """Agents that restarted a different number of times agree on the highest count."""
    counts = [0, 2, 1]
    results = _run_agents(lambda store, rank: assign_ranks(store, rank, 3, "default", 1, counts[rank])[1], counts)
    assert results == [2, 2, 2]


def test_torchrun_peer_keeps_torch_format(tmp_path):
    """A torchrun agent (no restart_count in its role info) gets torch's 4-element assignment."""
    store = HashStore()

    def torch_like_agent():  # what torch's _assign_worker_ranks writes for group rank 1
        store.set("torchelastic/role_info/1", b'{"role": "default", "rank": 1, "local_world_size": 2}')
        return json.loads(store.get("torchelastic/assigned_ranks/1"))

    peer = threading.Thread(target=lambda: results.append(torch_like_agent()))
    results: list = []
    peer.start()
    ours = assign_ranks(store, 0, 2, "default", 2, restart_count=3)
    peer.join(10)
    assert ours == ((0, 4, 0, 4), None, ())  # nor is the store's host known
    assert results == [[2, 4, 2, 4]]


@pytest.mark.parametrize(
    ("hosting", "expected"),
    [((False, True, False), (2, 3, 4)), ((False, False, False), ()), ((True, True, False), ())],
    ids=["one host", "none (the store outlives the nodes)", "two claims (not known which)"],
)
def test_every_node_learns_the_store_hosts_ranks(hosting, expected):
    """The agent hosting the round's store says so in its role info; every node's assignment carries
    that node's global ranks (its local_world_size of them), for the verdict when the store is lost."""
    sizes = (2, 3, 1)
    results = _run_agents(
        lambda store, rank: assign_ranks(store, rank, 3, "default", sizes[rank], 0, hosting[rank])[2], sizes
    )
    assert results == [expected] * 3
