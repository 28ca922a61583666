"""The etcd connection shared by the rendezvous backend and the store: clients, key layout, lease, errors.

Everything goes through etcd's v3 API over its gRPC-gateway JSON endpoint (``/v3/...``) with
``etcd3gw``. Values travel base64-encoded (etcd3gw does that); keys are UTF-8 bytes.

A cluster's members are given as a list (``--rdzv-endpoint a:2379,b:2379,c:2379``). etcd3gw
talks to one member and torch's etcd handlers take one endpoint, so the failover is here:
``EtcdConnection.post`` sends each request to the member that last answered and, when that
member cannot be reached, to the next one, as etcd's own clients (etcdctl, clientv3) do. Any
member serves a request: writes go through raft, reads are linearizable by default.
"""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Sequence
from typing import Any

import requests
from etcd3gw import exceptions as etcd_exceptions
from etcd3gw.client import Etcd3Client

#: Errors of the transport (server down, timeout) that become torch's ``RendezvousConnectionError``.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (etcd_exceptions.Etcd3Exception,)

#: Errors after which the next member is tried: no connection (refused, reset: the member is down),
#: HTTP 503 (etcd3gw maps it to ConnectionFailedError: e.g. a member without a leader) and timeouts.
FAILOVER_ERRORS: tuple[type[BaseException], ...] = (
    etcd_exceptions.ConnectionFailedError,
    etcd_exceptions.ConnectionTimeoutError,
)


def describe(exc: BaseException) -> str:
    """One line for an etcd3gw error: its type, etcd's answer (``detail_text``) and the HTTP reason."""
    detail = getattr(exc, "detail_text", None)
    parts = [str(p) for p in (detail, *exc.args) if p not in (None, "")]
    return f"{type(exc).__name__}: {' '.join(parts)}" if parts else type(exc).__name__


def b64(data: bytes | str) -> str:
    """Base64 for the JSON gateway (a str is UTF-8 encoded first)."""
    return base64.b64encode(data.encode() if isinstance(data, str) else bytes(data)).decode("ascii")


def unb64(data: str | None) -> bytes:
    """The bytes of a base64 field of a gateway answer (absent: empty)."""
    return base64.b64decode(data) if data else b""


def prefix_range_end(prefix: bytes) -> bytes:
    """The ``range_end`` that makes a range request cover every key starting with ``prefix``."""
    end = bytearray(prefix)
    for i in range(len(end) - 1, -1, -1):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"  # every key


class EtcdConnection:
    """etcd3gw clients, one per member of one etcd cluster, plus the lease that gives this agent's
    writes their TTL.

    Args:
        clients: an ``etcd3gw.client.Etcd3Client``, or one per cluster member (the order of
            ``--rdzv-endpoint``; the first is asked first).
        ttl: seconds every key written through this connection outlives its last write
            (0: keys never expire). The lease is granted on the first write and kept alive by
            later writes, so a job's keys disappear ``ttl`` seconds after its last agent stopped
            writing (torch's etcd-v2 backend writes its state with a 2-hour TTL likewise). A lease
            belongs to the cluster, so it outlives the member that granted it.
        failover_timeout: seconds ``post`` keeps going round the members while none answers
            (an election after the leader was lost takes about a second), then it raises.
    """

    def __init__(self, clients: Etcd3Client | Sequence[Etcd3Client], ttl: int = 7200, failover_timeout: float = 60):
        self.clients = [clients] if isinstance(clients, Etcd3Client) else list(clients)
        if not self.clients:
            raise ValueError("EtcdConnection needs at least one etcd client")
        self.ttl = ttl
        self.failover_timeout = failover_timeout
        self._current = 0  # the member that answered last
        self._lease_id: int | None = None
        self._lease_refreshed = 0.0
        self._lock = threading.Lock()

    @property
    def client(self) -> Etcd3Client:
        """The client of the member that answered last (the first member until one failed)."""
        return self.clients[self._current]

    @property
    def urls(self) -> list[str]:
        """Every member's client URL (``http://host:port``), in ``--rdzv-endpoint`` order."""
        return [c.base_url for c in self.clients]

    def post(self, path: str, body: dict[str, Any], *, deadline: float | None = None) -> Any:
        """POST ``body`` to ``/v3/<path>`` of the member that answered last; while it cannot be
        reached (FAILOVER_ERRORS), each other member in turn, round and round (pausing 0.1 s, doubling
        up to 1 s, after each round) until ``deadline`` (``time.monotonic()``; default: now +
        ``failover_timeout``). Other errors (etcd said no) are raised at once.

        Raises:
            etcd3gw.exceptions.Etcd3Exception: no member answered in time (the last member's error),
                or etcd refused the request.
        """
        deadline = time.monotonic() + self.failover_timeout if deadline is None else deadline
        pause, count = 0.1, len(self.clients)
        while True:
            start = self._current
            for step in range(count):
                index = (start + step) % count
                client = self.clients[index]
                try:
                    answer = client.post(client.get_url(path), json=body)  # get_url may ask /version first
                except FAILOVER_ERRORS as exc:
                    last = exc
                    continue
                self._current = index
                return answer
            if time.monotonic() + pause > deadline:
                raise last
            time.sleep(pause)
            pause = min(pause * 2, 1.0)

    def check(self) -> None:
        """Ask each member for its version, in turn, once, until one answers (no waiting).

        Raises:
            etcd3gw.exceptions.Etcd3Exception: no member answered (the last member's error).
        """
        for index, client in enumerate(self.clients):
            try:
                _ = client.api_path  # GET /version
            except CONNECTION_ERRORS as exc:
                last = exc
                continue
            self._current = index
            return
        raise last

    # -- raw v3 calls -------------------------------------------------------------------------
    def txn(self, compare: list[dict], success: list[dict], failure: list[dict] | None = None) -> dict[str, Any]:
        """One ``/kv/txn`` call; ``succeeded`` is always present in the answer (False when omitted)."""
        body = {"compare": compare, "success": success, "failure": failure or []}
        result = self.post("/kv/txn", body)
        result.setdefault("succeeded", False)
        return result

    def range(self, key: bytes, *, prefix: bool = False, count_only: bool = False) -> dict[str, Any]:
        body: dict[str, Any] = {"key": b64(key)}
        if prefix:
            body["range_end"] = b64(prefix_range_end(key))
        if count_only:
            body["count_only"] = True
        return self.post("/kv/range", body)

    def delete(self, key: bytes, *, prefix: bool = False) -> int:
        """Delete ``key`` (or every key under it); returns how many keys were deleted."""
        body: dict[str, Any] = {"key": b64(key)}
        if prefix:
            body["range_end"] = b64(prefix_range_end(key))
        answer = self.post("/kv/deleterange", body)
        return int(answer.get("deleted", 0))

    # -- request builders ---------------------------------------------------------------------
    def put_op(self, key: bytes, value: bytes) -> dict[str, Any]:
        put: dict[str, Any] = {"key": b64(key), "value": b64(value)}
        lease = self.lease_id()
        if lease:
            put["lease"] = lease
        return {"request_put": put}

    @staticmethod
    def range_op(key: bytes) -> dict[str, Any]:
        return {"request_range": {"key": b64(key)}}

    @staticmethod
    def compare_mod_revision(key: bytes, revision: int) -> dict[str, Any]:
        """True when ``key``'s last modification is ``revision`` (0: the key does not exist)."""
        return {"key": b64(key), "result": "EQUAL", "target": "MOD", "mod_revision": str(revision)}

    @staticmethod
    def compare_absent(key: bytes) -> dict[str, Any]:
        return {"key": b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": "0"}

    # -- lease ----------------------------------------------------------------------------------
    def lease_id(self) -> int | None:
        """This connection's lease, granted on first use and refreshed at most every ttl/10 s."""
        if self.ttl <= 0:
            return None
        with self._lock:
            now = time.monotonic()
            if self._lease_id is not None and now - self._lease_refreshed < max(1.0, self.ttl / 10):
                return self._lease_id
            if self._lease_id is not None:
                answer = self.post("/lease/keepalive", {"ID": self._lease_id})
                if int(answer.get("result", {}).get("TTL", -1)) > 0:
                    self._lease_refreshed = now
                    return self._lease_id
            answer = self.post("/lease/grant", {"TTL": self.ttl, "ID": 0})
            self._lease_id, self._lease_refreshed = int(answer["ID"]), now
            return self._lease_id

    def forget_lease(self) -> None:
        """Drop the cached lease (it expired under us); the next write grants a new one."""
        with self._lock:
            self._lease_id = None

    def with_lease_retry(self, fn):
        """Run ``fn()``; if etcd says the lease is gone, grant a new one and run it once more."""
        try:
            return fn()
        except etcd_exceptions.Etcd3Exception as exc:
            if "lease not found" not in describe(exc):
                raise
            self.forget_lease()
            return fn()


def kv_of(txn_answer: dict[str, Any], index: int = 0) -> dict[str, Any] | None:
    """The first key-value of the ``index``-th range response of a txn answer, or None."""
    responses = txn_answer.get("responses") or []
    if index >= len(responses):
        return None
    kvs = responses[index].get("response_range", {}).get("kvs") or []
    return kvs[0] if kvs else None


class _Session(requests.Session):
    """A requests session whose own CA file (``verify``) wins over ``$REQUESTS_CA_BUNDLE`` and
    ``$CURL_CA_BUNDLE``: requests lets those replace a session's ``verify`` (psf/requests#3829),
    so ``ca_cert`` would be ignored wherever they are set."""

    def merge_environment_settings(self, url, proxies, stream, verify, cert):
        settings = super().merge_environment_settings(url, proxies, stream, verify, cert)
        if verify in (None, True) and self.verify not in (None, True):
            settings["verify"] = self.verify
        return settings


def create_connection(
    members: Sequence[tuple[str, int]],
    *,
    protocol: str = "http",
    read_timeout: float = 60,
    ca_cert: str | None = None,
    cert: str | None = None,
    cert_key: str | None = None,
    ttl: int = 7200,
) -> EtcdConnection:
    """A connection to the etcd cluster whose members' client URLs are ``members`` (``(host, port)``,
    default port 2379): the same TLS files for every member, as etcdctl takes them (``ca_cert``: the
    CA to verify the members with; ``cert``/``cert_key``: this client's certificate and key).
    ``read_timeout`` bounds each HTTP request and, as ``failover_timeout``, how long a request goes
    round the members."""
    clients = []
    for host, port in members:
        session = _Session()
        if ca_cert:
            session.verify = ca_cert
        if cert:  # one file with both, or the certificate and its key (torch's etcd-v2 reads them so)
            session.cert = (cert, cert_key) if cert_key else cert
        clients.append(Etcd3Client(host=host, port=port, protocol=protocol, timeout=read_timeout, session=session))
    return EtcdConnection(clients, ttl=ttl, failover_timeout=read_timeout)
