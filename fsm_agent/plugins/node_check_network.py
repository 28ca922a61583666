"""Built-in plugin ``node-check-network``: find a slow or broken network link before the workers start.

Switched on with ``--node-check-network`` (``FSM_AGENT_NODE_CHECK_NETWORK``, off by default). Every
node of the round opens a TCP server on its ``node_addr`` for the check's duration and measures,
as the client, the link to the next node of a ring (group rank ``i`` with ``i + 1 mod N``):

- ``rtt_ms``: the median of 5 one-byte ping-pongs (milliseconds);
- ``up_mbps`` and ``down_mbps``: what one TCP stream carries in ``--node-check-network-seconds``
  (default 0.2 s) each way (Mbit/s, counted by the receiver), so a host whose egress *or* ingress
  is limited is seen.

Group rank 0 gathers the ring's results and judges each link against the round's medians (over
every direction measured: a node slow one way touches 2 of the 2N values, both ways 4, so the
median stays a healthy one from N = 3, resp. N = 5):

- a link is bad when a direction carries less than ``--node-check-min-bandwidth-ratio`` (default
  0.25, in (0, 1)) times the median bandwidth, when its RTT is above both
  ``--node-check-max-rtt-ratio`` (default 10, > 1) times the median RTT and
  ``--node-check-rtt-floor-ms`` (default 10 ms), or when it could not be measured (no connection,
  no answer before the deadline, the peer never published its address);
- a node whose two ring links are bad, its neighbours' other links being good, is that bad node
  (round 1); a node that published no result at all is blamed for that;
- any other bad link (one slow link alone, or a run of three and more) is ambiguous: in round 2
  each of its endpoints is measured once more by a node known good (one whose ring link was good),
  and an endpoint that is bad against a good node is blamed. There is no third round.

Bounds: 2 measurement rounds. Every node healthy, the check takes about ``2 x seconds`` plus a
few store round trips (0.52 s at 8 hosts); a node that never shows up is blamed after ``JOIN_S``
+ ``2 x seconds`` + ``STORE_SLACK_S`` (3.4 s); a link's measurement never takes more than its
transfers + ``MEASURE_SLACK_S``, and every wait ends by the round's deadline.

Store requests per node per round (keys under ``fsm_agent/node_check/network/``: ``addr/<rank>``,
``ring/<rank>``, ``plan``, ``test/<rank>``): 6 on every node but group rank 0 (set its address,
wait + get its ring peer's, set its ring result, wait + get the plan), 7 on group rank 0 (no plan
to read; wait + ``multi_get`` of every ring result, set the plan). Round 2 adds 1 on a node that
measures there and 2 on group rank 0 (wait + ``multi_get`` of the tests). Only when results are
missing does group rank 0 make ``check`` requests, bisecting to the missing keys (O(m log N) for m
missing). Never O(N) requests per node.

Limits: the measurement is relative (one Python TCP stream in a fraction of a second, not the
link's capacity): it finds a link much slower than its peers, not a uniformly slow network. Two
nodes have no median to compare with: only a node that does not take part is found. Which of two
nodes is bad cannot be decided when no third node is known good: then nobody is blamed (logged).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import math
import socket
import statistics
import struct
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from fsm_agent.node_checks import CheckResult, CheckRound
from fsm_agent.plugins import hookimpl

log = logging.getLogger(__name__)
PLUGIN_NAME = "node-check-network"
CHECK = "network"
#: Seconds a node waits for its ring peer's address (the nodes reach the check within a store
#: round trip of each other after the rendezvous).
JOIN_S = 2.0
#: Seconds a link's measurement may take beyond its two transfers (connects, pings, the drain of
#: a slow link's socket buffer).
MEASURE_SLACK_S = 2.5
#: Seconds for a store round trip or an analysis, added to the waits for other nodes.
STORE_SLACK_S = 1.0
#: Seconds kept before ``check_round.deadline`` for the answer to reach the caller.
END_MARGIN_S = 0.3
PINGS = 5
CHUNK = 64 * 1024
#: Sender's socket buffer (bytes): bounds what a slow link still drains after the stream stops.
SEND_BUFFER = 128 * 1024
_HEADER = struct.Struct("!cd")  # command (P, U, D), then pings or seconds
_REPLY = struct.Struct("!Qd")  # bytes received, seconds


def _ratio_below_one(value: float) -> None:
    if not (math.isfinite(value) and 0 < value < 1):
        raise ValueError(f"expected a ratio in (0, 1), got {value}")


def _ratio_above_one(value: float) -> None:
    if not (math.isfinite(value) and value > 1):
        raise ValueError(f"expected a ratio > 1, got {value}")


def _milliseconds(value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"expected milliseconds >= 0, got {value}")


def _transfer_seconds(value: float) -> None:
    if not (math.isfinite(value) and 0 < value <= 5):
        raise ValueError(f"expected seconds in (0, 5], got {value}")


#: (name, type, default, check, help): option ``name`` is flag ``--node-check-<name>`` and env
#: ``FSM_AGENT_NODE_CHECK_<NAME>``, the family of ``node-check-local``'s options.
OPTIONS: tuple[tuple[str, type, Any, Any, str], ...] = (
    ("network", bool, False, None, "measure bandwidth and RTT between the nodes before the workers start"),
    (
        "min_bandwidth_ratio",
        float,
        0.25,
        _ratio_below_one,
        "a link carrying less than RATIO x the round's median bandwidth is bad (network check)",
    ),
    (
        "max_rtt_ratio",
        float,
        10.0,
        _ratio_above_one,
        "a link whose RTT is above RATIO x the round's median RTT (and the floor) is bad (network check)",
    ),
    ("rtt_floor_ms", float, 10.0, _milliseconds, "milliseconds of RTT a link is never blamed below (network check)"),
    ("network_seconds", float, 0.2, _transfer_seconds, "seconds each direction of a link is measured"),
)


@hookimpl
def fsm_agent_addoption(options: Any) -> None:
    for name, kind, default, check, text in OPTIONS:
        flag = "--node-check-" + name.replace("_", "-")
        env = "FSM_AGENT_NODE_CHECK_" + name.upper()
        options.add(name, type=kind, default=default, flag=flag, env=env, check=check, help=text)


@attrs.frozen
class Thresholds:
    """When a link is bad (see the module docstring); the option checks apply here too."""

    min_bandwidth_ratio: float = attrs.field(default=0.25)
    max_rtt_ratio: float = attrs.field(default=10.0)
    rtt_floor_ms: float = attrs.field(default=10.0)

    def __attrs_post_init__(self) -> None:
        _ratio_below_one(self.min_bandwidth_ratio)
        _ratio_above_one(self.max_rtt_ratio)
        _milliseconds(self.rtt_floor_ms)


# ------------------------------------------------------------------------------------------------
# The analysis: pure functions of the measurements
# ------------------------------------------------------------------------------------------------
#: A link's measurement: ``{"up_mbps", "down_mbps", "rtt_ms"}`` (numbers), or ``{"error": "..."}``
#: when it could not be measured.
Link = Mapping[str, Any]


@attrs.frozen
class Reference:
    """The round's medians: ``mbps`` over every measured direction, ``rtt_ms`` over every link
    (None when nothing was measured)."""

    mbps: float | None
    rtt_ms: float | None

    @classmethod
    def of(cls, links: Sequence[Link | None]) -> Reference:
        measured = [link for link in links if link and "error" not in link]
        rates = [float(link[d]) for link in measured for d in ("up_mbps", "down_mbps")]
        rtts = [float(link["rtt_ms"]) for link in measured]
        return cls(statistics.median(rates) if rates else None, statistics.median(rtts) if rtts else None)


def link_fault(link: Link | None, reference: Reference, thresholds: Thresholds) -> str:
    """Why ``link`` is bad, in a few words ("" when it is good)."""
    if link is None:
        return "not measured"
    if "error" in link:
        return str(link["error"])
    faults = []
    if reference.mbps:
        floor = thresholds.min_bandwidth_ratio * reference.mbps
        for direction in ("up_mbps", "down_mbps"):
            if float(link[direction]) < floor:
                faults.append(
                    f"{direction[:-5]} {float(link[direction]):.1f} Mbit/s < {thresholds.min_bandwidth_ratio:g} x "
                    f"median {reference.mbps:.1f}"
                )
    if reference.rtt_ms is not None:
        limit = max(thresholds.max_rtt_ratio * reference.rtt_ms, thresholds.rtt_floor_ms)
        if float(link["rtt_ms"]) > limit:
            faults.append(f"rtt {float(link['rtt_ms']):.2f} ms > {limit:.2f} ms")
    return ", ".join(faults)


def _checked(link: Any) -> Link | None:
    """``link`` when it is a measurement or an error, else an error saying it is malformed (a peer's
    record is data from another process: never trusted to have the right shape)."""
    if link is None or (isinstance(link, Mapping) and isinstance(link.get("error"), str)):
        return link
    try:
        values = {name: float(link[name]) for name in ("up_mbps", "down_mbps", "rtt_ms")}
    except (KeyError, TypeError, ValueError):
        return {"error": "malformed measurement"}
    if not all(math.isfinite(value) and value >= 0 for value in values.values()):
        return {"error": "malformed measurement"}
    return values


@attrs.frozen
class RingVerdict:
    """Round 1's outcome.

    Attributes:
        blamed: ``{group_rank: reason}`` decided from the ring alone.
        tests: ``[(good node, suspect node), ...]``: round 2's measurements (the good node measures).
        undecided: suspects no good node can test (nobody is blamed for them).
        reference: the medians the links were judged against.
    """

    blamed: Mapping[int, str]
    tests: Sequence[tuple[int, int]]
    undecided: Sequence[int]
    reference: Reference


def analyse_ring(n: int, links: Mapping[int, Link | None], thresholds: Thresholds) -> RingVerdict:
    """Judge the ring: ``links[i]`` is node ``i``'s measurement of link ``(i, i + 1 mod n)``, None
    when node ``i`` published no result (it is blamed for that)."""
    ring = [_checked(links.get(i)) for i in range(n)]
    reference = Reference.of(ring)
    blamed = {i: "published no network result before the deadline" for i in range(n) if ring[i] is None}
    if n == 2:  # the same pair twice: no median tells which end is slow, only an absent node is known
        return RingVerdict(blamed, (), [], reference)
    bad = {i: why for i in range(n) if (why := link_fault(ring[i], reference, thresholds))}
    for k in range(n):  # k's links: k-1 (as server) and k (as client); its neighbours' others: k-2, k+1
        if k in blamed or (k - 1) % n not in bad or k not in bad:
            continue
        if (k - 2) % n not in bad and (k + 1) % n not in bad:
            blamed[k] = (
                f"both ring links bad: with node {(k - 1) % n}: {bad[(k - 1) % n]}; with node {(k + 1) % n}: {bad[k]}"
            )
    # A bad link that touches a blamed node is explained; the endpoints of any other are suspects.
    unexplained = [i for i in bad if i not in blamed and (i + 1) % n not in blamed]
    suspects = sorted({end for i in unexplained for end in (i, (i + 1) % n)})
    good = [k for k in range(n) if k not in blamed and k not in suspects and ((k - 1) % n not in bad or k not in bad)]
    if not good:
        return RingVerdict(blamed, (), suspects, reference)
    tests = [(good[j % len(good)], suspect) for j, suspect in enumerate(suspects)]
    return RingVerdict(blamed, tests, [], reference)


def analyse_tests(
    tests: Sequence[tuple[int, int]],
    results: Mapping[tuple[int, int], Link | None],
    reference: Reference,
    thresholds: Thresholds,
) -> dict[int, str]:
    """Round 2: blame each suspect whose link to a good node is bad, judged against round 1's
    ``reference``; a test whose good node published nothing blames nobody."""
    blamed = {}
    for good, suspect in tests:
        result = _checked(results.get((good, suspect)))
        if result is None:
            continue
        if why := link_fault(result, reference, thresholds):
            blamed[suspect] = f"bad link to known-good node {good} (round 2): {why}"
    return blamed


# ------------------------------------------------------------------------------------------------
# The measurement: a TCP server per node, a client per link
# ------------------------------------------------------------------------------------------------


def _timeout(until: float) -> float:
    return max(0.001, until - time.monotonic())


def _recv_exact(sock: socket.socket, size: int, until: float) -> bytes:
    data = b""
    while len(data) < size:
        sock.settimeout(_timeout(until))
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("peer closed the connection")
        data += chunk
    return data


def _drain(sock: socket.socket, until: float) -> tuple[int, float]:
    """Read until EOF or ``until``: (bytes, seconds from the call to the last byte)."""
    started = last = time.monotonic()
    count = 0
    buffer = bytearray(CHUNK)
    while time.monotonic() < until:
        sock.settimeout(_timeout(until))
        try:
            got = sock.recv_into(buffer)
        except TimeoutError:
            break
        if not got:
            break
        count += got
        last = time.monotonic()
    return count, max(last - started, 1e-6)


def _stream(sock: socket.socket, seconds: float, until: float) -> None:
    """Send zeros for ``seconds`` (never past ``until``), then end the direction."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
    payload = memoryview(bytes(CHUNK))
    stop = min(time.monotonic() + seconds, until)
    while time.monotonic() < stop:
        sock.settimeout(_timeout(until))
        sock.sendall(payload)
    sock.shutdown(socket.SHUT_WR)


class _Server:
    """Answers the peers' measurements for the check's duration (a thread per connection)."""

    def __init__(self, host: str, until: float):
        family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
        self.sock = socket.create_server((host, 0), family=family, backlog=64)
        self.sock.settimeout(0.1)  # the accept loop looks at the stop flag this often
        self.host, self.port, self.until = host, self.sock.getsockname()[1], until
        self.sessions = 0
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="node-check-network-server", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="node-check-network-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            command, value = _HEADER.unpack(_recv_exact(conn, _HEADER.size, self.until))
            if command == b"P":
                for _ in range(int(value)):
                    conn.sendall(_recv_exact(conn, 1, self.until))
            elif command == b"U":
                count, seconds = _drain(conn, self.until)
                conn.settimeout(_timeout(self.until))
                conn.sendall(_REPLY.pack(count, seconds))
            elif command == b"D":
                _stream(conn, value, self.until)
                _drain(conn, self.until)  # until the client closes: it has counted everything
            with self._lock:
                self.sessions += 1
        except (OSError, struct.error):
            pass  # the client counts a broken session as its failed measurement
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self.sock.close()
        self._thread.join(timeout=1.0)
        with self._lock:  # a peer still measuring gets a reset, not a server that outlives the check
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)


def _connect(host: str, port: int, until: float) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=min(_timeout(until), 1.0))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def measure_link(host: str, port: int, seconds: float, until: float) -> dict[str, Any]:
    """Measure the link to the server at ``host:port``: RTT (ms), then ``seconds`` of upload and
    of download (Mbit/s, as the receiver counted), all before ``until`` (monotonic seconds).
    Returns ``{"up_mbps", "down_mbps", "rtt_ms"}`` or ``{"error": "phase: what failed"}``."""
    phase = "connect"
    try:
        with _connect(host, port, until) as sock:
            phase = "ping"
            sock.sendall(_HEADER.pack(b"P", PINGS))
            rtts = []
            for _ in range(PINGS):
                sent = time.perf_counter()
                sock.sendall(b"x")
                _recv_exact(sock, 1, until)
                rtts.append(time.perf_counter() - sent)
        phase = "upload"
        with _connect(host, port, until) as sock:
            sock.sendall(_HEADER.pack(b"U", seconds))
            _stream(sock, seconds, until)
            count, took = _REPLY.unpack(_recv_exact(sock, _REPLY.size, until))
        up = count * 8 / took / 1e6
        phase = "download"
        with _connect(host, port, until) as sock:
            sock.sendall(_HEADER.pack(b"D", seconds))
            count, took = _drain(sock, until)
        if time.monotonic() >= until:
            raise TimeoutError("no end of the stream before the deadline")
        return {"up_mbps": up, "down_mbps": count * 8 / took / 1e6, "rtt_ms": statistics.median(rtts) * 1e3}
    except (OSError, struct.error) as exc:
        what = "timed out" if isinstance(exc, TimeoutError) else (getattr(exc, "strerror", None) or str(exc))
        return {"error": f"{phase} to {host}:{port} failed: {' '.join(str(what).split())}"}


def _record(value: bytes) -> dict[str, Any] | None:
    """A node's ring record (``{"addr": {"host", "port"}, "link": {...}}``), None when malformed."""
    try:
        record = json.loads(value)
    except ValueError:
        return None
    return record if isinstance(record, dict) and "link" in record else None


def _address(record: Mapping[str, Any] | None) -> tuple[str, int]:
    """``(host, port)`` from a ring record; ``("", 0)`` when it has none usable."""
    addr = (record or {}).get("addr")
    if isinstance(addr, dict) and isinstance(addr.get("host"), str) and isinstance(addr.get("port"), int):
        return addr["host"], addr["port"]
    return "", 0


class _CountingStore:
    """The round's store, counting requests (``store_requests`` in the measurements)."""

    def __init__(self, store: Any):
        self.store, self.requests = store, 0

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)

        def call(*args: Any) -> Any:
            self.requests += 1
            return method(*args)

        return call

    def wait_until(self, keys: list[str], until: float) -> bool:
        """Wait for ``keys`` until ``until`` (monotonic): False when they are not all there."""
        try:
            self.wait(keys, datetime.timedelta(seconds=_timeout(until)))
            return True
        except (RuntimeError, TimeoutError):  # torch's DistStoreError, the fsm store's StoreTimeout: timed out
            return False

    def missing(self, keys: list[str]) -> list[str]:
        """The keys not in the store, by bisection (``check`` answers for a whole list)."""
        if self.check(keys):
            return []
        if len(keys) == 1:
            return list(keys)
        half = len(keys) // 2
        return self.missing(keys[:half]) + self.missing(keys[half:])


class NetworkCheck:
    """The network node check (module docstring); ``seconds``: each direction's transfer time."""

    def __init__(self, thresholds: Thresholds | None = None, seconds: float = 0.2):
        _transfer_seconds(seconds)
        self.thresholds, self.seconds = thresholds or Thresholds(), seconds

    @hookimpl
    def fsm_agent_node_check(self, check_round: CheckRound) -> CheckResult | None:
        if check_round.group_world_size < 2:
            return None
        return self.run(check_round.for_check(CHECK))

    def run(self, cr: CheckRound) -> CheckResult:
        started = time.monotonic()
        end = cr.deadline - END_MARGIN_S
        measure_s = 2 * self.seconds + MEASURE_SLACK_S
        store = _CountingStore(cr.store)
        rank, n, key = cr.group_rank, cr.group_world_size, cr.key_prefix
        server = _Server(cr.node_addr, end)
        try:
            me = {"host": cr.node_addr, "port": server.port}
            store.set(f"{key}addr/{rank}", json.dumps(me))
            peer = (rank + 1) % n
            if store.wait_until([f"{key}addr/{peer}"], min(started + JOIN_S, end)):
                addr = json.loads(store.get(f"{key}addr/{peer}"))
                link = measure_link(addr["host"], addr["port"], self.seconds, min(time.monotonic() + measure_s, end))
            else:
                link = {"error": f"node {peer} published no address within {JOIN_S:g} s"}
            store.set(f"{key}ring/{rank}", json.dumps({"addr": me, "link": link}))
            ring_until = min(started + JOIN_S + measure_s + STORE_SLACK_S, end)
            if rank == 0:
                return self._decide(cr, store, server, link, ring_until, measure_s, started)
            return self._follow(cr, store, server, link, ring_until, measure_s, started)
        finally:
            server.close()

    def _measurements(self, link: Link, store: _CountingStore, rounds: int, started: float) -> dict[str, float]:
        values = {name: float(link[name]) for name in ("up_mbps", "down_mbps", "rtt_ms") if name in link}
        values.update(link_failed=float("error" in link), rounds=float(rounds), store_requests=float(store.requests))
        values["check_s"] = time.monotonic() - started
        return values

    def _run_tests(
        self, store: _CountingStore, rank: int, plan: Mapping[str, Any], measure_s: float, end: float
    ) -> None:
        """Round 2 on this node: measure each suspect assigned to it, one after another (each its
        own ``measure_s`` seconds), and publish the results."""
        mine = [test for test in plan["tests"] if test[0] == rank]
        if mine:
            results = [
                [
                    suspect,
                    measure_link(host, port, self.seconds, min(time.monotonic() + measure_s, end))
                    if host
                    else {"error": "published no usable address"},
                ]
                for _, suspect, host, port in mine
            ]
            store.set(f"{plan['key']}test/{rank}", json.dumps(results))

    @staticmethod
    def _round2_until(plan: Mapping[str, Any], measure_s: float, end: float) -> float:
        """When round 2 is over: the busiest tester's tests, one after another."""
        per_tester: dict[int, int] = {}
        for good, *_ in plan["tests"]:
            per_tester[good] = per_tester.get(good, 0) + 1
        return min(time.monotonic() + max(per_tester.values(), default=0) * measure_s, end)

    def _wait_served(self, server: _Server, rank: int, plan: Mapping[str, Any], until: float) -> None:
        """Keep the server up until this node's round-2 peers measured it (3 sessions each)."""
        expected = server.sessions + 3 * sum(1 for test in plan["tests"] if test[1] == rank)
        while server.sessions < expected and time.monotonic() < until:
            time.sleep(0.01)

    def _follow(
        self,
        cr: CheckRound,
        store: _CountingStore,
        server: _Server,
        link: Link,
        ring_until: float,
        measure_s: float,
        started: float,
    ) -> CheckResult:
        key, rank = cr.key_prefix, cr.group_rank
        rounds = 1
        plan_until = min(ring_until + STORE_SLACK_S, cr.deadline - END_MARGIN_S)
        if store.wait_until([f"{key}plan"], plan_until):
            plan = json.loads(store.get(f"{key}plan"))
            if plan["tests"]:
                rounds = 2
                end = cr.deadline - END_MARGIN_S
                until = self._round2_until(plan, measure_s, end)
                self._run_tests(store, rank, plan, measure_s, end)
                self._wait_served(server, rank, plan, until)
        else:
            log.warning("network check: no plan from group rank 0 within %.1f s", plan_until - started)
        values = self._measurements(link, store, rounds, started)
        if "error" in link and server.sessions == 0:
            return CheckResult(check=CHECK, ok=False, reason=f"reached no peer: {link['error']}", measurements=values)
        return CheckResult(check=CHECK, ok=True, measurements=values)

    def _decide(
        self,
        cr: CheckRound,
        store: _CountingStore,
        server: _Server,
        link: Link,
        ring_until: float,
        measure_s: float,
        started: float,
    ) -> CheckResult:
        key, n = cr.key_prefix, cr.group_world_size
        keys = [f"{key}ring/{i}" for i in range(n)]
        # Healthy links answer within the transfers and a round trip; only a node that published its
        # address (it is measuring) is waited for beyond that, up to ``ring_until``.
        soon = min(started + JOIN_S + 2 * self.seconds + STORE_SLACK_S, ring_until)
        missing: list[str] = []
        if not store.wait_until(keys, soon):
            missing = store.missing(keys)
            absent = store.missing([k.replace("/ring/", "/addr/") for k in missing])
            late = [k for k in missing if k.replace("/ring/", "/addr/") not in absent]
            if late and not store.wait_until(late, ring_until):
                missing = [k for k in missing if k not in late] + store.missing(late)
            else:
                missing = [k for k in missing if k not in late]
        present = [k for k in keys if k not in missing]
        records = {int(k.rsplit("/", 1)[1]): _record(v) for k, v in zip(present, store.multi_get(present))}
        verdict = analyse_ring(n, {i: r["link"] for i, r in records.items() if r}, self.thresholds)
        blamed = dict(verdict.blamed)
        tests = [[good, s, *_address(records.get(s))] for good, s in verdict.tests]
        plan = {"key": key, "tests": tests}
        store.set(f"{key}plan", json.dumps(plan))
        if verdict.undecided:
            log.warning("network check: no node known good to decide between nodes %s", verdict.undecided)
        if tests:
            end = cr.deadline - END_MARGIN_S
            until = self._round2_until(plan, measure_s, end)
            self._run_tests(store, 0, plan, measure_s, end)
            testers = sorted({good for good, _ in verdict.tests})
            test_keys = [f"{key}test/{g}" for g in testers]
            got = test_keys
            if not store.wait_until(test_keys, min(until + STORE_SLACK_S, end)):
                lost = store.missing(test_keys)
                got = [k for k in test_keys if k not in lost]
            results = {}
            for k, value in zip(got, store.multi_get(got) if got else []):
                good = int(k.rsplit("/", 1)[1])
                results.update({(good, int(suspect)): result for suspect, result in json.loads(value)})
            blamed.update(analyse_tests(verdict.tests, results, verdict.reference, self.thresholds))
            self._wait_served(server, 0, plan, until)
        values = self._measurements(link, store, 2 if tests else 1, started)
        if verdict.reference.mbps is not None:
            values["median_mbps"] = verdict.reference.mbps
        if verdict.reference.rtt_ms is not None:
            values["median_rtt_ms"] = verdict.reference.rtt_ms
        values["blamed"] = float(len(blamed))
        own = blamed.pop(0, "")
        return CheckResult(check=CHECK, ok=not own, reason=own, blamed=blamed, measurements=values)


@hookimpl
def fsm_agent_configure(config: Any, agent: Any) -> None:
    options = config.plugin_options(PLUGIN_NAME) if config is not None else {}
    if not options.get("network"):
        return
    thresholds = Thresholds(
        min_bandwidth_ratio=options.get("min_bandwidth_ratio") or 0.25,
        max_rtt_ratio=options.get("max_rtt_ratio") or 10.0,
        rtt_floor_ms=10.0 if options.get("rtt_floor_ms") is None else options["rtt_floor_ms"],
    )
    check = NetworkCheck(thresholds, seconds=options.get("network_seconds") or 0.2)
    agent.plugin_manager.register(check, f"{PLUGIN_NAME}-{id(agent)}")
    log.info("node check network switched on (%s, %g s per direction)", thresholds, check.seconds)
