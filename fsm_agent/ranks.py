"""Rank assignment, as torch's ``SimpleElasticAgent._assign_worker_ranks`` (same store keys).

Using torch's keys lets an fsm-agent node and a torchrun node agree on ranks in one job.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import attrs

from fsm_agent.worker import Worker, WorkerSpec

ROLE_INFO_PREFIX = "torchelastic/role_info/"
ASSIGNED_RANKS_PREFIX = "torchelastic/assigned_ranks/"


def compute_assignments(role_infos: list[tuple[str, int]]) -> list[tuple[int, int, int, int]]:
    """Per agent (in group-rank order): (base_global_rank, global_world_size, base_role_rank, role_world_size).

    Args:
        role_infos: one ``(role, local_world_size)`` per agent, index == group_rank.
    """
    role_sizes: dict[str, int] = defaultdict(int)
    for role, size in role_infos:
        role_sizes[role] += size
    global_size = sum(size for _, size in role_infos)
    base, role_bases, result = 0, defaultdict[str, int](int), []
    for role, size in role_infos:
        result.append((base, global_size, role_bases[role], role_sizes[role]))
        base += size
        role_bases[role] += size
    return result


def assign_ranks(
    store: Any,
    group_rank: int,
    group_world_size: int,
    role: str,
    local_world_size: int,
    restart_count: int = 0,
    hosts_store: bool = False,
) -> tuple[tuple[int, int, int, int], int | None, tuple[int, ...]]:
    """Exchange role info through the round's store.

    Every agent writes ``torchelastic/role_info/<group_rank>``; group rank 0 computes and writes
    ``torchelastic/assigned_ranks/<i>``; every agent blocks on its own key (store timeout applies).

    fsm-agent also puts its ``restart_count`` in its role info (torch ignores extra keys). When
    every agent of the round did so, rank 0 appends the job-wide count (the maximum) to each
    assignment, so all nodes agree on ``TORCHELASTIC_RESTART_COUNT`` and spend one job-wide
    budget (torch's counts are per agent and diverge). It appends the global ranks of the node
    whose agent hosts the round's store (``hosts_store``) too: when that store becomes unreachable,
    the survivors know whose node went with it. With a torchrun peer in the round the assignment
    keeps torch's 4-element form, the count stays per agent and the store's host is not known.

    Returns:
        ((base_global_rank, global_world_size, base_role_rank, role_world_size), job_restart_count or None,
        the store host's global ranks or ``()``)
    """
    info = json.dumps(
        {
            "role": role,
            "rank": group_rank,
            "local_world_size": local_world_size,
            "restart_count": restart_count,
            "hosts_store": hosts_store,
        }
    )
    store.set(f"{ROLE_INFO_PREFIX}{group_rank}", info.encode())
    if group_rank == 0:
        raw = store.multi_get([f"{ROLE_INFO_PREFIX}{i}" for i in range(group_world_size)])
        infos = [json.loads(bytes(b).decode()) for b in raw]
        assignments: list[list[Any]] = [
            list(a) for a in compute_assignments([(i["role"], i["local_world_size"]) for i in infos])
        ]
        if all("restart_count" in i for i in infos):
            job_count = max(int(i["restart_count"]) for i in infos)
            host_ranks = _store_host_ranks(infos, assignments)
            for a in assignments:
                a.append(job_count)
                a.append(host_ranks)
        store.multi_set(
            [f"{ASSIGNED_RANKS_PREFIX}{i}" for i in range(group_world_size)], [json.dumps(a) for a in assignments]
        )
    values = json.loads(bytes(store.get(f"{ASSIGNED_RANKS_PREFIX}{group_rank}")).decode())
    restarts = values[4] if len(values) > 4 else None
    return tuple(values[:4]), restarts, tuple(values[5]) if len(values) > 5 else ()


def _store_host_ranks(infos: list[dict[str, Any]], assignments: list[list[Any]]) -> list[int]:
    """The global ranks of the one agent that hosts the round's store; [] when none does (the store
    outlives every node, as etcd) or several claim to (which one is not known)."""
    hosts = [i for i, info in enumerate(infos) if info.get("hosts_store")]
    if len(hosts) != 1:
        return []
    base = int(assignments[hosts[0]][0])
    return list(range(base, base + int(infos[hosts[0]]["local_world_size"])))


@attrs.frozen
class JoinedRound:
    """A rendezvous round this node joined, with its workers ranked.

    Attributes:
        info: the handler's ``RendezvousInfo`` (store, rank, world_size, bootstrap_store_info).
        workers: the local workers, ranked (torch's ``_assign_worker_ranks``).
        job_restart_count: the highest restart count of the round's nodes, or None (one node).
        store_host_ranks: the global ranks of the node whose agent hosts the round's store, or ``()``.
    """

    info: Any
    workers: list[Worker]
    job_restart_count: int | None
    store_host_ranks: tuple[int, ...] = ()


def join_round(rdzv: Any, spec: WorkerSpec, restart_count: int) -> JoinedRound:
    """``next_rendezvous()`` (torch's name) on the handler of ``rdzv`` (a ``RendezvousAdapter``),
    then rank this node's workers through the round's store.

    Raises:
        whatever the handler raises (torch's ``RendezvousError`` family, fsm-agent's).
    """
    info = rdzv.handler.next_rendezvous()
    (base_global, world, base_role, role_world), job_restart_count, store_host_ranks = assign_ranks(
        info.store, info.rank, info.world_size, spec.role, spec.local_world_size, restart_count, rdzv.hosts_store
    )
    workers = [
        Worker(
            local_rank=r,
            global_rank=base_global + r,
            role_rank=base_role + r,
            world_size=world,
            role_world_size=role_world,
        )
        for r in range(spec.local_world_size)
    ]
    return JoinedRound(info, workers, job_restart_count, store_host_ranks)
