"""How often each agent may look at a key of the job's shared store, so that the store's load stays
flat in the number of nodes.

A look that every agent makes on a fixed period costs the store ``nodes / period`` requests a
second: 20,000 at 0.5 s for 10,000 nodes. ``look_interval`` spreads the job's looks to
``STORE_LOOKS_PER_S`` in all (10,000 nodes: one look per agent every 10 s), never more often than
``least_s`` (small jobs) nor less often than ``most_s``. Used by the job-wide drain's looks
(``fsm_agent.drain.job_drain_look_interval``) and the static rendezvous' look whether its store's
host finished.
"""

from __future__ import annotations

#: Looks the whole job makes at one key of its store per second.
STORE_LOOKS_PER_S = 1000.0


def look_interval(group_world_size: int, least_s: float, most_s: float) -> float:
    """Seconds between one agent's looks in a job of ``group_world_size`` nodes:
    ``group_world_size / STORE_LOOKS_PER_S``, at least ``least_s``, at most ``most_s``."""
    return min(most_s, max(least_s, group_world_size / STORE_LOOKS_PER_S))
