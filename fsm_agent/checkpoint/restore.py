"""The restore plan: which step every rank of the new round restores, and from where.

At each rendezvous round every agent publishes its ``Inventory`` (which checkpoints it holds in
memory, in its own workers' slots or as a peer's replica, and which its ``--checkpoint-dir``
scan found) to the round's store; group rank 0 builds the ``Plan`` with ``make_plan`` and
publishes it; every agent stages its own workers' restores from it.

The step is the job's, not a rank's: the newest step that *every* global rank of the new world
can restore from some source (a rank restored at step 120 beside one at step 100 would train a
model that never existed). Sources, best first, for the rank's new node: ``memory`` (that node
holds it: the workers were restarted on the same node), ``peer`` (another node holds it in memory:
the rank moved, or its node was lost and a replica survives), ``disk`` (that node's scan of
``--checkpoint-dir`` found it). A checkpoint is only for the world size it was taken in (a
different world size needs resharding: ``dcp.load`` from a DCP checkpoint on disk does that; this
plan then finds no step).

When two neighbours of the ring are lost (node i and node i+1, which held i's replica), node i's
ranks exist only on disk: the plan takes the newest step the disk has for every rank, or none.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import attrs

MEMORY, PEER, DISK = "memory", "peer", "disk"


@attrs.frozen
class Inventory:
    """What one agent holds, as published in the round's store.

    Attributes:
        group_rank: the agent's rank in this round.
        address: (host, port) of its replica server, or None (no replication).
        runs: the global ranks of its workers in this round.
        memory: (global_rank, world_size, step) of every COMPLETE checkpoint in its shared memory.
        disk: (global_rank, world_size, step) of every complete checkpoint its disk scan found.
    """

    group_rank: int
    address: tuple[str, int] | None
    runs: tuple[int, ...]
    memory: tuple[tuple[int, int, int], ...] = ()
    disk: tuple[tuple[int, int, int], ...] = ()

    def to_json(self) -> str:
        return json.dumps(attrs.asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Inventory:
        doc = json.loads(text)
        return cls(
            group_rank=int(doc["group_rank"]),
            address=None if doc["address"] is None else (str(doc["address"][0]), int(doc["address"][1])),
            runs=tuple(int(g) for g in doc["runs"]),
            memory=tuple((int(g), int(w), int(s)) for g, w, s in doc["memory"]),
            disk=tuple((int(g), int(w), int(s)) for g, w, s in doc["disk"]),
        )


@attrs.frozen
class Source:
    """One place a rank's checkpoint can come from: ``kind`` (memory, peer, disk) and, for a peer,
    the holder's group rank and replica-server address."""

    kind: str
    holder: int | None = None
    address: tuple[str, int] | None = None


@attrs.frozen
class Plan:
    """The round's restore decision.

    Attributes:
        step: the step every rank restores, or None (no step that every rank can restore: the
            workers start without a checkpoint).
        world_size: the world size it is for.
        sources: {global_rank: its sources, best first} (empty when ``step`` is None).
        addresses: {group_rank: replica-server address} of every agent that has one (the ring's
            successors are looked up here).
        runs: {group_rank: the global ranks its workers run this round} (a node keeps the
            replicas of its predecessor's ranks only).
        reason: why there is no step, when there is none.
    """

    step: int | None
    world_size: int
    sources: Mapping[int, tuple[Source, ...]] = attrs.field(factory=dict)
    addresses: Mapping[int, tuple[str, int]] = attrs.field(factory=dict)
    runs: Mapping[int, tuple[int, ...]] = attrs.field(factory=dict)
    reason: str = ""

    def to_json(self) -> str:
        return json.dumps(
            {
                "step": self.step,
                "world_size": self.world_size,
                "sources": {
                    str(g): [[s.kind, s.holder, None if s.address is None else list(s.address)] for s in sources]
                    for g, sources in self.sources.items()
                },
                "addresses": {str(r): list(a) for r, a in self.addresses.items()},
                "runs": {str(r): list(g) for r, g in self.runs.items()},
                "reason": self.reason,
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Plan:
        doc = json.loads(text)
        return cls(
            step=doc["step"],
            world_size=int(doc["world_size"]),
            sources={
                int(g): tuple(
                    Source(kind, holder, None if address is None else (str(address[0]), int(address[1])))
                    for kind, holder, address in sources
                )
                for g, sources in doc["sources"].items()
            },
            addresses={int(r): (str(a[0]), int(a[1])) for r, a in doc["addresses"].items()},
            runs={int(r): tuple(int(g) for g in ranks) for r, ranks in doc.get("runs", {}).items()},
            reason=str(doc.get("reason", "")),
        )


def make_plan(inventories: Sequence[Inventory], world_size: int) -> Plan:
    """The newest step every global rank ``0..world_size-1`` can restore, and each rank's sources.

    Deterministic in its input (any agent computing it gets the same plan)."""
    addresses = {inv.group_rank: inv.address for inv in inventories if inv.address is not None}
    runs = {inv.group_rank: inv.runs for inv in inventories}
    runner = {g: inv.group_rank for inv in inventories for g in inv.runs}
    holders: dict[tuple[int, int], list[int]] = {}  # (g, step) -> group ranks holding it in memory
    on_disk: dict[tuple[int, int], set[int]] = {}
    for inv in sorted(inventories, key=lambda i: i.group_rank):
        for g, w, s in inv.memory:
            if w == world_size:
                holders.setdefault((g, s), []).append(inv.group_rank)
        for g, w, s in inv.disk:
            if w == world_size:
                on_disk.setdefault((g, s), set()).add(inv.group_rank)
    steps = sorted({s for _, s in holders} | {s for _, s in on_disk}, reverse=True)
    missing = [g for g in range(world_size) if g not in runner]
    if missing:
        return Plan(None, world_size, addresses=addresses, runs=runs, reason=f"no agent runs global ranks {missing}")
    for step in steps:
        sources = {}
        for g in range(world_size):
            found = _sources(g, step, runner[g], holders.get((g, step), []), on_disk.get((g, step), set()), addresses)
            if not found:
                break
            sources[g] = found
        else:
            return Plan(step, world_size, sources, addresses, runs)
    reason = "no checkpoint held" if not steps else f"no step that all {world_size} ranks hold (newest: {steps[0]})"
    return Plan(None, world_size, addresses=addresses, runs=runs, reason=reason)


def _sources(
    global_rank: int,
    step: int,
    runner: int,
    holders: list[int],
    disk_nodes: set[int],
    addresses: Mapping[int, tuple[str, int]],
) -> tuple[Source, ...]:
    found = []
    if runner in holders:
        found.append(Source(MEMORY))
    found += [Source(PEER, h, addresses[h]) for h in holders if h != runner and h in addresses]
    if runner in disk_nodes:
        found.append(Source(DISK))
    return tuple(found)


def successor(group_rank: int, group_world_size: int) -> int | None:
    """The group rank this agent replicates to: the next in the ring, None when alone."""
    if group_world_size < 2:
        return None
    return (group_rank + 1) % group_world_size
