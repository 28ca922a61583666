"""Fixtures: real etcd on 127.0.0.1 (one member per session, or a three-member cluster per test; free
ports, tmp data dirs) and real fsm-agent processes.

Helpers are fixtures or fixture methods, not imports: the plugins' tests directories are not packages.

Every process started here runs in its own session and is killed by process group at teardown.
etcd comes from Debian's ``etcd-server`` package (``.ci/install-etcd.sh`` installs it).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import ssl
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from fsm_agent.testing import AgentProcesses
from fsm_agent.testing.conformance import free_port

ETCD_BINARY = os.environ.get("FSM_AGENT_TEST_ETCD", shutil.which("etcd") or "/usr/bin/etcd")


#: etcd's raft heartbeat and election timeout (ms; defaults 100/1000) raised for a loaded 2-core
#: machine, where 100 ms heartbeats are missed and a three-member cluster re-elects for nothing.
#: The election stays well below the agents' keep-alive timeout (5 s in these tests).
ETCD_TIMING = ("--heartbeat-interval", "250", "--election-timeout", "2500")


@dataclass(frozen=True)
class TlsFiles:
    """A test CA and one certificate for 127.0.0.1 (server and client use), made with openssl."""

    ca: Path
    cert: Path
    key: Path

    @classmethod
    def make(cls, directory: Path) -> TlsFiles:
        openssl = shutil.which("openssl")
        if not openssl:
            pytest.fail("no openssl on PATH (Debian's openssl package) to make the TLS test certificates")
        d = directory
        (d / "ext.cnf").write_text(
            "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n"
            "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n"
        )
        for argv in (
            [
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                "ca.key",
                "-out",
                "ca.pem",
                "-days",
                "1",
                "-subj",
                "/CN=fsm-agent test CA",
            ],
            [
                "req",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                "node.key",
                "-out",
                "node.csr",
                "-subj",
                "/CN=127.0.0.1",
            ],
            [
                "x509",
                "-req",
                "-in",
                "node.csr",
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                "node.pem",
                "-days",
                "1",
                "-extfile",
                "ext.cnf",
            ],
        ):
            subprocess.run([openssl, *argv], cwd=d, check=True, capture_output=True, timeout=60)
        return cls(ca=d / "ca.pem", cert=d / "node.pem", key=d / "node.key")

    def context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca))
        context.load_cert_chain(str(self.cert), str(self.key))
        return context


class EtcdMember:
    """One etcd member: clients on 127.0.0.1:``port`` (https with client certificates when ``tls``),
    peers on 127.0.0.1:``peer_port`` (plain http), its own session."""

    def __init__(self, data_dir: Path, name: str, tls: TlsFiles | None = None):
        self.name, self.data_dir, self.tls = name, data_dir, tls
        self.port, self.peer_port = free_port(), free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.url = f"{'https' if tls else 'http'}://{self.endpoint}"
        self.peer_url = f"http://127.0.0.1:{self.peer_port}"
        self.log_path = data_dir / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self, initial_cluster: str) -> None:
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [
                ETCD_BINARY,
                "--name",
                self.name,
                "--data-dir",
                str(self.data_dir / self.name),
                "--listen-client-urls",
                self.url,
                "--advertise-client-urls",
                self.url,
                "--listen-peer-urls",
                self.peer_url,
                "--initial-advertise-peer-urls",
                self.peer_url,
                "--initial-cluster",
                initial_cluster,
                "--initial-cluster-state",
                "new",
                "--initial-cluster-token",
                f"fsm-agent-test-{self.data_dir.name}",
                *ETCD_TIMING,
                *(
                    [
                        "--cert-file",
                        str(self.tls.cert),
                        "--key-file",
                        str(self.tls.key),
                        "--trusted-ca-file",
                        str(self.tls.ca),
                        "--client-cert-auth",
                    ]
                    if self.tls
                    else []
                ),
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def healthy(self) -> bool:
        """True once this member answers /health with a leader elected (False while it is starting)."""
        if self.proc is None or self.proc.poll() is not None:
            raise RuntimeError(f"etcd member {self.name} is not running: {self.log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=1, context=self._context()) as answer:
                return json.loads(answer.read()).get("health") == "true"
        except OSError:
            return False

    def _context(self) -> ssl.SSLContext | None:
        return self.tls.context() if self.tls else None

    def status(self) -> dict:
        """etcd's maintenance status of this member (``header.member_id``, ``leader``, ...)."""
        request = urllib.request.Request(f"{self.url}/v3/maintenance/status", data=b"{}", method="POST")
        with urllib.request.urlopen(request, timeout=5, context=self._context()) as answer:
            return json.loads(answer.read())

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """SIGKILL the member's process group (a machine dying) and reap it."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._log.close()


class EtcdCluster:
    """``size`` etcd members on free 127.0.0.1 ports with data directories under ``data_dir``, started
    together (they elect a leader among themselves). ``endpoint`` is ``--rdzv-endpoint``: every
    member's HOST:PORT, comma-separated."""

    def __init__(self, data_dir: Path, size: int = 1, tls: TlsFiles | None = None):
        if not os.access(ETCD_BINARY, os.X_OK):
            pytest.fail(f"no etcd binary at {ETCD_BINARY}: run .ci/install-etcd.sh (Debian's etcd-server)")
        self.tls = tls
        self.members = [EtcdMember(data_dir, f"member{i}", tls) for i in range(size)]
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        try:
            for member in self.members:
                member.start(initial)
            self._wait_healthy(timeout=60)
        except BaseException:
            self.stop()
            raise

    @property
    def endpoint(self) -> str:
        return ",".join(m.endpoint for m in self.members)

    @property
    def port(self) -> int:
        return self.members[0].port

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(m.healthy() for m in self.members):
                return
            time.sleep(0.1)
        raise RuntimeError(
            f"etcd not healthy after {timeout}s: " + "\n".join(m.log_path.read_text()[-2000:] for m in self.members)
        )

    def leader(self) -> EtcdMember:
        """The member that is the raft leader now (asked of a running member)."""
        status = next(m for m in self.members if m.running).status()
        ids = {m: int(m.status()["header"]["member_id"]) for m in self.members if m.running}
        return next(m for m, member_id in ids.items() if member_id == int(status["leader"]))

    def version(self) -> str:
        with urllib.request.urlopen(f"{self.members[0].url}/version", timeout=5) as answer:
            return json.loads(answer.read())["etcdserver"]

    def client(self):
        """An etcd3gw client of a running member (what the tests read the keys with)."""
        from etcd3gw.client import Etcd3Client

        member = next(m for m in self.members if m.running)
        return Etcd3Client(host="127.0.0.1", port=member.port, timeout=10)

    def stop(self) -> None:
        for member in self.members:
            member.stop()
        for member in self.members:
            shutil.rmtree(member.data_dir / member.name, ignore_errors=True)


#: The fixtures that start a real etcd; a test that asks for one (itself or through another
#: fixture) is marked ``etcd``, so ``-m "not etcd"`` runs the rest without Debian's etcd-server.
ETCD_FIXTURES = frozenset({"etcd_server", "etcd_cluster", "etcd_tls_cluster"})


def pytest_collection_modifyitems(items):
    for item in items:
        if ETCD_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.etcd)


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory):
    """A real one-member etcd for the whole session; tests keep apart by using their own run ids."""
    server = EtcdCluster(tmp_path_factory.mktemp("etcd"))
    yield server
    server.stop()


@pytest.fixture
def etcd_cluster(tmp_path_factory):
    """A real three-member etcd cluster of this test alone (members may be killed: ``members[i].stop()``)."""
    cluster = EtcdCluster(tmp_path_factory.mktemp("etcd3"), size=3)
    yield cluster
    cluster.stop()


@pytest.fixture
def etcd_tls_cluster(tmp_path_factory):
    """As ``etcd_cluster``, its client URLs https and client certificates required (``cluster.tls``)."""
    directory = tmp_path_factory.mktemp("etcd3tls")
    cluster = EtcdCluster(directory, size=3, tls=TlsFiles.make(directory))
    yield cluster
    cluster.stop()


class Agents(AgentProcesses):
    """fsm-agent's AgentProcesses, plus readers for the agents' events files."""

    @staticmethod
    def read_events(path: Path) -> list[dict]:
        return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]

    @classmethod
    def transitions(cls, path: Path) -> list[tuple[str, str, str]]:
        return [(e["source"], e["dest"], e["trigger"]) for e in cls.read_events(path) if e["kind"] == "transition"]


@pytest.fixture
def agents(tmp_path):
    group = Agents(tmp_path)
    yield group
    group.kill_all()
