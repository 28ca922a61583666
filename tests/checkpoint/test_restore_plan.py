"""The restore plan (``fsm_agent.checkpoint.restore.make_plan``): one step for the whole job, each
rank's sources best first, and what is left when nodes are lost."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fsm_agent.checkpoint.restore import DISK, MEMORY, PEER, Inventory, Plan, make_plan, successor

pytestmark = pytest.mark.unit

A, B, C = ("10.0.0.1", 1), ("10.0.0.2", 2), ("10.0.0.3", 3)


def inv(rank, address, runs, memory=(), disk=()):
    return Inventory(rank, address, tuple(runs), tuple(memory), tuple(disk))


def test_a_restart_on_the_same_nodes_restores_from_memory():
    plan = make_plan([inv(0, A, [0, 1], [(0, 4, 10), (1, 4, 10)]), inv(1, B, [2, 3], [(2, 4, 10), (3, 4, 10)])], 4)
    assert plan.step == 10
    assert all(plan.sources[g][0].kind == MEMORY for g in range(4))


def test_the_step_is_the_newest_that_every_rank_holds():
    # rank 1 died before its save of step 20: everyone restores 10
    plan = make_plan([inv(0, A, [0, 1], [(0, 2, 10), (0, 2, 20), (1, 2, 10)])], 2)
    assert plan.step == 10


def test_a_spare_in_a_lost_nodes_seat_restores_from_the_peer_holding_the_replica():
    # node 1 was lost; node 0 holds its ranks' replicas; the spare (now group rank 1) holds nothing
    survivor = inv(0, A, [0], [(0, 2, 30), (1, 2, 30)])
    spare = inv(1, C, [1])
    plan = make_plan([survivor, spare], 2)
    assert plan.step == 30
    assert plan.sources[1][0].kind == PEER and plan.sources[1][0].holder == 0 and plan.sources[1][0].address == A
    assert plan.sources[0][0].kind == MEMORY


def test_two_lost_neighbours_leave_only_the_disk():
    # the ring 0 -> 1 -> 2 -> 0: nodes 1 and 2 lost; rank 1 lived on node 1 and its replica on node 2
    survivor = inv(0, A, [0], [(0, 3, 40), (2, 3, 40)], disk=[(0, 3, 30)])
    spare1, spare2 = inv(1, B, [1], disk=[(1, 3, 30)]), inv(2, C, [2], disk=[(2, 3, 30)])
    plan = make_plan([survivor, spare1, spare2], 3)
    assert plan.step == 30 and [plan.sources[g][-1].kind for g in range(3)] == [DISK, DISK, DISK]
    nothing = make_plan([survivor, inv(1, B, [1]), inv(2, C, [2])], 3)
    assert nothing.step is None and "no step that all 3 ranks hold" in nothing.reason


def test_a_checkpoint_of_another_world_size_is_not_restored():
    plan = make_plan([inv(0, A, [0, 1, 2], [(0, 2, 10), (1, 2, 10)])], 3)
    assert plan.step is None


def test_sources_are_ordered_memory_peer_disk():
    plan = make_plan([inv(0, A, [0], [(0, 2, 5)], [(0, 2, 5)]), inv(1, B, [1], [(0, 2, 5), (1, 2, 5)])], 2)
    assert [s.kind for s in plan.sources[0]] == [MEMORY, PEER, DISK]


def test_the_plan_survives_its_json():
    plan = make_plan([inv(0, A, [0], [(0, 2, 5), (1, 2, 5)]), inv(1, None, [1])], 2)
    assert Plan.from_json(plan.to_json()) == plan
    assert Inventory.from_json(inv(0, A, [0], [(0, 2, 5)]).to_json()) == inv(0, A, [0], [(0, 2, 5)])


def test_the_ring():
    assert [successor(r, 4) for r in range(4)] == [1, 2, 3, 0]
    assert successor(0, 1) is None


held = st.lists(st.tuples(st.integers(0, 3), st.just(4), st.integers(0, 5)), max_size=12)


@given(st.lists(held, min_size=2, max_size=2), st.lists(held, min_size=2, max_size=2))
def test_every_rank_of_a_planned_step_has_a_source_that_holds_it(memory, disk):
    inventories = [inv(r, (f"h{r}", r), [2 * r, 2 * r + 1], memory[r], disk[r]) for r in range(2)]
    plan = make_plan(inventories, 4)
    if plan.step is None:
        return
    for g in range(4):
        runner = g // 2
        for source in plan.sources[g]:
            holder = runner if source.kind in (MEMORY, DISK) else source.holder
            have = inventories[holder].disk if source.kind == DISK else inventories[holder].memory
            assert (g, 4, plan.step) in have
    newer = {s for m in memory + disk for _, _, s in m if s > plan.step}
    for step in newer:  # no newer step had every rank
        assert not all(
            any((g, 4, step) in (*i.memory, *(i.disk if i.group_rank == g // 2 else ())) for i in inventories)
            for g in range(4)
        )
