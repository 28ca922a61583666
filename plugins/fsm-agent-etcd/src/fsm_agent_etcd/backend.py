"""EtcdV3RendezvousBackend: torch's ``RendezvousBackend`` (shared rendezvous state) on one etcd v3 key.

The state is the pickled ``_RendezvousState`` of torch's ``DynamicRendezvousHandler``, stored
as-is under ``<key_prefix>/rendezvous/<run_id>``. The fencing token is the key's
``mod_revision``; ``set_state`` is one etcd transaction that compares it and either writes the
new state or returns the current one (torch's etcd-v2 backend does the same with v2's
``prevIndex``).
"""

from __future__ import annotations

from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from fsm_agent_etcd import BACKEND_NAME
from fsm_agent_etcd._client import CONNECTION_ERRORS, EtcdConnection, describe, kv_of, unb64


class EtcdV3RendezvousBackend(RendezvousBackend):
    """Holds the rendezvous state of one run in etcd.

    Args:
        connection: the EtcdConnection (client + lease).
        run_id: the rendezvous run id (``--rdzv-id``); must not be empty.
        key_prefix: etcd key prefix; the state lives at ``<key_prefix>/rendezvous/<run_id>``.
    """

    def __init__(self, connection: EtcdConnection, run_id: str, key_prefix: str = "/torch/elastic"):
        if not run_id:
            raise ValueError("The run id must be a non-empty string.")
        self._conn = connection
        self.key = f"{key_prefix.rstrip('/')}/rendezvous/{run_id}".encode()

    @property
    def name(self) -> str:
        """See base class."""
        return BACKEND_NAME

    def get_state(self) -> tuple[bytes, Token] | None:
        """See base class: the state and its ``mod_revision``, or None when no state was written."""
        try:
            answer = self._conn.range(self.key)
        except CONNECTION_ERRORS as exc:
            raise RendezvousConnectionError(f"the connection to etcd has failed: {describe(exc)}") from exc
        kvs = answer.get("kvs") or []
        return self._decode(kvs[0]) if kvs else None

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        """See base class: write ``state`` only if ``token`` is the key's current ``mod_revision``.

        ``token=None`` writes only when there is no state yet. Either way the answer is the state
        now in etcd, its token, and whether this call wrote it.
        """
        if token is not None:
            try:
                revision = int(token)
            except (TypeError, ValueError):
                current = self.get_state()
                return None if current is None else (*current, False)
            compare = self._conn.compare_mod_revision(self.key, revision)
        else:
            compare = self._conn.compare_absent(self.key)

        def attempt():
            return self._conn.txn([compare], [self._conn.put_op(self.key, state)], [self._conn.range_op(self.key)])

        try:
            answer = self._conn.with_lease_retry(attempt)
        except CONNECTION_ERRORS as exc:
            raise RendezvousConnectionError(f"the connection to etcd has failed: {describe(exc)}") from exc
        if answer["succeeded"]:
            return state, int(answer["header"]["revision"]), True
        kv = kv_of(answer)
        if kv is None:  # the key vanished between compare and read (expired lease): read again
            current = self.get_state()
            return None if current is None else (*current, False)
        return (*self._decode(kv), False)

    @staticmethod
    def _decode(kv: dict) -> tuple[bytes, Token]:
        try:
            return unb64(kv.get("value")), int(kv["mod_revision"])
        except (KeyError, ValueError) as exc:
            raise RendezvousStateError(f"the rendezvous state in etcd is corrupt: {exc}") from exc
