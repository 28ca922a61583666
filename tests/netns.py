"""Fixtures for multi-host tests: three "hosts" made of Linux network namespaces on one machine.

Topology (nothing is created in the root namespace, nothing outside the namespaces is contacted)::

    namespace fsmh<tag>_sw:  bridge fsmbr, ports fsmp0 fsmp1 fsmp2 (the switch)
                               |       |       |        veth pairs
    namespace fsmh<tag>_0:   fsmeth0 10.231.<net>.1/24, lo up
    namespace fsmh<tag>_1:   fsmeth0 10.231.<net>.2/24, lo up
    namespace fsmh<tag>_2:   fsmeth0 10.231.<net>.3/24, lo up

Each agent runs as ``ip netns exec fsmh<tag>_<i> python -m fsm_agent run --local-addr <its IP> ...``
(the namespaces share one hostname, so ``--local-addr`` tells the nodes apart), or without
``--local-addr``, in a UTS namespace of its own (``unshare --uts``) with a hostname of its own and
``/etc/hosts``/``/etc/resolv.conf`` of its namespace (``/etc/netns/<ns>/``, removed at teardown). Workers use gloo on
``fsmeth0`` (``GLOO_SOCKET_IFNAME``): the shared hostname resolves to no address inside a namespace.

Teardown, also after a failure: every agent's process group gets SIGKILL, then every process still
inside one of the namespaces (``ip netns pids``: only processes this fixture started can be there)
gets SIGKILL by pid, then the namespaces are deleted (which deletes the veths and the bridge).
The fixture skips, with the reason, where namespaces cannot be made (not root, no ``ip``, no
permission, no veth/bridge support).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from fsm_agent.testing.processes import remove_worker_cgroups, tmpdir_env
from tests.helpers.events import read_events, transitions

IFNAME = "fsmeth0"
#: Port of the rendezvous endpoint on host 0 (a fresh namespace: nothing else can hold it).
RDZV_PORT = 29400

#: The training script every agent runs: a gloo all_reduce through init_process_group("env://").
#: argv: OUT_DIR HOST FINAL_WORLD. A worker whose WORLD_SIZE is not FINAL_WORLD reduces, then
#: waits to be stopped by its agent (a re-rendezvous); one in the final world reduces and exits 0.
#: With ``FSM_TEST_WORKER_EXIT=N`` in its environment it exits N right after it started; with
#: ``FSM_TEST_WORKER_REINIT=N`` it destroys and re-creates its process group N times before "done", rank 0 destroying each one a second
#: late (the others re-initialize while rank 0's store still runs: the race fsm_agent/pg_generations.py closes).
WORKER = r"""
import json, os, sys, time
started = time.time()
out, host, final = sys.argv[1], sys.argv[2], int(sys.argv[3])
world = int(os.environ["WORLD_SIZE"])
tag = "%s_%d_%d" % (host, world, os.getpid())
KEYS = ("RANK", "WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE")

def dump(kind, **record):
    record.update(host=host, pid=os.getpid(), env={k: os.environ.get(k) for k in KEYS})
    path = os.path.join(out, "%s_%s.json" % (kind, tag))
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)

dump("start", ts=started)
if os.environ.get("FSM_TEST_WORKER_EXIT"):  # a worker that exits at once with this code
    sys.exit(int(os.environ["FSM_TEST_WORKER_EXIT"]))
import datetime
import torch
import torch.distributed as dist
dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=60))
value = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(value)
ok = dist.get_world_size() == world and value.item() == world * (world + 1) / 2
dump("reduced", ts=time.time(), sum=value.item(), pg_rank=dist.get_rank(), pg_world=dist.get_world_size(), ok=ok)
if not ok:
    sys.exit(3)
if world != final:
    time.sleep(600)  # the agent stops this worker when the membership changes
    sys.exit(5)
reinit = int(os.environ.get("FSM_TEST_WORKER_REINIT", "0"))
dist.barrier()
if reinit and dist.get_rank() == 0:
    time.sleep(1.0)  # rank 0 destroys late, so the others re-initialize while its store still runs
dist.destroy_process_group()
for again in range(reinit):  # re-create the group N times
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=60))
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    dump("reinit_%d" % again, sum=value.item(), ok=value.item() == world * (world + 1) / 2)
    dist.barrier()
    if dist.get_rank() == 0:
        time.sleep(1.0)
    dist.destroy_process_group()
dump("done", ts=time.time())
"""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


class Agent:
    """One agent process in one namespaced host."""

    def __init__(self, host: int, name: str, proc: subprocess.Popen, events: Path, stdout: Path, stderr: Path):
        self.host, self.name, self.proc = host, name, proc
        self.events, self.stdout, self.stderr = events, stdout, stderr
        self.killed_at: float | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"agent {self.name} still running after {timeout:.0f}s\n{self.output()}") from None

    def output(self, tail: int = 6000) -> str:
        text = ""
        for label, path in (("stdout", self.stdout), ("stderr", self.stderr)):
            body = path.read_text(errors="replace") if path.exists() else ""
            text += f"--- {self.name} {label} (last {tail} chars) ---\n{body[-tail:]}\n"
        return text

    def transitions(self) -> list[tuple[str, str, str]]:
        return transitions(self.events, while_written=True)

    def events_list(self) -> list[dict]:
        """The records the agent has written so far (none before its events file exists)."""
        return read_events(self.events, while_written=True)


class NetnsHosts:
    """Three namespaced hosts on one switch; ``start_agent(i, ...)`` runs an agent in host ``i``."""

    def __init__(self, workdir: Path, count: int = 3):
        tag = secrets.token_hex(3)
        self.prefix = f"fsmh{tag}"
        self.switch = f"{self.prefix}_sw"
        self.names = [f"{self.prefix}_{i}" for i in range(count)]
        self.net = random.randint(1, 254)
        self.addrs = [f"10.231.{self.net}.{i + 1}" for i in range(count)]
        self.workdir = workdir
        self.out = workdir / "out"
        self.out.mkdir(parents=True, exist_ok=True)
        self.script = workdir / "worker.py"
        self.script.write_text(textwrap.dedent(WORKER))
        self.agents: list[Agent] = []
        self._processes: list[subprocess.Popen] = []
        self._created: list[str] = []
        self._etc: list[Path] = []

    # -- topology --------------------------------------------------------------------------------
    def create(self) -> None:
        def add_ns(name: str) -> None:
            _ip("netns", "add", name)
            self._created.append(name)
            _ip("-n", name, "link", "set", "lo", "up")

        add_ns(self.switch)
        _ip("-n", self.switch, "link", "add", "fsmbr", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "fsmbr", "up")
        for i, (name, addr) in enumerate(zip(self.names, self.addrs)):
            add_ns(name)
            port = f"fsmp{i}"
            _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", IFNAME, "netns", name)
            _ip("-n", self.switch, "link", "set", port, "master", "fsmbr")
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", name, "addr", "add", f"{addr}/24", "dev", IFNAME)
            _ip("-n", name, "link", "set", IFNAME, "up")

    def set_link(self, host: int, up: bool) -> None:
        """Plug (``up``) or unplug host ``host``'s cable: a partition, the process keeps running."""
        _ip("-n", self.names[host], "link", "set", IFNAME, "up" if up else "down")

    def destroy(self) -> None:
        for pid in [agent.pid for agent in self.agents] + [p.pid for p in self._processes]:  # their groups first
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        for name in self._created:  # then whatever still lives in our namespaces, by pid
            for pid in self.pids_in(name):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        for proc in [agent.proc for agent in self.agents] + self._processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(self.pids_in(n) for n in self._created):
            time.sleep(0.05)
        # Everything in the namespaces was killed at once, cgroup keepers too: none removed its
        # agent's worker cgroup. (``ip netns exec`` remounts /sys, so agents there find no cgroup
        # v2 hierarchy and make none; this is for a system where they do.)
        remove_worker_cgroups(agent.pid for agent in self.agents)
        for name in reversed(self._created):
            _ip("netns", "del", name, check=False)
        self._created.clear()
        for folder in self._etc:
            shutil.rmtree(folder, ignore_errors=True)
            with contextlib.suppress(OSError):  # /etc/netns itself, when no one else's folder is in it
                folder.parent.rmdir()
        self._etc.clear()

    @staticmethod
    def pids_in(name: str) -> list[int]:
        proc = _ip("netns", "pids", name, check=False)
        return [int(p) for p in proc.stdout.split() if p.strip().isdigit()]

    # -- agents ----------------------------------------------------------------------------------
    def endpoint(self) -> str:
        return f"{self.addrs[0]}:{RDZV_PORT}"

    def set_etc(self, host: int, hosts: str, resolv: str = "nameserver 127.0.0.1\n") -> None:
        """Give host ``host`` its own ``/etc/hosts`` and ``/etc/resolv.conf`` (``ip netns exec`` bind-mounts
        ``/etc/netns/<ns>/*`` over ``/etc``); the default resolver answers nothing (nothing listens
        on the namespace's loopback port 53), so a name missing from ``hosts`` does not resolve."""
        folder = Path("/etc/netns") / self.names[host]
        folder.mkdir(parents=True, exist_ok=True)
        self._etc.append(folder)
        (folder / "hosts").write_text(hosts)
        (folder / "resolv.conf").write_text(resolv)

    def _wrap(self, host: int, argv: list[str], hostname: str | None) -> list[str]:
        """``ip netns exec <ns> [unshare --uts sh -c 'hostname NAME; exec ...'] ARGV`` (one pid throughout)."""
        if hostname is not None:
            argv = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', hostname, *argv]
        return ["ip", "netns", "exec", self.names[host], *argv]

    def start_process(self, host: int, argv: list[str], name: str) -> subprocess.Popen:
        """Any program in host ``host`` (an etcd server, ...), output in ``<name>.log``; killed at teardown."""
        with open(self.workdir / f"{name}.log", "w") as log:
            proc = subprocess.Popen(
                self._wrap(host, argv, None),
                cwd=self.workdir,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self._processes.append(proc)
        return proc

    def run_in(self, host: int, argv: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
        """Run a short command in host ``host`` and return its result."""
        return subprocess.run(self._wrap(host, argv, None), capture_output=True, text=True, timeout=timeout)

    def start_agent(
        self,
        host: int,
        *flags: str,
        final_world: int,
        name: str | None = None,
        local_addr: bool = True,
        hostname: str | None = None,
        env: dict[str, str] | None = None,
        gloo_ifname: bool = True,
    ) -> Agent:
        """``ip netns exec <host ns> python -m fsm_agent run --local-addr <host IP> FLAGS worker.py``.

        ``local_addr=False`` leaves ``--local-addr`` out; ``hostname`` runs the agent in its own UTS
        namespace with that hostname (``unshare --uts``); ``env`` is added to the agent's environment
        (a pod's ``PET_*``...); ``gloo_ifname=False`` leaves ``GLOO_SOCKET_IFNAME`` unset.
        """
        name = name or f"h{host}"
        events = self.workdir / f"events_{name}.jsonl"
        stdout, stderr = self.workdir / f"agent_{name}.out", self.workdir / f"agent_{name}.err"
        agent_env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "FSM_AGENT_", "TORCHELASTIC_"))}
        agent_env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", LOGLEVEL="INFO")
        if gloo_ifname:
            agent_env.update(GLOO_SOCKET_IFNAME=IFNAME)
        agent_env.update(tmpdir_env(self.workdir / "tmp"))  # a killed node's heartbeat directory stays in the workdir
        agent_env.update(env or {})
        addr = ["--local-addr", self.addrs[host]] if local_addr else []
        argv = self._wrap(
            host,
            [
                sys.executable,
                "-m",
                "fsm_agent",
                "run",
                *addr,
                "--events-file",
                str(events),
                "--log-dir",
                str(self.workdir / f"logs_{name}"),
                *flags,
                str(self.script),
                str(self.out),
                name,
                str(final_world),
            ],
            hostname,
        )
        with open(stdout, "w") as out, open(stderr, "w") as err:
            proc = subprocess.Popen(
                argv,
                cwd=self.workdir,
                env=agent_env,
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        agent = Agent(host, name, proc, events, stdout, stderr)
        self.agents.append(agent)
        return agent

    def kill_node(self, agent: Agent) -> float:
        """SIGKILL the agent's process group and its workers (as a machine dying); returns the time."""
        workers = [r["pid"] for r in self.records("start") if r["host"] == agent.name]
        killed_at = time.time()
        for pgid in [agent.pid, *workers]:  # the agent leads its group; each worker leads its own
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        agent.killed_at = killed_at
        agent.proc.wait(timeout=30)
        return killed_at

    # -- what the workers wrote ------------------------------------------------------------------
    def records(self, kind: str) -> list[dict]:
        records = []
        for path in sorted(self.out.glob(f"{kind}_*.json")):
            with contextlib.suppress(OSError, ValueError):
                records.append(json.loads(path.read_text()))
        return records

    def diagnostics(self) -> str:
        return "".join(a.output() for a in self.agents)

    def wait_for(
        self, predicate: Callable[[], bool], timeout: float, what: str, expect_running: list[Agent] | None = None
    ) -> None:
        """Poll ``predicate`` every 50 ms; fail with every agent's output on timeout, or at once when
        one of ``expect_running`` exits."""
        deadline = time.monotonic() + timeout
        while not predicate():
            for agent in expect_running or ():
                if agent.poll() is not None:
                    raise AssertionError(
                        f"waiting for {what}: agent {agent.name} exited with {agent.poll()}\n{self.diagnostics()}"
                    )
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{self.diagnostics()}")
            time.sleep(0.05)


def _skip_reason() -> str | None:
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); run as root to include these tests"
    if shutil.which("ip") is None:
        return "the 'ip' command (iproute2) is not installed"
    return None


def namespaced_hosts(tmp_path: Path, count: int = 3):
    """``count`` namespaced hosts (see the module docstring) for a fixture to yield from, removed at
    teardown even on failure; skips where namespaces cannot be made."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    hosts = NetnsHosts(tmp_path, count=count)
    try:
        hosts.create()
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        detail = (getattr(exc, "stderr", None) or str(exc)).strip()
        hosts.destroy()
        pytest.skip(
            f"cannot create network namespaces/veths on this machine: {' '.join(exc.cmd) if hasattr(exc, 'cmd') else ''}: {detail}"
        )
    try:
        yield hosts
    finally:
        hosts.destroy()


@pytest.fixture
def netns_hosts(tmp_path):
    """Three namespaced hosts (see the module docstring), removed at teardown even on failure."""
    yield from namespaced_hosts(tmp_path)
