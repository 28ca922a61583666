"""The ``fsm`` rendezvous planner (``planner.Rendezvous``) over random join / leave / loss / restart
interleavings of up to 64 nodes, driven as the store drives it: one request at a time, then
``tick``, with a clock that only moves forward. Nodes are modelled as clients that block in a
join until the store answers them."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsm_agent.plugins.rendezvous_fsm.planner import Node, Rendezvous

pytestmark = pytest.mark.property

MAX_NODES = 64
OPS = ("join", "join", "join", "restart", "leave", "lose", "tick")


@st.composite
def scenarios(draw):
    max_nodes = draw(st.integers(1, MAX_NODES))
    min_nodes = draw(st.one_of(st.integers(1, min(max_nodes, 3)), st.integers(1, max_nodes)))
    n_ids = min(MAX_NODES, max_nodes + draw(st.integers(0, 3)))  # a few nodes more than fit
    steps = draw(
        st.lists(
            st.tuples(
                st.sampled_from(OPS),
                st.integers(0, n_ids - 1),
                st.sampled_from([0.0, 0.0, 0.0, 0.1, 0.3, 0.6, 2.0, 61.0]),
            ),
            min_size=1,
            max_size=400,
        )
    )
    hints = draw(st.dictionaries(st.integers(0, n_ids - 1), st.integers(0, 3), max_size=4))
    return min_nodes, max_nodes, steps, hints


class Clients:
    """What each node sees: blocked in a join, or ranked in a round, or gone."""

    def __init__(self, rdzv: Rendezvous):
        self.rdzv = rdzv
        self.blocked: set[str] = set()
        self.ranked: dict[str, tuple[int, int]] = {}  # node -> (round, rank) of its last answer
        self.completed: dict[int, dict[str, int]] = {}  # round -> ranks, recorded once

    def answer(self, ranked: list[str], away: list[str]) -> None:
        r = self.rdzv
        if ranked:
            assert r.round not in self.completed, f"round {r.round} completed twice"
            ranks = r.ranks()
            assert sorted(ranks.values()) == list(range(len(ranks))), "ranks are not 0..n-1"
            assert set(ranks) == set(ranked) and len(ranks) <= r.max_nodes and len(ranks) >= r.min_nodes
            # every participant was a node blocked in its join, and every one gets its answer
            assert set(ranked) <= self.blocked, set(ranked) - self.blocked
            self._stable(ranks)
            self.completed[r.round] = dict(ranks)
            for p in ranked:
                self.blocked.discard(p)
                self.ranked[p] = (r.round, ranks[p])
        for p in away:
            assert p in self.blocked and r._live_participants() >= r.max_nodes
            self.blocked.discard(p)

    def _stable(self, ranks: dict[str, int]) -> None:
        """Ranks follow (hint, host, first-join order): two nodes of two rounds keep their order."""
        nodes = self.rdzv.nodes
        order = sorted(ranks, key=ranks.__getitem__)
        keys = [(nodes[p].node_rank if nodes[p].node_rank is not None else float("inf"), nodes[p].seq) for p in order]
        assert keys == sorted(keys)


def check_invariants(r: Rendezvous, c: Clients) -> None:
    parts = set(r.participants)
    assert len(parts) <= r.max_nodes
    assert parts <= set(r.nodes) | r.lost
    assert not ((parts - r.lost) & set(r.wait_list)), "a node both seated and waiting"
    if not r.complete:
        assert parts <= set(r.nodes), "a gone node still holds a seat"
        assert not (r.reserved & parts) and r.reserved <= set(r.nodes)
        assert len(parts) + len(r.reserved) <= r.max_nodes, "a new node took a reserved seat"
        assert r._settling <= {p for p in parts if r.nodes[p].rounds == 0}, "a node settles that ran a round"
    else:
        assert all(v is not None for v in r.participants.values())
    assert set(r.wait_list) <= set(r.nodes)
    if r.complete and r.wait_list:  # someone is left to open the next round for the waiting nodes
        assert r._live_participants() > 0, "nodes wait for a round that no live node will open"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_planner_keeps_its_guarantees_over_any_interleaving(scenario):
    min_nodes, max_nodes, steps, hints = scenario
    r = Rendezvous(min_nodes, max_nodes, last_call_timeout=0.5, rejoin_timeout=60.0)
    c = Clients(r)
    now = 0.0
    for op, i, dt in steps:
        now += dt
        me = f"n{i}"
        if op in ("join", "restart"):
            if me in c.blocked:
                op = "tick"  # a client joins again only after an answer
            elif me in c.ranked and me in r.nodes:
                op = "restart"  # a ranked node asks again: its workers failed, or it saw a change
            elif op == "restart":
                op = "join"
        if op in ("join", "restart"):
            returned = c.ranked[me][0] if op == "restart" else None
            was_complete_full = r.complete and r._live_participants() >= r.max_nodes and me not in r.participants
            joined = r.join(me, Node(me, 1000 + i, node_rank=hints.get(i)), now, returned)
            if joined.status == "wait":
                c.blocked.add(me)
                c.ranked.pop(me, None)
            elif joined.status == "not_needed":
                assert was_complete_full and me not in r.nodes
                c.ranked.pop(me, None)
            else:
                assert joined.status == "ranked" and r.complete and joined.rank == r.participants[me]
        elif op == "leave" and me in c.blocked:
            r.leave(me, now, forget=False)  # a join that timed out: back to the wait list, or out
            c.blocked.discard(me)
        elif op == "lose" and me in r.nodes:
            r.lose(me, now)
            c.blocked.discard(me)
            c.ranked.pop(me, None)
            if r.complete and me in r.participants:
                assert me in r.lost
        c.answer(*r.tick(now))
        check_invariants(r, c)
    # liveness: with no more requests, once the deadline passes a round with min live nodes completes
    if not r.complete and len(r.participants) >= r.min_nodes:
        deadline = r.deadline()
        assert deadline <= now + 60.0
        c.answer(*r.tick(max(now, deadline)))
        assert r.complete, "min nodes joined but the round never completes"
        assert not (c.blocked & set(r.participants)), "a live participant left unranked"
    check_invariants(r, c)


def test_the_property_test_sees_a_double_completion():
    """Not vacuous: a round that completes again is caught by ``Clients.answer``."""
    r = Rendezvous(1, 2, last_call_timeout=0.0)
    c = Clients(r)
    r.join("a", Node("a", 1), 0.0, None)
    c.blocked.add("a")
    c.answer(*r.tick(0.0))
    r.complete = False  # a broken planner that reopens the completed round
    c.blocked.add("a")
    try:
        c.answer(*r.tick(1.0))
    except AssertionError as exc:
        assert "completed twice" in str(exc)
    else:
        raise AssertionError("a double completion went unnoticed")
