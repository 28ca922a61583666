"""What an idle ``fsm`` node costs its store (issue #38): the store holds each node's membership
watch and keeps its lease alive meanwhile (one request per ``keep_alive_hold``, not one per
``keep_alive_interval``), the watch carries keys a node subscribed to (a peer's job-wide drain
answers it: no polling), and the connection that owns a lease is probed by TCP keep-alive (a
silent host is found by the store host's kernel, without requests). Real store, real handlers;
no test is timed beyond generous bounds."""

from __future__ import annotations

import select
import socket
import threading
import time
import uuid

import pytest

from fsm_agent.plugins.rendezvous_fsm.store import StoreClient, StoreServer
from tests.rendezvous.test_fsm_backend import nodes, readable, rendezvous_all  # noqa: F401

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

INFO = {"addr": "127.0.0.1", "port": 1, "host": False, "node_rank": None}


def _join_alone(client: StoreClient, run: str, node: str, lease: str, ttl: float) -> dict:
    """``node`` joins a one-node run, creating its lease (``ttl``) on ``client``'s connection."""
    return client.rendezvous(
        "join",
        30,
        run=run,
        node=node,
        lease=lease,
        lease_ttl=ttl,
        probe=0.5,
        info=INFO,
        min=1,
        max=1,
        last_call_timeout=0.1,
        rejoin_timeout=30,
        returned_round=None,
        standby=False,
    )


def _watch(client: StoreClient, run: str, node: str, rnd: int, hold: float, **fields) -> None:
    """Send a membership watch on ``client`` without waiting for its answer."""
    req = {"op": "rdzv_watch", "run": run, "node": node, "round": rnd, "lost": 0, "waiting": 0, "timeout": hold}
    with client._lock:
        if client._sock is None:
            client._open()
        client._send({**req, **fields})


def _answered(client: StoreClient, within: float) -> dict | None:
    if not client._buf and not select.select([client._sock], [], [], within)[0]:
        return None
    return client._recv(time.monotonic() + 30)


@pytest.fixture
def store():
    server = StoreServer().start()
    clients: list[StoreClient] = []

    def client() -> StoreClient:
        clients.append(StoreClient("127.0.0.1", server.port))
        return clients[-1]

    yield server, client
    for c in clients:
        c.close()
    server.close()


def test_a_held_watch_keeps_the_lease_alive_without_requests(store):
    server, client = store
    run, node = f"hold-{uuid.uuid4().hex[:6]}", "n0"
    lease = f"{run}/alive/{node}"
    owner, watcher, observer = client(), client(), client()
    rnd = _join_alone(owner, run, node, lease, ttl=0.3)["round"]
    _watch(watcher, run, node, rnd, hold=60, lease=lease, ttl=0.3)
    time.sleep(1.5)  # five lease timeouts, and no request renews it: the held watch does
    assert observer.exists([lease]) == [True]
    assert _answered(watcher, 0) is None
    requests = observer.stats()["ops"]
    assert requests.get("touch", 0) == 0 and requests["rdzv_watch"] == 1
    version = observer.get_versioned([lease])[1][0]
    watcher.close()  # the hold ends with its connection: the lease now lapses ttl later
    changed, _ = observer.watch({lease: version}, timeout=30)
    assert changed == {lease: 0}


def test_a_watch_answered_early_leaves_the_lease_its_ttl_only(store):
    server, client = store
    run, node = f"early-{uuid.uuid4().hex[:6]}", "n0"
    lease, key = f"{run}/alive/{node}", f"{run}/round/0/some/key"
    owner, watcher, observer = client(), client(), client()
    rnd = _join_alone(owner, run, node, lease, ttl=0.5)["round"]
    _watch(watcher, run, node, rnd, hold=60, lease=lease, ttl=0.5, versions={key: 0})
    observer.set(key, "x")
    reply = _answered(watcher, 30)
    assert reply is not None and reply["changed"] == {key: observer.get_versioned([key])[1][0]}
    # The node does not watch again (hung): its lease ends ttl after the answer, not at the hold's end.
    version = observer.get_versioned([lease])[1][0]
    changed, _ = observer.watch({lease: version}, timeout=30)
    assert changed == {lease: 0}


def test_a_watched_key_answers_the_held_watch_with_its_new_version(store):
    server, client = store
    run, node = f"keys-{uuid.uuid4().hex[:6]}", "n0"
    lease, key = f"{run}/alive/{node}", f"{run}/round/0/fsm_agent/drain/job"
    owner, watcher, peer = client(), client(), client()
    rnd = _join_alone(owner, run, node, lease, ttl=30)["round"]
    _watch(watcher, run, node, rnd, hold=60, lease=lease, ttl=30, versions={key: 0})
    assert _answered(watcher, 0.5) is None  # nothing changed: held
    version = peer.set(key, "a peer drains the job")
    reply = _answered(watcher, 30)
    assert reply == {"ok": True, "lost": 0, "waiting": 0, "changed": {key: version}}
    # A watch that carries an old version is answered at once.
    _watch(watcher, run, node, rnd, hold=60, lease=lease, ttl=30, versions={key: 0})
    assert _answered(watcher, 30)["changed"] == {key: version}
    # One that carries the current version is held; its timeout answers it with nothing changed.
    _watch(watcher, run, node, rnd, hold=0.2, lease=lease, ttl=30, versions={key: version})
    assert _answered(watcher, 30)["changed"] == {}


def test_the_connection_that_owns_a_lease_is_probed_by_tcp_keep_alive(store):
    server, client = store
    run, node = f"probe-{uuid.uuid4().hex[:6]}", "n0"
    lease = f"{run}/alive/{node}"
    _join_alone(client(), run, node, lease, ttl=1.5)
    sock = server._data[lease].owner.sock  # the server's end of the join's connection
    assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
    if hasattr(socket, "TCP_KEEPIDLE"):
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 1  # whole seconds, at least 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 1
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 1500  # the ttl, in ms


# -- the handler: subscriptions ------------------------------------------------------------------------
def _ops(port: int) -> dict[str, int]:
    c = StoreClient("127.0.0.1", port)
    try:
        return c.stats()["ops"]
    finally:
        c.close()


def _diff(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


def test_a_subscribed_key_wakes_the_node_without_polling(nodes):  # noqa: F811
    a, b = nodes.add(2, 2), nodes.add(2, 2)
    results, _ = rendezvous_all([a, b])
    store_a, store_b = (r.store for r in results)
    woken = threading.Event()
    assert store_b.subscribe("fsm_agent/drain/job", woken.set)
    time.sleep(1.0)
    before = _ops(a.port)
    time.sleep(2.0)  # idle: the watches are held, nothing is polled
    idle = _diff(_ops(a.port), before)
    assert set(idle) <= {"hello", "stats"}, idle
    assert not woken.is_set()
    store_a.set("fsm_agent/drain/job", "a drains the job")
    assert woken.wait(30)
    assert not readable(b.membership_fd(), 0)  # a key, not a membership change


def test_a_key_set_before_the_subscription_fires_at_once(nodes):  # noqa: F811
    a, b = nodes.add(2, 2), nodes.add(2, 2)
    results, _ = rendezvous_all([a, b])
    results[0].store.set("fsm_agent/drain/job", "early")
    woken = threading.Event()
    assert results[1].store.subscribe("fsm_agent/drain/job", woken.set)
    assert woken.wait(30)


def test_a_subscription_is_carried_into_the_next_round_without_a_poke(nodes):  # noqa: F811
    a, b = nodes.add(2, 2), nodes.add(2, 2)
    results, _ = rendezvous_all([a, b])
    assert results[1].store.subscribe("fsm_agent/drain/job", lambda: None)
    results, _ = rendezvous_all([a, b])  # the next round
    time.sleep(0.5)  # b's first watch of the round is sent, already carrying the key
    before = _ops(a.port)
    woken = threading.Event()
    assert results[1].store.subscribe("fsm_agent/drain/job", woken.set)
    assert "set" not in _diff(_ops(a.port), before)  # no poke: the watch held now carries it
    results[0].store.set("fsm_agent/drain/job", "next round")
    assert woken.wait(30)


def test_a_one_node_job_cannot_subscribe_and_its_callers_poll(nodes):  # noqa: F811
    solo = nodes.add(1, 1)
    (result,), _ = rendezvous_all([solo])
    assert result.store.subscribe("fsm_agent/drain/job", lambda: None) is False


def test_a_late_node_that_fills_every_seat_answers_the_held_watch_at_once(nodes):  # noqa: F811
    """Nodes waiting to join are reported at once when they fill every seat: the store answers
    the held watch then, not at its hold's end (60 s here; the test waits less)."""
    first = nodes.add(1, 2, keep_alive_hold=60)
    rendezvous_all([first])
    late = nodes.add(1, 2, keep_alive_hold=60)
    box: dict = {}
    joiner = threading.Thread(target=lambda: box.setdefault("info", late.next_rendezvous()), daemon=True)
    joiner.start()
    assert readable(first.membership_fd(), 30)
    assert first.num_nodes_waiting() == 1 and first.num_nodes_lost() == 0
    results, _ = rendezvous_all([first])
    joiner.join(30)
    assert results[0].world_size == 2 and box["info"].world_size == 2


# -- a node that joins the next round ------------------------------------------------------------------
def test_a_node_joining_the_next_round_keeps_its_lease_while_the_round_forms(nodes):  # noqa: F811
    """A node's membership watch of the round it leaves must not outlive its join: while held it
    stops the keep-alive's touches, and the join renews the lease for one ttl only. The round
    then forming for longer than the ttl (a peer slow to come back) lost the node spuriously."""
    a, b, c = (nodes.add(3, 3) for _ in range(3))
    rendezvous_all([a, b, c])
    time.sleep(0.5)  # all hold their membership watch of round 0
    joined: dict = {}

    def join(name, handler):
        try:
            joined[name] = handler.next_rendezvous()
        except Exception as exc:  # noqa: BLE001 - handed to the test
            joined[name] = exc

    threads = [threading.Thread(target=join, args=(n, h), daemon=True) for n, h in (("c", c), ("a", a))]
    threads[0].start()  # c opens round 1: a and b hear of it and watch round 0 again, knowing
    time.sleep(0.5)
    threads[1].start()  # a joins round 1 while that watch of round 0 is held
    time.sleep(4 * 0.2 * 3)  # then waits for b for four of its lease's ttl (FAST: 0.6 s)
    join("b", b)
    for t in threads:
        t.join(30)
    assert sorted(r.rank for r in joined.values()) == [0, 1, 2], joined  # one round, all three in it
    # a's lease never lapsed: its join was not sent back for a new lease, nobody counted it lost
    assert _ops(a.port).get("status:no_lease", 0) == 0, _ops(a.port)
    assert [h.num_nodes_lost() for h in (a, b, c)] == [0, 0, 0]
