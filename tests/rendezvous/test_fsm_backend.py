"""The ``fsm`` rendezvous backend: several handlers (threads, and a subprocess) on 127.0.0.1."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from datetime import timedelta
from types import SimpleNamespace

import pytest

from fsm_agent.errors import ConfigError, RendezvousFailed
from fsm_agent.plugins import rendezvous_fsm
from fsm_agent.plugins.registry import BackendRegistry
from fsm_agent.plugins.rendezvous_fsm import (
    FsmRendezvousHandler,
    FsmRendezvousSettings,
    Joined,
    Node,
    Rendezvous,
    create_fsm_handler,
    parse_endpoint,
)
from fsm_agent.ranks import assign_ranks

pytestmark = [pytest.mark.unit, pytest.mark.timeout(90)]

FAST = dict(
    last_call_timeout=0.3,
    keep_alive_interval=0.2,
    keep_alive_max_attempt=3,
    join_timeout=20,
    handshake_timeout=1.0,
    linger_timeout=1.0,
)
#: Lost-node bound of FAST: keep_alive_interval * keep_alive_max_attempt, plus scheduling slack.
FAST_LOST_BOUND = 0.2 * 3 + 0.4


class Nodes:
    """Handlers of one run on 127.0.0.1:<port>; shut down at teardown."""

    def __init__(self):
        self.port = 0  # the first handler hosts the store on a free port (no race for a probed port)
        self.run_id = f"job-{uuid.uuid4().hex[:8]}"
        self.handlers: list[FsmRendezvousHandler] = []

    def add(self, min_nodes: int, max_nodes: int, **conf) -> FsmRendezvousHandler:
        settings = FsmRendezvousSettings(**{**FAST, **conf})
        h = FsmRendezvousHandler(self.run_id, f"127.0.0.1:{self.port}", min_nodes, max_nodes, settings=settings)
        if self.port == 0:
            self.port = h.port
        self.handlers.append(h)
        return h

    def close(self):
        for h in reversed(self.handlers):  # the host (first) last
            h.shutdown()


@pytest.fixture
def nodes():
    n = Nodes()
    yield n
    n.close()


def rendezvous_all(handlers, timeout: float = 30):
    """next_rendezvous on every handler at once; returns (results or exceptions, seconds until the last)."""
    results: list = [None] * len(handlers)
    barrier = threading.Barrier(len(handlers) + 1)

    def run(i, h):
        barrier.wait()
        try:
            results[i] = h.next_rendezvous()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i, h), daemon=True) for i, h in enumerate(handlers)]
    for t in threads:
        t.start()
    barrier.wait()
    started = time.perf_counter()
    for t in threads:
        t.join(timeout)
    return results, time.perf_counter() - started


def start_rendezvous(h):
    box: dict = {}

    def run():
        try:
            box["info"] = h.next_rendezvous()
        except BaseException as exc:  # noqa: BLE001
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def readable(fd: int, timeout: float) -> bool:
    return bool(select.select([fd], [], [], timeout)[0])


def time_until_readable(fd: int, timeout: float) -> float | None:
    started = time.monotonic()
    return time.monotonic() - started if readable(fd, timeout) else None


# -- the pure state machine -----------------------------------------------------------------------------
def _rdzv(min_nodes=1, max_nodes=4, last_call_timeout=0.5):
    return Rendezvous(min_nodes, max_nodes, last_call_timeout=last_call_timeout, rejoin_timeout=60.0)


def _join(rdzv, me, now=0.0, returned=None, hint=None):
    """One join then the tick the store runs after every request: (join answer, ranked, turned away)."""
    joined = rdzv.join(me, Node(me, 1000, host=me == "host", node_rank=hint), now, returned)
    ranked, away = rdzv.tick(now)
    return joined, ranked, away


def test_plan_ranks_follow_hints_then_host_then_join_order():
    rdzv = _rdzv(min_nodes=4)
    for i, (name, hint) in enumerate([("a", None), ("host", None), ("b", 0), ("c", None)]):
        joined, ranked, _ = _join(rdzv, name, now=float(i), hint=hint)
    assert joined.status == "wait" and ranked == ["b", "host", "a", "c"]  # n == max: at once
    assert rdzv.complete and rdzv.ranks() == {"b": 0, "host": 1, "a": 2, "c": 3}
    assert rdzv.master == ("b", 1000)
    assert rdzv.join("a", Node("a", 1001), 4.0, None) == Joined("ranked", 0, 2, 4)


def test_plan_settle_window_and_dead_nodes():
    rdzv = _rdzv(min_nodes=1)
    _join(rdzv, "a", now=0.0)
    _join(rdzv, "b", now=0.2)
    assert rdzv.tick(0.3) == ([], []) and rdzv.deadline() == pytest.approx(0.7)  # settle: last join 0.2 + 0.5
    rdzv.lose("b", 0.3)  # b's lease is gone: dropped
    assert "b" not in rdzv.nodes and "b" not in rdzv.participants
    assert rdzv.tick(0.71)[0] == ["a"] and rdzv.complete


def test_plan_reserved_seats_and_redundant_nodes():
    rdzv = _rdzv(min_nodes=2, max_nodes=2)
    rdzv.hot_spares = False  # nodes beyond max leave (hot spares: tests/rendezvous/test_fsm_hot_spares.py)
    _join(rdzv, "a")
    _, ranked, _ = _join(rdzv, "b")
    assert ranked == ["a", "b"] and rdzv.complete
    joined, _, _ = _join(rdzv, "c")
    assert joined.status == "not_needed" and "c" not in rdzv.nodes
    joined, _, _ = _join(rdzv, "a", returned=0)  # a restarts: round 1
    assert (joined.status, rdzv.round, list(rdzv.participants), rdzv.reserved) == ("wait", 1, ["a"], {"b"})
    joined, _, _ = _join(rdzv, "c")
    assert joined.status == "wait" and "c" not in rdzv.participants and "c" in rdzv.wait_list  # b's seat is reserved
    rdzv.lose("b", 1.0)  # b is gone: its seat goes to the waiting c
    assert list(rdzv.participants) == ["a", "c"] and not rdzv.complete
    assert rdzv.tick(1.0)[0] == ["a", "c"]  # n == max: no settle window


# -- real handlers ----------------------------------------------------------------------------------------
#: A settle window far longer than any round here: a round that waited for it would show.
LONG_SETTLE = dict(last_call_timeout=60.0, rejoin_timeout=120.0, join_timeout=180)
#: Generous against a loaded 2-core CI machine, well below LONG_SETTLE's window (behaviour, not speed:
#: the speed of a round is benchmarks/rendezvous_scale.py's).
NO_SETTLE_BOUND_S = 30.0


@pytest.mark.parametrize("k", [2, 4, 8, 16])
def test_k_nodes_form_one_round_without_waiting_for_the_settle_window(nodes, k, record_property):
    handlers = [nodes.add(k, k, **LONG_SETTLE) for _ in range(k)]
    assert [h.hosts_store for h in handlers] == [True] + [False] * (k - 1)
    results, elapsed = rendezvous_all(handlers)
    assert all(not isinstance(r, BaseException) for r in results), results
    assert sorted(r.rank for r in results) == list(range(k))
    assert {r.world_size for r in results} == {k}
    assert results[0].rank == 0  # the store host
    assert len({(r.bootstrap_store_info.master_addr, r.bootstrap_store_info.master_port) for r in results}) == 1
    record_property(f"round_s_k{k}", round(elapsed, 4))
    print(f"\nK={k}: first round in {elapsed * 1000:.1f} ms")
    assert elapsed < NO_SETTLE_BOUND_S  # n == max completes at once, not after last_call_timeout
    # a second round (every node restarts) neither: no sleeps anywhere
    results, elapsed = rendezvous_all(handlers)
    assert sorted(r.rank for r in results) == list(range(k))
    print(f"K={k}: restart round in {elapsed * 1000:.1f} ms")
    assert elapsed < NO_SETTLE_BOUND_S


def test_round_store_serves_rank_assignment_and_exit_barrier(nodes):
    handlers = [nodes.add(3, 3) for _ in range(3)]
    infos, _ = rendezvous_all(handlers)
    out: dict = {}

    def assign(info):
        result = assign_ranks(info.store, info.rank, info.world_size, "trainer", 2)
        out[info.rank] = result[0] if isinstance(result[0], tuple) else result  # (assignment, job restart count)

    ts = [threading.Thread(target=assign, args=(i,)) for i in infos]
    for t in ts:
        t.start()
    for t in ts:
        t.join(10)
    assert out == {0: (0, 6, 0, 6), 1: (2, 6, 2, 6), 2: (4, 6, 4, 6)}
    store = infos[0].store
    assert [i.store.add("torchelastic/agent/terminal_state/num_members", 1) for i in infos] == [1, 2, 3]
    store.set("torchelastic/agent/terminal_state/last_member", "<val_ignored>")
    infos[2].store.wait(["torchelastic/agent/terminal_state/last_member"], timedelta(seconds=1))
    again, _ = rendezvous_all(handlers)
    assert not again[0].store.check(["torchelastic/agent/terminal_state/last_member"])  # a fresh prefix


def test_standalone_endpoint_port_zero_hosts_on_loopback():
    h = FsmRendezvousHandler("solo", "localhost:0", 1, 1, settings=FsmRendezvousSettings(**FAST))
    try:
        assert h.hosts_store and h.port != 0
        assert h._server._listener.getsockname()[0] == "127.0.0.1"
        started = time.perf_counter()
        info = h.next_rendezvous()
        assert time.perf_counter() - started < 0.5
        assert (info.rank, info.world_size) == (0, 1)
        assert info.bootstrap_store_info.master_addr == "127.0.0.1"
        assert h.use_agent_store is False
    finally:
        h.shutdown()


def test_late_joiner_is_reported_after_the_settle_window(nodes):
    # 2:4: the late node leaves a seat free, so it is not reported at once (see test_settle_window)
    a, b = nodes.add(2, 4), nodes.add(2, 4)
    rendezvous_all([a, b])
    assert a.num_nodes_waiting() == 0 and not readable(a.membership_fd(), 0)
    c = nodes.add(2, 4)
    joined = time.monotonic()
    t, box = start_rendezvous(c)
    assert readable(a.membership_fd(), 5) and readable(b.membership_fd(), 5)
    waited = time.monotonic() - joined
    assert FAST["last_call_timeout"] - 0.05 <= waited < FAST["last_call_timeout"] + 0.5
    assert a.num_nodes_waiting() == 1 and b.num_nodes_waiting() == 1 and a.num_nodes_lost() == 0
    results, _ = rendezvous_all([a, b])
    t.join(10)
    ranks = sorted([r.rank for r in results] + [box["info"].rank])
    assert ranks == [0, 1, 2] and results[0].world_size == 3
    assert not readable(a.membership_fd(), 0) and a.num_nodes_waiting() == 0


def test_scale_up_one_by_one_causes_one_restart(nodes):
    running = [nodes.add(2, 8, last_call_timeout=0.5) for _ in range(2)]
    first, _ = rendezvous_all(running)
    joiners = []
    for _ in range(3):  # three nodes arrive 0.15 s apart, inside one settle window
        h = nodes.add(2, 8, last_call_timeout=0.5)
        joiners.append((h, *start_rendezvous(h)))
        time.sleep(0.15)
    assert readable(running[0].membership_fd(), 5)
    assert running[0].num_nodes_waiting() == 3
    second, _ = rendezvous_all(running)
    for _h, t, box in joiners:
        t.join(10)
        assert box["info"].world_size == 5
    assert {r.world_size for r in second} == {5}
    assert {r.store.prefix for r in second} | {box["info"].store.prefix for _, _, box in joiners} == {
        second[0].store.prefix
    }
    assert second[0].store.prefix.endswith("/round/1")  # round 0, then exactly one more


def test_restart_by_one_participant_wakes_the_others_at_once(nodes):
    a, b = nodes.add(2, 2), nodes.add(2, 2)
    rendezvous_all([a, b])
    t, box = start_rendezvous(a)  # a's workers failed: it asks for a new round
    delay = time_until_readable(b.membership_fd(), 5)
    assert delay is not None and delay < 0.3
    assert b.num_nodes_waiting() == 1
    info_b = b.next_rendezvous()
    t.join(10)
    assert {info_b.rank, box["info"].rank} == {0, 1}
    assert info_b.store.prefix.endswith("/round/1")


def test_hung_node_is_detected_within_the_hold_and_the_keep_alive_bound(nodes):
    """c's agent hangs: its keep-alive stops while the store holds its membership watch, its
    connections stay open and its host answers. The store keeps its lease until the watch's
    hold ends, then keep_alive_timeout more. (A silent host is found by the store host's TCP
    keep-alive instead: tests/agent/test_netns.py; a killed agent at once: below.)"""
    hold = 1.0
    a, b, c = (nodes.add(2, 3, keep_alive_hold=hold) for _ in range(3))
    rendezvous_all([a, b, c])
    end = time.monotonic() + 30
    while c._keys.in_flight is None and time.monotonic() < end:  # c's watch is held now
        time.sleep(0.01)
    c._stop.set()
    stopped = time.monotonic()
    assert readable(a.membership_fd(), 30) and readable(b.membership_fd(), 30)
    detected = time.monotonic() - stopped
    bound = hold + FAST_LOST_BOUND + 1.0  # generous: a loaded 2-core machine
    print(f"\nhung node detected after {detected:.3f}s (bound {bound:.2f}s)")
    assert detected < bound
    assert a.num_nodes_lost() == 1 and b.num_nodes_lost() == 1 and a.num_nodes_waiting() == 0
    results, elapsed = rendezvous_all([a, b])
    assert sorted(r.rank for r in results) == [0, 1] and results[0].world_size == 2
    assert elapsed < 1.0  # survivors are known nodes: no settle window
    assert a.num_nodes_lost() == 0 and not readable(a.membership_fd(), 0)


NODE_SCRIPT = """
import json, sys
from fsm_agent.plugins.rendezvous_fsm import FsmRendezvousHandler, FsmRendezvousSettings
s = FsmRendezvousSettings(**json.loads(sys.argv[2]))
h = FsmRendezvousHandler(sys.argv[3], sys.argv[1], 2, 3, settings=s)
info = h.next_rendezvous()
print(json.dumps({"rank": info.rank, "world": info.world_size, "torch": "torch" in sys.modules}), flush=True)
sys.stdin.read()
"""


def test_killed_node_process_is_detected_at_once(nodes):
    # a long settle window: the round waits for the subprocess (python start-up) and completes at max
    a, b = nodes.add(2, 3, last_call_timeout=30), nodes.add(2, 3, last_call_timeout=30)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            NODE_SCRIPT,
            f"127.0.0.1:{nodes.port}",
            json.dumps({**FAST, "last_call_timeout": 30, "is_host": False}),
            nodes.run_id,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        results, _ = rendezvous_all([a, b])
        line = json.loads(proc.stdout.readline())
        assert line["world"] == 3 and line["torch"] is False
        assert sorted([r.rank for r in results] + [line["rank"]]) == [0, 1, 2]
        killed = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
        assert readable(a.membership_fd(), 5)
        detected = time.monotonic() - killed
        print(f"\nkilled node detected after {detected:.3f}s")
        assert detected < FAST_LOST_BOUND
        assert a.num_nodes_lost() == 1
        results, _ = rendezvous_all([a, b])
        assert sorted(r.rank for r in results) == [0, 1]
    finally:
        proc.kill()
        proc.wait()


def test_shutdown_of_one_node_leaves_the_rendezvous_open(nodes):
    a, b, c = (nodes.add(2, 3) for _ in range(3))
    rendezvous_all([a, b, c])
    assert c.shutdown() is True
    assert readable(a.membership_fd(), 2)
    assert a.num_nodes_lost() == 1
    assert not a.is_closed() and not b.is_closed()
    results, _ = rendezvous_all([a, b])
    assert sorted(r.rank for r in results) == [0, 1]
    d = nodes.add(2, 3)  # a new node can still join: reported, then one more round with it
    t, box = start_rendezvous(d)
    assert readable(a.membership_fd(), 5)
    results, _ = rendezvous_all([a, b])
    t.join(10)
    assert box["info"].world_size == 3


def test_set_closed_closes_for_everyone(nodes):
    a, b = nodes.add(1, 2, last_call_timeout=0.1), nodes.add(1, 2, last_call_timeout=0.1)
    rendezvous_all([a, b])
    a.set_closed()
    assert b.is_closed()
    with pytest.raises(RendezvousFailed, match="closed"):
        b.next_rendezvous()


def test_join_timeout_names_backend_endpoint_and_hosting(nodes):
    a = nodes.add(2, 2, join_timeout=0.5)
    started = time.monotonic()
    with pytest.raises(RendezvousFailed) as info:
        a.next_rendezvous()
    assert 0.45 < time.monotonic() - started < 2
    text = str(info.value)
    for part in ("backend=fsm", f"127.0.0.1:{nodes.port}", "join_timeout=0.5s", "hosts the store", "timed out"):
        assert part in text


@pytest.mark.parametrize("listening", [True, False])
def test_endpoint_port_held_by_another_program_fails_fast(listening):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        if listening:
            holder.listen()  # accepts, never answers
        port = holder.getsockname()[1]
        h = FsmRendezvousHandler("x", f"127.0.0.1:{port}", 1, 1, settings=FsmRendezvousSettings(handshake_timeout=0.5))
        try:
            started = time.monotonic()
            with pytest.raises(RendezvousFailed) as info:
                h.next_rendezvous()
            assert time.monotonic() - started < 2
            text = str(info.value)
            assert f"127.0.0.1:{port}" in text and "taken when it started" in text
            assert "another program" in text
        finally:
            h.shutdown()
        with pytest.raises(RendezvousFailed, match="is_host=1"):
            FsmRendezvousHandler("x", f"127.0.0.1:{port}", 1, 1, settings=FsmRendezvousSettings(is_host=True))


def test_a_store_host_that_exits_while_this_node_joins_is_not_called_another_program():
    """The port was taken when this node tried to host (the host was there), then the host exited."""
    holder = socket.create_server(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    h = FsmRendezvousHandler("x", f"127.0.0.1:{port}", 1, 1, settings=FsmRendezvousSettings(handshake_timeout=0.5))
    holder.close()  # the hosting agent exits
    try:
        with pytest.raises(RendezvousFailed) as info:
            h.next_rendezvous()
    finally:
        h.shutdown()
    text = str(info.value)
    assert "another program" not in text, text
    assert (
        f"fsm store at 127.0.0.1:{port}: nothing listens there any more: what held the port when this node "
        f"tried to host the store (an agent hosting it, shutting down?) has exited; start this node again and "
        f"it hosts the store"
    ) in text


def test_store_host_shutdown_waits_for_the_others_to_leave(nodes):
    host, other = nodes.add(2, 2), nodes.add(2, 2)
    rendezvous_all([host, other])
    t, box = start_rendezvous(other)  # still using the store when the host exits
    started = time.monotonic()

    def leave_soon():
        time.sleep(0.3)
        other.shutdown()

    threading.Thread(target=leave_soon, daemon=True).start()
    assert host.shutdown() is True
    assert 0.25 < time.monotonic() - started < FAST["linger_timeout"]


def test_create_handler_from_plain_params_and_registry():
    params = SimpleNamespace(
        backend="fsm",
        endpoint="127.0.0.1:0",
        run_id="p",
        min_nodes=1,
        max_nodes=2,
        local_addr="10.1.2.3",
        config={"last_call_timeout": "0.1", "keep_alive_interval": "0.25", "is_host": "yes", "node_rank": 3},
    )
    params.get = lambda key, default=None: params.config.get(key, default)
    registry = BackendRegistry()
    rendezvous_fsm.fsm_agent_register_backends(registry)
    h = registry.get("rendezvous", "fsm")(params)
    try:
        assert h.get_backend() == "fsm" and h.get_run_id() == "p" and h.hosts_store
        assert h.settings.last_call_timeout == 0.1 and h.settings.keep_alive_interval == 0.25
        assert h.settings.node_rank == 3 and h.settings.is_host is True
        info = h.next_rendezvous()
        assert info.bootstrap_store_info.master_addr == "10.1.2.3"
    finally:
        h.shutdown()


@pytest.mark.parametrize(
    "conf, match",
    [
        ({"join_timeout": "soon"}, "join_timeout='soon'"),
        ({"is_host": "maybe"}, "is_host"),
        ({"keep_alive_interval": "0"}, "keep_alive_interval"),
        ({"keep_alive_max_attempt": "0"}, "keep_alive_max_attempt"),
    ],
)
def test_bad_settings_are_config_errors(conf, match):
    with pytest.raises(ConfigError, match=match):
        FsmRendezvousSettings.from_params(SimpleNamespace(config=conf))


def test_parse_endpoint():
    assert parse_endpoint("") == ("localhost", 29400)
    assert parse_endpoint("node0") == ("node0", 29400)
    assert parse_endpoint("node0:1234") == ("node0", 1234)
    assert parse_endpoint("[::1]:5") == ("::1", 5)
    with pytest.raises(ConfigError, match="port"):
        parse_endpoint("node0:http")


def test_backend_imports_no_torch():
    code = (
        "import sys, fsm_agent.plugins.rendezvous_fsm, fsm_agent.plugins.rendezvous_fsm.store; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_torch_free_parameters_from_launch_config():
    from fsm_agent.config import LaunchConfig
    from fsm_agent.plugins.rendezvous_fsm import FsmRendezvousParameters

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=3,
        rdzv_backend="fsm",
        rdzv_endpoint="127.0.0.1:0",
        run_id="lc",
        rdzv_configs={"last_call_timeout": "0.1", "is_host": "true"},
        local_addr="10.0.0.7",
        node_rank=2,
    )
    params = FsmRendezvousParameters.from_launch_config(config)
    assert (params.backend, params.endpoint, params.run_id, params.min_nodes, params.max_nodes, params.local_addr) == (
        "fsm",
        "127.0.0.1:0",
        "lc",
        1,
        3,
        "10.0.0.7",
    )
    assert params.get("node_rank") == 2 and params.get_as_bool("is_host") is True
    assert params.get_as_int("missing", 5) == 5
    h = create_fsm_handler(params)
    try:
        assert h.settings.node_rank == 2 and h.settings.last_call_timeout == 0.1 and h.hosts_store
    finally:
        h.shutdown()


class _Interrupt(BaseException):
    """Stands in for the agent's SignalStop."""


def test_a_signal_during_a_blocked_rendezvous_leaves_the_handler_usable(nodes):
    a = nodes.add(2, 2)

    def on_alarm(signum, frame):
        raise _Interrupt()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        started = time.monotonic()
        with pytest.raises(_Interrupt):
            a.next_rendezvous()  # blocked waiting for a second node
        assert time.monotonic() - started < 1
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    b = nodes.add(2, 2)
    results, _ = rendezvous_all([a, b])
    assert sorted(r.rank for r in results) == [0, 1]


def test_survivors_of_a_dead_store_host_fail_fast_and_shut_down_fast(nodes):
    host, other = nodes.add(2, 2), nodes.add(2, 2, read_timeout=0.5)
    rendezvous_all([host, other])
    host._server.close()  # the store host's process is gone
    assert readable(other.membership_fd(), 2)
    assert other.num_nodes_lost() >= 1
    started = time.monotonic()
    with pytest.raises(RendezvousFailed) as info:
        other.next_rendezvous()
    assert time.monotonic() - started < 3
    assert f"127.0.0.1:{nodes.port}" in str(info.value) and "did not try to host" not in str(info.value)
    started = time.monotonic()
    assert other.shutdown() is False
    assert time.monotonic() - started < FAST["handshake_timeout"] + 1.5
