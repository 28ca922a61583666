"""The fsm planner's settle window (``last_call_timeout``, torch's c10d default of 30 s, #30.8),
on the planner's own clock (seconds): a first round below ``max_nodes`` waits it out; a late node
is reported to the running round after waiting it out, or at once when it fills every seat; and a
round it then opens is not held back for it a second time."""

from __future__ import annotations

import pytest

from fsm_agent.plugins.rendezvous_fsm.planner import DEFAULT_LAST_CALL_TIMEOUT_S, Node, Rendezvous

pytestmark = pytest.mark.unit

T = DEFAULT_LAST_CALL_TIMEOUT_S


def _join(r: Rendezvous, me: str, now: float, returned_round: int | None = None):
    joined = r.join(me, Node("127.0.0.1", 29500), now, returned_round)
    ranked, _ = r.tick(now)
    return joined, ranked


def test_a_first_round_below_max_nodes_waits_the_settle_window():
    r = Rendezvous(1, 2)
    _join(r, "a", 0.0)
    assert not r.complete and r.deadline() == T
    assert r.tick(T - 0.1) == ([], []) and not r.complete
    _, ranked = _join(r, "b", 10.0)  # max_nodes: complete at once
    assert ranked == ["a", "b"] and r.round == 0


def test_a_late_node_that_waited_the_window_is_not_waited_for_again():
    r = Rendezvous(2, 4)
    _join(r, "a", 0.0)
    _join(r, "b", 0.0)
    assert r.tick(T) == (["a", "b"], [])
    _join(r, "c", 100.0)  # the running round has room for two more
    assert r.membership("a", 0, 100.0)[1] == 0 and r.waiting_due_at() == 100.0 + T
    assert r.membership("a", 0, 100.0 + T)[1] == 1  # reported: the group restarts to take it
    _join(r, "a", 100.0 + T, returned_round=0)  # opens round 1; c is seated from the wait list
    _, ranked = _join(r, "b", 101.0 + T, returned_round=0)
    assert ranked == ["a", "b", "c"] and r.round == 1  # no second window for c


def test_a_late_node_that_fills_every_seat_is_reported_at_once():
    r = Rendezvous(2, 3)
    _join(r, "a", 0.0)
    _join(r, "b", 0.0)
    r.tick(T)
    _join(r, "c", 100.0)
    assert r.waiting_due_at() == 100.0 and r.membership("a", 0, 100.0)[1] == 1


def test_a_node_new_to_the_run_in_a_later_round_still_settles():
    r = Rendezvous(1, 3)
    _join(r, "a", 0.0)
    r.tick(T)
    _, ranked = _join(r, "a", 50.0, returned_round=0)  # a restart: round 1 opens with a alone
    assert ranked == ["a"] and r.round == 1  # no one new: at once
    r.join("a", Node("127.0.0.1", 29500), 60.0, 1)  # round 2 opens; d joins before the store ticks
    r.join("d", Node("127.0.0.1", 29500), 60.0, None)  # new to the run, seated directly: it settles
    assert r.tick(60.0) == ([], []) and r.deadline() == 60.0 + T
    assert r.tick(60.0 + T) == (["a", "d"], [])
