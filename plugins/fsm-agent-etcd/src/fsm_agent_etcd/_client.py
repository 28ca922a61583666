"""The etcd connection shared by the rendezvous backend and the store: client, key layout, lease, errors.

Everything goes through etcd's v3 API over its gRPC-gateway JSON endpoint (``/v3/...``) with
``etcd3gw``. Values travel base64-encoded (etcd3gw does that); keys are UTF-8 bytes.
"""

from __future__ import annotations

import base64
import threading
import time
from typing import Any

from etcd3gw import exceptions as etcd_exceptions
from etcd3gw.client import Etcd3Client

#: Errors of the transport (server down, timeout) that become torch's ``RendezvousConnectionError``.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (etcd_exceptions.Etcd3Exception,)


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
    """One etcd3gw client plus the lease that gives this agent's writes their TTL.

    Args:
        client: an ``etcd3gw.client.Etcd3Client``.
        ttl: seconds every key written through this connection outlives its last write
            (0: keys never expire). The lease is granted on the first write and kept alive by
            later writes, so a job's keys disappear ``ttl`` seconds after its last agent stopped
            writing (torch's etcd-v2 backend writes its state with a 2-hour TTL likewise).
    """

    def __init__(self, client: Etcd3Client, ttl: int = 7200):
        self.client = client
        self.ttl = ttl
        self._lease_id: int | None = None
        self._lease_refreshed = 0.0
        self._lock = threading.Lock()

    # -- raw v3 calls -------------------------------------------------------------------------
    def txn(self, compare: list[dict], success: list[dict], failure: list[dict] | None = None) -> dict[str, Any]:
        """One ``/kv/txn`` call; ``succeeded`` is always present in the answer (False when omitted)."""
        body = {"compare": compare, "success": success, "failure": failure or []}
        result = self.client.transaction(body)
        result.setdefault("succeeded", False)
        return result

    def range(self, key: bytes, *, prefix: bool = False, count_only: bool = False) -> dict[str, Any]:
        body: dict[str, Any] = {"key": b64(key)}
        if prefix:
            body["range_end"] = b64(prefix_range_end(key))
        if count_only:
            body["count_only"] = True
        return self.client.post(self.client.get_url("/kv/range"), json=body)

    def delete(self, key: bytes, *, prefix: bool = False) -> int:
        """Delete ``key`` (or every key under it); returns how many keys were deleted."""
        body: dict[str, Any] = {"key": b64(key)}
        if prefix:
            body["range_end"] = b64(prefix_range_end(key))
        answer = self.client.post(self.client.get_url("/kv/deleterange"), json=body)
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
                answer = self.client.post(self.client.get_url("/lease/keepalive"), json={"ID": self._lease_id})
                if int(answer.get("result", {}).get("TTL", -1)) > 0:
                    self._lease_refreshed = now
                    return self._lease_id
            answer = self.client.post(self.client.get_url("/lease/grant"), json={"TTL": self.ttl, "ID": 0})
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


def create_connection(host: str, port: int, *, protocol: str = "http", read_timeout: float = 60,
                      ca_cert: str | None = None, cert: str | None = None, cert_key: str | None = None,
                      ttl: int = 7200) -> EtcdConnection:
    """A connection to the etcd server at ``host:port`` (etcd's client URL, default port 2379)."""
    client = Etcd3Client(host=host, port=port, protocol=protocol, ca_cert=ca_cert, cert_cert=cert,
                         cert_key=cert_key, timeout=read_timeout)
    return EtcdConnection(client, ttl=ttl)
