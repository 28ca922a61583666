"""A peer's job-wide drain where the round's store tells of its key's changes (``fsm``:
``PrefixStore.subscribe``, the key carried by the node's held membership watch): the agent asks
the store only when told, so an idle agent makes no request for it, and a drain announced by one
node still reaches the others. A store that cannot tell (c10d's) is looked at on a schedule, as
before. Not timed beyond generous bounds."""

from __future__ import annotations

import os
import select
import time
import types

import pytest

from fsm_agent import drain as drain_module
from fsm_agent.drain import JOB_DRAIN_KEY, JOB_DRAIN_SEEN_KEY, NODE_DRAIN_KEY, NodeDrain
from fsm_agent.interrupts import empty_pipe
from fsm_agent.plugins.rendezvous_fsm.store import StoreClient
from tests.rendezvous.test_fsm_backend import nodes, rendezvous_all  # noqa: F401

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


class _Store:
    """A round's store that counts what is asked of it; ``tells``: it offers ``subscribe``."""

    def __init__(self, tells: bool):
        self.data: dict[str, bytes] = {}
        self.asked: list[str] = []
        self.callbacks: list = []
        self.tells = tells

    def subscribe(self, key: str, callback) -> bool:
        if not self.tells:
            return False
        self.callbacks.append((key, callback))
        return True

    def check(self, keys) -> bool:
        self.asked.append("check")
        return all(k in self.data for k in keys)

    def get(self, key: str) -> bytes:
        self.asked.append("get")
        return self.data[key]

    def add(self, key: str, amount: int) -> int:
        self.asked.append("add")
        value = int(self.data.get(key, b"0")) + amount
        self.data[key] = str(value).encode()
        return value


@pytest.fixture
def pipe():
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    yield r, w
    os.close(r)
    os.close(w)


@pytest.fixture
def every_call_is_due(monkeypatch):
    """Every ``look_if_due`` is due, and so is every scheduled look at the store: no clock in the test."""
    monkeypatch.setattr(drain_module, "DRAIN_POLL_S", 0.0)
    monkeypatch.setattr(drain_module, "job_drain_look_interval", lambda world: 0.0)


def _group(store) -> types.SimpleNamespace:
    return types.SimpleNamespace(store=store, group_world_size=2, group_rank=1)


def test_a_store_that_tells_is_asked_only_once_it_told(pipe, every_call_is_due):
    wake_r, wake_w = pipe
    store, drain = _Store(tells=True), NodeDrain("trainer", wake_w)
    group = _group(store)
    for _ in range(20):
        drain.look_if_due(group, healthy=True)
    assert store.asked == [] and drain.request is None
    callbacks = dict(store.callbacks)  # one subscription per key per round's store
    assert len(store.callbacks) == 2 and set(callbacks) == {JOB_DRAIN_KEY, NODE_DRAIN_KEY}
    callback = callbacks[JOB_DRAIN_KEY]
    store.data[JOB_DRAIN_KEY] = b"node0 (group_rank 0): signal SIGUSR2"
    callback()
    assert select.select([wake_r], [], [], 0)[0]  # the run loop wakes
    assert drain.seconds_to_next_look() == 0.0
    drain.look_if_due(group, healthy=True)
    assert store.asked == ["check", "get", "add"]  # looked once, and counted itself as having seen it
    assert drain.request == {"scope": "job", "source": "peer", "by": "node0 (group_rank 0): signal SIGUSR2"}
    assert store.data[JOB_DRAIN_SEEN_KEY] == b"1"


def test_a_store_that_cannot_tell_is_looked_at_on_its_schedule(pipe, every_call_is_due):
    store, drain = _Store(tells=False), NodeDrain("trainer", pipe[1])
    group = _group(store)
    for _ in range(5):
        drain.look_if_due(group, healthy=True)
    assert store.asked == ["check"] * 5


def test_news_waits_for_a_healthy_look_and_a_closed_drain_hears_none(pipe, every_call_is_due):
    wake_r, wake_w = pipe
    store, drain = _Store(tells=True), NodeDrain("trainer", wake_w)
    group = _group(store)
    drain.look_if_due(group, healthy=True)
    callback = dict(store.callbacks)[JOB_DRAIN_KEY]
    callback()
    drain.look_if_due(group, healthy=False)  # not while the workers are unhealthy
    assert store.asked == []
    drain.look_if_due(group, healthy=True)
    assert store.asked == ["check"]  # nothing announced: a spurious wake costs one look
    empty_pipe(wake_r)
    drain.closed = True
    callback()
    assert not select.select([wake_r], [], [], 0)[0]


def test_a_new_rounds_store_is_subscribed_to_again(pipe, every_call_is_due):
    wake_r, wake_w = pipe
    drain = NodeDrain("trainer", wake_w)
    first, second = _Store(tells=True), _Store(tells=True)
    drain.look_if_due(_group(first), healthy=True)
    drain.look_if_due(_group(second), healthy=True)
    assert len(first.callbacks) == 2 and len(second.callbacks) == 2
    for _, callback in first.callbacks:  # the old round's store: not this drain's news any more
        callback()
    assert not select.select([wake_r], [], [], 0)[0]
    assert not drain.peer_leaving(_group(second))
    dict(second.callbacks)[JOB_DRAIN_KEY]()
    assert select.select([wake_r], [], [], 0)[0]


def test_a_peer_that_announces_it_leaves_is_heard_at_once_from_a_store_that_tells(pipe, every_call_is_due):
    """A peer's stop signal or node drain (``NODE_DRAIN_KEY``) is a membership change as soon as
    the store tells of it, not only once this node's workers fail (under in-process restart they
    do not: they wait for a new generation)."""
    wake_r, wake_w = pipe
    store, drain = _Store(tells=True), NodeDrain("trainer", wake_w)
    group = _group(store)
    drain.look_if_due(group, healthy=True)
    assert not drain.peer_leaving(group) and store.asked == []  # no news: no request
    leaving = dict(store.callbacks)[NODE_DRAIN_KEY]
    leaving()  # a spurious wake (the key not set): one look, no change
    assert select.select([wake_r], [], [], 0)[0] and drain.seconds_to_next_look() == 0.0
    assert not drain.peer_leaving(group) and store.asked == ["check"]
    store.data[NODE_DRAIN_KEY] = b"1"
    leaving()
    assert drain.peer_leaving(group) and store.asked == ["check", "check"]
    assert not drain.peer_leaving(group)  # told once, heard once
    drain.take("node", "signal", "SIGTERM")  # this node leaves itself: its own announcement is no news
    leaving()
    assert not drain.peer_leaving(group)


def test_a_store_that_cannot_tell_is_never_asked_whether_a_peer_leaves(pipe, every_call_is_due):
    store, drain = _Store(tells=False), NodeDrain("trainer", pipe[1])
    store.data[NODE_DRAIN_KEY] = b"1"
    drain.look_if_due(_group(store), healthy=True)
    asked = list(store.asked)
    assert not drain.peer_leaving(_group(store)) and store.asked == asked  # its workers' failure tells


def test_a_job_wide_drain_reaches_the_other_fsm_node_through_its_held_watch(nodes, pipe):  # noqa: F811
    """Two real ``fsm`` handlers: node b's drain makes no request while idle; node a announces a
    job-wide drain; b's run loop is woken, looks once and drains, and a sees it counted."""
    wake_r, wake_w = pipe
    a, b = nodes.add(2, 2), nodes.add(2, 2)
    results, _ = rendezvous_all([a, b])
    group_a = types.SimpleNamespace(store=results[0].store, group_world_size=2, group_rank=results[0].rank)
    group_b = types.SimpleNamespace(store=results[1].store, group_world_size=2, group_rank=results[1].rank)
    a_r, a_w = os.pipe()
    drain_a, drain_b = NodeDrain("trainer", a_w), NodeDrain("trainer", wake_w)
    stats = StoreClient("127.0.0.1", a.port)
    try:
        drain_b.look_if_due(group_b, healthy=True)  # subscribes
        time.sleep(0.5)
        before = stats.stats()["ops"].get("check", 0)
        end = time.monotonic() + 2.0
        while time.monotonic() < end:  # b's run loop, idle
            select.select([wake_r], [], [], drain_b.seconds_to_next_look())
            empty_pipe(wake_r)
            drain_b.look_if_due(group_b, healthy=True)
        assert stats.stats()["ops"].get("check", 0) == before  # no look at the store while idle
        drain_a.take("job", "signal", "SIGUSR2")
        drain_a.announce(group_a, "host-a", lambda name, fn: fn())
        end = time.monotonic() + 60
        while drain_b.request is None and time.monotonic() < end:
            select.select([wake_r], [], [], drain_b.seconds_to_next_look())
            empty_pipe(wake_r)
            drain_b.look_if_due(group_b, healthy=True)
        assert drain_b.request is not None and drain_b.request["scope"] == "job", drain_b.request
        assert drain_b.request["source"] == "peer" and "host-a" in drain_b.request["by"]
        assert int(group_a.store.add(JOB_DRAIN_SEEN_KEY, 0)) == 1
    finally:
        stats.close()
        os.close(a_r)
        os.close(a_w)
