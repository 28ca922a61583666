"""Hot spares on the ``fsm`` backend: nodes beyond ``max_nodes`` wait as standbys (torch's
redundancy list) and take the seat of a lost node in the next round.

The planner (``planner.Rendezvous``) alone, then real handlers on 127.0.0.1 (their store in one of
them). Agents end to end: ``tests/agent/test_hot_spares.py`` and ``tests/agent/test_netns.py``.
"""

from __future__ import annotations

import math
import threading
import time

import pytest

from fsm_agent.errors import RendezvousNotNeeded
from fsm_agent.plugins.rendezvous_fsm import Node, Rendezvous
from tests.rendezvous.test_fsm_backend import Nodes, readable, rendezvous_all, start_rendezvous

pytestmark = [pytest.mark.unit, pytest.mark.timeout(90)]


def _join(rdzv, me, now=0.0, returned=None):
    joined = rdzv.join(me, Node(me, 1000), now, returned)
    ranked, away = rdzv.tick(now)
    return joined, ranked, away


def _full_round(rejoin_timeout=60.0):
    """a and b ranked in round 0 of ``--nnodes 2:2``; c joins and waits as a standby."""
    rdzv = Rendezvous(2, 2, last_call_timeout=0.5, rejoin_timeout=rejoin_timeout)
    _join(rdzv, "a")
    assert _join(rdzv, "b")[1] == ["a", "b"]
    joined, ranked, away = _join(rdzv, "c", now=0.1)
    assert (joined.status, ranked, away) == ("wait", [], [])
    assert rdzv.is_standby("c") and "c" in rdzv.nodes and "c" not in rdzv.participants
    return rdzv


# -- the planner -------------------------------------------------------------------------------------------
def test_plan_standby_never_counts_and_never_wakes_the_round():
    rdzv = _full_round()
    assert rdzv.membership("a", 0, 5.0) == (0, 0, math.inf)  # no re-rendezvous for a standby
    assert rdzv.waiting_due_at() == math.inf
    joined, _, _ = _join(rdzv, "d", now=0.2)  # a second spare: the same
    assert joined.status == "wait" and rdzv.is_standby("d") and len(rdzv.participants) == 2


def test_plan_a_lost_node_seat_goes_to_the_standby_in_the_next_round():
    rdzv = _full_round()
    rdzv.lose("b", 1.0)
    assert rdzv.membership("a", 0, 1.0)[0] == 1  # a is told at once
    assert not rdzv.is_standby("c")  # a seat is free now
    joined, ranked, _ = _join(rdzv, "a", now=1.1, returned=0)  # a re-rendezvouses: c seated at once
    assert (joined.status, ranked, rdzv.round) == ("wait", ["a", "c"], 1)
    assert rdzv.ranks() == {"a": 0, "c": 1} and not rdzv.wait_list


def test_plan_the_previous_rounds_live_node_keeps_its_seat_against_a_standby():
    rdzv = _full_round()
    _join(rdzv, "a", now=1.0, returned=0)  # a restarts (its workers failed): b's seat is reserved
    assert rdzv.reserved == {"b"} and rdzv.is_standby("c") and list(rdzv.participants) == ["a"]
    assert rdzv.tick(30.0) == ([], [])  # b is slow, not gone: c still waits
    _, ranked, _ = _join(rdzv, "b", now=30.0, returned=0)
    assert ranked == ["a", "b"] and rdzv.is_standby("c")


def test_plan_a_survivor_that_never_comes_back_loses_its_seat_after_rejoin_timeout():
    rdzv = _full_round(rejoin_timeout=5.0)
    _join(rdzv, "a", now=10.0, returned=0)
    assert rdzv.deadline() == 15.0  # the store's timer
    assert rdzv.tick(14.9) == ([], []) and rdzv.is_standby("c")
    assert rdzv.tick(15.0)[0] == ["a", "c"] and rdzv.round == 1


def test_plan_standbys_are_not_needed_once_every_participant_left():
    rdzv = _full_round()
    rdzv.leave("a", 1.0)
    assert not rdzv.ended()
    rdzv.leave("b", 1.1)
    assert rdzv.ended() and "c" in rdzv.wait_list


def test_plan_standbys_cannot_overfill_a_round():
    rdzv = Rendezvous(1, 2, last_call_timeout=0.5)
    for i, name in enumerate("abcde"):
        _join(rdzv, name, now=i * 0.01)
    assert rdzv.complete and list(rdzv.ranks()) == ["a", "b"]  # n == max: complete at once
    assert all(rdzv.is_standby(x) for x in "cde")


# -- real handlers -------------------------------------------------------------------------------------------
@pytest.fixture
def nodes():
    n = Nodes()
    yield n
    n.close()


def _standby(nodes, *, min_nodes=2, max_nodes=2, **conf):
    """Two handlers ranked, then a third in a thread: returns (a, b, c, c's thread, c's box, c's messages)."""
    a, b = nodes.add(min_nodes, max_nodes, **conf), nodes.add(min_nodes, max_nodes, **conf)
    results, _ = rendezvous_all([a, b])
    assert {r.world_size for r in results} == {2}, results
    c = nodes.add(min_nodes, max_nodes, **conf)
    told: list[str] = []
    seen = threading.Event()
    c.on_standby = lambda message: (told.append(message), seen.set())
    t, box = start_rendezvous(c)
    assert seen.wait(10), box
    return a, b, c, t, box, told


def test_node_beyond_max_waits_as_a_standby_without_waking_the_round(nodes):
    a, b, c, t, box, told = _standby(nodes, join_timeout=1.0)
    assert told == [told[0]] and told[0].startswith("standby: the job has 2 nodes")
    assert c.standby
    time.sleep(2.0)  # beyond c's join_timeout: a standby waits without one
    assert t.is_alive() and not box
    assert a.num_nodes_waiting() == 0 and b.num_nodes_waiting() == 0
    assert not readable(a.membership_fd(), 0.1) and not readable(b.membership_fd(), 0.1)


def test_standby_takes_the_seat_of_a_lost_node(nodes):
    a, b, c, t, box, _ = _standby(nodes)
    b.shutdown()  # b is gone (a kill is the same for the planner: tests/agent/test_hot_spares.py)
    assert readable(a.membership_fd(), 10) and a.num_nodes_lost() == 1
    info = a.next_rendezvous()
    t.join(10)
    assert "info" in box, box
    assert (info.world_size, box["info"].world_size) == (2, 2)
    assert {info.rank, box["info"].rank} == {0, 1} and not c.standby


def test_standbys_leave_as_not_needed_when_the_job_ends(nodes):
    a, b, c, t, box, _ = _standby(nodes)
    b.shutdown()
    a.shutdown()  # the store host last: it lingers until c has left
    t.join(10)
    assert isinstance(box.get("error"), RendezvousNotNeeded), box
    assert "standby" in str(box["error"])
