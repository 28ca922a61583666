"""Which nodes of a round finished: their workers all succeeded and their agent went on to its exit barrier.

A node that finished stops keeping the rendezvous alive once it leaves (c10d, fsm, etcd: its
keep-alive lapses; static: rank 0's store closes), which its slower peers would otherwise take
for a lost node and answer with a re-rendezvous that kills their still-running workers. torchrun
never asks, so it never confuses the two; fsm-agent notices lost nodes, so each finished node
says so in the round's store before its exit barrier, and a peer counts a lost node only beyond
the finished ones.

Keys (in the round's store, the one the exit barrier uses):

* ``fsm_agent/finished/count``: how many nodes of the round finished (``store.add``).
* ``fsm_agent/finished/<group_rank>``: set when that node finished (its hostname), so a backend
  can wait for one node in particular (static: rank 0, whose agent hosts the store).

Stores here are ``torch.distributed.Store``-like (``set``, ``add``); nothing imports torch.
"""

from __future__ import annotations

from typing import Any

FINISHED_COUNT_KEY = "fsm_agent/finished/count"


def finished_key(group_rank: int) -> str:
    """The key set when node ``group_rank`` of the round finished."""
    return f"fsm_agent/finished/{group_rank}"


def mark_finished(store: Any, group_rank: int, hostname: str) -> None:
    """Record in ``store`` (the round's) that this node finished. Raises what the store raises."""
    store.set(finished_key(group_rank), hostname)
    store.add(FINISHED_COUNT_KEY, 1)


def count_finished(store: Any) -> int:
    """How many nodes of the round ``store`` belongs to finished. Raises what the store raises."""
    return int(store.add(FINISHED_COUNT_KEY, 0))
