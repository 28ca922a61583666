"""A soak of many real agents under a seeded fault schedule (issue #34 part 2).

``--agents`` fsm-agents on 127.0.0.1 (``--rdzv-backend fsm``, ``--nnodes N-1:N-1``: one hot spare,
``--max-restarts 10000``, ``--hang-timeout``), each with ``--nproc`` workers of
``workers/soak_worker.py`` (no torch, no collectives: a step every ``--step-s`` s and a heartbeat;
what is simulated is the training, the agents, their rendezvous and their workers are real). For
``--minutes`` a fault every ``--fault-interval`` s, drawn from ``--seed`` in shuffled blocks of the
five kinds (the same as ``goodput.py``): a worker raising, a worker SIGKILLed, a worker hung, a node
lost (its agent and workers SIGKILLed; a replacement agent starts 1 s later and waits as the spare),
a node preempted (SIGTERM to its agent; a replacement starts once it has exited). The store's host
is never the target (its loss ends the job by design). A fault is injected at its time or, while
the job still recovers from the last one, as soon as it has.

Recovered: every rank's newest worker started after the fault and has completed a step; time to
recover is the fault to the last of those first steps. A fault not recovered within ``--deadline``
s ends the soak (reported as such). At the end the workers are told to finish (the job succeeds),
and what is left behind is counted before anything is cleaned up: processes of the run, worker
cgroups, entries in the agents' temporary directories, new ``fsm-agent*`` entries in /dev/shm.
Everything is then removed (by process group, pid and path), whatever the count said.

    python benchmarks/soak.py --agents 64 --minutes 10 --seed 1
    python benchmarks/soak.py --agents 8 --minutes 1 --fault-interval 10 --seed 1   # the CI version
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
from _jobs import KINDS, Agent, Fault, InjectedFault, Job, fmt, loadavg, log, pct, schedule

WORKER = Path(__file__).resolve().parent / "workers" / "soak_worker.py"
SHM = Path("/dev/shm")
#: the key of a lost node's leftovers in the report (listed, not counted)
LOST = "on lost nodes (not counted)"
OTHER_SHM = "new in /dev/shm, not fsm-agent's (not counted)"


class SoakJob(Job):
    def __init__(self, folder: Path, agents: int, nproc: int, step_s: float, hang_timeout_s: float):
        super().__init__("soak", folder, agents - 1, nproc)
        self.step_s, self.hang_timeout_s = step_s, hang_timeout_s

    def command(self, slot: int) -> list[str]:
        active = str(self.nodes)
        return [
            sys.executable, "-m", "fsm_agent", "run", "--rdzv-backend", "fsm",
            "--nnodes", f"{active}:{active}", "--nproc-per-node", str(self.nproc),
            "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", self.run_id,
            "--max-restarts", "10000", "--local-addr", "127.0.0.1",
            "--hang-timeout", str(self.hang_timeout_s),
            "--events-file", str(self.dir / f"events.slot{slot}.jsonl"),
            str(WORKER), str(self.out), str(self.step_s),
        ]  # fmt: skip

    def job_env(self, slot: int) -> dict[str, str]:
        node_tmp = self.tmp / f"slot{slot}"  # each node its own /tmp: what is left is known by node
        node_tmp.mkdir()
        return {"LOGLEVEL": "WARNING", "TMPDIR": str(node_tmp)}

    def joined(self, agent: Agent) -> bool:
        """The agent has ended or holds a connection to the rendezvous store."""
        if agent.proc.poll() is not None:
            return True
        with contextlib.suppress(psutil.Error):
            for conn in psutil.Process(agent.proc.pid).net_connections("tcp"):
                if conn.raddr and conn.raddr.port == self.port and conn.status == psutil.CONN_ESTABLISHED:
                    return True
        return False

    def lost_nodes(self) -> set[int]:
        """Slots whose agent, keeper and workers were SIGKILLed together (a node's loss)."""
        return {a.slot for a in self.agents if a.injected == "agent_sigkill"}

    def recovered_at(self, since: float) -> float | None:
        """When every rank's newest worker, started after ``since``, had completed a step (None: not yet)."""
        newest = self.newest_workers()
        first_steps = {r["pid"]: r["t"] for r in self.events() if r["kind"] == "first_step"}
        times = []
        for rank in range(self.world):
            record = newest.get(rank)
            # the newest first_step of that pid, and after this worker's start: a reused pid's
            # earlier worker does not count
            stepped = first_steps.get(record["pid"]) if record is not None else None
            if record is None or record["t"] <= since or stepped is None or stepped < record["t"]:
                return None
            times.append(stepped)
        return max(times)


@dataclass
class Recovery:
    kind: str
    at: float  # seconds after the soak's start
    detail: str
    seconds: float | None  # None: not recovered within the deadline


@dataclass
class Report:
    agents: int
    nproc: int
    minutes: float
    seed: int
    fault_interval_s: float
    recoveries: list[Recovery] = field(default_factory=list)
    failure: str = ""
    agent_exit_codes: dict[str, int] = field(default_factory=dict)
    left_behind: dict[str, list[str]] = field(default_factory=dict)
    load_start: str = ""
    load_end: str = ""
    first_step_s: float | None = None


def run_soak(args: argparse.Namespace, folder: Path, report: Report) -> None:
    shm_before = set(os.listdir(SHM))
    job = SoakJob(folder, args.agents, args.nproc, args.step_s, args.hang_timeout)
    faults = schedule(args.seed, args.minutes * 60, args.fault_interval, args.kinds, job.world, job.nodes)
    try:
        job.start(spare=True, deadline=args.deadline)
        t0 = time.time()
        started = job.recovered_at(0.0)
        while started is None and time.time() - t0 < args.deadline and job.any_agent_alive():
            time.sleep(0.2)
            started = job.recovered_at(0.0)
        if started is None:
            report.failure = f"the world of {job.world} never stepped within {args.deadline:.0f} s"
            return
        report.first_step_s = started - job.agents[0].started
        log(f"{job.world} ranks stepping {report.first_step_s:.1f} s after the first agent started; load {loadavg()}")
        t0 = time.time()
        inject_faults(job, faults, t0, args, report)
        if not report.failure:
            finish(job, args.deadline, report)
    finally:
        report.load_end = loadavg()
        report.left_behind = left_behind(job, shm_before)
        job.close()


def inject_faults(job: SoakJob, faults: list[Fault], t0: float, args: argparse.Namespace, report: Report) -> None:
    queue = list(faults)
    pending: InjectedFault | None = None
    while queue or pending is not None:
        now = time.time()
        job.tend()
        if pending is not None:
            done = job.recovered_at(pending.at)
            if done is not None:
                report.recoveries.append(
                    Recovery(pending.fault.kind, pending.at - t0, pending.detail, done - pending.at)
                )
                log(f"  recovered from {pending.fault.kind} in {done - pending.at:.2f} s")
                pending = None
            elif now - pending.at > args.deadline:
                report.recoveries.append(Recovery(pending.fault.kind, pending.at - t0, pending.detail, None))
                report.failure = f"{pending.fault.kind} ({pending.detail}) not recovered within {args.deadline:.0f} s"
                return
        if not job.any_agent_alive() or job.agents[0].proc.poll() is not None:
            report.failure = f"the job ended at +{now - t0:.0f} s (store host exit code {job.agents[0].proc.poll()})"
            return
        if pending is None and queue and now >= t0 + queue[0].offset:
            injected = job.inject(queue[0])
            if injected is not None:
                queue.pop(0)
                pending = injected
                log(f"  +{injected.at - t0:6.1f} s {injected.fault.kind}: {injected.detail}; load {loadavg()}")
        time.sleep(0.1)


def finish(job: SoakJob, deadline: float, report: Report) -> None:
    """Tell the workers to finish; every agent not injected must end with exit code 0."""
    end = time.monotonic() + deadline
    while (job.pending_replacements or not all(map(job.joined, job.agents))) and time.monotonic() < end:
        job.tend()  # a replacement still starting when the job ends would wait for a store that is gone
        time.sleep(0.1)
    (job.out / "done").touch()
    end = time.monotonic() + deadline
    while job.any_agent_alive() and time.monotonic() < end:
        time.sleep(0.2)
    for agent in job.agents:
        code = agent.proc.poll()
        report.agent_exit_codes[f"slot {agent.slot}{' (' + agent.injected + ')' if agent.injected else ''}"] = (
            -999 if code is None else code
        )
    # a finished job's agents end with 0, a preempted one with 128 + SIGTERM, a lost node's by SIGKILL
    expected = {"": 0, "node_sigterm": 128 + signal.SIGTERM, "agent_sigkill": -signal.SIGKILL}
    bad = {
        f"slot {a.slot}": a.proc.returncode
        for a in job.agents
        if a.proc.returncode != expected.get(a.injected or "", a.proc.returncode)
    }
    if bad:
        report.failure = f"agents ended with unexpected exit codes (0, 143 preempted, -9 lost): {bad}"


def left_behind(job: SoakJob, shm_before: set[str]) -> dict[str, list[str]]:
    """What the run left once its agents ended (a SIGKILLed agent's keeper gets 10 s to clean up).
    A lost node's leftovers (its agent's keeper died with it, as on a machine that is gone) are
    listed apart and not counted: a real lost machine takes its cgroups and /tmp with it."""
    from fsm_agent.testing.processes import remove_worker_cgroups

    end = time.monotonic() + 10
    while (job.any_agent_alive() or job.token_procs()) and time.monotonic() < end:
        time.sleep(0.2)
    alive = [a for a in job.agents if a.proc.poll() is None]
    processes = [f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in job.token_procs() if p.is_running()]
    lost = job.lost_nodes()
    lost_pids = {job.agents[slot].proc.pid for slot in lost}
    cgroups = remove_worker_cgroups(a.proc.pid for a in job.agents if a.proc.poll() is not None)
    of_lost = [
        c for c in cgroups if int(c.rsplit("fsm-agent-", 1)[1].split("-")[0]) in lost_pids
    ]  # fsm-agent-<pid>-<x>
    temporary = [f"{d.name}/{f}" for d in sorted(job.tmp.iterdir()) for f in sorted(os.listdir(d))]
    lost_tmp = tuple(f"slot{slot}/" for slot in lost)
    return {
        "agents still running": [f"slot {a.slot} pid {a.proc.pid}" for a in alive],
        "processes": [] if alive else processes,  # a running agent's own processes are not leftovers
        "worker cgroups": [c for c in cgroups if c not in of_lost],
        "temporary files": [t for t in temporary if not t.startswith(lost_tmp)],
        "/dev/shm entries": sorted(n for n in set(os.listdir(SHM)) - shm_before if n.startswith("fsm-agent")),
        LOST: of_lost + [t for t in temporary if t.startswith(lost_tmp)],
        # new entries of other names: not fsm-agent's (other work on the machine)
        OTHER_SHM: sorted(n for n in set(os.listdir(SHM)) - shm_before if not n.startswith("fsm-agent")),
    }


def left_count(report: Report) -> int:
    return sum(len(v) for k, v in report.left_behind.items() if k not in (LOST, OTHER_SHM))


def markdown(report: Report, command: str) -> list[str]:
    by_kind: dict[str, list[Recovery]] = {}
    for r in report.recoveries:
        by_kind.setdefault(r.kind, []).append(r)
    lines = [
        f"Soak: {report.agents} agents x {report.nproc} workers (one hot spare), {report.minutes:g} min, "
        f"a fault every {report.fault_interval_s:g} s, seed {report.seed}; load average {report.load_start} → "
        f"{report.load_end}; cpus {os.cpu_count()}. `{command}`",
        "",
        "| fault | injected | recovered | time to recover p50 | p95 | max |",
        "|---|---|---|---|---|---|",
    ]
    for kind in [*KINDS, "all"]:
        rows = report.recoveries if kind == "all" else by_kind.get(kind, [])
        if not rows and kind != "all":
            continue
        times = [r.seconds for r in rows if r.seconds is not None]
        lines.append(
            f"| {kind} | {len(rows)} | {len(times)} | {fmt(pct(times, 0.5))} s | {fmt(pct(times, 0.95))} s "
            f"| {fmt(max(times) if times else None)} s |"
        )
    left = left_count(report)
    lines += [
        "",
        f"- left behind: {left}"
        + "".join(f"; {k}: {v}" for k, v in report.left_behind.items() if v and k not in (LOST, OTHER_SHM)),
        f"- {LOST}: {report.left_behind.get(LOST) or 'none'}",
        f"- {OTHER_SHM}: {report.left_behind.get(OTHER_SHM) or 'none'}",
        f"- verdict: {'FAILED: ' + report.failure if report.failure else 'every fault recovered'}",
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=64, help="agents started (one of them the hot spare)")
    parser.add_argument("--nproc", type=int, default=1, help="workers per agent")
    parser.add_argument("--minutes", type=float, default=10.0, help="how long faults are injected")
    parser.add_argument("--fault-interval", type=float, default=20.0, help="seconds between faults")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--kinds", default=",".join(KINDS), help="the fault kinds drawn from, comma separated")
    parser.add_argument("--step-s", type=float, default=0.5, help="the workers' step time, seconds")
    parser.add_argument("--hang-timeout", type=float, default=10.0, help="fsm-agent --hang-timeout, seconds")
    parser.add_argument("--deadline", type=float, default=180.0, help="seconds a start or a recovery may take")
    parser.add_argument("--markdown", type=Path, help="write the report's table here too")
    parser.add_argument("--json", type=Path, help="write the report as JSON here")
    parser.add_argument("--keep", type=Path, help="run in this folder and keep the agents' logs")
    args = parser.parse_args(argv)
    args.kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    for kind in args.kinds:
        if kind not in KINDS:
            parser.error(f"--kinds: {kind!r} is not one of {', '.join(KINDS)}")
    if args.agents < 3:
        parser.error(f"--agents {args.agents}: at least 3 (the store's host, a node to fault, the spare)")
    report = Report(args.agents, args.nproc, args.minutes, args.seed, args.fault_interval, load_start=loadavg())
    with tempfile.TemporaryDirectory(prefix="soak-runs-") as scratch:
        folder = args.keep or Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        run_soak(args, folder, report)
    command = "python benchmarks/soak.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = markdown(report, command)
    print("\n".join(lines))
    if args.markdown:
        args.markdown.write_text("\n".join(lines) + "\n")
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=1))
    kinds = Counter(r.kind for r in report.recoveries)
    log(f"faults: {dict(kinds)}; verdict: {report.failure or 'ok'}")
    left = left_count(report)
    return 1 if report.failure or left else 0


if __name__ == "__main__":
    sys.exit(main())
