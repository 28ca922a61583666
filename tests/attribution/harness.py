"""Runs one fault kind of ``tests/attribution/faults.py`` under a launcher, and judges the outcome.

``run_fault(kind, launcher, tmpdir, seed)`` starts the kind's agents on loopback, each in a
session of its own: ``fsm-agent run --rdzv-backend fsm --node-rank i ... --max-restarts 0
--events-file ...`` or torchrun (``python -m torch.distributed.run``, its default c10d backend),
the worker ``tests/fixtures/fault_worker.py``; node 0 first, the others once its rendezvous
endpoint listens (so node 0 hosts the store under both launchers). The harness then does the
kind's injection from outside, if any, and waits for every agent to end, ``deadline`` seconds at
most (a run should end well within 30 s on a loaded 2-core machine); what has not ended then is a
hang. Whatever happens, every process the run started is SIGKILLed at the end by its process
group, then by pid (a private token in the environment finds the workers torchrun starts in
sessions of their own), worker cgroups a killed agent's keeper left are removed, and the run's
temporary directory goes.

``judge(outcome, truth)`` decides whether the launcher named the right root cause.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from tests.attribution.faults import Fault, get

CHECKOUT = Path(__file__).resolve().parents[2]
WORKER = CHECKOUT / "tests" / "fixtures" / "fault_worker.py"
LAUNCHERS = ("fsm-agent", "torchrun")
#: seconds a run may take before what is left is killed and counted as a hang
DEADLINE_S = 60.0
TOKEN_VAR = "FAULT_HARNESS_TOKEN"
_POLL_S = 0.02
_SCRUB_PREFIXES = ("PET_", "FSM_AGENT_", "TORCHELASTIC_", "TORCH_ELASTIC_", "FAULT_")
_SCRUB_KEYS = frozenset(
    {"MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"}
    | {"GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "OMP_NUM_THREADS", "LOGLEVEL"}
    | {"CUDA_VISIBLE_DEVICES", "PYTEST_CURRENT_TEST", "PYTEST_XDIST_WORKER"}
)
#: torch's heading, and fsm-agent's ("Root Cause (first observed failure):", "Root Cause (the job's verdict, ...):")
_ROOT_CAUSE = re.compile(r"^Root Cause \(.*\):\s*$", re.MULTILINE)
_RANK_LINE = re.compile(r"^\s*rank\s*:\s*(\d+)")
_BRACKET_LINE = re.compile(r"^\s*\[(\d+)\]:\s*$")


@dataclass
class NodeOutcome:
    """One agent's end.

    exit_code: None when it had not ended by the deadline (killed then: a hang).
    seconds_to_end: from the fault to the agent's end (None: no fault time, or it never ended).
    summary_root_cause: the global rank under "Root Cause (first observed failure):" in its last
        printed summary (the "rank :" line, since torchrun's "[N]:" is an index), None: none printed.
    verdict: its events file's ``verdict`` record (fsm-agent), None: none.
    injected: the harness took this node as the fault (killed, stopped or signalled its agent).
    """

    node: int
    exit_code: int | None
    seconds_to_end: float | None
    summary_root_cause: int | None
    verdict: dict | None
    injected: bool
    stderr_tail: str = ""
    #: global rank -> non-zero exit code, from its events file's ``worker_exit`` records (fsm-agent)
    failed_ranks: dict[int, int] = field(default_factory=dict)


@dataclass
class Outcome:
    kind: str
    launcher: str
    nodes: list[NodeOutcome]
    #: the ground truth of this run (a node's ranks resolved from its workers' own reports)
    truth: frozenset[int]
    #: global rank -> the harness's node index, from the workers' reports
    rank_nodes: dict[int, int] = field(default_factory=dict)
    fault_time: float | None = None
    timed_out: bool = False
    wall_s: float = 0.0


@dataclass
class Judgement:
    right: bool
    reasons: list[str]
    #: (ranks outside the truth classed "collateral" by the verdicts, ranks outside the truth that
    #: failed or were classed at all); None: no verdict
    collateral: tuple[int, int] | None = None

    def collateral_text(self) -> str:
        if self.collateral is None or self.collateral[1] == 0:
            return "-"
        return f"{self.collateral[0]} of {self.collateral[1]}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def summary_root_cause(stderr: str) -> int | None:
    """The global rank a launcher's last printed summary names as root cause, or None."""
    headings = list(_ROOT_CAUSE.finditer(stderr))
    if not headings:
        return None
    bracket = None
    for line in stderr[headings[-1].end() :].splitlines()[1:]:
        if line.startswith(("=====", "-----")):
            break
        found = _RANK_LINE.match(line)
        if found:
            return int(found.group(1))
        found = _BRACKET_LINE.match(line)
        if found and bracket is None:
            bracket = int(found.group(1))
    return bracket


def _records(events_file: Path, kind: str) -> list[dict]:
    found = []
    with contextlib.suppress(FileNotFoundError):
        for line in events_file.read_text(encoding="utf-8", errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict) and record.get("kind") == kind:
                    found.append(record)
    return found


def read_verdict(events_file: Path) -> dict | None:
    """The last ``verdict`` record of an events file (JSON lines), None when there is none."""
    verdicts = _records(events_file, "verdict")
    return verdicts[-1] if verdicts else None


def read_failed_ranks(events_file: Path) -> dict[int, int]:
    """Global rank -> exit code of the workers an events file's ``worker_exit`` records show failed."""
    return {
        int(r["global_rank"]): int(r["exit_code"])
        for r in _records(events_file, "worker_exit")
        if r.get("global_rank") is not None and r.get("exit_code") not in (0, None)
    }


def _env(token: str, fault: Fault, marks: Path, tmp: Path, node: int, step: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_SCRUB_PREFIXES) and k not in _SCRUB_KEYS}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(CHECKOUT), env.get("PYTHONPATH")]))
    env.update(
        {
            TOKEN_VAR: token,
            "TMPDIR": str(tmp),
            "OMP_NUM_THREADS": "1",
            "FAULT_KIND": fault.worker_kind,
            "FAULT_RANKS": ",".join(map(str, fault.worker_ranks)),
            "FAULT_STEP": str(step),
            "FAULT_DIR": str(marks),
            "FAULT_NODE": str(node),
        }
    )
    env.update(fault.env)
    return env


def _command(fault: Fault, launcher: str, node: int, port: int, run_id: str, events: Path) -> list[str]:
    common = [
        "--nnodes",
        str(fault.nnodes),
        "--nproc-per-node",
        str(fault.nproc),
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        run_id,
        "--max-restarts",
        "0",
        "--local-addr",
        "127.0.0.1",
    ]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend", "c10d", *common, str(WORKER)]
    if launcher != "fsm-agent":
        raise ValueError(f"launcher: one of {LAUNCHERS}, not {launcher!r}")
    return [
        sys.executable,
        "-m",
        "fsm_agent",
        "run",
        "--rdzv-backend",
        "fsm",
        "--node-rank",
        str(node),
        *common,
        "--events-file",
        str(events),
        *fault.agent_flags,
        *fault.node_agent_flags.get(node, ()),
        str(WORKER),
    ]


def _marks(marks: Path, name: str) -> dict[int, dict]:
    found = {}
    for path in marks.glob(f"{name}.*"):
        if path.suffix == ".tmp":
            continue
        with contextlib.suppress(ValueError, OSError):
            record = json.loads(path.read_text(encoding="utf-8"))
            found[int(record["rank"])] = record
    return found


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _token_procs(token: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if proc.pid != os.getpid() and proc.environ().get(TOKEN_VAR) == token:
                found.append(proc)
    return found


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _tree(pid: int) -> list[psutil.Process]:
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    return []


class _Run:
    """The processes of one run; ``close()`` leaves none behind."""

    def __init__(self, fault: Fault, launcher: str, tmpdir: Path, seed: int):
        self.fault, self.launcher = fault, launcher
        self.dir = Path(tmpdir) / f"{fault.name}-{launcher}-{seed}-{uuid.uuid4().hex[:6]}"
        self.marks = self.dir / "marks"
        self.marks.mkdir(parents=True)
        # short: multiprocessing's sockets and the agents' temporary directories live there
        self.tmp = Path(tempfile.mkdtemp(prefix="fault-"))
        self.token = uuid.uuid4().hex
        self.step = int(fault.env.get("FAULT_STEP", 4 + seed % 3))
        self.port = free_port()
        self.run_id = f"fault-{fault.name}-{seed}-{self.token[:6]}"
        self.procs: list[subprocess.Popen] = []
        self.ended: dict[int, float] = {}
        self.injected: set[int] = set()
        self.stopped: list[psutil.Process] = []

    def start(self, node: int) -> None:
        out = (self.dir / f"node{node}.out").open("wb")
        err = (self.dir / f"node{node}.err").open("wb")
        with out, err:
            self.procs.append(
                subprocess.Popen(
                    _command(self.fault, self.launcher, node, self.port, self.run_id, self.events(node)),
                    env=_env(self.token, self.fault, self.marks, self.tmp, node, self.step),
                    cwd=self.dir,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    start_new_session=True,
                )
            )

    def events(self, node: int) -> Path:
        return self.dir / f"node{node}.events.jsonl"

    def poll(self) -> bool:
        """Record agents that ended; True when all did (or were taken as the fault)."""
        for node, proc in enumerate(self.procs):
            if node not in self.ended and proc.poll() is not None:
                self.ended[node] = time.time()
        return all(n in self.ended or n in self.stopped_nodes for n in range(len(self.procs)))

    @property
    def stopped_nodes(self) -> set[int]:
        return {n for n in self.injected if self.fault.action is not None and self.fault.action.what == "stop_node"}

    def inject(self) -> bool:
        """Do the kind's action once its trigger is seen; True once done (or there is none)."""
        action = self.fault.action
        if action is None:
            return True
        reached = _marks(self.marks, "reached")
        if action.rank is not None:
            target = reached.get(action.rank)
            if target is None:
                return False
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(target["pid"]), getattr(signal, action.signal))
            return True
        node_ranks = [r for r, m in reached.items() if m.get("node") == str(action.node)]
        if len(node_ranks) < self.fault.nproc:
            return False
        agent = self.procs[action.node]
        self.injected.add(action.node)
        if action.what == "kill_agent":  # the machine is gone: its agent and all under it at once
            for proc in _tree(agent.pid):
                with contextlib.suppress(psutil.Error):
                    proc.kill()
        elif action.what == "signal_agent":
            agent.send_signal(getattr(signal, action.signal))
        elif action.what == "stop_node":
            for proc in _tree(agent.pid):  # the agent first, then what it started
                with contextlib.suppress(psutil.Error):
                    proc.suspend()
                    self.stopped.append(proc)
        else:
            raise ValueError(f"unknown action {action.what!r}")
        return True

    def close(self) -> None:
        """SIGKILL what the run started (process groups, stopped processes, then by token and pid),
        remove worker cgroups left behind and the run's temporary directory; an interrupt
        meanwhile still gets the kills by pid and the removals."""
        try:
            for proc in self.procs:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(proc.pid, signal.SIGKILL)
            for proc in self.stopped:
                with contextlib.suppress(psutil.Error):
                    proc.kill()
            for proc in self.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=30)
            deadline = time.monotonic() + 5.0  # a killed agent's cgroup keeper kills its workers itself
            while any(map(_alive, _token_procs(self.token))) and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            left = _token_procs(self.token)
            for proc in left:
                with contextlib.suppress(psutil.Error):
                    proc.kill()  # by pid
            psutil.wait_procs(left, timeout=10)
            for proc in self.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)
            with contextlib.suppress(Exception):
                from fsm_agent.testing.processes import remove_worker_cgroups

                remove_worker_cgroups(p.pid for p in self.procs)
            shutil.rmtree(self.tmp, ignore_errors=True)


def run_fault(
    kind: str | Fault,
    launcher: str = "fsm-agent",
    tmpdir: Path | str | None = None,
    seed: int = 0,
    *,
    deadline: float = DEADLINE_S,
) -> Outcome:
    """Run one fault kind under ``launcher`` (``fsm-agent`` or ``torchrun``) and return its outcome.

    ``tmpdir``: where the run's logs, events files and markers go (a subfolder of its own, kept for
    a reader; None: a temporary directory, removed). ``seed`` picks the fault's step (4 to 6) and
    the run id.
    """
    fault = get(kind) if isinstance(kind, str) else kind
    if tmpdir is None:
        with tempfile.TemporaryDirectory(prefix="faults-") as tmp:
            return run_fault(fault, launcher, tmp, seed, deadline=deadline)
    run = _Run(fault, launcher, Path(tmpdir), seed)
    started = time.time()
    timed_out = False
    fault_time: float | None = None
    try:
        run.start(0)
        end = time.monotonic() + deadline
        while not _listening(run.port) and run.procs[0].poll() is None and time.monotonic() < end:
            time.sleep(_POLL_S)
        for node in range(1, fault.nnodes):
            run.start(node)
        injected = False
        while time.monotonic() < end:
            if not injected:
                injected = run.inject()
                if injected and fault.action is not None:
                    fault_time = time.time()
            if run.poll():
                break
            time.sleep(_POLL_S)
        else:
            timed_out = True
    finally:
        run.close()  # what ends from here on was killed: not recorded as ended
    rank_nodes = {r: int(m["node"]) for r, m in _marks(run.marks, "reached").items() if m.get("node") is not None}
    faults = _marks(run.marks, "fault")
    if fault_time is None and faults:
        fault_time = min(float(m["time"]) for m in faults.values())
    truth = fault.truth
    if fault.truth_node is not None:
        ranks = frozenset(r for r, n in rank_nodes.items() if n == fault.truth_node)
        truth = ranks if len(ranks) == fault.nproc else fault.truth
    nodes = []
    for node in range(fault.nnodes):
        stderr = (run.dir / f"node{node}.err").read_text(encoding="utf-8", errors="replace")
        ended = run.ended.get(node)
        rc = run.procs[node].returncode if ended is not None else None
        nodes.append(
            NodeOutcome(
                node=node,
                exit_code=rc,
                seconds_to_end=(ended - fault_time) if ended is not None and fault_time is not None else None,
                summary_root_cause=summary_root_cause(stderr),
                verdict=read_verdict(run.events(node)) if launcher == "fsm-agent" else None,
                failed_ranks=read_failed_ranks(run.events(node)) if launcher == "fsm-agent" else {},
                injected=node in run.injected,
                stderr_tail="\n".join(stderr.splitlines()[-40:]),
            )
        )
    return Outcome(
        kind=fault.name,
        launcher=launcher,
        nodes=nodes,
        truth=truth,
        rank_nodes=rank_nodes,
        fault_time=fault_time,
        timed_out=timed_out,
        wall_s=time.time() - started,
    )


def judge(outcome: Outcome, truth: frozenset[int] | set[int] | None = None) -> Judgement:
    """Right when every node ended, and every node (but those the harness took as the fault) names a
    ground-truth rank as THE root cause: fsm-agent in its ``verdict`` record (none: a miss), with
    no rank outside the truth classed ``root_cause`` or ``own``; torchrun in its printed summary
    (every node that printed one; at least one did)."""
    truth = frozenset(outcome.truth if truth is None else truth)
    reasons = []
    if outcome.timed_out:
        hung = [n.node for n in outcome.nodes if n.exit_code is None and not n.injected]
        if hung:
            reasons.append(f"node(s) {hung} had not ended after the deadline (a hang)")
    judged = [n for n in outcome.nodes if not n.injected and n.exit_code is not None]
    if outcome.launcher == "torchrun":
        named = [n for n in judged if n.summary_root_cause is not None]
        if not named:
            reasons.append("no node printed a root cause")
        for n in named:
            if n.summary_root_cause not in truth:
                reasons.append(f"node {n.node} names rank {n.summary_root_cause}, truth {sorted(truth)}")
        return Judgement(not reasons, reasons)
    classed: dict[int, set[str]] = {}
    for n in judged:
        verdict = n.verdict
        if verdict is None:
            reasons.append(f"node {n.node} (exit {n.exit_code}): no verdict record")
            continue
        causes = verdict.get("root_causes") or []
        if not causes or causes[0] not in truth:
            reasons.append(f"node {n.node}'s verdict names {causes[:1] or 'no rank'}, truth {sorted(truth)}")
        for rank, cls in (verdict.get("classes") or {}).items():
            classed.setdefault(int(rank), set()).add(cls)
    collateral = None
    if any(n.verdict is not None for n in judged):
        outside = {r: c for r, c in classed.items() if r not in truth}
        failed = {r for n in outcome.nodes for r in n.failed_ranks if r not in truth}
        collateral = (sum(1 for c in outside.values() if c == {"collateral"}), len(failed | set(outside)))
        wrong = sorted(r for r, c in outside.items() if c & {"root_cause", "own"})
        if wrong:
            reasons.append(f"collateral rank(s) {wrong} classed root_cause/own")
    if not judged and not reasons:
        reasons.append("no node ended to name a root cause")
    return Judgement(not reasons, reasons, collateral)


def describe(outcome: Outcome) -> str:
    """Several lines: each node's end, for a failed assertion or the report's details."""
    lines = [
        f"{outcome.kind} under {outcome.launcher}: truth {sorted(outcome.truth)}, ranks' nodes {outcome.rank_nodes}"
    ]
    for n in outcome.nodes:
        verdict = n.verdict and {k: n.verdict.get(k) for k in ("root_causes", "classes", "exit_code", "summary")}
        lines.append(
            f"  node {n.node}: exit {n.exit_code}, {n.seconds_to_end and round(n.seconds_to_end, 1)} s after the "
            f"fault, summary root cause {n.summary_root_cause}, verdict {verdict}"
            + (" (taken as the fault)" if n.injected else "")
        )
    return "\n".join(lines)
