"""What keeps the ``fsm`` rendezvous O(1) per node at scale (issue #17): two store connections
and one keep-alive thread per node, the lease kept by the held membership watch, and a loss storm
that wakes each watcher once per round, not once per lost node. Real store, real handlers."""

from __future__ import annotations

import select
import threading
import time
import uuid

import psutil
import pytest

from fsm_agent.plugins.rendezvous_fsm.store import StoreClient, StoreServer
from tests.rendezvous.test_fsm_backend import FAST_LOST_BOUND, nodes, readable, rendezvous_all  # noqa: F401

pytestmark = [pytest.mark.unit, pytest.mark.timeout(90)]


def _store_sockets(port: int) -> int:
    """This process's TCP connections to the store at 127.0.0.1:``port`` (client side)."""
    return sum(
        1
        for c in psutil.Process().net_connections(kind="tcp")
        if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
    )


def test_a_node_holds_two_store_connections_and_one_keep_alive_thread(nodes):  # noqa: F811
    a, b, c = (nodes.add(2, 3) for _ in range(3))
    rendezvous_all([a, b, c])
    c.shutdown()  # a and b hear it on their keep-alive connection (their watch)
    assert readable(a.membership_fd(), 5) and readable(b.membership_fd(), 5)
    assert _store_sockets(a.port) == 2 * 2
    threads = [t for t in threading.enumerate() if t.name.startswith("fsm-rdzv-") and nodes.run_id in t.name]
    assert sorted(t.name for t in threads) == [f"fsm-rdzv-keep-alive-{nodes.run_id}"] * 2


def test_the_held_membership_watch_alone_keeps_the_lease(nodes):  # noqa: F811
    """In a round the store keeps a node's lease while it holds the node's watch: several lease
    timeouts pass with no request at all, and nobody is lost."""
    a, b = nodes.add(2, 2, keep_alive_hold=60), nodes.add(2, 2, keep_alive_hold=60)
    rendezvous_all([a, b])
    run = a._server._runs[nodes.run_id]  # a hosts the store
    end = time.monotonic() + 30
    while len(run.watchers) < 2 and time.monotonic() < end:  # the store holds both watches
        time.sleep(0.01)
    stats = StoreClient("127.0.0.1", a.port)
    try:
        before = stats.stats()["ops"]
        time.sleep(4 * FAST_LOST_BOUND)  # several lease timeouts: no touch, no watch renews the leases
        after = stats.stats()["ops"]
    finally:
        stats.close()
    assert not readable(a.membership_fd(), 0) and a.num_nodes_lost() == 0 and b.num_nodes_lost() == 0
    assert after.get("touch", 0) == before.get("touch", 0)
    assert after["rdzv_watch"] == before["rdzv_watch"]


def _join(client: StoreClient, run: str, node: str, lease: str, n: int, out: dict) -> None:
    client.set(lease, node, ttl=60, ephemeral=True)
    info = {"addr": "127.0.0.1", "port": 1, "host": False, "node_rank": None}
    out[node] = client.rendezvous(
        "join",
        30,
        run=run,
        node=node,
        lease=lease,
        info=info,
        min=n,
        max=n,
        last_call_timeout=0.1,
        rejoin_timeout=30,
        returned_round=None,
        standby=False,
    )


def test_a_second_lost_node_does_not_wake_a_watcher_that_saw_the_first():
    server = StoreServer().start()
    run, n = f"storm-{uuid.uuid4().hex[:8]}", 4
    clients = [StoreClient("127.0.0.1", server.port) for _ in range(n + 1)]
    try:
        out: dict = {}
        joins = [
            threading.Thread(target=_join, args=(clients[i], run, f"n{i}", f"{run}/alive/n{i}", n, out))
            for i in range(n)
        ]
        for t in joins:
            t.start()
        for t in joins:
            t.join(30)
        assert sorted(r["rank"] for r in out.values()) == list(range(n))
        rnd = out["n0"]["round"]
        clients[3].close()  # n3 dies: its lease ends with its connection
        watcher = clients[n]
        first = watcher.rendezvous("watch", 30, run=run, node="n0", round=rnd, lost=0, waiting=0)
        assert first["lost"] == 1
        # n0 saw a loss; now n2 dies too. Before, each lost node answered every watcher again.
        watcher._send(
            {"op": "rdzv_watch", "run": run, "node": "n0", "round": rnd, "lost": 1, "waiting": 0, "timeout": 2.0}
        )
        clients[2].close()
        assert not select.select([watcher._sock], [], [], 0.5)[0], "the second loss woke the watcher"
        reply = watcher._recv(time.monotonic() + 30)  # its timeout answers it, with the count up to date
        assert reply["ok"] and reply["lost"] == 2
    finally:
        for c in clients:
            c.close()
        server.close()
