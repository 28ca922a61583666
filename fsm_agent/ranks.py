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
    store: Any, group_rank: int, group_world_size: int, role: str, local_world_size: int, restart_count: int = 0
) -> tuple[tuple[int, int, int, int], int | None]:
    """Exchange role info through the round's store.

    Every agent writes ``torchelastic/role_info/<group_rank>``; group rank 0 computes and writes
    ``torchelastic/assigned_ranks/<i>``; every agent blocks on its own key (store timeout applies).

    fsm-agent also puts its ``restart_count`` in its role info (torch ignores extra keys). When
    every agent of the round did so, rank 0 appends the job-wide count (the maximum) to each
    assignment, so all nodes agree on ``TORCHELASTIC_RESTART_COUNT`` and spend one job-wide
    budget (torch's counts are per agent and diverge). With a torchrun peer in the round the
    assignment keeps torch's 4-element form and the count stays per agent.

    Returns:
        ((base_global_rank, global_world_size, base_role_rank, role_world_size), job_restart_count or None)
    """
    info = json.dumps(
        {"role": role, "rank": group_rank, "local_world_size": local_world_size, "restart_count": restart_count}
    )
    store.set(f"{ROLE_INFO_PREFIX}{group_rank}", info.encode())
    if group_rank == 0:
        raw = store.multi_get([f"{ROLE_INFO_PREFIX}{i}" for i in range(group_world_size)])
        infos = [json.loads(bytes(b).decode()) for b in raw]
        assignments = [list(a) for a in compute_assignments([(i["role"], i["local_world_size"]) for i in infos])]
        if all("restart_count" in i for i in infos):
            job_count = max(int(i["restart_count"]) for i in infos)
            for a in assignments:
                a.append(job_count)
        store.multi_set(
            [f"{ASSIGNED_RANKS_PREFIX}{i}" for i in range(group_world_size)], [json.dumps(a) for a in assignments]
        )
    values = json.loads(bytes(store.get(f"{ASSIGNED_RANKS_PREFIX}{group_rank}")).decode())
    return tuple(values[:4]), (values[4] if len(values) > 4 else None)


@attrs.frozen
class JoinedRound:
    """A rendezvous round this node joined, with its workers ranked.

    Attributes:
        info: the handler's ``RendezvousInfo`` (store, rank, world_size, bootstrap_store_info).
        workers: the local workers, ranked (torch's ``_assign_worker_ranks``).
        job_restart_count: the highest restart count of the round's nodes, or None (one node).
    """

    info: Any
    workers: list[Worker]
    job_restart_count: int | None


def join_round(handler: Any, spec: WorkerSpec, restart_count: int) -> JoinedRound:
    """``handler.next_rendezvous()`` (torch's name), then rank this node's workers through the
    round's store.

    Raises:
        whatever the handler raises (torch's ``RendezvousError`` family, fsm-agent's).
    """
    info = handler.next_rendezvous()
    (base_global, world, base_role, role_world), job_restart_count = assign_ranks(
        info.store, info.rank, info.world_size, spec.role, spec.local_world_size, restart_count
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
    return JoinedRound(info=info, workers=workers, job_restart_count=job_restart_count)
