"""fsm_agent.plugins.rendezvous_fsm.store: the JSON-lines key-value store the ``fsm`` rendezvous runs on
(``python -m fsm_agent.store`` runs it on its own)."""

from __future__ import annotations

import ast
import contextlib
import errno
import json
import pathlib
import pickle
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest

from fsm_agent.errors import RendezvousFailed
from fsm_agent.plugins.rendezvous_fsm.store import (
    PROTO,
    PrefixStore,
    StoreBindError,
    StoreClient,
    StoreConnectionError,
    StoreProtocolError,
    StoreServer,
    StoreTimeout,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


@pytest.fixture
def server():
    srv = StoreServer().start()
    yield srv
    srv.close()


@pytest.fixture
def clients(server):
    made = []

    def make(**kw) -> StoreClient:
        c = StoreClient("127.0.0.1", server.port, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def port_nobody_listens_on() -> int:
    """A port a StoreServer could bind on 127.0.0.1, closed again (a server started later takes it)."""
    probe = StoreServer().bind()
    port = probe.port
    probe.close()
    return port


def in_thread(fn, *args):
    box: dict = {}

    def run():
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc
        box["t"] = time.monotonic()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def test_server_listens_on_loopback_by_default(server):
    assert server.host == "127.0.0.1"
    assert server._listener.getsockname()[0] == "127.0.0.1"


def test_set_get_bytes_and_str(clients):
    c = clients()
    c.set("a", "text")
    c.set("b", b"\x00\xffbin")
    assert c.get("a") == b"text"
    assert c.get("b") == b"\x00\xffbin"
    assert isinstance(c.get("a"), bytes)


def test_blocking_get_is_woken_by_another_clients_set(clients):
    getter, setter = clients(), clients()
    t, box = in_thread(getter.get, "late", timedelta(seconds=10))
    time.sleep(0.2)  # the test's own pause: make sure get is already blocked on the server
    assert t.is_alive()
    set_at = time.monotonic()
    setter.set("late", b"v")
    t.join(5)
    assert box["value"] == b"v"
    assert box["t"] - set_at < 0.2


def test_wait_is_woken_and_times_out(clients):
    waiter, setter = clients(), clients()
    t, box = in_thread(waiter.wait, ["k1", "k2"], timedelta(seconds=10))
    setter.set("k1", b"1")
    time.sleep(0.1)
    assert t.is_alive(), "wait returned before every key was set"
    setter.set("k2", b"2")
    t.join(5)
    assert "error" not in box
    started = time.monotonic()
    with pytest.raises(StoreTimeout) as info:
        waiter.wait(["never"], timedelta(seconds=0.3))
    assert 0.25 < time.monotonic() - started < 2
    assert isinstance(info.value, RendezvousFailed) and isinstance(info.value, TimeoutError)
    assert f"127.0.0.1:{waiter.port}" in str(info.value)


def test_get_uses_the_store_timeout(clients):
    c = clients(timeout=timedelta(seconds=0.2))
    assert c.timeout == timedelta(seconds=0.2)
    with pytest.raises(StoreTimeout):
        c.get("missing")
    c.set_timeout(timedelta(seconds=5))
    assert c.timeout == timedelta(seconds=5)


def test_add_is_atomic_under_threads(clients):
    threads, per_thread = 8, 200
    results: list[int] = []
    lock = threading.Lock()
    cs = [clients() for _ in range(threads)]

    def work(c):
        mine = [c.add("counter", 1) for _ in range(per_thread)]
        with lock:
            results.extend(mine)

    ts = [threading.Thread(target=work, args=(c,)) for c in cs]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert sorted(results) == list(range(1, threads * per_thread + 1))
    assert cs[0].get("counter") == str(threads * per_thread).encode()
    assert cs[0].add("counter", -5) == threads * per_thread - 5


def test_compare_set_semantics(clients):
    c = clients()
    assert c.compare_set("k", "", "first") == b"first"  # missing + "" -> set
    assert c.compare_set("k", "wrong", "second") == b"first"  # mismatch -> current value
    assert c.compare_set("k", "first", "second") == b"second"  # match -> swapped
    assert c.compare_set("absent", "x", "y") == b"x"  # missing + non-empty: not set (torch)
    assert not c.check(["absent"])


def test_compare_set_has_one_winner_under_threads(clients):
    cs = [clients() for _ in range(8)]
    winners = []

    def race(i, c):
        if c.compare_set("slot", "", f"node{i}") == f"node{i}".encode():
            winners.append(i)

    ts = [threading.Thread(target=race, args=(i, c)) for i, c in enumerate(cs)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert len(winners) == 1


def test_multi_get_blocks_until_all_are_set(clients):
    reader, writer = clients(), clients()
    t, box = in_thread(reader.multi_get, ["x", "y"], timedelta(seconds=10))
    writer.set("x", b"1")
    time.sleep(0.1)
    assert t.is_alive()
    writer.multi_set(["y", "z"], ["2", b"3"])
    t.join(5)
    assert box["value"] == [b"1", b"2"]
    assert reader.multi_get(["z"]) == [b"3"]


def test_check_delete_num_keys(clients):
    c = clients()
    c.set("a", b"1")
    c.set("b", b"2")
    assert c.check(["a", "b"]) and not c.check(["a", "nope"])
    assert c.num_keys() == 2
    assert c.delete_key("a") is True
    assert c.delete_key("a") is False
    assert c.num_keys() == 1
    assert c.exists(["a", "b"]) == [False, True]


def test_prefix_store(clients):
    c = clients()
    p = PrefixStore("round/3", c)
    p.set("k", b"v")
    assert c.get("round/3/k") == b"v"
    assert p.get("k") == b"v"
    assert p.add("n", 2) == 2
    p.multi_set(["a", "b"], ["1", "2"])
    assert p.multi_get(["a", "b"]) == [b"1", b"2"]
    assert p.check(["a"]) and not c.check(["a"])
    p.wait(["a"], timedelta(seconds=1))
    assert p.compare_set("a", "1", "9") == b"9"
    assert p.delete_key("a")
    assert p.timeout == c.timeout


def test_versions_and_watch(clients):
    c, other = clients(), clients()
    values, versions, listing, now = c.get_versioned(["w"], prefix="")
    assert values == [None] and versions == [0]
    t, box = in_thread(c.watch, {"w": 0}, 10)
    other.set("w", b"1")
    t.join(5)
    changed, _ = box["value"]
    assert changed["w"] > 0
    version = changed["w"]
    started = time.monotonic()
    changed, now2 = c.watch({"w": version}, 0.2)
    assert changed == {} and now2 > now
    assert time.monotonic() - started >= 0.15
    values, versions, listing, _ = c.get_versioned(["w"], prefix="w")
    assert values == [b"1"] and versions == [version] and listing == {"w": version}


def test_lease_expires_and_wakes_watchers(clients):
    owner, watcher = clients(), clients()
    version = owner.set("alive/n1", b"x", ttl=0.3)
    started = time.monotonic()
    assert owner.touch(["alive/n1", "alive/none"], 0.3) == [True, False]
    changed, _ = watcher.watch({"alive/n1": version}, 5)
    elapsed = time.monotonic() - started
    assert changed == {"alive/n1": 0}
    assert 0.25 < elapsed < 1.0


def test_ephemeral_key_goes_with_its_connection(server, clients):
    owner, watcher = StoreClient("127.0.0.1", server.port), clients()
    version = owner.set("eph", b"x", ttl=60, ephemeral=True)
    t, box = in_thread(watcher.watch, {"eph": version}, 10)
    time.sleep(0.1)
    closed_at = time.monotonic()
    owner.close()
    t.join(5)
    assert box["value"][0] == {"eph": 0}
    assert box["t"] - closed_at < 0.3


def test_requests_are_answered_in_order_while_one_blocks(server):
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        f = s.makefile("rwb")
        f.write(b'{"op":"get","key":"later","timeout":5}\n{"op":"num_keys"}\n')
        f.flush()
        other = StoreClient("127.0.0.1", server.port)
        other.set("later", b"v")
        first, second = json.loads(f.readline()), json.loads(f.readline())
        other.close()
    assert first["ok"] and first["value"] == "dg=="  # base64 of b"v"
    assert second == {"ok": True, "value": 1}


def test_no_pickle_on_the_wire(server, clients):
    """A pickle (or any non-JSON line) is refused with a JSON error and the connection is closed."""
    payload = pickle.dumps({"op": "set", "key": "k", "value": "x"}) + b"\n"
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(payload)
        f = s.makefile("rb")
        reply = json.loads(f.readline())
        assert reply["ok"] is False and reply["error"] == "bad_request"
        assert f.readline() == b""  # closed
    assert clients().num_keys() == 0  # nothing was stored, the server still serves


def test_no_deserialiser_but_json_in_the_sources():
    root = pathlib.Path(__file__).resolve().parents[2] / "fsm_agent"
    banned_modules = {"pickle", "marshal", "shelve", "dill", "cloudpickle", "torch"}
    package = sorted((root / "plugins" / "rendezvous_fsm").glob("*.py"))
    assert {p.name for p in package} >= {"__init__.py", "handler.py", "planner.py", "params.py", "store.py"}
    for path in [root / "store.py", *package]:
        name = path.relative_to(root)
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert not {a.name.split(".")[0] for a in node.names} & banned_modules, (name, node.lineno)
            elif isinstance(node, ast.ImportFrom):
                assert (node.module or "").split(".")[0] not in banned_modules, (name, node.lineno)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in ("eval", "exec", "__import__"), (name, node.lineno)


def test_unknown_op_and_bad_fields_keep_the_connection(server):
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        f = s.makefile("rwb")
        f.write(b'{"op":"frobnicate"}\n{"op":"add","key":"k","amount":"x"}\n{"op":"hello","proto":"x"}\n')
        f.flush()
        assert json.loads(f.readline())["error"] == "bad_request"
        assert json.loads(f.readline())["error"] == "bad_request"
        assert json.loads(f.readline())["proto"] == PROTO


def test_non_finite_numbers_are_refused(server, clients):
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        f = s.makefile("rwb")
        f.write(b'{"op":"wait","keys":["k"],"timeout":NaN}\n')
        f.flush()
        assert json.loads(f.readline())["error"] == "bad_request"
    c = clients()
    c.set("k", b"v", ttl=1e300)  # clamped, still served
    assert c.get("k") == b"v"


OPS = [
    "hello",
    "set",
    "multi_set",
    "get",
    "multi_get",
    "wait",
    "watch",
    "add",
    "compare_set",
    "check",
    "exists",
    "delete",
    "num_keys",
    "get_versioned",
    "touch",
    "time",
]
BAD_VALUES = [None, 1, -1, 1e300, "x", "!!notbase64", [], [1], {}, {"a": "b"}, True]


def test_malformed_requests_never_take_the_server_down(server, clients):
    fields = [
        "key",
        "keys",
        "value",
        "values",
        "amount",
        "expected",
        "desired",
        "timeout",
        "versions",
        "ttl",
        "prefix",
        "ephemeral",
    ]
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.settimeout(10)
        f = s.makefile("rwb")
        sent = 0
        for op in OPS:
            for bad in BAD_VALUES:
                req = {"op": op, **{name: bad for name in fields}}
                if op in ("get", "multi_get", "wait", "watch"):
                    req["timeout"] = 0  # keep blocking ops from waiting
                f.write(json.dumps(req).encode() + b"\n")
                sent += 1
        f.flush()
        replies = [json.loads(f.readline()) for _ in range(sent)]
    assert all("ok" in r for r in replies)
    c = clients()
    c.set("still", b"alive")
    assert c.get("still") == b"alive"


def test_bind_on_a_taken_port_fails_at_once():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(StoreBindError) as info:
            StoreServer("127.0.0.1", port).start()
        assert info.value.errno == errno.EADDRINUSE
        assert str(port) in str(info.value)


def test_client_fails_fast_on_a_port_held_by_a_silent_program():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()  # accepts into the backlog, never answers
        port = holder.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(StoreProtocolError) as info:
            StoreClient("127.0.0.1", port, handshake_timeout=0.5).connect()
        assert time.monotonic() - started < 2
        assert f"127.0.0.1:{port}" in str(info.value) and "another program" in str(info.value)


@contextlib.contextmanager
def program_answering(answer: bytes):
    """The port of a listener (not a store) that answers the first thing it reads with ``answer``."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()

        def serve():
            conn, _ = holder.accept()
            conn.recv(100)
            conn.sendall(answer)
            conn.close()

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        yield holder.getsockname()[1]
        t.join(5)


def test_client_fails_fast_on_a_program_that_answers_garbage():
    with program_answering(b"HTTP/1.1 400 Bad Request\r\n\r\n") as port:
        started = time.monotonic()
        with pytest.raises(StoreProtocolError):
            StoreClient("127.0.0.1", port).connect()
        assert time.monotonic() - started < 1


def test_connect_timeout_names_the_endpoint():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        with pytest.raises(StoreConnectionError) as info:
            StoreClient("127.0.0.1", port, connect_timeout=0.3).connect()
        assert f"127.0.0.1:{port}" in str(info.value)
        assert isinstance(info.value, RendezvousFailed)


def test_client_waits_for_a_server_that_starts_later():
    port = port_nobody_listens_on()
    c = StoreClient("127.0.0.1", port, connect_timeout=10)
    t, box = in_thread(c.set, "k", b"v")
    time.sleep(0.3)
    srv = StoreServer("127.0.0.1", port).start()
    try:
        t.join(5)
        assert "error" not in box, box.get("error")
        assert c.get("k") == b"v"
    finally:
        c.close()
        srv.close()


def test_abort_stops_a_client_still_connecting_and_it_never_reconnects():
    """abort() from another thread ends a connect that waits for a server, and the client stays closed.

    Regression: a reconnect racing abort() left a live socket under a blocked request, so close()
    waited forever for the request lock (the fsm backend's shutdown hung).
    """
    port = port_nobody_listens_on()
    c = StoreClient("127.0.0.1", port, connect_timeout=30)
    t, box = in_thread(c.set, "k", b"v")
    time.sleep(0.3)
    c.abort()
    t.join(5)
    assert not t.is_alive(), "abort() did not end the connect loop"
    assert isinstance(box["error"], StoreConnectionError) and "closed" in str(box["error"])
    srv = StoreServer("127.0.0.1", port).start()
    try:
        with pytest.raises(StoreConnectionError, match="closed"):
            c.set("k", b"v")
    finally:
        srv.close()


def test_close_from_another_thread_ends_a_blocked_request(server):
    """close() does not wait for a request blocked on the server: it ends it, then returns."""
    c = StoreClient("127.0.0.1", server.port)
    t, box = in_thread(c.get, "never", timedelta(seconds=60))
    time.sleep(0.2)
    closer, closed = in_thread(c.close)
    closer.join(5)
    t.join(5)
    assert not closer.is_alive() and not t.is_alive()
    assert isinstance(box["error"], StoreConnectionError)


def test_server_gone_raises_connection_error_naming_the_endpoint():
    srv = StoreServer().start()
    c = StoreClient("127.0.0.1", srv.port, connect_timeout=0.2)
    c.set("k", b"v")
    t, box = in_thread(c.get, "never", timedelta(seconds=30))
    time.sleep(0.1)
    srv.close()
    t.join(5)
    assert isinstance(box["error"], StoreConnectionError)
    assert f"127.0.0.1:{srv.port}" in str(box["error"])
    with pytest.raises(StoreConnectionError):
        c.get("k")
    c.close()


def test_a_server_gone_after_use_fails_at_once_not_as_a_squatter():
    """Once a handshake worked, a refused reconnect means the server is gone: no retrying for the
    connect timeout, and not the "another program holds the port" message meant for first contact."""
    srv = StoreServer().start()
    c = StoreClient("127.0.0.1", srv.port, connect_timeout=30, fail_fast_refused=True)
    c.set("k", b"v")
    srv.close()
    started = time.monotonic()
    with pytest.raises(StoreConnectionError) as info:
        for _ in range(2):  # the first request may still see the old connection close
            c.get("k", timedelta(seconds=1))
    assert time.monotonic() - started < 10
    assert "gone" in str(info.value) or "closed the connection" in str(info.value)
    assert "another program" not in str(info.value)
    with pytest.raises(StoreConnectionError, match="is gone"):
        c.get("k", timedelta(seconds=1))
    c.close()


def test_store_imports_no_torch():
    code = "import sys, fsm_agent.plugins.rendezvous_fsm.store; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_standalone_server_process():
    proc = subprocess.Popen(
        [sys.executable, "-m", "fsm_agent.store", "--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("fsm store listening on 127.0.0.1:")
        port = int(line.split()[4].rsplit(":", 1)[1])
        c = StoreClient("127.0.0.1", port)
        assert c.add("n", 3) == 3
        c.close()
    finally:
        proc.kill()
        proc.wait()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "fsm_agent.store", "--port", str(port)], capture_output=True, text=True, timeout=30
        )
        assert done.returncode == 1 and "cannot listen" in done.stdout


def test_a_client_without_handshake_sends_its_protocol_with_its_first_request(server, clients):
    """``handshake=False`` (the rendezvous keep-alive's client): no hello on the wire; the first
    request of each connection carries ``proto``, and everything works as with a hello."""
    shaker, quiet = clients(), clients(handshake=False)
    shaker.set("k", b"v")
    hellos = shaker.stats()["ops"].get("hello", 0)
    assert quiet.get("k") == b"v" and quiet.add("n", 2) == 2
    assert shaker.stats()["ops"].get("hello", 0) == hellos  # the quiet client said no hello


def test_each_new_connection_of_a_client_without_handshake_carries_the_protocol_once():
    """On the wire: no hello; ``proto`` in the first request of each connection (again after the
    connection broke), not in the requests after it."""
    lines: list[dict] = []
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()

        def serve():
            for _ in range(2):  # the first connection answers two requests, then breaks
                conn, _ = listener.accept()
                with conn, conn.makefile("rwb") as f:
                    for _ in range(2 if not lines else 1):
                        lines.append(json.loads(f.readline()))
                        f.write(b'{"ok": true, "version": 1}\n')
                        f.flush()

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        c = StoreClient("127.0.0.1", listener.getsockname()[1], handshake=False)
        c.set("a", b"1")
        c.set("b", b"2")
        with pytest.raises(StoreConnectionError):  # the server closed this connection
            c.set("c", b"3")
        c.set("d", b"4")  # a new connection
        c.close()
        t.join(5)
    assert [(line["op"], line["key"], "proto" in line) for line in lines] == [
        ("set", "a", True),
        ("set", "b", False),
        ("set", "d", True),
    ]
    assert lines[0]["proto"] == PROTO


def test_a_client_without_handshake_whose_server_went_during_its_first_request_fails_at_once():
    """The keep-alive's first request is a held watch: a store host that dies while it is held is
    gone, and the reconnect's refusal says so at once (not after connect_timeout)."""
    srv = StoreServer().start()
    c = StoreClient("127.0.0.1", srv.port, handshake=False, connect_timeout=30)
    t, box = in_thread(c.get, "never-set", timedelta(seconds=20))  # held by the server: no reply yet
    time.sleep(0.5)
    srv.close()
    t.join(10)
    assert isinstance(box.get("error"), StoreConnectionError), box
    started = time.monotonic()
    with pytest.raises(StoreConnectionError, match="is gone"):
        c.get("k", timedelta(seconds=1))
    assert time.monotonic() - started < 10
    c.close()


def test_a_request_of_another_protocol_version_is_refused_and_its_connection_closed(server):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(json.dumps({"op": "get", "key": "k", "proto": "fsm-store/0"}).encode() + b"\n")
        reply = json.loads(sock.makefile("rb").readline())
        assert reply["ok"] is False and reply["error"] == "bad_proto"
        assert "fsm-store/0" in reply["message"] and PROTO in reply["message"]
        assert sock.recv(1) == b""  # closed after the reply


def test_a_client_without_handshake_names_a_peer_that_is_not_a_store():
    not_a_store = b'{"status": "something else"}\n'  # JSON, not a store's reply
    with program_answering(not_a_store) as port, pytest.raises(StoreProtocolError, match="not an fsm-store/1"):
        StoreClient("127.0.0.1", port, handshake=False).set("k", b"v")
