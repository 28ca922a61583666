"""The processes of a benchmark job of real agents on one machine, shared by ``goodput.py`` and
``soak.py``: start the agents (node 0 first: it hosts the rendezvous store), read what their workers
record, inject a seeded schedule of faults, start replacement agents, and stop everything.

Agents run on machines ("hosts"): host ``i`` for the ``i``-th agent started, the spare's the next
one, and a lost or preempted node's replacement on the host it ran on (the machine coming back).
On loopback a host is only that number; with ``netns`` (``goodput.py --netns``) each host is a
network namespace of its own with its own address on one bridge (``_netns.py``), so the
rendezvous, the store, gloo and the agents' checkpoint replicas go over veths, and the namespaces
are removed by ``close()``.

A job's workers write to ``<folder>/out``: ``events.log`` (one JSON line per record; every worker
writes ``{"kind": "start", "t", "rank", "pid", "slot"}`` first) and, in ``goodput.py``,
``steps.<rank>.log``. Every process a job starts carries a private token in its environment
(``JOB_TOKEN``): ``close()`` stops process groups, then what still carries the token, by pid.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from fsm_agent.env import STANDARD_KEYS

if TYPE_CHECKING:
    from _netns import Hosts

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
KINDS = ("worker_exception", "worker_sigkill", "worker_hang", "agent_sigkill", "node_sigterm")
WORKER_KINDS = KINDS[:3]
TOKEN_VAR = "JOB_TOKEN"
SHM_PREFIX = "/dev/shm/fsm-agent-ckpt-"
#: a SIGKILLed node's machine comes back (as a spare) this long after
REPLACE_AFTER_S = 1.0
_SCRUB_PREFIXES = ("PET_", "FSM_AGENT_", "TORCHELASTIC_", "TORCH_ELASTIC_", "GOODPUT_")
#: what a job's agents must not inherit: the worker environment a launcher sets, the harness's own
_SCRUB_KEYS = STANDARD_KEYS | {TOKEN_VAR, "JOB_SLOT", "OMP_NUM_THREADS", "LOGLEVEL", "CUDA_VISIBLE_DEVICES"}
_SCRUB_KEYS |= {"PYTEST_CURRENT_TEST", "PYTEST_XDIST_WORKER"}


def log(message: str) -> None:
    print(f"[{Path(sys.argv[0]).stem} {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    index = q * (len(values) - 1)
    lo, hi = math.floor(index), math.ceil(index)
    return values[lo] + (values[hi] - values[lo]) * (index - lo)


def fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


# ------------------------------------------------------------------------------------------------
# The fault schedule
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    offset: float  # seconds after the window's start
    kind: str
    target: int  # a global rank (worker kinds), else an index into the non-host active nodes


def schedule(
    seed: int, duration: float, interval: float, kinds: tuple[str, ...], world: int, nodes: int
) -> list[Fault]:
    """One fault per ``interval`` s (jitter ±25 %), kinds in seeded shuffled blocks of all kinds; a
    worker fault's target is a global rank below ``world``, a node fault's an index below
    ``nodes - 1`` into the active nodes other than the store's host."""
    rng = random.Random(seed)
    count = max(1, int(duration // interval))
    order: list[str] = []
    while len(order) < count:
        block = list(kinds)
        rng.shuffle(block)
        order += block
    faults = []
    for i in range(count):
        offset = interval * (i + 0.5) + rng.uniform(-0.25, 0.25) * interval
        kind = order[i]
        target = rng.randrange(world) if kind in WORKER_KINDS else rng.randrange(nodes - 1)
        faults.append(Fault(round(offset, 2), kind, target))
    return faults


@dataclass
class Agent:
    slot: int
    proc: subprocess.Popen
    started: float
    injected: str | None = None


@dataclass
class InjectedFault:
    fault: Fault
    at: float  # wall time of injection
    detail: str


class Job:
    """The processes of one job of one mode; ``close()`` leaves none behind (with ``netns``, no
    namespace either)."""

    def __init__(self, name: str, folder: Path, nodes: int, nproc: int, netns: bool = False):
        self.nodes, self.nproc, self.world = nodes, nproc, nodes * nproc
        self.dir = folder
        self.out = folder / "out"
        self.out.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f"{name}-"))  # agents' TMPDIR: short, removed at the end
        self.token = uuid.uuid4().hex
        self.port = free_port()
        self.run_id = f"{name}-{self.token[:6]}"
        self.agents: list[Agent] = []
        self.slot_hosts: list[int] = []  # slot -> the host (machine) its agent runs on
        self.netns = netns
        self.net: Hosts | None = None  # the hosts' namespaces, once start() made them
        self._exits = contextlib.ExitStack()  # what close() undoes last: the namespaces
        self.shm_dirs: set[str] = set()
        self.pending_replacements: list[tuple[float, Agent | None, int]] = []  # (not before, waiting on, host)
        self._events: list[dict] = []
        self._events_read = 0  # bytes of events.log parsed so far

    # -- starting ----------------------------------------------------------------------------
    def command(self, slot: int) -> list[str]:
        """The command line of the agent in ``slot`` (the n-th agent started)."""
        raise NotImplementedError

    def job_env(self, slot: int) -> dict[str, str]:
        """What this kind of job adds to the agent's environment."""
        return {}

    def env(self, slot: int) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(_SCRUB_PREFIXES) and k not in _SCRUB_KEYS}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        env.update({TOKEN_VAR: self.token, "TMPDIR": str(self.tmp), "OMP_NUM_THREADS": "1", "JOB_SLOT": str(slot)})
        if self.net is not None:
            env.update(self.net.env())
        env.update(self.job_env(slot))
        return env

    def address(self, slot: int) -> str:
        """The address of the host the agent in ``slot`` runs on (its ``--local-addr``)."""
        return "127.0.0.1" if self.net is None else self.net.addrs[self.slot_hosts[slot]]

    def endpoint(self) -> str:
        """The rendezvous endpoint: host 0's address (its agent hosts the store)."""
        return f"{'127.0.0.1' if self.net is None else self.net.addrs[0]}:{self.port}"

    def start_agent(self, host: int | None = None) -> Agent:
        """Start the next agent (its slot: how many were started before) on ``host`` (default: a
        host of its own, numbered as its slot)."""
        slot = len(self.agents)
        self.slot_hosts.append(slot if host is None else host)
        argv = self.command(slot)
        if self.net is not None:
            argv = self.net.inside(self.slot_hosts[slot], argv)
        with (self.dir / f"agent{slot}.out").open("wb") as out, (self.dir / f"agent{slot}.err").open("wb") as err:
            proc = subprocess.Popen(
                argv,
                env=self.env(slot),
                cwd=self.dir,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
        agent = Agent(slot, proc, time.time())
        self.agents.append(agent)
        return agent

    def start(self, spare: bool, deadline: float) -> None:
        """Node 0 (it hosts the rendezvous store), the others once it listens, then the spare once
        the world is ready (``world_ready``: so it is the one beyond MAX). With ``netns``, first a
        namespace per host: one per node and one for the spare."""
        if self.netns:
            from _netns import hosts

            self.net = self._exits.enter_context(hosts(self.nodes + (1 if spare else 0)))
            log(f"  hosts: namespaces {', '.join(self.net.names)} at {', '.join(self.net.addrs)} on one bridge")
        self.start_agent()
        end = time.monotonic() + deadline
        while not self.store_listening() and self.agents[0].proc.poll() is None and time.monotonic() < end:
            time.sleep(0.02)
        for _ in range(self.nodes - 1):
            self.start_agent()
        if spare:
            while time.monotonic() < end and not self.world_ready() and self.any_agent_alive():
                time.sleep(0.1)
            self.start_agent()

    def store_listening(self) -> bool:
        """Whether node 0's agent listens at the endpoint (in a namespace: seen in its socket table)."""
        if self.net is None:
            return listening(self.port)
        return self.net.listens(self.agents[0].proc.pid, self.port)

    def namespaces(self) -> list[str]:
        """The names of the network namespaces this job made (``netns``; removed by ``close()``)."""
        return [] if self.net is None else [*self.net.names, self.net.switch]

    def world_ready(self) -> bool:
        """Every rank's worker has started (its start record)."""
        return len(self.newest_workers()) >= self.world

    # -- reading the workers' records -------------------------------------------------------------
    def events(self) -> list[dict]:
        """Every record in ``events.log`` so far (read on from where the last call stopped)."""
        with contextlib.suppress(FileNotFoundError), (self.out / "events.log").open("rb") as f:
            f.seek(self._events_read)
            chunk = f.read()
            whole = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written waits for the next call
            self._events_read += len(whole)
            for line in whole.splitlines():
                with contextlib.suppress(ValueError):
                    self._events.append(json.loads(line))
        return self._events

    def steps(self) -> list[tuple[float, int, int, int]]:
        """(time, step, rank, pid) of every completed step, in time order."""
        found = []
        for rank in range(self.world):
            with contextlib.suppress(FileNotFoundError):
                for line in (self.out / f"steps.{rank}.log").read_text().splitlines():
                    parts = line.split()
                    if len(parts) == 3:
                        found.append((float(parts[1]), int(parts[0]), rank, int(parts[2])))
        found.sort()
        return found

    def stepped_ranks(self) -> set[int]:
        return {rank for rank in range(self.world) if (self.out / f"steps.{rank}.log").exists()}

    def any_agent_alive(self) -> bool:
        return any(a.proc.poll() is None for a in self.agents)

    def newest_workers(self) -> dict[int, dict]:
        """Global rank → the start record of its newest worker."""
        newest: dict[int, dict] = {}
        for record in self.events():
            if record["kind"] == "start" and (
                record["rank"] not in newest or record["t"] >= newest[record["rank"]]["t"]
            ):
                newest[record["rank"]] = record
        return newest

    # -- injection --------------------------------------------------------------------------------
    def _tree(self, pid: int) -> list[psutil.Process]:
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(pid)
            return [root, *root.children(recursive=True)]
        return []

    def note_shm(self, procs: list[psutil.Process] | None = None) -> None:
        """Remember the /dev/shm checkpoint directories our processes map or hold open."""
        for proc in procs if procs is not None else self.token_procs():
            with contextlib.suppress(psutil.Error, OSError):
                for path in [m.path for m in proc.memory_maps(grouped=True)] + [f.path for f in proc.open_files()]:
                    if path.startswith(SHM_PREFIX):
                        self.shm_dirs.add(SHM_PREFIX + path[len(SHM_PREFIX) :].split("/", 1)[0])
            with contextlib.suppress(OSError):
                for fd in os.listdir(f"/proc/{proc.pid}/fd"):
                    with contextlib.suppress(OSError):
                        path = os.readlink(f"/proc/{proc.pid}/fd/{fd}")
                        if path.startswith(SHM_PREFIX):
                            self.shm_dirs.add(SHM_PREFIX + path[len(SHM_PREFIX) :].split("/", 1)[0])

    def shm_of(self, procs: list[psutil.Process]) -> set[str]:
        """The /dev/shm checkpoint directories only ``procs`` use (``note_shm`` of them alone)."""
        before, self.shm_dirs = self.shm_dirs, set()
        try:
            self.note_shm(procs)
            return set(self.shm_dirs)
        finally:
            self.shm_dirs = before | self.shm_dirs

    def drop_lost_memory(self, tree: list[psutil.Process], dirs: set[str]) -> None:
        """A lost node's memory goes with it: once its killed processes are gone, remove the /dev/shm
        checkpoint directories they held (else each lost node's checkpoints stay in this machine's
        memory until the job ends: with large states, an OOM)."""
        if not dirs:
            return
        psutil.wait_procs(tree[1:], timeout=5)  # not the agent: our child, Popen reaps it (its exit code)
        for path in dirs:
            shutil.rmtree(path, ignore_errors=True)

    def active_slots(self) -> list[int]:
        """Agents (not the store host) whose node runs live workers now."""
        slots = set()
        for record in self.newest_workers().values():
            with contextlib.suppress(psutil.Error, ValueError):
                if psutil.Process(record["pid"]).status() != psutil.STATUS_ZOMBIE and record["slot"] not in ("?", "0"):
                    slots.add(int(record["slot"]))
        return sorted(s for s in slots if self.agents[s].proc.poll() is None and self.agents[s].injected is None)

    def inject(self, fault: Fault) -> InjectedFault | None:
        """Inject ``fault`` now; None when its target is not there (the caller tries again)."""
        if fault.kind in WORKER_KINDS:
            record = self.newest_workers().get(fault.target)
            if record is None:
                return None
            sig = {"worker_exception": signal.SIGUSR1, "worker_sigkill": signal.SIGKILL, "worker_hang": signal.SIGUSR2}
            try:
                os.kill(record["pid"], sig[fault.kind])
            except ProcessLookupError:
                return None
            return InjectedFault(
                fault, time.time(), f"rank {fault.target} (pid {record['pid']}, node slot {record['slot']})"
            )
        slots = self.active_slots()
        if not slots:
            return None
        agent = self.agents[slots[fault.target % len(slots)]]
        if fault.kind == "agent_sigkill":
            tree = self._tree(agent.proc.pid)
            lost = self.shm_of(tree)  # noted for close() too
            at = time.time()
            for proc in tree:
                with contextlib.suppress(psutil.Error):
                    proc.kill()
            self.pending_replacements.append((at + REPLACE_AFTER_S, None, self.slot_hosts[agent.slot]))
            self.drop_lost_memory(tree, lost)
        else:
            at = time.time()
            agent.proc.send_signal(signal.SIGTERM)
            self.pending_replacements.append((at, agent, self.slot_hosts[agent.slot]))
        agent.injected = fault.kind
        return InjectedFault(fault, at, f"agent slot {agent.slot} (pid {agent.proc.pid})")

    def tend(self) -> None:
        """Start the replacement agents that are due (a lost node's machine comes back as a spare,
        on its host: in its namespace, at its address)."""
        now = time.time()
        for item in list(self.pending_replacements):
            not_before, waiting_on, host = item
            if now >= not_before and (waiting_on is None or waiting_on.proc.poll() is not None):
                self.pending_replacements.remove(item)
                agent = self.start_agent(host)
                log(f"  replacement agent slot {agent.slot} started on host {host}")

    # -- stopping ---------------------------------------------------------------------------------
    def token_procs(self) -> list[psutil.Process]:
        found = []
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error, OSError):
                if proc.pid != os.getpid() and proc.environ().get(TOKEN_VAR) == self.token:
                    found.append(proc)
        return found

    def close(self) -> None:
        """Stop every process and remove what they left (``_stop``); last, however that ends, the
        namespaces (and whatever still runs in them)."""
        try:
            self._stop()
        finally:
            self._exits.close()

    def _stop(self) -> None:
        """SIGTERM the agents' process groups (a checkpointing agent removes its shared memory),
        SIGKILL what is left after 15 s (groups, then by token and pid), remove worker cgroups,
        /dev/shm checkpoint directories and the temporary directory."""
        try:
            with contextlib.suppress(Exception):
                self.note_shm()
            for agent in self.agents:
                if agent.proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(agent.proc.pid, signal.SIGTERM)
            end = time.monotonic() + 15
            while any(a.proc.poll() is None for a in self.agents) and time.monotonic() < end:
                time.sleep(0.1)
            for agent in self.agents:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(agent.proc.pid, signal.SIGKILL)
            for agent in self.agents:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    agent.proc.wait(timeout=30)
        finally:
            end = time.monotonic() + 5  # a killed agent's cgroup keeper ends its workers itself
            while self.token_procs() and time.monotonic() < end:
                time.sleep(0.1)
            left = self.token_procs()
            for proc in left:
                with contextlib.suppress(psutil.Error):
                    proc.kill()  # by pid
            psutil.wait_procs(left, timeout=10)
            with contextlib.suppress(Exception):
                from fsm_agent.testing.processes import remove_worker_cgroups

                remove_worker_cgroups(a.proc.pid for a in self.agents)
            for path in self.shm_dirs:
                shutil.rmtree(path, ignore_errors=True)
            shutil.rmtree(self.tmp, ignore_errors=True)
