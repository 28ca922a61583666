"""EtcdV3Store: a ``torch.distributed.Store`` whose keys live in etcd (v3 API).

The agents use it for what torch's rendezvous handler and agent put in the round's store
(MASTER_ADDR/MASTER_PORT of the attempt, the rank assignment, the exit barrier); workers never
see it, because the group-rank-0 agent hosts a fresh TCPStore for their process groups.

Key ``k`` is stored at ``<key_prefix>/store/<run_id>/k`` (UTF-8); values are raw bytes.
Blocking reads (``get``, ``wait``) poll etcd with a backoff of 10 ms doubling up to
``poll_interval`` until the store's timeout, then raise ``torch.distributed.DistStoreError``, as
a TCPStore does. ``add`` and ``compare_set`` are compare-and-swap loops on the key's
``mod_revision``; ``multi_get``/``multi_set`` are one etcd transaction each.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterable

from torch.distributed import DistStoreError, Store

from fsm_agent_etcd._client import CONNECTION_ERRORS, EtcdConnection, describe, kv_of, unb64


def _as_bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class EtcdV3Store(Store):
    """A c10d Store on etcd.

    Args:
        connection: the EtcdConnection (client + lease).
        prefix: etcd key prefix of this store (``/`` is appended if missing).
        timeout: default timeout of ``get``/``wait`` (torch's Store default, 300 s, when None).
        poll_interval: longest pause between two reads of a blocking ``get``/``wait``, seconds.
    """

    def __init__(
        self,
        connection: EtcdConnection,
        prefix: str,
        timeout: datetime.timedelta | None = None,
        poll_interval: float = 0.2,
    ):
        super().__init__()  # the pybind trampoline needs it
        self._conn = connection
        self.prefix = (prefix if prefix.endswith("/") else prefix + "/").encode()
        self.poll_interval = poll_interval
        if timeout is not None:
            self.set_timeout(timeout)

    def _key(self, key: str | bytes) -> bytes:
        return self.prefix + _as_bytes(key)

    # -- writes -------------------------------------------------------------------------------
    def set(self, key, value) -> None:
        k = self._key(key)
        self._call(lambda: self._conn.txn([], [self._conn.put_op(k, _as_bytes(value))]))

    def multi_set(self, keys: list[str], values: list) -> None:
        if len(keys) != len(values):
            raise ValueError(f"multi_set: {len(keys)} keys but {len(values)} values")
        ops = [self._conn.put_op(self._key(k), _as_bytes(v)) for k, v in zip(keys, values, strict=True)]
        self._call(lambda: self._conn.txn([], ops))

    def add(self, key, value: int) -> int:
        """Add ``value`` to the decimal integer at ``key`` (0 when absent); returns the new value."""
        k = self._key(key)
        while True:
            kv = self._read(k)
            current = int(unb64(kv.get("value")) or b"0") if kv else 0
            new = current + int(value)
            if self._swap(k, kv, str(new).encode()):
                return new

    def compare_set(self, key, expected_value, desired_value) -> bytes:
        """TCPStore's semantics: set ``desired`` if the value is ``expected`` (or the key is absent and
        ``expected`` is empty); return the value the key has afterwards (``expected`` when absent)."""
        k, expected, desired = self._key(key), _as_bytes(expected_value), _as_bytes(desired_value)
        while True:
            kv = self._read(k)
            if kv is None and expected:
                return expected
            current = unb64(kv.get("value")) if kv else b""
            if kv is not None and current != expected:
                return current
            if self._swap(k, kv, desired):
                return desired

    def deleteKey(self, key) -> bool:  # the name the C++ trampoline calls (``delete_key`` from Python)
        k = self._key(key)
        return self._call(lambda: self._conn.delete(k)) > 0

    def delete_key(self, key) -> bool:
        return self.deleteKey(key)

    # -- reads --------------------------------------------------------------------------------
    def get(self, key) -> bytes:
        k = self._key(key)
        found = self._wait_for([k], self.timeout)
        return found[k]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        ks = [self._key(k) for k in keys]
        found = self._wait_for(ks, self.timeout)
        return [found[k] for k in ks]

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._wait_for([self._key(k) for k in keys], self.timeout if timeout is None else timeout)

    def check(self, keys: list[str]) -> bool:
        ks = [self._key(k) for k in keys]
        return len(self._read_many(ks)) == len(ks)

    def getNumKeys(self) -> int:  # the name the C++ trampoline calls (``num_keys`` from Python)
        answer = self._call(lambda: self._conn.range(self.prefix, prefix=True, count_only=True))
        return int(answer.get("count", 0))

    def num_keys(self) -> int:
        return self.getNumKeys()

    def has_extended_api(self) -> bool:
        return True

    # -- helpers ------------------------------------------------------------------------------
    def _call(self, fn):
        try:
            return self._conn.with_lease_retry(fn)
        except CONNECTION_ERRORS as exc:
            raise DistStoreError(f"etcd store {self.prefix.decode()!r}: {describe(exc)}") from exc

    def _read(self, key: bytes) -> dict | None:
        answer = self._call(lambda: self._conn.range(key))
        kvs = answer.get("kvs") or []
        return kvs[0] if kvs else None

    def _read_many(self, keys: Iterable[bytes]) -> dict[bytes, bytes]:
        keys = list(keys)
        answer = self._call(lambda: self._conn.txn([], [self._conn.range_op(k) for k in keys]))
        found = {}
        for i, k in enumerate(keys):
            kv = kv_of(answer, i)
            if kv is not None:
                found[k] = unb64(kv.get("value"))
        return found

    def _swap(self, key: bytes, seen: dict | None, value: bytes) -> bool:
        """Write ``value`` if ``key`` is still as ``seen`` (None: absent)."""
        compare = (
            self._conn.compare_absent(key)
            if seen is None
            else self._conn.compare_mod_revision(key, int(seen["mod_revision"]))
        )
        answer = self._call(lambda: self._conn.txn([compare], [self._conn.put_op(key, value)]))
        return bool(answer["succeeded"])

    def _wait_for(self, keys: list[bytes], timeout: datetime.timedelta) -> dict[bytes, bytes]:
        deadline = time.monotonic() + timeout.total_seconds()
        pause = 0.01
        while True:
            found = self._read_many(keys)
            if len(found) == len(keys):
                return found
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [k.decode(errors="replace") for k in keys if k not in found]
                raise DistStoreError(
                    f"etcd store: timed out after {timeout.total_seconds():g}s waiting for keys {missing}"
                )
            time.sleep(min(pause, left))
            pause = min(pause * 2, self.poll_interval)
