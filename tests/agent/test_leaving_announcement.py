"""The ``stop_requested`` row's ``_announce_leaving`` on the statechart test kit: a signalled node
tells its round (the node drain's key in the round's store) only while its workers run in a
round shared with other nodes; a node whose workers all succeeded (it waits in its exit barrier)
fails nobody and must not, or a survivor's later genuine failure would go uncounted.
The real-agent path is tests/agent/test_preempted_node.py."""

from __future__ import annotations

import signal

import pytest

from fsm_agent.drain import NODE_DRAIN_KEY
from fsm_agent.testing import Scenario

pytestmark = pytest.mark.unit


def _announced(run) -> bool:
    return bool(run.rendezvous.infos[-1].store.check([NODE_DRAIN_KEY]))


def test_a_signalled_node_announces_it_leaves_before_its_workers_stop():
    run = Scenario().rendezvous(rank=1, world_size=2).attempt("never").signal(signal.SIGTERM, at=1).run()
    assert run.result.signal == signal.SIGTERM, run.result
    assert _announced(run)


def test_a_signalled_node_alone_in_its_round_has_nobody_to_tell():
    run = Scenario().rendezvous(rank=0, world_size=1).attempt("never").signal(signal.SIGTERM, at=1).run()
    assert run.result.signal == signal.SIGTERM, run.result
    assert not run.rendezvous.infos[-1].store.check([NODE_DRAIN_KEY])


def test_a_node_whose_workers_all_succeeded_does_not_announce(monkeypatch):
    """SIGTERM while the node waits in its exit barrier (its workers exited 0): nobody's workers
    fail because of it, and the survivors run on in the same round."""
    from fsm_agent.exit_barrier import ExitBarrier

    def barrier_then_signal(self, group, call):
        signal.raise_signal(signal.SIGTERM)  # the agent's handler turns it into a stop
        call("exit-barrier", lambda: None)

    monkeypatch.setattr(ExitBarrier, "wait", barrier_then_signal)
    run = Scenario().rendezvous(rank=1, world_size=2).attempt("all_ok").run()
    assert run.result.signal == signal.SIGTERM, run.result
    assert not _announced(run)
