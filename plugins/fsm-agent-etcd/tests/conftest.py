"""Fixtures: a real etcd server on 127.0.0.1 (free ports, tmp data dir) and real fsm-agent processes.

Helpers are fixtures or fixture methods, not imports: the plugins' tests directories are not packages.

Every process started here runs in its own session and is killed by process group at teardown.
etcd comes from Debian's ``etcd-server`` package (``.ci/install-etcd.sh`` installs it).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from fsm_agent.testing import AgentProcesses

ETCD_BINARY = os.environ.get("FSM_AGENT_TEST_ETCD", shutil.which("etcd") or "/usr/bin/etcd")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EtcdServer:
    """One etcd member listening on 127.0.0.1:``port`` (clients) and a second free port (peers)."""

    def __init__(self, data_dir: Path):
        if not os.access(ETCD_BINARY, os.X_OK):
            pytest.fail(f"no etcd binary at {ETCD_BINARY}: run .ci/install-etcd.sh (Debian's etcd-server)")
        self.port, peer_port = free_port(), free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.url = f"http://{self.endpoint}"
        peer_url = f"http://127.0.0.1:{peer_port}"
        self.log_path = data_dir / "etcd.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [ETCD_BINARY, "--name", "fsm-agent-test", "--data-dir", str(data_dir / "data"),
             "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
             "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
             "--initial-cluster", f"fsm-agent-test={peer_url}", "--initial-cluster-state", "new"],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        self._wait_healthy(timeout=30)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}: {self.log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1) as answer:
                    if json.loads(answer.read()).get("health") == "true":
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"etcd not healthy after {timeout}s: {self.log_path.read_text()[-3000:]}")

    def version(self) -> str:
        with urllib.request.urlopen(f"{self.url}/version", timeout=5) as answer:
            return json.loads(answer.read())["etcdserver"]

    def client(self):
        """An etcd3gw client of this server (what the tests read the keys with)."""
        from etcd3gw.client import Etcd3Client

        return Etcd3Client(host="127.0.0.1", port=self.port, timeout=10)

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        self._log.close()


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory):
    """A real etcd for the whole session; tests keep apart by using their own run ids."""
    server = EtcdServer(tmp_path_factory.mktemp("etcd"))
    yield server
    server.stop()


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

