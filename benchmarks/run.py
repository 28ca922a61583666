#!/usr/bin/env python3
"""fsm-agent vs torchrun, side by side: startup, teardown, restarts, signals, idle cost, rendezvous,
node loss, hang detection and hot spares (scenarios a-j; see benchmarks/README.md).

    python benchmarks/run.py                      # the full suite (< 40 min on 2 cores)
    python benchmarks/run.py --quick              # CI: every scenario once, small; no timing asserted
    python benchmarks/run.py --scenarios b,d --trials 3 --markdown /tmp/bench.md

How it measures:

- Both launchers run the same worker scripts (``benchmarks/workers``), interleaved trial by trial
  (A B, B A, ...), each launcher as ``python -m fsm_agent run`` / ``python -m torch.distributed.run``
  in its own session (process group), on loopback only.
- Workers append ``{event, t, rank, attempt, pid, ...}`` lines to ``$FSMBENCH_EVENTS`` with
  ``t = time.time()`` (CLOCK_REALTIME, shared by every process here). The harness takes its own
  stamp just before ``Popen`` (or just before it sends a signal) and reads the file afterwards.
  Launcher and worker exits are awaited on pidfds (``select``), never by sleep-polling; the harness
  only polls the events file to decide *when* to act (e.g. "all workers are up: send SIGTERM now"),
  which never enters a measured interval.
- Every process started is killed at the end of its trial: the launcher's process group, each
  worker pid the events name, and any process whose environment carries this run's marker
  (``FSMBENCH_TOKEN``), all by pid (fsm-agent's cgroup keepers first get a moment to remove their
  agent's worker cgroup). Launchers get ``TMPDIR`` in the trial's directory, so the temporary
  directories a killed launcher leaves go with it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import random
import re
import select
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    import psutil
except ImportError:  # psutil is an fsm-agent dependency; without it (e) and the leftover sweep fail
    psutil = None
try:  # which processes are fsm-agent's cgroup keepers, and removing a worker cgroup a killed one left
    from fsm_agent.testing.processes import is_cgroup_keeper, remove_worker_cgroups
except ImportError:  # fsm-agent is not importable here (--fsm-agent-cmd names another installation)
    is_cgroup_keeper = lambda cmdline: False  # noqa: E731
    remove_worker_cgroups = lambda pids: []  # noqa: E731

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORKERS = HERE / "workers"
PLAIN = str(WORKERS / "plain.py")
TORCH_WORKER = str(WORKERS / "torch_worker.py")
FSM, TR = "fsm-agent", "torchrun"
SCENARIOS = "abcdefghij"
#: Seconds fsm-agent's cgroup keepers get to end by themselves before a sweep kills them.
KEEPER_GRACE_S = 15.0
TITLES = {
    "a": "startup and teardown",
    "b": "restart latency, plain workers",
    "c": "restart latency, torch workers",
    "d": "SIGTERM to the agent",
    "e": "idle cost of the agent",
    "f": "multi-agent rendezvous on loopback",
    "g": "node loss (--nnodes 2:3)",
    "h": "hung worker",
    "i": "node loss, idle workers (--nnodes 1:2)",
    "j": "node loss with a hot spare (--nnodes 2:2, 3 agents)",
}


# ------------------------------------------------------------------------------------------------
# Sizes: quick (CI) and full. Every field can be overridden from the command line.
# ------------------------------------------------------------------------------------------------


@dataclass
class Sizes:
    trials: int  # default trial count (per launcher) for a-f and h
    startup_p: list[int]  # (a) plain workers
    startup_torch_p: list[int]  # (a) torch workers
    startup_torch_trials: int  # (a) torch workers' trial count
    restart_p: int  # (b)
    restart_intervals: list[float]  # (b) --monitor-interval values
    torch_restart_p: int  # (c)
    torch_restart_intervals: list[float]
    torch_restart_trials: int
    torch_restarts_n: int  # (c) restarts in one run, for the preload launcher's p50/p90      # (c)
    sigterm_p: int  # (d)
    idle_p: int  # (e)
    idle_s: float  # (e) measured window
    idle_trials: int  # (e)
    rdzv_k: list[int]  # (f)
    rdzv_trials: int  # (f)
    node_loss_nproc: int  # (g) workers per agent
    node_loss_trials_fsm: int  # (g)
    node_loss_trials_torchrun: int  # (g)
    node_loss_trials_etcd: int  # (g) fsm-agent etcd-v3 on a three-member etcd (0: skip)
    node_loss_cutoff_s: float  # (g) wait for the survivors after the kill
    node_loss_goal_s: float  # (g) "running again within N s"
    node_loss_rdzv_conf: str  # (g) --rdzv-conf for c10d runs ("" = torch's defaults)
    hang_p: int  # (h)
    hang_timeout_s: float  # (h) fsm-agent --hang-timeout
    hang_grace_s: float  # (h) torchrun: watch this long past the timeout, then give up
    hang_trials_torchrun: int  # (h)
    idle_loss_trials: int  # (i) per fsm-agent backend, and torchrun
    idle_loss_cutoff_s: float  # (i) wait for the survivor after the kill
    idle_loss_rdzv_conf: str  # (i) --rdzv-conf for the c10d and etcd-v3 runs
    trial_timeout_s: float  # any single launch


#: (i): keep-alive 1 s x 5 (torch's own heartbeats can be 3 s apart after a round completes: 1 x 2
#: would drop live nodes on a busy machine); last call 1 s, so a lone survivor's round completes soon.
IDLE_LOSS_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=5"

FULL = Sizes(
    trials=5,
    startup_p=[1, 4, 8],
    startup_torch_p=[1, 4, 8],
    startup_torch_trials=3,
    restart_p=4,
    restart_intervals=[0.1, 5.0],
    torch_restart_p=4,
    torch_restart_intervals=[0.1],
    torch_restart_trials=3,
    torch_restarts_n=20,
    sigterm_p=4,
    idle_p=4,
    idle_s=20.0,
    idle_trials=3,
    rdzv_k=[2, 4, 8, 16],
    rdzv_trials=3,
    node_loss_nproc=1,
    node_loss_trials_fsm=10,
    node_loss_trials_torchrun=3,
    node_loss_trials_etcd=5,
    node_loss_cutoff_s=90.0,
    node_loss_goal_s=10.0,
    node_loss_rdzv_conf="",
    hang_p=4,
    hang_timeout_s=3.0,
    hang_grace_s=10.0,
    hang_trials_torchrun=2,
    idle_loss_trials=3,
    idle_loss_cutoff_s=30.0,
    idle_loss_rdzv_conf=IDLE_LOSS_CONF,
    trial_timeout_s=180.0,
)
QUICK = Sizes(
    trials=1,
    startup_p=[4],
    startup_torch_p=[1],
    startup_torch_trials=1,
    restart_p=2,
    restart_intervals=[0.1],
    torch_restart_p=1,
    torch_restart_intervals=[0.1],
    torch_restart_trials=1,
    torch_restarts_n=2,
    sigterm_p=2,
    idle_p=2,
    idle_s=3.0,
    idle_trials=1,
    rdzv_k=[2],
    rdzv_trials=1,
    node_loss_nproc=1,
    node_loss_trials_fsm=1,
    node_loss_trials_torchrun=1,
    node_loss_trials_etcd=1,
    node_loss_cutoff_s=20.0,
    node_loss_goal_s=10.0,
    # torch's defaults (keep-alive 5 s x 3, last call 30 s) cost >= 41 s per node-loss trial;
    # quick mode checks that the scenario works, so it shortens them for every c10d run.
    node_loss_rdzv_conf="last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2",
    hang_p=2,
    hang_timeout_s=2.0,
    hang_grace_s=3.0,
    hang_trials_torchrun=1,
    idle_loss_trials=1,
    idle_loss_cutoff_s=15.0,
    idle_loss_rdzv_conf=IDLE_LOSS_CONF,
    trial_timeout_s=120.0,
)


# ------------------------------------------------------------------------------------------------
# Results: one Row per measured quantity, values per launcher, printed as a table.
# ------------------------------------------------------------------------------------------------


class TrialError(Exception):
    """A trial did not produce its measurement (bad exit code, missing events, timeout)."""


@dataclass
class Row:
    sid: str  # scenario letter
    label: str
    unit: str  # "s", "MB", "CPU s"
    goal: str = ""  # shown in the goal column, e.g. "≤ 0.35"
    check: Callable[[Row], bool] | None = None  # goal verdict (None: informational row)
    fsm: list[float | None] = field(default_factory=list)  # None: did not happen within the cutoff
    tr: list[float | None] = field(default_factory=list)
    errors: dict[str, list[str]] = field(default_factory=lambda: {FSM: [], TR: []})
    notes: list[str] = field(default_factory=list)
    never: str = "never"  # how a None value reads
    extra: dict[str, list[Any]] = field(default_factory=lambda: {FSM: [], TR: []})  # per-trial details

    def values(self, who: str) -> list[float | None]:
        return self.fsm if who == FSM else self.tr

    def add(self, who: str, value: float | None, **extra: Any) -> None:
        self.values(who).append(value)
        if extra:
            self.extra[who].append(extra)

    def fail(self, who: str, message: str) -> None:
        self.errors[who].append(message)

    def median(self, who: str) -> float | None:
        ok = [v for v in self.values(who) if v is not None]
        return statistics.median(ok) if ok else None

    def ratio(self) -> float | None:
        a, b = self.median(FSM), self.median(TR)
        if a is None or b is None or b <= 0:
            return None
        return a / b

    def complete(self) -> bool:
        """Both launchers produced at least one result (a number or a 'never')."""
        return bool(self.fsm) and bool(self.tr)

    def verdict(self) -> str:
        if not self.goal:
            return ""
        if self.check is None:
            return self.goal
        try:
            met = self.check(self)
        except Exception:
            met = None
        mark = {True: "met", False: "MISSED", None: "not measured"}[met]
        return f"{self.goal} ({mark})"

    def cell(self, who: str) -> str:
        values = self.values(who)
        ok = [v for v in values if v is not None]
        parts = []
        if ok:
            parts.append(f"{fmt(statistics.median(ok))} [{fmt(min(ok))}–{fmt(max(ok))}]")
            if len(ok) < len(values):
                parts.append(f"{len(values) - len(ok)}/{len(values)} {self.never}")
        elif values:
            parts.append(f"{self.never} ({len(values)}/{len(values)})")
        if self.errors[who]:
            parts.append(f"{len(self.errors[who])} failed")
        return ", ".join(parts) if parts else "—"

    def ratio_cell(self) -> str:
        r = self.ratio()
        if r is None:
            return "—"
        return f"{r:.3f}" if r < 0.1 else f"{r:.2f}"

    def to_json(self) -> dict:
        return {
            "scenario": self.sid,
            "label": self.label,
            "unit": self.unit,
            "goal": self.goal,
            "verdict": self.verdict(),
            "fsm_agent": self.fsm,
            "torchrun": self.tr,
            "ratio": self.ratio(),
            "errors": self.errors,
            "notes": self.notes,
            "extra": self.extra,
        }


def fmt(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def ratio_le(limit: float) -> Callable[[Row], bool]:
    return lambda row: row.ratio() is not None and row.ratio() <= limit


HEADER = ["scenario", "fsm-agent median [min–max]", "torchrun median [min–max]", "ratio fsm/torchrun", "goal", "notes"]


def table_rows(rows: list[Row]) -> list[list[str]]:
    return [
        [f"({r.sid}) {r.label} [{r.unit}]", r.cell(FSM), r.cell(TR), r.ratio_cell(), r.verdict(), "; ".join(r.notes)]
        for r in rows
    ]


def markdown_table(rows: list[Row]) -> str:
    def esc(text: str) -> str:
        return text.replace("|", "\\|")

    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(esc(c) for c in cells) + " |" for cells in table_rows(rows)]
    return "\n".join(lines)


def text_table(rows: list[Row]) -> str:
    data = [HEADER, *table_rows(rows)]
    widths = [min(max(len(r[i]) for r in data), 90) for i in range(len(HEADER) - 1)]
    out = []
    for n, cells in enumerate(data):
        out.append(" | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " | " + cells[-1])
        if n == 0:
            out.append("-+-".join("-" * w for w in widths) + "-+-" + "-" * 5)
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------
# Processes: launchers in their own session, exits seen on pidfds, cleanup by pid/process group.
# ------------------------------------------------------------------------------------------------


def _seconds_or_never(value: float | None) -> str:
    return f"{value:.3f} s" if value is not None else "never"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def pidfd_open(pid: int) -> int | None:
    """A pidfd for ``pid`` (readable once it has exited), or None if it is already gone."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return None


def wait_fds(fds: Iterable[int], timeout: float) -> dict[int, float]:
    """Block until each fd is readable or ``timeout`` s pass; {fd: time.time() it became readable}."""
    pending, seen = set(fds), {}
    deadline = time.monotonic() + timeout
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        ready, _, _ = select.select(list(pending), [], [], remaining)
        now = time.time()
        for fd in ready:
            seen[fd] = now
            pending.discard(fd)
    return seen


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Proc:
    """One launcher process: the session leader of its own process group."""

    def __init__(self, trial: Trial, cmd: list[str], name: str, env: dict[str, str]):
        self.trial, self.cmd, self.name, self.env = trial, cmd, name, env
        self.log_path = trial.dir / f"{name}.log"
        self.popen: subprocess.Popen | None = None
        self.pidfd: int | None = None
        self.t_launch = self.t_exit = None
        self.rc: int | None = None

    def start(self) -> Proc:
        with open(self.log_path, "wb") as log_file:
            self.t_launch = time.time()
            self.popen = subprocess.Popen(
                self.cmd,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.trial.dir,
                start_new_session=True,
            )
        self.pidfd = pidfd_open(self.popen.pid)
        return self

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def running(self) -> bool:
        return self.popen is not None and self.rc is None

    def reaped(self, t_exit: float) -> None:
        self.t_exit = t_exit
        self.rc = self.popen.wait()
        self._close_fd()

    def _close_fd(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None

    def kill(self) -> None:
        if self.popen is None:
            return
        try:  # the whole group, even after the leader exited (a pgid is not reused while it has members)
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.rc is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.rc = self.popen.wait(timeout=10)
        self._close_fd()

    def tail(self, lines: int = 25) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(f"    {line}" for line in text[-lines:])


def wait_exits(procs: list[Proc], timeout: float) -> bool:
    """Wait (pidfds, no polling) until every proc has exited or ``timeout`` s passed; True if all did."""
    live = {p.pidfd: p for p in procs if p.running and p.pidfd is not None}
    seen = wait_fds(live, timeout)
    for fd, t in seen.items():
        live[fd].reaped(t)
    return all(not p.running for p in procs)


def watch_worker_exits(trial: Trial, proc: Proc, timeout: float) -> dict[int, float | None]:
    """Wait for ``proc`` to exit while recording when each worker process exits: {pid: time or None}.

    Worker pids are learnt from their ``started`` events (the file is re-read every 20 ms: that
    only bounds how soon a pidfd is opened); exits are stamped when ``select`` wakes on the pidfd.
    A worker that was gone before its pid was seen maps to None.
    """
    exits: dict[int, float | None] = {}
    fds: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    while proc.running and time.monotonic() < deadline:
        for event in by_event(trial.events(), "started"):
            if event["pid"] not in exits:
                fd = pidfd_open(event["pid"])
                exits[event["pid"]] = None
                if fd is not None:
                    fds[fd] = event["pid"]
        ready, _, _ = select.select([proc.pidfd, *fds], [], [], 0.02)
        now = time.time()
        for fd in ready:
            if fd == proc.pidfd:
                proc.reaped(now)
            else:
                exits[fds.pop(fd)] = now
                os.close(fd)
    for fd in fds:
        os.close(fd)
    return exits


class Trial:
    """One launch of one launcher (possibly K agents): a directory, an events file, cleanup."""

    def __init__(self, bench: Bench, tag: str):
        self.bench = bench
        self.name = tag
        self.dir = bench.tmp / tag
        self.dir.mkdir(parents=True)
        self.events_path = self.dir / "events.jsonl"
        self.procs: list[Proc] = []
        self.env = dict(os.environ)
        self.env.update(
            FSMBENCH_EVENTS=str(self.events_path),
            FSMBENCH_TOKEN=bench.token,
            FSMBENCH_RUN=tag,
            PYTHONPYCACHEPREFIX=str(bench.pycache),
        )
        # What a launcher killed here cannot remove (fsm-agent's temporary log and heartbeat
        # directories) and what torchrun never removes (its torchelastic_* log directories) goes
        # with the trial's directory instead of staying in the machine's temporary directory.
        (self.dir / "tmp").mkdir()
        self.env["TMPDIR"] = str(self.dir / "tmp")
        self.env.pop("PYTHONDONTWRITEBYTECODE", None)  # bytecode goes to the bench's own cache (see Bench)
        self.env.pop("LOGLEVEL", None)

    def launch(self, launcher: str, argv: list[str], name: str = "agent", restarts_pg: bool = False) -> Proc:
        """Start one launcher. ``restarts_pg``: its workers re-create a process group after a
        restart, which torchrun's shared store breaks (see ``Bench.torchrun_restart_env``)."""
        own = []
        if launcher == FSM and "--events-file" not in argv:  # kept beside the logs, for diagnosis
            own = ["--events-file", str(self.dir / f"{name}.agent_events.jsonl")]
        env = dict(self.env)
        if launcher == TR and restarts_pg:
            env.update(self.bench.torchrun_restart_env)
        proc = Proc(self, [*self.bench.commands[launcher], *own, *map(str, argv)], name, env)
        self.procs.append(proc)
        self.bench.live.append(proc)
        return proc.start()

    def events(self) -> list[dict]:
        return read_events(self.events_path)

    def poll_events(self, ready: Callable[[list[dict]], bool], timeout: float, what: str) -> list[dict]:
        """Set-up only (never inside a measured interval): wait until ``ready(events)``."""
        deadline = time.monotonic() + timeout
        while True:
            events = self.events()
            if ready(events):
                return events
            dead = [p for p in self.procs if p.running and p.popen.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{dead[0].name} exited with {dead[0].popen.returncode}" if dead else f"{timeout:g} s passed"
                raise TrialError(f"waiting for {what}: {why}" + self.tails())
            time.sleep(0.05)

    def tails(self) -> str:
        return "".join(f"\n  --- {p.name} log ({p.log_path}):\n{p.tail()}" for p in self.procs)

    def cleanup(self) -> None:
        for proc in self.procs:
            proc.kill()
        for event in self.events():  # workers live in their own sessions under fsm-agent
            kill_pid(event.get("pid"))
        self.bench.sweep(run=self.name)
        for path in remove_worker_cgroups(p.popen.pid for p in self.procs if p.popen is not None):
            log(f"  removed the worker cgroup {path}: its keeper was killed before it did")
        for proc in self.procs:
            if proc in self.bench.live:
                self.bench.live.remove(proc)

    def __enter__(self) -> Trial:
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()


def _is_keeper(proc: Any) -> bool:
    try:
        return is_cgroup_keeper(proc.cmdline())
    except (psutil.Error, OSError):
        return False


def kill_pid(pid: Any) -> None:
    if not isinstance(pid, int) or pid <= 1 or pid == os.getpid():
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


def read_events(path: Path) -> list[dict]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    events = []
    for line in text.splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            pass  # a line being written
    return events


def by_event(events: list[dict], name: str, **where: Any) -> list[dict]:
    return [e for e in events if e.get("event") == name and all(e.get(k) == v for k, v in where.items())]


def all_ranks_t(events: list[dict], name: str, world: int, after: float = float("-inf"), **where: Any) -> float:
    """max over ranks 0..world-1 of the earliest ``name`` event (after ``after``); TrialError if a rank is missing."""
    first: dict[int, float] = {}
    for e in by_event(events, name, **where):
        if e["t"] > after and (e["rank"] not in first or e["t"] < first[e["rank"]]):
            first[e["rank"]] = e["t"]
    missing = sorted(set(range(world)) - set(first))
    if missing:
        raise TrialError(f"no {name!r} event ({where or ''}) from rank(s) {missing}")
    return max(first[r] for r in range(world))


# ------------------------------------------------------------------------------------------------
# The bench: launch commands, fsm-agent capabilities, trial bookkeeping, final cleanup.
# ------------------------------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace, sizes: Sizes):
        self.args, self.sizes = args, sizes
        self.tmp = Path(tempfile.mkdtemp(prefix="fsmbench_", dir=args.tmp_dir))
        self.token = uuid.uuid4().hex[:12]
        self.rng = random.Random(args.seed)
        self.commands = {FSM: shlex.split(args.fsm_agent_cmd), TR: shlex.split(args.torchrun_cmd)}
        self.fsm_single = shlex.split(args.fsm_single_node_args)
        # Bytecode: an editable checkout under PYTHONDONTWRITEBYTECODE=1 has no .pyc files, so each
        # fsm-agent start would compile its modules again (~0.3 CPU s here) while torch's are
        # compiled at install. Every launch uses one cache of its own (PYTHONPYCACHEPREFIX; nothing
        # is written into the repository), filled by an untimed warm-up launch of each launcher.
        self.pycache = Path(args.pycache_prefix) if args.pycache_prefix else self.tmp / "pycache"
        self.live: list[Proc] = []
        self._count = 0
        self.notes: list[str] = []
        self.backends: dict[str, list[str]] = {}
        self.fast_backend = "c10d"
        self.preimport: list[str] | None = None
        self.single_backend = "?"  # the rendezvous backend fsm-agent's single-node flags end up using
        # (g), (i): one etcd cluster per member count for every etcd-v3 trial, started on demand
        self._etcd: list[subprocess.Popen] = []
        self._etcd_endpoints: dict[int, str] = {}
        self.etcd_error = ""
        # torch 2.13's torchrun shares its rendezvous TCPStore with the workers across attempts, and
        # a restarted gloo group then reads the previous attempt's addresses and fails to connect
        # (pytorch/pytorch#135712). Unless --torchrun-shared-store, torchrun runs whose workers
        # rebuild a process group after a restart ((c), (g); (i): see there) use torch's own opt-out.
        self.torchrun_restart_env = {} if args.torchrun_shared_store else {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        if self.torchrun_restart_env:
            self.notes.append(
                "(c), (g), (i) and (j): torchrun runs with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (workers host "
                "a fresh store per attempt); with torch's default shared store the restarted gloo "
                "group fails to connect (stale keys, pytorch/pytorch#135712) — see "
                "--torchrun-shared-store"
            )

    # -- fsm-agent capabilities ------------------------------------------------------------------
    def preflight(self) -> None:
        done = subprocess.run([*self.commands[FSM], "--help"], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:  # torchrun is not probed: importing torch costs seconds here
            raise SystemExit(f"fsm-agent ({shlex.join(self.commands[FSM])}) does not start:\n{done.stderr[-3000:]}")
        self.backends = self.detect_backends()
        rdzv, launchers = self.backends.get("rendezvous", []), self.backends.get("launcher", [])
        wanted = self.args.fsm_backend
        if wanted == "auto":
            self.fast_backend = "fsm" if "fsm" in rdzv else "c10d"
        else:
            if rdzv and wanted not in rdzv:
                raise SystemExit(f"--fsm-backend {wanted}: fsm-agent knows {', '.join(rdzv)}")
            self.fast_backend = wanted
        pre = self.args.fsm_preimport_launcher
        if pre == "auto":
            hits = [n for n in launchers if n != "subprocess" and re.search(r"preload|pre.?import|fork|zygote|warm", n)]
            pre = hits[0] if hits else ""
        if pre and pre != "none":
            self.preimport = ["--launcher", pre, *shlex.split(self.args.fsm_preimport_args)]
        self.warm_up()
        log(
            f"fsm-agent backends: rendezvous={rdzv or '?'} launchers={launchers or '?'}; single-node "
            f"({shlex.join(self.fsm_single)}) backend: {self.single_backend}; "
            f"multi-node backend for fsm-agent: {self.fast_backend}; pre-importing launcher: "
            f"{shlex.join(self.preimport) if self.preimport else 'none'}"
        )

    def warm_up(self) -> None:
        """One untimed launch of each launcher with a torch worker: fills the bytecode cache."""
        started = time.monotonic()
        for who in (FSM, TR):
            with self.trial(f"warmup_{who}") as t:
                proc = t.launch(who, [*self.single(who), "--nproc-per-node", 1, TORCH_WORKER, "allreduce"])
                if not wait_exits([proc], self.sizes.trial_timeout_s) or proc.rc != 0:
                    raise SystemExit(f"warm-up launch of {who} failed (exit code {proc.rc})" + t.tails())
                if who == FSM:
                    used = {e.get("rdzv_backend") for e in read_events(t.dir / "agent.agent_events.jsonl")}
                    self.single_backend = ", ".join(sorted(b for b in used if b)) or "?"
        log(f"warm-up (bytecode cache {self.pycache}) took {time.monotonic() - started:.0f} s")

    def detect_backends(self) -> dict[str, list[str]]:
        """Registered rendezvous backends and launchers: the plugin registry, else a failed launch's message."""
        code = (
            "import json; from fsm_agent.plugins.manager import build_registry, get_plugin_manager; "
            "r = build_registry(get_plugin_manager()); "
            "print(json.dumps({k: r.names(k) for k in ('rendezvous', 'launcher')}))"
        )
        try:
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
            if done.returncode == 0:
                return json.loads(done.stdout.strip().splitlines()[-1])
        except (subprocess.SubprocessError, ValueError, IndexError):
            pass
        found: dict[str, list[str]] = {}
        probes = {
            "rendezvous": ["--rdzv-backend", "fsmbench-probe", "--rdzv-endpoint", "127.0.0.1:1"],
            "launcher": ["--standalone", "--launcher", "fsmbench-probe"],
        }
        for kind, flags in probes.items():
            done = subprocess.run([*self.commands[FSM], *flags, PLAIN], capture_output=True, text=True, timeout=120)
            match = re.search(r"known backends are (.+?); fix", done.stderr)
            found[kind] = [n.strip() for n in match.group(1).split(",")] if match else []
        return found

    # -- trials ----------------------------------------------------------------------------------
    def trial(self, tag: str) -> Trial:
        self._count += 1
        return Trial(self, f"{self._count:04d}_{re.sub(r'[^A-Za-z0-9_.-]+', '_', tag)}")

    def single(self, who: str) -> list[str]:
        """Single-node rendezvous flags: ``--standalone`` (fsm-agent: ``--fsm-single-node-args``)."""
        return list(self.fsm_single) if who == FSM else ["--standalone"]

    def marked(self, run: str | None = None) -> list:
        """Live (non-zombie) processes that carry this bench's marker (and ``run``'s, if given)."""
        found = []
        if psutil is None:
            return found
        for proc in psutil.process_iter():
            if proc.pid == os.getpid():
                continue
            try:
                env = proc.environ()
                if env.get("FSMBENCH_TOKEN") != self.token or (run and env.get("FSMBENCH_RUN") != run):
                    continue
                if proc.status() == psutil.STATUS_ZOMBIE:
                    continue
            except (psutil.Error, OSError):
                continue
            found.append(proc)
        return found

    def sweep(self, run: str | None = None) -> int:
        """SIGKILL (by pid) every live process that carries the marker (and ``run``'s, if given).

        fsm-agent's cgroup keepers carry it too; each first gets up to KEEPER_GRACE_S to end by
        itself: once its agent is gone a keeper kills and removes the workers' cgroup, and one
        killed midway leaves that cgroup behind (``Trial.cleanup`` then removes it).
        """
        deadline = time.monotonic() + KEEPER_GRACE_S
        while time.monotonic() < deadline and any(_is_keeper(p) for p in self.marked(run)):
            time.sleep(0.05)
        victims = self.marked(run)
        for proc in victims:
            kill_pid(proc.pid)
        return len(victims)

    def etcd_endpoint(self, members: int = 1) -> str | None:
        """``--rdzv-endpoint`` of an etcd cluster of ``members`` members this bench started on 127.0.0.1
        (``$FSMBENCH_ETCD`` or ``etcd`` on PATH): ``127.0.0.1:P1,127.0.0.1:P2,...``, or None
        (``etcd_error`` says why). Their process groups are killed by ``close``."""
        if members in self._etcd_endpoints or self.etcd_error:
            return self._etcd_endpoints.get(members)
        import shutil
        import urllib.request

        binary = os.environ.get("FSMBENCH_ETCD") or shutil.which("etcd")
        if not binary:
            self.etcd_error = "no etcd binary (set $FSMBENCH_ETCD or put etcd on PATH)"
            return None
        ports = [(free_port(), free_port()) for _ in range(members)]
        names = [f"fsmbench{members}m{i}" for i in range(members)]
        cluster = ",".join(f"{n}=http://127.0.0.1:{peer}" for n, (_, peer) in zip(names, ports))
        urls = [f"http://127.0.0.1:{port}" for port, _ in ports]
        procs = []
        for name, url, (_, peer) in zip(names, urls, ports):
            peer_url = f"http://127.0.0.1:{peer}"
            with open(self.tmp / f"{name}.log", "wb") as out:
                procs.append(
                    subprocess.Popen(
                        [
                            binary,
                            "--name",
                            name,
                            "--data-dir",
                            str(self.tmp / name),
                            "--listen-client-urls",
                            url,
                            "--advertise-client-urls",
                            url,
                            "--listen-peer-urls",
                            peer_url,
                            "--initial-advertise-peer-urls",
                            peer_url,
                            "--initial-cluster",
                            cluster,
                            "--initial-cluster-token",
                            f"fsmbench{members}m-{self.token}",
                            # raft timing for a loaded machine (defaults 100/1000 ms): no re-election for nothing
                            "--heartbeat-interval",
                            "250",
                            "--election-timeout",
                            "2500",
                        ],
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                )
        self._etcd += procs

        def healthy(url: str) -> bool:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=1) as answer:
                    return json.loads(answer.read()).get("health") == "true"
            except OSError:
                return False

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and all(p.poll() is None for p in procs):
            if all(healthy(url) for url in urls):
                self._etcd_endpoints[members] = ",".join(url[len("http://") :] for url in urls)
                return self._etcd_endpoints[members]
            time.sleep(0.1)
        self.etcd_error = (
            f"etcd ({binary}, {members} member(s)) not healthy within 60 s (logs: {self.tmp}/fsmbench*.log)"
        )
        return None

    def close(self) -> None:
        for etcd in self._etcd:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(etcd.pid, signal.SIGKILL)
            etcd.wait(timeout=30)
        for proc in list(self.live):
            proc.kill()
        left = self.sweep()
        if left:
            log(f"killed {left} leftover process(es)")
        if self.args.keep_tmp:
            log(f"run directories kept in {self.tmp}")
        else:
            import shutil

            shutil.rmtree(self.tmp, ignore_errors=True)


def variant_trials(trials: int, variants: list, made: dict) -> Iterable[tuple[int, str, str, list]]:
    """``(i, launcher, backend, rows)`` for trial i of every variant, interleaved: torchrun's value
    feeds every row of ``made`` ({backend: Row}), fsm-agent's only its backend's."""
    for i in range(trials):
        for who, backend in interleaved(i, variants):
            yield i, who, backend, (list(made.values()) if who == TR else [made[backend]])


def interleaved(trial: int, variants: list) -> list:
    """A B, B A, A B, ...: alternate the order so neither launcher always runs first."""
    return list(variants) if trial % 2 == 0 else list(reversed(variants))


def attempt(row_fn: Callable[[], None], rows: list[Row], who: str, what: str) -> None:
    """Run one measurement; a TrialError (or any bug) is recorded as a failure in ``rows``."""
    try:
        row_fn()
    except TrialError as exc:
        log(f"    {who}: FAILED: {exc}")
        for row in rows:
            row.fail(who, str(exc).splitlines()[0])
    except Exception as exc:  # a harness bug must not lose the other scenarios
        log(f"    {who}: ERROR in {what}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        for row in rows:
            row.fail(who, f"{type(exc).__name__}: {exc}")


# ------------------------------------------------------------------------------------------------
# (a) startup: launch -> all P workers running; workers returned -> launcher exited
# ------------------------------------------------------------------------------------------------


def scenario_a(bench: Bench) -> list[Row]:
    sz, rows = bench.sizes, []
    for kind, counts in (("plain", sz.startup_p), ("torch", sz.startup_torch_p)):
        for p in counts:
            running = Row("a", f"startup, {kind} workers, P={p}: launch → all workers running", "s")
            exited = Row("a", f"teardown, {kind} workers, P={p}: last worker returned → launcher exited", "s")
            reduced = Row("a", f"startup, torch workers, P={p}: launch → all_reduce done", "s")
            proc_exit = Row("a", f"teardown, torch workers, P={p}: last worker process exited → launcher exited", "s")
            proc_exit.notes.append(
                "a torch worker's own interpreter exit after returning takes seconds here; "
                "this row leaves it out (worker exits seen on pidfds)"
            )
            # The same startup with a launcher that imports torch once for all workers (preload).
            pre = list(bench.preimport) if kind == "torch" and bench.preimport else None
            reduced_pre = Row(
                "a",
                f"startup, torch workers, P={p}: launch → all_reduce done (fsm-agent: {shlex.join(pre or [])})",
                "s",
            )
            if kind == "plain" and p == 4:
                running.goal, running.check = "≤ 0.35", ratio_le(0.35)
            if p == 4 and kind == "plain":
                exited.goal, exited.check = "≤ 0.2", ratio_le(0.2)
            if p == 4 and kind == "torch":  # "returned" there includes the worker's own seconds-long exit
                proc_exit.goal, proc_exit.check = "≤ 0.2", ratio_le(0.2)
                reduced_pre.goal, reduced_pre.check = "≤ 0.4", ratio_le(0.4)
            group = [running, exited] + ([reduced, proc_exit] if kind == "torch" else [])
            variants = [(FSM, None), *([(FSM, pre)] if pre else []), (TR, None)]
            for i in range(sz.trials if kind == "plain" else sz.startup_torch_trials):
                for who, extra in interleaved(i, variants):
                    targets = [reduced_pre] if extra else group + ([reduced_pre] if pre and who == TR else [])

                    def measure(who=who, p=p, kind=kind, extra=extra):
                        script = [PLAIN, "exit"] if kind == "plain" else [TORCH_WORKER, "allreduce"]
                        name = f"a_{kind}_p{p}_{who}" + ("_pre" if extra else "")
                        with bench.trial(name) as t:
                            proc = t.launch(who, [*bench.single(who), *(extra or []), "--nproc-per-node", p, *script])
                            worker_exits = {}
                            if kind == "torch":  # torch workers take seconds to start: their pids are seen in time
                                worker_exits = watch_worker_exits(t, proc, sz.trial_timeout_s)
                            if not wait_exits([proc], sz.trial_timeout_s):
                                raise TrialError(f"still running after {sz.trial_timeout_s:g} s" + t.tails())
                            if proc.rc != 0:
                                raise TrialError(f"exit code {proc.rc}" + t.tails())
                            ev = t.events()
                            r = all_ranks_t(ev, "started", p) - proc.t_launch
                            x = proc.t_exit - all_ranks_t(ev, "returning", p)
                            line = f"running {r:.3f} s, exit after return {x:.3f} s"
                            ar = all_ranks_t(ev, "allreduce_done", p) - proc.t_launch if kind == "torch" else None
                            if extra:  # the preload variant feeds its own row only
                                reduced_pre.add(who, ar)
                                log(
                                    f"  (a) {kind} P={p} #{i + 1} {who} {shlex.join(extra)}: {line}, "
                                    f"all_reduce done {ar:.3f} s"
                                )
                                return
                            running.add(who, r)
                            exited.add(who, x)
                            if kind == "torch":
                                reduced.add(who, ar)
                                if pre and who == TR:
                                    reduced_pre.add(who, ar)
                                line += f", all_reduce done {ar:.3f} s"
                                if len(worker_exits) == p and None not in worker_exits.values():
                                    pe = proc.t_exit - max(worker_exits.values())
                                    proc_exit.add(who, pe)
                                    line += f", exit after worker exits {pe:.3f} s"
                                else:
                                    proc_exit.fail(who, "a worker exited before its pid was seen")
                            log(f"  (a) {kind} P={p} #{i + 1} {who}: {line}")

                    attempt(measure, targets, who, "a")
            rows += group + ([reduced_pre] if pre else [])
    return rows


# ------------------------------------------------------------------------------------------------
# (b)/(c) restart latency: one rank crashes in attempt 0 at a random moment
# ------------------------------------------------------------------------------------------------


def restart_rows(bench: Bench, sid: str, kind: str, p: int, intervals: list[float], trials: int) -> list[Row]:
    sz, rows = bench.sizes, []
    fsm_variants = [("subprocess launcher", [])]
    if kind == "torch" and bench.preimport:
        fsm_variants.append((f"{shlex.join(bench.preimport)}", list(bench.preimport)))
    for mi in intervals:
        target = "all_reduce done" if kind == "torch" else "all workers running"
        made: dict[str, Row] = {}
        for name, _ in fsm_variants:
            label = f"restart, {kind} workers, P={p}, --monitor-interval {mi:g}: crash → attempt 1 {target}"
            if len(fsm_variants) > 1 or kind == "torch":
                label += f" (fsm-agent: {name})"
            made[name] = Row(sid, label, "s")
        if kind == "plain" and p == 4 and mi in (0.1, 5.0):
            limit = 0.4 if mi == 0.1 else 0.05
            made["subprocess launcher"].goal, made["subprocess launcher"].check = f"≤ {limit:g}", ratio_le(limit)
        if kind == "torch" and len(fsm_variants) > 1:
            row = made[fsm_variants[1][0]]
            row.goal, row.check = "≤ 0.5", ratio_le(0.5)
        elif kind == "torch":
            row = made["subprocess launcher"]
            row.goal, row.check = "≤ 0.5 with a pre-importing launcher", lambda r: None
            row.notes.append("no pre-importing fsm-agent launcher registered: the goal's row cannot be measured")
        variants = [(FSM, name, extra) for name, extra in fsm_variants] + [(TR, "", [])]
        for i in range(trials):
            crash_rank = bench.rng.randrange(p)
            delay = round(bench.rng.uniform(0.3, 0.3 + max(1.0, min(mi, 5.0))), 3)
            for who, name, extra in interleaved(i, variants):
                targets = list(made.values()) if who == TR else [made[name]]

                def measure(who=who, name=name, extra=extra):
                    if kind == "plain":
                        script, done_event = [PLAIN, "crash", crash_rank, delay], "started"
                    else:
                        script, done_event = [TORCH_WORKER, "crash", crash_rank, delay], "allreduce_done"
                    with bench.trial(f"{sid}_{kind}_mi{mi:g}_{who}_{name}") as t:
                        proc = t.launch(
                            who,
                            [
                                *bench.single(who),
                                *extra,
                                "--nproc-per-node",
                                p,
                                "--max-restarts",
                                1,
                                "--monitor-interval",
                                mi,
                                *script,
                            ],
                            restarts_pg=kind == "torch",
                        )
                        limit = sz.trial_timeout_s + 3 * mi
                        if not wait_exits([proc], limit):
                            raise TrialError(f"still running after {limit:g} s" + t.tails())
                        if proc.rc != 0:
                            raise TrialError(f"exit code {proc.rc}" + t.tails())
                        ev = t.events()
                        crash = by_event(ev, "crash", attempt=0)
                        if len(crash) != 1:
                            raise TrialError(f"expected one crash event, got {len(crash)}" + t.tails())
                        value = all_ranks_t(ev, done_event, p, attempt=1) - crash[0]["t"]
                        for row in targets:
                            row.add(who, value)
                        log(
                            f"  ({sid}) {kind} P={p} mi={mi:g} #{i + 1} {who} {name}: crash → attempt 1 "
                            f"{target}: {value:.3f} s (rank {crash_rank} after {delay} s)"
                        )

                attempt(measure, targets, who, sid)
        rows += made.values()
    return rows


def scenario_b(bench: Bench) -> list[Row]:
    sz = bench.sizes
    return restart_rows(bench, "b", "plain", sz.restart_p, sz.restart_intervals, sz.trials)


def scenario_c(bench: Bench) -> list[Row]:
    sz = bench.sizes
    rows = restart_rows(bench, "c", "torch", sz.torch_restart_p, sz.torch_restart_intervals, sz.torch_restart_trials)
    if bench.preimport:
        rows += repeated_restart_rows(bench, sz.torch_restart_p, sz.torch_restart_intervals[0], sz.torch_restarts_n)
    return rows


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear between the closest ranks (numpy's default)."""
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    low = int(k)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


def repeated_restart_rows(bench: Bench, p: int, mi: float, n: int) -> list[Row]:
    """One run per launcher with N restarts (rank p-1 crashes 0.3 s after each attempt's all_reduce):
    crash of attempt k → attempt k+1's all_reduce done, every k; p50 and p90 over the N restarts."""
    sz, pre = bench.sizes, list(bench.preimport)
    head = (
        f"restart, torch workers, P={p}, --monitor-interval {mi:g}, {n} restarts in one run: "
        f"crash → next attempt all_reduce done"
    )
    p50 = Row("c", f"{head}, every restart (median = p50) (fsm-agent: {shlex.join(pre)})", "s")
    p90 = Row("c", f"{head}, p90 (fsm-agent: {shlex.join(pre)})", "s")
    p90.goal = "p90 ≤ 0.15 s and ≤ 0.1"
    p90.check = lambda r: (
        r.median(FSM) is not None and r.median(FSM) <= 0.15 and r.ratio() is not None and r.ratio() <= 0.1
    )
    for who, extra in interleaved(0, [(FSM, pre), (TR, [])]):

        def measure(who=who, extra=extra):
            with bench.trial(f"c_repeated_{who}") as t:
                proc = t.launch(
                    who,
                    [
                        *bench.single(who),
                        *extra,
                        "--nproc-per-node",
                        p,
                        "--max-restarts",
                        n,
                        "--monitor-interval",
                        mi,
                        TORCH_WORKER,
                        "crashes",
                        n,
                        p - 1,
                        0.3,
                    ],
                    restarts_pg=True,
                )
                limit = sz.trial_timeout_s * (1 + n / 4)
                if not wait_exits([proc], limit):
                    raise TrialError(f"still running after {limit:g} s" + t.tails())
                if proc.rc != 0:
                    raise TrialError(f"exit code {proc.rc}" + t.tails())
                ev = t.events()
                values = []
                for k in range(n):
                    crash = by_event(ev, "crash", attempt=k)
                    if len(crash) != 1:
                        raise TrialError(f"attempt {k}: expected one crash event, got {len(crash)}" + t.tails())
                    values.append(all_ranks_t(ev, "allreduce_done", p, attempt=k + 1) - crash[0]["t"])
                for value in values:
                    p50.add(who, value)
                p90.add(who, percentile(values, 90))
                log(
                    f"  (c) repeated {who}: {n} restarts, p50 {percentile(values, 50):.3f} s, "
                    f"p90 {percentile(values, 90):.3f} s, max {max(values):.3f} s"
                )

        attempt(measure, [p50, p90], who, "c")
    return [p50, p90]


# ------------------------------------------------------------------------------------------------
# (d) SIGTERM to the agent -> agent and all workers gone
# ------------------------------------------------------------------------------------------------


def scenario_d(bench: Bench) -> list[Row]:
    sz, p = bench.sizes, bench.sizes.sigterm_p
    row = Row(
        "d",
        f"SIGTERM to the agent, P={p} sleeping workers → agent and all workers gone",
        "s",
        goal="≤ 1.0, exit 143, 0 left",
    )

    def check(r: Row) -> bool:
        fsm = r.extra[FSM]
        return (
            ratio_le(1.0)(r)
            and bool(fsm)
            and all(x["rc"] == 143 for x in fsm)
            and all(x["left"] == 0 for x in fsm)
            and not r.errors[FSM]
        )

    row.check = check
    cutoff = 45.0
    row.never = f"not all gone within {cutoff:g} s"
    for i in range(sz.trials):
        for who in interleaved(i, [FSM, TR]):

            def measure(who=who):
                with bench.trial(f"d_{who}") as t:
                    proc = t.launch(who, [*bench.single(who), "--nproc-per-node", p, PLAIN, "sleep", 3600])
                    ev = t.poll_events(
                        lambda ev: len({e["rank"] for e in by_event(ev, "started")}) >= p,
                        sz.trial_timeout_s,
                        f"{p} workers",
                    )
                    time.sleep(0.5)
                    fds = {proc.pidfd: "agent"}
                    for e in by_event(ev, "started"):
                        fd = pidfd_open(e["pid"])
                        if fd is None:
                            raise TrialError(f"worker {e['pid']} gone before the signal")
                        fds[fd] = e["pid"]
                    agent_fd = proc.pidfd
                    t0 = time.time()
                    os.kill(proc.pid, signal.SIGTERM)
                    seen = wait_fds(fds, cutoff)
                    for fd in fds:
                        if fd != agent_fd:
                            os.close(fd)
                    if agent_fd in seen:
                        proc.reaped(seen[agent_fd])
                    gone = max(seen.values()) - t0 if len(seen) == len(fds) else None
                    agent_gone = seen[agent_fd] - t0 if agent_fd in seen else None
                    workers_gone = [seen[fd] - t0 for fd in fds if fd != agent_fd and fd in seen]
                    last_worker = max(workers_gone) if len(workers_gone) == len(fds) - 1 else None
                    time.sleep(1.0)  # leftovers: anything of this run still alive 1 s after
                    left = len(bench.marked(run=t.name))
                    rc = proc.rc if proc.rc is not None else "still running"
                    row.add(who, gone, rc=rc, left=left, agent_gone=agent_gone, last_worker_gone=last_worker)
                    show = lambda v: f"{v:.3f} s" if v is not None else row.never  # noqa: E731
                    log(
                        f"  (d) #{i + 1} {who}: all gone {show(gone)} (workers {show(last_worker)}, agent "
                        f"{show(agent_gone)}), exit code {rc}, {left} process(es) left after 1 s"
                    )

            attempt(measure, [row], who, "d")
    for who in (FSM, TR):
        extra = row.extra[who]
        if extra:
            codes = sorted({str(x["rc"]) for x in extra})
            row.notes.append(f"{who}: exit code {'/'.join(codes)}, left {max(x['left'] for x in extra)}")
    return [row]


# ------------------------------------------------------------------------------------------------
# (e) idle cost: agent (+ helpers, workers excluded) CPU and RSS while workers sleep
# ------------------------------------------------------------------------------------------------


def agent_side(agent_pid: int, worker_pids: set[int]) -> list:
    """The agent process and its descendants that are neither workers nor below a worker."""
    agent = psutil.Process(agent_pid)
    procs = [agent]
    for child in agent.children(recursive=True):
        try:
            if child.pid in worker_pids or any(a.pid in worker_pids for a in child.parents()):
                continue
        except psutil.Error:
            continue
        procs.append(child)
    return procs


def scenario_e(bench: Bench) -> list[Row]:
    sz, p, window = bench.sizes, bench.sizes.idle_p, bench.sizes.idle_s
    cpu = Row(
        "e", f"idle CPU, agent + helpers, {p} workers sleeping {window:g} s", "CPU s", goal="≤ 0.5", check=ratio_le(0.5)
    )
    rss = Row(
        "e",
        f"RSS, agent + helpers (max over the {window:g} s window), {p} workers",
        "MB",
        goal="≤ 0.25",
        check=ratio_le(0.25),
    )
    if psutil is None:
        raise SystemExit("scenario (e) needs psutil")
    for i in range(sz.idle_trials):
        for who in interleaved(i, [FSM, TR]):

            def measure(who=who):
                with bench.trial(f"e_{who}") as t:
                    proc = t.launch(who, [*bench.single(who), "--nproc-per-node", p, PLAIN, "sleep", window + 6])
                    ev = t.poll_events(
                        lambda ev: len({e["rank"] for e in by_event(ev, "started")}) >= p,
                        sz.trial_timeout_s,
                        f"{p} workers",
                    )
                    workers = {e["pid"] for e in by_event(ev, "started")}
                    time.sleep(1.0)  # let the agent settle after spawning
                    first: dict[int, float] = {}
                    last: dict[int, float] = {}
                    peak, helpers = 0.0, set()
                    end = time.monotonic() + window
                    while True:
                        total = 0
                        for q in agent_side(proc.pid, workers):
                            try:
                                times, mem = q.cpu_times(), q.memory_info()
                            except psutil.Error:
                                continue
                            used = times.user + times.system
                            first.setdefault(q.pid, used)
                            last[q.pid] = used
                            total += mem.rss
                            if q.pid != proc.pid:
                                helpers.add(q.pid)
                        peak = max(peak, total / 2**20)
                        if time.monotonic() >= end:
                            break
                        time.sleep(min(0.5, max(0.0, end - time.monotonic())))
                    if not proc.running or proc.popen.poll() is not None:
                        raise TrialError("the launcher exited during the idle window" + t.tails())
                    spent = sum(last[k] - first[k] for k in last)
                    cpu.add(who, spent, helpers=len(helpers))
                    rss.add(who, peak, helpers=len(helpers))
                    log(
                        f"  (e) #{i + 1} {who}: {spent:.3f} CPU s over {window:g} s, RSS {peak:.0f} MB, "
                        f"{len(helpers)} helper process(es)"
                    )

            attempt(measure, [cpu, rss], who, "e")
    for who in (FSM, TR):
        if cpu.extra[who]:
            cpu.notes.append(f"{who}: {max(x['helpers'] for x in cpu.extra[who])} helper process(es)")
    return [cpu, rss]


# ------------------------------------------------------------------------------------------------
# (f) K agents rendezvous on loopback: first launch -> all K workers running
# ------------------------------------------------------------------------------------------------


def multi_node_args(backend: str, port: int, run_id: str, nnodes: str) -> list:
    return [
        "--nnodes",
        nnodes,
        "--rdzv-backend",
        backend,
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        run_id,
        "--local-addr",
        "127.0.0.1",
    ]


def scenario_f(bench: Bench) -> list[Row]:
    sz, rows = bench.sizes, []
    fast = bench.fast_backend
    for k in sz.rdzv_k:
        variants = [(TR, "c10d"), (FSM, "c10d")] + ([(FSM, fast)] if fast != "c10d" else [])
        made = {
            b: Row(
                "f",
                f"rendezvous of K={k} agents, fsm-agent --rdzv-backend {b} vs torchrun c10d: "
                f"first launch → all workers running",
                "s",
            )
            for b in dict.fromkeys(b for w, b in variants if w == FSM)
        }
        if k == 16:
            made[fast].goal, made[fast].check = "≤ 0.6", ratio_le(0.6)
        for i, who, backend, targets in variant_trials(sz.rdzv_trials, variants, made):

            def measure(who=who, backend=backend):
                with bench.trial(f"f_k{k}_{who}_{backend}") as t:
                    port, run_id = free_port(), f"bench-{uuid.uuid4().hex[:8]}"
                    argv = [*multi_node_args(backend, port, run_id, str(k)), "--nproc-per-node", 1, PLAIN, "exit"]
                    procs = [t.launch(who, argv, f"agent{j}") for j in range(k)]
                    if not wait_exits(procs, sz.trial_timeout_s + 5 * k):
                        raise TrialError(f"agents still running after {sz.trial_timeout_s + 5 * k:g} s" + t.tails())
                    bad = [p for p in procs if p.rc != 0]
                    if bad:
                        raise TrialError(f"{bad[0].name} exit code {bad[0].rc}" + t.tails())
                    value = all_ranks_t(t.events(), "started", k) - procs[0].t_launch
                    for row in targets:
                        row.add(who, value)
                    log(f"  (f) K={k} #{i + 1} {who} {backend}: all running {value:.3f} s")

            attempt(measure, targets, who, "f")
        rows += made.values()
    return rows


# ------------------------------------------------------------------------------------------------
# (g) node loss: 3 agents (--nnodes 2:3), one SIGKILLed with its workers -> survivors running again
# ------------------------------------------------------------------------------------------------


def listening_on(pid: int, port: int) -> bool:
    try:
        proc = psutil.Process(pid)
        conns = proc.net_connections(kind="tcp") if hasattr(proc, "net_connections") else proc.connections("tcp")
    except psutil.Error:
        return False
    return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in conns)


def scenario_g(bench: Bench) -> list[Row]:
    """Three agents (``--nnodes 2:3``, torch workers doing all_reduce in a loop); one agent and its
    workers SIGKILLed; timed: kill → the survivors' workers running again in a world of 2 (and their
    first all_reduce). fsm-agent on its fastest backend loses a node that does not host the store
    (losing the host ends an ``fsm`` job); fsm-agent on etcd-v3 with a three-member etcd loses the
    first agent started, the one that would host an ``fsm`` or ``c10d`` store; torchrun (c10d) loses
    a non-host node. torchrun's values are shown beside both."""
    sz, fast = bench.sizes, bench.fast_backend
    nproc, world = sz.node_loss_nproc, 3 * sz.node_loss_nproc
    goal_s, cutoff = sz.node_loss_goal_s, sz.node_loss_cutoff_s
    fsm_trials = (
        sz.node_loss_trials_fsm if fast != "c10d" else min(sz.node_loss_trials_fsm, sz.node_loss_trials_torchrun)
    )
    conf = sz.node_loss_rdzv_conf
    etcd_conf = sz.idle_loss_rdzv_conf  # keep-alive 1 s x 5: torch's 5 s x 3 would cost 15 s of every trial
    rdzv = bench.backends.get("rendezvous", [])
    etcd_trials = sz.node_loss_trials_etcd if (not rdzv or "etcd-v3" in rdzv) else 0
    etcd_note = ""
    if etcd_trials and bench.etcd_endpoint(3) is None:
        etcd_trials, etcd_note = 0, f"etcd-v3 not measured: {bench.etcd_error}"

    def rows_for(backend: str, victim: str, trials: int) -> tuple[Row, Row]:
        what = (
            f"node loss, --nnodes 2:3, {nproc} torch worker(s)/agent, fsm-agent --rdzv-backend {backend} vs "
            f"torchrun c10d: SIGKILL {victim} agent+workers → survivors' workers"
        )
        running = Row("g", f"{what} running again (new world)", "s", goal=f"all ≤ {goal_s:g} s ({trials}/{trials})")
        running.check = lambda r: (
            len(r.fsm) == trials and all(v is not None and v <= goal_s for v in r.fsm) and not r.errors[FSM]
        )
        reduced = Row("g", f"{what}' first all_reduce in the new world done", "s")
        for row in (running, reduced):
            row.never = f"not within {cutoff:g} s"
        return running, reduced

    made = {fast: rows_for(fast, "a non-host", fsm_trials)}
    running = made[fast][0]
    if fast == "c10d":
        running.notes.append(f"fsm-agent has no 'fsm' rendezvous backend here: c10d used, {fsm_trials} trials")
    if conf:
        running.notes.append(f"c10d runs use --rdzv-conf {conf}")
    if etcd_trials:
        made["etcd-v3 ×3"] = rows_for("etcd-v3 (three etcd members)", "the first-started", etcd_trials)
        made["etcd-v3 ×3"][0].notes.append(
            f"etcd-v3 runs use --rdzv-conf {etcd_conf}; the victim is the first agent "
            "started (for fsm and c10d, the store host)"
        )
    elif etcd_note:
        running.notes.append(etcd_note)
    counts = {(FSM, fast): fsm_trials, (TR, "c10d"): sz.node_loss_trials_torchrun, (FSM, "etcd-v3 ×3"): etcd_trials}
    for i in range(max(counts.values())):
        for who, backend in interleaved(i, list(counts)):
            if i >= counts[(who, backend)]:
                continue
            targets = [r for pair in made.values() for r in pair] if who == TR else list(made[backend])

            def measure(who=who, backend=backend, targets=targets):
                rdzv_backend = "etcd-v3" if backend.startswith("etcd-v3") else backend
                with bench.trial(f"g_{who}_{rdzv_backend}") as t:
                    port, run_id = free_port(), f"bench-{uuid.uuid4().hex[:8]}"
                    argv = [
                        *multi_node_args(rdzv_backend, port, run_id, "2:3"),
                        "--nproc-per-node",
                        nproc,
                        "--max-restarts",
                        3,
                    ]
                    if rdzv_backend == "etcd-v3":
                        argv[argv.index("--rdzv-endpoint") + 1] = bench.etcd_endpoint(3)
                        argv += ["--rdzv-conf", etcd_conf]
                    elif conf and backend == "c10d":
                        argv += ["--rdzv-conf", conf]
                    argv += [TORCH_WORKER, "loop", world]
                    procs = [t.launch(who, argv, f"agent{j}", restarts_pg=True) for j in range(3)]
                    ev = t.poll_events(
                        lambda ev: len({e["rank"] for e in by_event(ev, "allreduce_done", world_size=world)}) >= world,
                        sz.trial_timeout_s + 60,
                        f"{world} workers in one world",
                    )
                    time.sleep(bench.rng.uniform(0.2, 1.2))  # a random moment relative to keep-alives
                    by_agent: dict[int, list[dict]] = {p.pid: [] for p in procs}
                    for e in by_event(ev, "started", world_size=world):
                        try:
                            parent = psutil.Process(e["pid"]).ppid()
                        except psutil.Error:
                            continue
                        if parent in by_agent:
                            by_agent[parent].append(e)
                    if rdzv_backend == "etcd-v3":  # no agent hosts the rendezvous: lose the first one started
                        hosts: set[int] = set()
                        candidates = [procs[0]] if by_agent[procs[0].pid] else []
                    else:
                        hosts = {p.pid for p in procs if listening_on(p.pid, port)}
                        candidates = [p for p in procs if p.pid not in hosts and by_agent[p.pid]] or [
                            p for p in procs if by_agent[p.pid]
                        ]
                    if not candidates:
                        raise TrialError("cannot tell which workers belong to which agent" + t.tails())
                    victim = max(candidates, key=lambda p: max(e["group_rank"] for e in by_agent[p.pid]))
                    t_kill = time.time()
                    os.kill(victim.pid, signal.SIGKILL)
                    for e in by_agent[victim.pid]:
                        kill_pid(e["pid"])
                    survivors = [p for p in procs if p is not victim]
                    wait_exits([victim], 10)
                    wait_exits(survivors, cutoff)  # they exit once their new world has done its all_reduce
                    ev = t.events()
                    values = []
                    for name in ("started", "allreduce_done"):
                        try:
                            values.append(all_ranks_t(ev, name, 2 * nproc, after=t_kill, world_size=2 * nproc) - t_kill)
                        except TrialError:
                            values.append(None)
                    ended = "survivors exited" if all(not p.running for p in survivors) else f"cutoff {cutoff:g} s"
                    info = dict(
                        victim_group_rank=max(e["group_rank"] for e in by_agent[victim.pid]),
                        rdzv_host_killed=victim.pid in hosts,
                        first_started_killed=victim is procs[0],
                    )
                    for running_row, reduced_row in zip(targets[::2], targets[1::2]):
                        running_row.add(who, values[0], **info)
                        reduced_row.add(who, values[1], **info)
                    show = lambda v: f"{v:.3f} s" if v is not None else "never"  # noqa: E731
                    log(
                        f"  (g) #{i + 1} {who} {backend}: survivors' workers running again {show(values[0])}, "
                        f"all_reduce {show(values[1])} ({ended}; killed group rank {info['victim_group_rank']}"
                        f"{', the rendezvous host' if info['rdzv_host_killed'] else ''}"
                        f"{', the first agent started' if info['first_started_killed'] else ''})"
                    )

            attempt(measure, targets, who, "g")
    for running_row, _ in made.values():
        for who in (FSM, TR):
            values = running_row.values(who)
            if values:
                within = sum(1 for v in values if v is not None and v <= goal_s)
                running_row.notes.append(f"{who}: running again ≤ {goal_s:g} s in {within}/{len(values)}")
    return [row for pair in made.values() for row in pair]


# ------------------------------------------------------------------------------------------------
# (h) hung worker: detected (fsm-agent --hang-timeout) and restarted
# ------------------------------------------------------------------------------------------------


def scenario_h(bench: Bench) -> list[Row]:
    sz, p, timeout = bench.sizes, bench.sizes.hang_p, bench.sizes.hang_timeout_s
    watch = timeout + sz.hang_grace_s
    detected = Row(
        "h",
        f"hung worker, P={p}, --hang-timeout {timeout:g}: hang → detected",
        "s",
        goal=f"≤ {timeout + 1:g} s; torchrun never",
    )
    detected.check = lambda r: (
        bool(r.fsm)
        and all(v is not None and v <= timeout + 1 for v in r.fsm)
        and not r.errors[FSM]
        and bool(r.tr)
        and all(v is None for v in r.tr)
    )
    restarted = Row("h", f"hung worker, P={p}, --hang-timeout {timeout:g}: hang → attempt 1 all workers running", "s")
    for row in (detected, restarted):
        row.never = f"never (watched {watch:g} s)"
    counts = {FSM: sz.trials, TR: sz.hang_trials_torchrun}
    for i in range(max(counts.values())):
        hang_rank, delay = bench.rng.randrange(p), round(bench.rng.uniform(0.5, 1.5), 3)
        for who in interleaved(i, [FSM, TR]):
            if i >= counts[who]:
                continue

            def measure(who=who):
                with bench.trial(f"h_{who}") as t:
                    agent_events = t.dir / "agent_events.jsonl"
                    own = ["--hang-timeout", timeout, "--events-file", agent_events] if who == FSM else []
                    proc = t.launch(
                        who,
                        [
                            *bench.single(who),
                            *own,
                            "--nproc-per-node",
                            p,
                            "--max-restarts",
                            1,
                            PLAIN,
                            "hang",
                            hang_rank,
                            delay,
                        ],
                    )
                    ev = t.poll_events(lambda ev: bool(by_event(ev, "hang")), sz.trial_timeout_s, "the hang")
                    t_hang = by_event(ev, "hang")[0]["t"]
                    limit = watch if who == TR else watch + sz.trial_timeout_s
                    wait_exits([proc], max(0.0, t_hang + limit - time.time()))
                    if not proc.running and proc.rc != 0:
                        raise TrialError(f"exit code {proc.rc}" + t.tails())
                    hung = [
                        e
                        for e in read_events(agent_events)
                        if e.get("kind") == "transition" and e.get("trigger") == "workers_hung"
                    ]
                    seen = hung[0]["ts"] - t_hang if hung else None
                    try:
                        again = all_ranks_t(t.events(), "started", p, attempt=1) - t_hang
                    except TrialError:
                        again = None
                    if who == FSM and again is None:
                        raise TrialError("fsm-agent did not restart the hung group" + t.tails())
                    detected.add(who, seen)
                    restarted.add(who, again)
                    log(
                        f"  (h) #{i + 1} {who}: detected {_seconds_or_never(seen)}, "
                        f"attempt 1 running {_seconds_or_never(again)}"
                    )

            attempt(measure, [detected, restarted], who, "h")
    return [detected, restarted]


# ------------------------------------------------------------------------------------------------
# (i) node loss with idle workers: nothing fails but the rendezvous can tell the survivor
# ------------------------------------------------------------------------------------------------


def scenario_i(bench: Bench) -> list[Row]:
    """Two agents (``--nnodes 1:2``, one plain worker each, idle in the world of 2: no collective
    breaks); the second agent and its worker are SIGKILLed; timed: kill → the survivor's worker
    running again in a world of 1. Only the rendezvous can tell the survivor (torchrun: never)."""
    sz, conf, cutoff = bench.sizes, bench.sizes.idle_loss_rdzv_conf, bench.sizes.idle_loss_cutoff_s
    rdzv = bench.backends.get("rendezvous", [])
    backends = [b for b in ("fsm", "c10d", "etcd-v3") if not rdzv or b in rdzv]
    notes = []
    if "etcd-v3" in backends and bench.etcd_endpoint() is None:
        backends.remove("etcd-v3")
        notes.append(f"etcd-v3 not measured: {bench.etcd_error}")
    keep_alive = dict(kv.split("=", 1) for kv in conf.split(",") if "=" in kv)
    expiry = float(keep_alive.get("keep_alive_interval", 5)) * float(keep_alive.get("keep_alive_max_attempt", 3))
    made = {}
    for backend in backends:
        row = Row(
            "i",
            f"node loss, idle workers, --nnodes 1:2, fsm-agent --rdzv-backend {backend} vs torchrun c10d: "
            f"SIGKILL agent+worker → survivor's worker running again (world 1)",
            "s",
        )
        row.never = f"never (watched {cutoff:g} s)"
        if backend != "fsm":
            row.notes.append(
                f"fsm-agent's {backend} and torchrun's c10d runs: --rdzv-conf {conf} (keep-alive {expiry:g} s)"
            )
            row.goal = f"≤ keep-alive + 5 s = {expiry + 5:g} s; torchrun never"
            row.check = lambda r, bound=expiry + 5: (
                bool(r.fsm)
                and all(v is not None and v <= bound for v in r.fsm)
                and not r.errors[FSM]
                and all(v is None for v in r.tr)
            )
        made[backend] = row
    if notes and made:
        next(iter(made.values())).notes += notes
    variants = [(TR, "c10d")] + [(FSM, b) for b in backends]
    for i, who, backend, targets in variant_trials(sz.idle_loss_trials, variants, made):

        def measure(who=who, backend=backend):
            with bench.trial(f"i_{who}_{backend}") as t:
                port, run_id = free_port(), f"bench-{uuid.uuid4().hex[:8]}"
                endpoint = bench.etcd_endpoint() if backend == "etcd-v3" else f"127.0.0.1:{port}"
                argv = [
                    "--nnodes",
                    "1:2",
                    "--rdzv-backend",
                    backend,
                    "--rdzv-endpoint",
                    endpoint,
                    "--rdzv-id",
                    run_id,
                    "--local-addr",
                    "127.0.0.1",
                    "--nproc-per-node",
                    1,
                    "--max-restarts",
                    0,
                    "--monitor-interval",
                    0.1,
                ]
                if backend != "fsm":
                    argv += ["--rdzv-conf", conf]
                finish = t.dir / "finish"  # made just before the kill: a world of 1 then ends the job
                argv += [PLAIN, "idle", 2, finish]
                # restarts_pg: when agent0's round of 1 completed before agent1 came, torchrun's shared
                # store publishes no MASTER_ADDR for the next round (agent1 times out waiting for it)
                host = t.launch(who, argv, "agent0", restarts_pg=True)
                if backend != "etcd-v3":  # agent0 hosts the rendezvous store: the victim is agent1
                    wait_listening(t, host, port, sz.trial_timeout_s)
                victim = t.launch(who, argv, "agent1", restarts_pg=True)
                t.poll_events(
                    lambda ev: len({e["group_rank"] for e in by_event(ev, "started", world_size=2)}) == 2,
                    sz.trial_timeout_s,
                    "two workers in a world of 2",
                )
                time.sleep(bench.rng.uniform(0.2, 1.2))  # a random moment relative to keep-alives
                workers = [
                    e["pid"]
                    for e in by_event(t.events(), "started", world_size=2)
                    if psutil is not None and _parent(e["pid"]) == victim.pid
                ]
                finish.touch()
                t_kill = time.time()
                os.kill(victim.pid, signal.SIGKILL)
                for pid in workers:
                    kill_pid(pid)
                wait_exits([victim], 10)
                wait_exits([host], cutoff)  # the survivor exits once its world-1 worker returned
                if not host.running and host.rc != 0:
                    raise TrialError(f"agent0 exit code {host.rc}" + t.tails())
                again = [e["t"] for e in by_event(t.events(), "started", world_size=1) if e["t"] >= t_kill]
                value = min(again) - t_kill if again else None
                for row in targets:
                    row.add(who, value)
                show = f"{value:.3f} s" if value is not None else f"never (watched {cutoff:g} s)"
                log(f"  (i) #{i + 1} {who} {backend}: survivor's worker running again {show}")

        attempt(measure, targets, who, "i")
    return list(made.values())


def wait_listening(t: Trial, host: Proc, port: int, timeout: float) -> None:
    """Wait until ``host`` listens on the rendezvous ``port`` (it hosts the store)."""
    deadline = time.monotonic() + timeout
    while not listening_on(host.pid, port):
        if time.monotonic() > deadline or host.popen.poll() is not None:
            raise TrialError(f"{host.name} never listened on the rendezvous port" + t.tails())
        time.sleep(0.05)


# ------------------------------------------------------------------------------------------------
# (j) node loss with a hot spare: the spare takes the lost node's seat, world size kept
# ------------------------------------------------------------------------------------------------


def spares_waiting(backend: str, port: int, run_id: str) -> int:
    """Nodes of run ``run_id`` waiting beyond MAX: the fsm store's wait list, torch's redundancy list (c10d)."""
    if backend == "fsm":
        from fsm_agent.plugins.rendezvous_fsm.store import StoreClient

        client = StoreClient("127.0.0.1", port, timeout=10)
        try:
            return int(client.rendezvous("status", run=run_id)["waiting"])
        finally:
            client.close()
    import pickle
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    state = C10dRendezvousBackend(
        TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10)), run_id
    ).get_state()
    return len(pickle.loads(state[0]).redundancy_list) if state else 0


def scenario_j(bench: Bench) -> list[Row]:
    """Three agents for ``--nnodes 2:2`` (torch workers, all_reduce every 50 ms); the third waits as
    a standby; the active agent that does not host the store is SIGKILLed with its workers; timed:
    kill → every rank of the full world (2 nodes) done with its first all_reduce again (and
    started). fsm-agent on ``fsm`` and ``c10d``; torchrun on ``c10d``, whose survivor's restart
    meets the spare and fails in ``init_process_group`` (DistStoreError: its shared store)."""
    sz = bench.sizes
    conf, cutoff, nproc = sz.idle_loss_rdzv_conf, sz.node_loss_cutoff_s, sz.node_loss_nproc
    world = 2 * nproc
    rdzv = bench.backends.get("rendezvous", [])
    backends = [b for b in ("fsm", "c10d") if not rdzv or b in rdzv]
    made = {}
    for backend in backends:
        row = Row(
            "j",
            f"hot spare, --nnodes 2:2 + 1 standby, {nproc} torch worker(s)/agent, fsm-agent --rdzv-backend "
            f"{backend} vs torchrun c10d: SIGKILL agent+workers → full world ({world} ranks, 2 nodes) "
            f"all_reduce done again",
            "s",
        )
        row.never = f"never (watched {cutoff:g} s)"
        row.notes.append(f"c10d runs (both launchers): --rdzv-conf {conf}")
        made[backend] = row
    variants = [(TR, "c10d")] + [(FSM, b) for b in backends]
    for i, who, backend, targets in variant_trials(sz.idle_loss_trials, variants, made):

        def measure(who=who, backend=backend):
            with bench.trial(f"j_{who}_{backend}") as t:
                port, run_id = free_port(), f"bench-{uuid.uuid4().hex[:8]}"
                finish = t.dir / "finish"  # made just before the kill: the spare's world then ends the job
                argv = [
                    *multi_node_args(backend, port, run_id, "2:2"),
                    "--nproc-per-node",
                    nproc,
                    "--max-restarts",
                    3,
                    "--monitor-interval",
                    0.1,
                ]
                if backend != "fsm":
                    argv += ["--rdzv-conf", conf]
                argv += [TORCH_WORKER, "spare", finish]
                host = t.launch(who, argv, "agent0", restarts_pg=True)
                wait_listening(t, host, port, sz.trial_timeout_s)
                victim = t.launch(who, argv, "agent1", restarts_pg=True)
                t.poll_events(
                    lambda ev: len({e["rank"] for e in by_event(ev, "allreduce_done", world_size=world)}) >= world,
                    sz.trial_timeout_s + 60,
                    f"{world} workers in one world",
                )
                spare = t.launch(who, argv, "agent2", restarts_pg=True)
                deadline = time.monotonic() + sz.trial_timeout_s
                while spares_waiting(backend, port, run_id) < 1:
                    if time.monotonic() > deadline or spare.popen.poll() is not None:
                        raise TrialError("agent2 never waited as a standby" + t.tails())
                    time.sleep(0.1)
                time.sleep(bench.rng.uniform(0.2, 1.2))  # a random moment relative to keep-alives
                workers = [
                    e["pid"]
                    for e in by_event(t.events(), "started", world_size=world)
                    if psutil is not None and _parent(e["pid"]) == victim.pid
                ]
                finish.touch()
                t_kill = time.time()
                os.kill(victim.pid, signal.SIGKILL)
                for pid in workers:
                    kill_pid(pid)
                wait_exits([victim], 10)
                wait_exits([host, spare], cutoff)
                ev = t.events()
                values = []
                for name in ("allreduce_done", "started"):
                    try:
                        values.append(all_ranks_t(ev, name, world, after=t_kill, world_size=world) - t_kill)
                    except TrialError:
                        values.append(None)
                after = [e for e in ev if e["t"] > t_kill and e.get("event") == "started"]
                info = dict(
                    started_s=values[1],
                    attempts=sorted({e["attempt"] for e in after}),
                    exit_codes=[p.rc for p in (host, spare)],
                )
                for row in targets:
                    row.add(who, values[0], **info)
                show = lambda v: f"{v:.3f} s" if v is not None else f"never (watched {cutoff:g} s)"  # noqa: E731
                log(
                    f"  (j) #{i + 1} {who} {backend}: full world all_reduce again {show(values[0])}, started "
                    f"{show(values[1])}, restart counts {info['attempts']}, exit codes {info['exit_codes']}"
                )

        attempt(measure, targets, who, "j")
    return list(made.values())


def _parent(pid: int) -> int | None:
    try:
        return psutil.Process(pid).ppid()
    except psutil.Error:
        return None


RUNNERS = {
    "a": scenario_a,
    "b": scenario_b,
    "c": scenario_c,
    "d": scenario_d,
    "e": scenario_e,
    "f": scenario_f,
    "g": scenario_g,
    "h": scenario_h,
    "i": scenario_i,
    "j": scenario_j,
}


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------


def machine() -> dict[str, str]:
    info = {
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()}",
        "cpus": str(os.cpu_count()),
    }
    with contextlib.suppress(AttributeError):
        info["cpus_usable"] = str(len(os.sched_getaffinity(0)))
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    if psutil is not None:
        info["memory"] = f"{psutil.virtual_memory().total / 2**30:.1f} GiB"
    with contextlib.suppress(OSError):
        info["load_average"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    from importlib import metadata

    for dist in ("torch", "fsm-agent"):
        try:
            info[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            info[dist] = "?"
    try:
        git = ["git", "-C", str(REPO), "describe", "--always", "--dirty"]
        info["fsm-agent"] += f" (git {subprocess.run(git, capture_output=True, text=True, timeout=30).stdout.strip()})"
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def render_markdown(
    bench: Bench, rows: list[Row], command: str, wall: float, info: dict[str, str], started: str
) -> str:
    mode = "quick (CI smoke run: sizes cut down, timings not meaningful)" if bench.args.quick else "full"
    lines = [
        "# fsm-agent vs torchrun benchmarks",
        "",
        f"Mode: {mode}. Started {started}, wall time {wall / 60:.1f} min.",
        "",
        "Command (from the repository root):",
        "",
        "```bash",
        command,
        "```",
        "",
        "Machine: " + ", ".join(f"{k} {v}" for k, v in info.items()) + ".",
        "",
        f"Launchers: fsm-agent = `{shlex.join(bench.commands[FSM])} {shlex.join(bench.fsm_single)}` for "
        f"single-node scenarios (rendezvous backend `{bench.single_backend}`); torchrun = `{shlex.join(bench.commands[TR])} --standalone`. fsm-agent "
        f"rendezvous backends: {', '.join(bench.backends.get('rendezvous', [])) or '?'}; launchers: "
        f"{', '.join(bench.backends.get('launcher', [])) or '?'}. Fastest multi-node backend used for "
        f"fsm-agent: `{bench.fast_backend}`.",
        "",
        "Each cell: median [min–max] over the trials (seconds unless the scenario says otherwise); ratio = "
        "median fsm-agent / median torchrun. Trials alternate the launcher order (A B, B A, ...).",
        "",
        markdown_table(rows),
        "",
    ]
    if bench.notes:
        lines += ["Notes:", ""] + [f"- {n}" for n in bench.notes] + [""]
    failures = [(r, who, msg) for r in rows for who in (FSM, TR) for msg in r.errors[who]]
    if failures:
        lines += ["Failed trials:", ""] + [f"- ({r.sid}) {r.label}, {who}: {msg}" for r, who, msg in failures] + [""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, Sizes]:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="CI mode: every scenario once, small; no goals asserted")
    parser.add_argument("--scenarios", default=SCENARIOS, help="which scenarios to run, e.g. a,b,d (default: all)")
    parser.add_argument("--markdown", metavar="PATH", help="also write the report as Markdown to PATH")
    parser.add_argument("--json", metavar="PATH", help="write every value, per trial, as JSON to PATH")
    parser.add_argument("--seed", type=int, default=1234, help="random crash ranks/moments (default 1234)")
    parser.add_argument("--keep-tmp", action="store_true", help="keep the per-trial directories (logs, events)")
    parser.add_argument("--tmp-dir", default=None, help="where the per-trial directories go (default: $TMPDIR)")
    parser.add_argument(
        "--pycache-prefix",
        default=None,
        metavar="DIR",
        help="bytecode cache (PYTHONPYCACHEPREFIX) for every launch; keep one across runs to skip "
        "the warm-up's compiling (default: a fresh one in the run's temporary directory)",
    )
    parser.add_argument(
        "--fsm-agent-cmd",
        default=f"{shlex.quote(sys.executable)} -m fsm_agent run",
        help="how to start fsm-agent (default: %(default)s)",
    )
    parser.add_argument(
        "--torchrun-cmd",
        default=f"{shlex.quote(sys.executable)} -m torch.distributed.run",
        help="how to start torchrun (default: %(default)s)",
    )
    parser.add_argument(
        "--torchrun-shared-store",
        action="store_true",
        help="keep torch's shared rendezvous store in (c)/(g) (restarted gloo groups then fail, "
        "pytorch/pytorch#135712); default: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 there",
    )
    parser.add_argument(
        "--fsm-single-node-args",
        default="--standalone",
        help="fsm-agent's rendezvous flags for single-node scenarios (default: %(default)s)",
    )
    parser.add_argument(
        "--fsm-backend", default="auto", help="fsm-agent's backend for (f)/(g): auto = 'fsm' if registered, else c10d"
    )
    parser.add_argument(
        "--fsm-preimport-launcher",
        default="auto",
        help="fsm-agent --launcher that pre-imports torch, for (c); auto = a registered launcher "
        "named like preload/preimport/fork/zygote/warm; 'none' to skip",
    )
    parser.add_argument("--fsm-preimport-args", default="", help="extra fsm-agent flags for that launcher")
    sizes = parser.add_argument_group("sizes (defaults: full mode, or quick mode with --quick)")
    ints = lambda s: [int(x) for x in s.split(",") if x.strip()]  # noqa: E731
    floats = lambda s: [float(x) for x in s.split(",") if x.strip()]  # noqa: E731
    for name, kind in (
        ("trials", int),
        ("startup_p", ints),
        ("startup_torch_p", ints),
        ("startup_torch_trials", int),
        ("restart_p", int),
        ("restart_intervals", floats),
        ("torch_restart_p", int),
        ("torch_restart_intervals", floats),
        ("torch_restart_trials", int),
        ("torch_restarts_n", int),
        ("sigterm_p", int),
        ("idle_p", int),
        ("idle_s", float),
        ("idle_trials", int),
        ("rdzv_k", ints),
        ("rdzv_trials", int),
        ("node_loss_nproc", int),
        ("node_loss_trials_fsm", int),
        ("node_loss_trials_torchrun", int),
        ("node_loss_trials_etcd", int),
        ("node_loss_cutoff_s", float),
        ("node_loss_goal_s", float),
        ("node_loss_rdzv_conf", str),
        ("hang_p", int),
        ("hang_timeout_s", float),
        ("hang_grace_s", float),
        ("hang_trials_torchrun", int),
        ("idle_loss_trials", int),
        ("idle_loss_cutoff_s", float),
        ("idle_loss_rdzv_conf", str),
        ("trial_timeout_s", float),
    ):

        def show(v):
            if isinstance(v, list):
                return ",".join(f"{x:g}" if isinstance(x, float) else str(x) for x in v)
            return f"{v:g}" if isinstance(v, float) else repr(v) if v == "" else str(v)

        sizes.add_argument(
            "--" + name.replace("_", "-"),
            type=kind,
            default=None,
            dest=name,
            metavar="V",
            help=f"full: {show(getattr(FULL, name))}; quick: {show(getattr(QUICK, name))}",
        )
    args = parser.parse_args(argv)
    base = QUICK if args.quick else FULL
    chosen = {k: getattr(args, k) for k in base.__dataclass_fields__ if getattr(args, k, None) is not None}
    if args.quick and args.trials is not None:
        chosen.setdefault("torch_restart_trials", args.trials)
    if not args.quick and args.trials is not None:
        for k in ("startup_torch_trials", "torch_restart_trials", "idle_trials", "rdzv_trials"):
            chosen.setdefault(k, min(args.trials, getattr(FULL, k)))
    unknown = set(args.scenarios.replace(",", "")) - set(SCENARIOS)
    if unknown:
        parser.error(f"--scenarios: unknown {', '.join(sorted(unknown))}; choose from {', '.join(SCENARIOS)}")
    return args, Sizes(**{**base.__dict__, **chosen})


def main(argv: list[str] | None = None) -> int:
    args, sizes = parse_args(argv)
    command = shlex.join(["python", "benchmarks/run.py", *(sys.argv[1:] if argv is None else argv)])
    wanted = [s for s in SCENARIOS if s in args.scenarios]
    started_at = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    t0 = time.monotonic()
    info = machine()
    bench = Bench(args, sizes)

    def on_signal(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    rows: list[Row] = []
    try:
        bench.preflight()
        for sid in wanted:
            log(f"== ({sid}) {TITLES[sid]} ==")
            started = time.monotonic()
            try:
                new = RUNNERS[sid](bench)
            except Exception as exc:
                log(f"scenario ({sid}) crashed: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
                new = [Row(sid, f"{TITLES[sid]}: harness error {type(exc).__name__}: {exc}", "s")]
            rows += new
            log(f"   ({sid}) took {time.monotonic() - started:.0f} s")
            print(text_table(new), flush=True)
            print(flush=True)
    finally:
        bench.close()
    wall = time.monotonic() - t0
    print(f"== fsm-agent vs torchrun ({'quick' if args.quick else 'full'} mode, wall {wall:.0f} s) ==")
    print(text_table(rows))
    if args.markdown:
        Path(args.markdown).write_text(render_markdown(bench, rows, command, wall, info, started_at))
        print(f"\nMarkdown written to {args.markdown}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "command": command,
                    "machine": info,
                    "wall_s": wall,
                    "quick": args.quick,
                    "sizes": sizes.__dict__,
                    "fast_backend": bench.fast_backend,
                    "rows": [r.to_json() for r in rows],
                },
                indent=1,
            )
        )
    incomplete = [r for r in rows if not r.complete()]
    missing = [s for s in wanted if not any(r.sid == s for r in rows)]
    for r in incomplete:
        print(f"INCOMPLETE: ({r.sid}) {r.label}: fsm-agent {r.cell(FSM)}, torchrun {r.cell(TR)}", file=sys.stderr)
    return 1 if incomplete or missing else 0


if __name__ == "__main__":
    sys.exit(main())
