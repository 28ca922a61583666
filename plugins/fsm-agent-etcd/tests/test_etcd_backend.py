"""The backend and the store against a real etcd: torch's RendezvousBackend and Store contracts."""

from __future__ import annotations

import datetime
import json
import pickle
import subprocess
import sys
import time
import uuid

import fsm_agent_etcd
import pytest
from torch.distributed import DistStoreError, PrefixStore
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError


def params(endpoint: str, run_id: str | None = None, **conf) -> RendezvousParameters:
    return RendezvousParameters(
        backend="etcd-v3", endpoint=endpoint, run_id=run_id or uuid.uuid4().hex, min_nodes=1, max_nodes=2, **conf
    )


def test_etcd_server_speaks_v3(etcd_server):
    major, minor = (int(x) for x in etcd_server.version().split(".")[:2])
    assert (major, minor) >= (3, 4)


def test_set_state_is_compare_and_set_on_the_mod_revision(etcd_server):
    backend, _ = fsm_agent_etcd.create_backend(params(etcd_server.endpoint))
    assert backend.name == "etcd-v3"
    assert backend.get_state() is None

    state, token, won = backend.set_state(b"first")  # no token: create only
    assert (state, won) == (b"first", True)
    assert backend.set_state(b"second") == (b"first", token, False)  # exists already: the current state back
    assert backend.set_state(b"stale", token + 1000) == (b"first", token, False)  # wrong token
    state, new_token, won = backend.set_state(b"third", token)  # right token
    assert (state, won) == (b"third", True) and new_token > token
    assert backend.get_state() == (b"third", new_token)
    assert backend.set_state(b"x", "not-a-token") == (b"third", new_token, False)


def test_two_backends_race_and_exactly_one_wins(etcd_server):
    run_id = uuid.uuid4().hex
    a, _ = fsm_agent_etcd.create_backend(params(etcd_server.endpoint, run_id))
    b, _ = fsm_agent_etcd.create_backend(params(etcd_server.endpoint, run_id))
    _, token, _ = a.set_state(b"base")
    results = [a.set_state(b"from-a", token), b.set_state(b"from-b", token)]
    assert [won for *_, won in results] == [True, False]
    assert results[1][0] == b"from-a"


def test_state_key_is_readable_by_any_client_and_carries_the_ttl_lease(etcd_server):
    run_id = uuid.uuid4().hex
    backend, _ = fsm_agent_etcd.create_backend(params(etcd_server.endpoint, run_id, ttl="120"))
    backend.set_state(pickle.dumps({"round": 0}))
    client = etcd_server.client()
    value, meta = client.get(f"/torch/elastic/rendezvous/{run_id}", metadata=True)[0]
    assert pickle.loads(value) == {"round": 0}
    lease = int(meta["lease"])
    answer = client.post(client.get_url("/kv/lease/timetolive"), json={"ID": lease})
    assert 0 < int(answer["TTL"]) <= 120


def test_ttl_zero_writes_keys_without_a_lease(etcd_server):
    run_id = uuid.uuid4().hex
    backend, _ = fsm_agent_etcd.create_backend(params(etcd_server.endpoint, run_id, ttl="0"))
    backend.set_state(b"forever")
    _, meta = etcd_server.client().get(f"/torch/elastic/rendezvous/{run_id}", metadata=True)[0]
    assert int(meta.get("lease", 0)) == 0


def test_store_behaves_like_a_tcpstore_through_a_prefix_store(etcd_server):
    run_id = uuid.uuid4().hex
    _, store = fsm_agent_etcd.create_backend(params(etcd_server.endpoint, run_id))
    s = PrefixStore(f"torch.rendezvous.{run_id}.0", store)
    s.set("a", "x")
    assert s.get("a") == b"x"
    assert (s.add("n", 2), s.add("n", 3)) == (2, 5)
    s.multi_set(["c", "d"], ["1", b"\x00\xff"])
    assert s.multi_get(["c", "d"]) == [b"1", b"\x00\xff"]
    assert s.check(["a", "c"]) and not s.check(["a", "missing"])
    assert s.compare_set("a", "x", "y") == b"y"  # matched: swapped
    assert s.compare_set("a", "x", "z") == b"y"  # did not match: current value
    assert s.compare_set("fresh", "", "v") == b"v"  # absent + empty expectation: set
    assert s.compare_set("absent", "q", "v") == b"q"  # absent + other expectation: expectation back
    assert s.num_keys() == 5  # a, n, c, d, fresh
    assert s.delete_key("a") is True and s.delete_key("a") is False
    keys = [meta["key"] for _, meta in etcd_server.client().get_prefix(f"/torch/elastic/store/{run_id}/")]
    assert f"/torch/elastic/store/{run_id}/torch.rendezvous.{run_id}.0/n".encode() in keys


def test_blocking_reads_wait_for_the_key_and_time_out_with_dist_store_error(etcd_server):
    import threading

    _, store = fsm_agent_etcd.create_backend(params(etcd_server.endpoint))
    store.set_timeout(datetime.timedelta(seconds=10))
    threading.Timer(0.3, lambda: store.set("late", "here")).start()
    started = time.monotonic()
    assert store.get("late") == b"here"
    assert time.monotonic() - started < 5
    started = time.monotonic()
    with pytest.raises(DistStoreError, match="timed out"):
        store.wait(["never"], datetime.timedelta(seconds=0.5))
    assert 0.4 < time.monotonic() - started < 5


def test_unreachable_etcd_is_a_connection_error_at_once(etcd_server):
    with socket_closed_port() as port:
        started = time.monotonic()
        with pytest.raises(RendezvousConnectionError, match="does not answer"):
            fsm_agent_etcd.create_backend(params(f"127.0.0.1:{port}", read_timeout="5"))
        assert time.monotonic() - started < 10


def test_a_revoked_lease_is_replaced_on_the_next_write(etcd_server):
    run_id = uuid.uuid4().hex
    backend, store = fsm_agent_etcd.create_backend(params(etcd_server.endpoint, run_id, ttl="60"))
    backend.set_state(b"before")
    client = etcd_server.client()
    _, meta = client.get(f"/torch/elastic/rendezvous/{run_id}", metadata=True)[0]
    client.post(client.get_url("/kv/lease/revoke"), json={"ID": int(meta["lease"])})  # etcd drops its keys
    assert backend.get_state() is None
    state, _, won = backend.set_state(b"after")
    assert (state, won) == (b"after", True)
    store.set("k", "v")
    _, meta_after = client.get(f"/torch/elastic/rendezvous/{run_id}", metadata=True)[0]
    assert int(meta_after["lease"]) not in (0, int(meta["lease"]))


def test_cli_with_an_unreachable_etcd_is_a_one_line_error(tmp_path):
    with socket_closed_port() as port:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "fsm_agent",
                "run",
                "--rdzv-backend",
                "etcd-v3",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                "nowhere",
                "-m",
                "json.tool",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"fsm-agent: error: --rdzv-backend etcd-v3 at 127.0.0.1:{port}: RendezvousConnectionError: "
        f"etcd at http://127.0.0.1:{port} does not answer: ConnectionFailedError"
    )


def test_bad_options_name_the_fix():
    with pytest.raises(ValueError, match="use http or https"):
        fsm_agent_etcd.read_options(params("127.0.0.1:1", protocol="gopher"))
    with pytest.raises(ValueError, match="must start with '/'"):
        fsm_agent_etcd.read_options(params("127.0.0.1:1", key_prefix="torch"))


def test_options_fall_back_to_the_environment(monkeypatch):
    monkeypatch.setenv("FSM_AGENT_ETCD_TTL", "33")
    monkeypatch.setenv("FSM_AGENT_ETCD_KEY_PREFIX", "/env/prefix")
    options = fsm_agent_etcd.read_options(params("127.0.0.1:1", key_prefix="/from/conf"))
    assert (options["ttl"], options["key_prefix"]) == (33, "/from/conf")


def test_declared_conf_keys_are_the_options_read():
    """``fsm-agent run`` checks ``--rdzv-conf`` keys against OPTIONS: it must name every option read."""
    assert set(fsm_agent_etcd.read_options(None)) == set(fsm_agent_etcd.OPTIONS)


def test_backend_is_listed_by_fsm_agent_plugins():
    out = subprocess.run(
        [sys.executable, "-m", "fsm_agent", "plugins", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    row = next(r for r in json.loads(out) if r["name"] == "etcd")
    assert row["distribution"] == "fsm-agent-etcd" and "fsm_agent_register_backends" in row["hooks"]


class socket_closed_port:
    """A port on 127.0.0.1 that nothing listens on (bound, never listened, for the block)."""

    def __enter__(self) -> int:
        import socket

        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        return self._sock.getsockname()[1]

    def __exit__(self, *exc) -> None:
        self._sock.close()
