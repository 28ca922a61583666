"""Goodput under a replayed fault schedule (issue #34 part 1): torchrun against fsm-agent.

A job of 4 agents x 2 workers on 127.0.0.1 (``--agents N``; ``--netns``: each agent in a network
namespace, see below; dynamic rendezvous, ``--nnodes N:N``, fsm-agent with one hot spare,
``--max-restarts 1000``) runs ``workers/goodput_worker.py``: gloo all_reduce every step, a fixed
compute time per step, ``--state-mib`` of float32 state per rank, a checkpoint every K steps, a
restore on every (re)start. The same seeded fault schedule, (time offset, kind, target) generated
once from ``--seed``, is replayed for every mode:

- ``worker_exception``: the target rank raises at its next step boundary (SIGUSR1 to it);
- ``worker_sigkill``: SIGKILL to the target rank;
- ``worker_hang``: the target rank stops stepping (SIGUSR2 to it) and sleeps forever;
- ``agent_sigkill``: node loss: SIGKILL to an agent and everything under it (never the agent that
  hosts the rendezvous store: under both launchers its loss ends the job); a replacement agent
  starts ``--replace-after`` s later and waits as the next spare;
- ``node_sigterm``: preemption: SIGTERM to an agent (not the store host); a replacement starts
  once it has exited.

Modes, side by side in one run:

- ``torchrun``: ``python -m torch.distributed.run --rdzv-backend c10d``, no spare (``--torchrun-spare``
  adds one: with a fifth agent every restart became a livelock of re-rendezvous, the four agents
  starting and stopping their workers every 2-3 s for minutes; without it a lost node's seat waits
  for its replacement agent), ``--rdzv-conf last_call_timeout=1,keep_alive_interval=1,
  keep_alive_max_attempt=5``, disk checkpoints: ``torch.save`` + fsync per rank, a barrier, rank 0
  commits the step; restore from disk. ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (without it a
  restarted gloo group meets stale keys, pytorch/pytorch#135712; ``--torchrun-shared-store`` drops it).
- ``fsm-disk``: ``fsm-agent run --rdzv-backend fsm`` (a hot spare waits as a standby), the same disk
  checkpoints, ``--hang-timeout``.
- ``fsm-memory``: the same plus ``--checkpoint-memory`` (``fsm_agent.checkpoint.save/load``; every
  ``--persist-every``-th save also goes to ``--checkpoint-dir``), ``--launcher preload``.
- ``fsm-inprocess`` (issue #33): ``fsm-memory`` plus ``--restart-mode inprocess --inprocess-timeout``
  (always ``--launcher preload``); the worker runs its loop through ``fsm_agent.inprocess.run``: a
  failed worker is replaced alone and restored from the most advanced survivor, the survivors keep
  their processes; a hang or a lost or preempted node restarts the whole group (from the agents'
  memory checkpoints).

Settings, the same for every mode: the gloo timeout max(20, 3 x the longest step, T + C, of any
mode) and fsm-agent's ``--hang-timeout`` max(5, 3 x the longest step of the fsm modes), both from
the calibrations, which run first for every mode.

K per mode (Young/Daly): a calibration run of the same job (no faults, a checkpoint every 3 steps)
measures the step time T and the checkpoint's cost C (a checkpoint step's extra time, median); then
K = max(1, round(sqrt(2 C MTBF) / T)), MTBF = ``--fault-interval``.

Measured from the workers' step logs (``steps.<rank>.log``: step, wall time, pid): the window starts
at the first completed step and lasts ``--duration`` s. Useful steps = the highest step completed in
the window minus the highest at its start (a step repeated after a restore counts once); goodput =
useful steps x T / window, T the median of the modes' calibrated step times (the same for every
mode); time to recovery = the fault's injection → every rank has completed the first step that a
worker started after the fault completed (in-process restart keeps the survivors' processes); steps lost per fault = the newest step completed before the fault minus the step the job
resumed from. A fault is injected at its offset or, when the job is still recovering from the last
one, as soon as it has recovered (a slow launcher meets fewer faults: in its favour). After the
window the job runs on, without new faults, until the last fault's recovery is timed. A mode whose job ends, or makes no step for ``--deadline`` s after
a fault, has failed to recover: the rest of its window counts as lost.

    python benchmarks/goodput.py                       # 5 min per mode, a fault every 20 s
    python benchmarks/goodput.py --quick               # 60 s per mode, 3 faults, 8 MiB: a smoke run
    python benchmarks/goodput.py --modes fsm-memory --duration 120 --keep /tmp/goodput-logs
    # 2 agents (--agents) each in a network namespace of its own: the job's traffic goes over veths
    python benchmarks/goodput.py --netns --modes fsm-memory --kinds node_kill,node_sigterm --duration 60
    # issue #33: 21 faults of three kinds, 256 MiB per rank, every mode meets all of them
    python benchmarks/goodput.py --modes torchrun,fsm-memory,fsm-inprocess --kinds exception,kill,node_kill --state-mib 256 --fault-interval 10 --fault-count 21 --all-faults

Also reported: steps repeated by survivors (a process that logs a step it had completed: must be
0 under in-process restart), and per fault whether the whole group restarted or the failed ranks
were replaced alone.

``--netns`` (root and iproute2's ``ip``): every host (node 0..N-1, the spare N) is a network
namespace of its own, the namespaces veths on one bridge (``_netns.py``: ``tests/netns.py``'s
topology, addresses in a private 10.231.x.0/24 inside the namespaces), so the rendezvous, the
TCPStore, gloo (``GLOO_SOCKET_IFNAME``) and the agents' checkpoint replicas go from one address to
another over veths, not loopback; a lost or preempted node's replacement starts in that node's
namespace, at its address (the machine coming back). ``--agents`` defaults to 2 with it; where the
namespaces cannot be made, the run ends with exit code 3 and the reason. What it
does not simulate: latency, bandwidth limits or loss (none is shaped), separate CPUs, memory,
disks or /dev/shm (the hosts share this machine's), and separate hostnames.

Every process a run starts is stopped by process group, then by pid (a private token in the
environment finds torchrun's workers and replacement agents); worker cgroups a killed agent left,
/dev/shm checkpoint directories of killed agents and temporary directories are removed; with
``--netns`` the namespaces (and their veths and bridge) too, also after an error, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from _jobs import (
    HERE,
    KINDS,
    Fault,
    InjectedFault,
    Job,
    fmt,
    loadavg,
    log,
    pct,
    schedule,
)

WORKER = HERE / "workers" / "goodput_worker.py"
MODES = ("torchrun", "fsm-disk", "fsm-memory", "fsm-inprocess")
#: modes whose workers checkpoint into the agents' memory (``--checkpoint-memory``)
MEMORY_MODES = ("fsm-memory", "fsm-inprocess")
#: short names ``--kinds`` also takes
KIND_ALIASES = {
    "exception": "worker_exception",
    "kill": "worker_sigkill",
    "hang": "worker_hang",
    "node_kill": "agent_sigkill",
    "node_sigterm": "node_sigterm",
}
#: --quick's three faults: a worker's death, a node's loss (the spare takes its seat), a preemption
QUICK_KINDS = ("worker_sigkill", "agent_sigkill", "node_sigterm")
#: agents (nodes, without the spare) by default, on loopback and with --netns; workers per agent
NODES, NETNS_NODES, NPROC = 4, 2, 2
CALIB_K = 3
# ------------------------------------------------------------------------------------------------
# One job: agents, their workers, injection, cleanup
# ------------------------------------------------------------------------------------------------


@dataclass
class Settings:
    state_mib: int
    compute_s: float
    pg_timeout_s: float
    hang_timeout_s: float
    persist_every: int
    torchrun_shared_store: bool
    preload: bool
    inprocess_timeout_s: float = 10.0
    nodes: int = NODES
    netns: bool = False  # every host in a network namespace of its own


class GoodputJob(Job):
    """One mode's job: ``settings.nodes`` agents x 2 workers of ``workers/goodput_worker.py``."""

    def __init__(self, mode: str, folder: Path, settings: Settings, k: int, max_steps: int):
        super().__init__(f"goodput-{mode}", folder, settings.nodes, NPROC, netns=settings.netns)
        self.mode, self.settings, self.k, self.max_steps = mode, settings, k, max_steps
        self.ckpt = folder / "ckpt"
        self.ckpt.mkdir(parents=True, exist_ok=True)
        (self.ckpt / "torch").mkdir(exist_ok=True)

    def command(self, slot: int) -> list[str]:
        s = self.settings
        common = [
            "--nnodes", f"{self.nodes}:{self.nodes}", "--nproc-per-node", str(NPROC),
            "--rdzv-endpoint", self.endpoint(), "--rdzv-id", self.run_id,
            "--max-restarts", "1000", "--local-addr", self.address(slot),
        ]  # fmt: skip
        script = [
            str(WORKER), str(self.out), "memory" if self.mode in MEMORY_MODES else "disk", str(s.state_mib),
            str(s.compute_s), str(self.k), str(self.max_steps), str(s.pg_timeout_s),
        ]  # fmt: skip
        if self.mode == "fsm-inprocess":
            script.append("inprocess")
        if self.mode == "torchrun":
            conf = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=5"
            if self.net is not None:  # the hosts share one hostname: torch cannot infer which hosts the store
                conf += f",is_host={int(slot == 0)}"
            return [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--rdzv-backend",
                "c10d",
                "--rdzv-conf",
                conf,
                *common,
                *script,
            ]
        cmd = [sys.executable, "-m", "fsm_agent", "run", "--rdzv-backend", "fsm", *common]
        cmd += ["--hang-timeout", str(s.hang_timeout_s), "--events-file", str(self.dir / f"events.slot{slot}.jsonl")]
        if self.mode in MEMORY_MODES:
            cmd += ["--checkpoint-memory", f"{s.state_mib + 1}MiB", "--checkpoint-dir", str(self.ckpt / "agent")]
            if s.preload or self.mode == "fsm-inprocess":
                cmd += ["--launcher", "preload"]
        if self.mode == "fsm-inprocess":
            cmd += ["--restart-mode", "inprocess", "--inprocess-timeout", str(s.inprocess_timeout_s)]
        return cmd + script

    def world_ready(self) -> bool:
        """Every rank has completed a step (the spare starts after the world's first step)."""
        return len(self.stepped_ranks()) >= self.world

    def job_env(self, slot: int) -> dict[str, str]:
        env = {}
        env.update(
            {
                "LOGLEVEL": "WARNING",
                "GOODPUT_CKPT_DIR": str(self.ckpt / "torch"),
                "GOODPUT_PERSIST_EVERY": str(self.settings.persist_every),
            }
        )
        if self.mode == "torchrun" and not self.settings.torchrun_shared_store:
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        return env


# ------------------------------------------------------------------------------------------------
# Calibration and the measured run
# ------------------------------------------------------------------------------------------------


@dataclass
class Calibration:
    step_s: float
    checkpoint_s: float
    checkpoints: int
    ok: bool
    note: str = ""
    namespaces: list[str] = field(default_factory=list)  # --netns: the ones its job made (and removed)


def calibrate(mode: str, folder: Path, settings: Settings, steps: int, deadline: float) -> Calibration:
    """A fault-free job of ``steps`` steps with a checkpoint every ``CALIB_K``: the step time
    (median interval of steps after a plain step) and the checkpoint's cost (median extra time of
    the step after a checkpoint; the first two checkpoints, which map fresh memory, left out)."""
    job = GoodputJob(mode, folder, settings, CALIB_K, steps)
    try:
        job.start(spare=False, deadline=deadline)
        end = time.monotonic() + deadline
        while job.any_agent_alive() and time.monotonic() < end:
            time.sleep(0.2)
        ok = not job.any_agent_alive() and all(a.proc.returncode == 0 for a in job.agents)
    finally:
        job.close()
    per_step: dict[int, float] = {}
    for t, step, _rank, _pid in job.steps():  # a step is done when its first rank logs it (one all_reduce)
        per_step.setdefault(step, t)
    plain, after_ckpt = [], []
    for step in sorted(per_step):
        if step - 1 in per_step and step >= 3:
            gap = per_step[step] - per_step[step - 1]
            (after_ckpt if (step - 1) % CALIB_K == CALIB_K - 1 else plain).append((step, gap))
    if not plain:
        return Calibration(settings.compute_s, 0.0, 0, False, "no steps", job.namespaces())
    step_s = statistics.median(g for _, g in plain)
    costs = [g - step_s for s, g in after_ckpt if s > 2 * CALIB_K + 1] or [g - step_s for _, g in after_ckpt]
    cost = max(0.001, statistics.median(costs)) if costs else 0.001
    note = "" if ok else "the calibration job did not end cleanly"
    return Calibration(step_s, cost, len(costs), ok, note, job.namespaces())


def young_daly(cost: float, mtbf: float, step_s: float) -> int:
    return max(1, round(math.sqrt(2 * cost * mtbf) / step_s))


@dataclass
class Result:
    mode: str
    k: int
    calibration: Calibration
    window_s: float = 0.0
    start_step: int = -1
    end_step: int = -1
    useful_steps: int = 0
    goodput: float | None = None
    faults: list[dict] = field(default_factory=list)
    group_starts: int = 0
    replaced_alone: int = 0
    repeats_by_survivors: int = 0
    failed_to_recover: str | None = None
    load_start: str = ""
    load_end: str = ""
    phases: dict[str, list[float]] = field(default_factory=dict)


def run_mode(
    mode: str,
    folder: Path,
    settings: Settings,
    k: int,
    calibration: Calibration,
    faults: list[Fault],
    duration: float,
    deadline: float,
    spare: bool = True,
    all_faults: bool = False,
) -> tuple[Result, GoodputJob]:
    """One mode's measured run. ``all_faults``: the window lasts until every fault of the schedule
    was injected and recovered from (at least ``duration`` s): a slow mode meets them all too."""
    result = Result(mode, k, calibration, load_start=loadavg())
    job = GoodputJob(mode, folder, settings, k, 10**9)
    injected: list[InjectedFault] = []
    t0 = t_window_end = None
    try:
        job.start(spare=spare, deadline=deadline)
        t0 = first_step(job, deadline)
        if t0 is None:
            result.failed_to_recover = "the job never made a step"
            return result, job
        log(f"{mode}: first step at +{t0 - job.agents[0].started:.1f} s after launch; window {duration:.0f} s")
        t_window_end = inject_all(job, result, list(faults), injected, t0, duration, deadline, all_faults)
        t_end = time.time()
    finally:
        result.load_end = loadavg()
        job.close()
    analyse(result, job, injected, t0, t_window_end or t0 + duration, t_end)
    return result, job


def first_step(job: GoodputJob, deadline: float) -> float | None:
    """The wall time of the job's first completed step (None: none within ``deadline`` s)."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        steps = job.steps()
        if steps:
            return steps[0][0]
        if not job.any_agent_alive():
            return None
        time.sleep(0.1)
    return None


def inject_all(
    job: GoodputJob,
    result: Result,
    queue: list[Fault],
    injected: list[InjectedFault],
    t0: float,
    duration: float,
    deadline: float,
    all_faults: bool,
) -> float:
    """Inject the schedule (each fault at its offset, once the last one recovered), then wait for
    the last recovery; returns the window's end (wall time)."""
    last_fault: InjectedFault | None = None
    next_shm_note = 0.0
    window_end = t0 + duration
    while True:
        now = time.time()
        if all_faults and queue:
            window_end = max(window_end, now + 0.1)  # not over while a fault waits
        if now >= window_end and (last_fault is None or now >= window_end + deadline):
            break
        job.tend()
        if job.mode in MEMORY_MODES and now >= next_shm_note:
            job.note_shm()
            next_shm_note = now + 5
        steps = job.steps()
        last_step_t = steps[-1][0] if steps else t0
        starts = {r["pid"]: r["t"] for r in job.events() if r["kind"] == "start"}
        recovered = last_fault is None or any(
            t > last_fault.at and starts.get(pid, 0) > last_fault.at for t, _s, _r, pid in steps[-3 * job.world :]
        )
        if not job.any_agent_alive():
            if now < window_end:
                result.failed_to_recover = f"every agent ended (at +{now - t0:.0f} s)"
            break
        if last_fault is not None and not recovered and now - max(last_fault.at, last_step_t) > deadline:
            if last_fault.at + deadline < window_end or all_faults:  # past the window: only unmeasured
                result.failed_to_recover = (
                    f"no step for {deadline:.0f} s after {last_fault.fault.kind} (at +{last_fault.at - t0:.0f} s)"
                )
            break
        if now >= window_end:
            if recovered:  # past the window, only to time the last fault's recovery
                break
        elif queue and now >= t0 + queue[0].offset and recovered:
            done = job.inject(queue[0])
            if done is not None:
                injected.append(done)
                last_fault = done
                log(f"  +{done.at - t0:6.1f} s {queue.pop(0).kind}: {done.detail}")
        time.sleep(0.05)
    return window_end


def analyse(
    result: Result, job: GoodputJob, injected: list[InjectedFault], t0: float, t_window_end: float, t_stop: float
) -> None:
    """Useful steps in the window, and per fault: its recovery (fault → every rank has completed
    the first step that a worker started after the fault completed: under in-process restart the
    survivors keep their processes), steps lost, where the time went."""
    steps = [s for s in job.steps() if s[0] <= t_stop]
    in_window = [s for s in steps if s[0] <= t_window_end]
    events = job.events()
    starts = {r["pid"]: r for r in events if r["kind"] == "start"}
    restores = [r for r in events if r["kind"] == "restored"]
    result.window_s = t_window_end - t0
    result.start_step = max((s for t, s, _r, _p in steps if t <= t0), default=-1)
    result.end_step = max((s for _t, s, _r, _p in in_window), default=-1)
    result.useful_steps = max(0, result.end_step - result.start_step)
    result.repeats_by_survivors = survivor_repeats(steps)
    phases: dict[str, list[float]] = {"detect_to_start": [], "start_to_restored": [], "restored_to_step": []}
    for i, inj in enumerate(injected):
        if inj.at > t_window_end:
            continue
        entry = {"at": inj.at, "offset": round(inj.at - t0, 1), "kind": inj.fault.kind, "target": inj.detail}
        recovery = recovery_of(inj.at, steps, starts, job.world)
        if recovery is None:
            entry.update(recovery_s=None, note="not recovered")
            result.faults.append(entry)
            continue
        t_all, t_new, s, pid = recovery
        # the newest step before the fault: the last one logged (a rewound job logs lower steps again)
        before = next((st for t, st, _r, _p in reversed(steps) if t <= inj.at), -1)
        entry.update(recovery_s=round(t_all - inj.at, 2), steps_lost=max(0, before - (s - 1)), resumed_from=s - 1)
        entry["ranks_restarted"] = len({r["rank"] for r in starts.values() if inj.at < r["t"] <= t_all})
        restored = {r["pid"]: r for r in reversed(restores) if r["t"] > inj.at}  # each pid's first after it
        entry["source"] = restored.get(pid, {}).get("source")
        group = [r for r in starts.values() if inj.at < r["t"] < t_new]  # the new workers
        if group:
            first_start = min(r["t"] for r in group)
            ready = max((restored[r["pid"]]["t"] for r in group if r["pid"] in restored), default=None)
            phases["detect_to_start"].append(first_start - inj.at)
            if ready is not None:
                phases["start_to_restored"].append(ready - first_start)
                phases["restored_to_step"].append(t_all - ready)
        if i + 1 < len(injected) and t_all > injected[i + 1].at:
            entry["note"] = "recovered after the next fault"
        result.faults.append(entry)
    result.phases = phases
    restarted = [f["ranks_restarted"] for f in result.faults if "ranks_restarted" in f]
    result.group_starts = sum(n >= job.world for n in restarted)
    result.replaced_alone = sum(0 < n < job.world for n in restarted)
    result.goodput = None  # set by the caller once the modes' step time is known


def recovery_of(
    at: float, steps: list[tuple[float, int, int, int]], starts: dict[int, dict], world: int
) -> tuple[float, float, int, int] | None:
    """(every rank done, first new worker done, step, its pid) of the first step after ``at`` that a
    worker started after ``at`` completed; None when none did or a rank never completed it."""
    first = next(((t, s, p) for t, s, _r, p in steps if t > at and starts.get(p, {}).get("t", 0) > at), None)
    if first is None:
        return None
    t_new, s, pid = first
    since = starts[pid]["t"]  # not the old workers' last steps (a rewound job logs the same numbers)
    done = {}
    for t, st, r, _p in steps:
        if t > since and st == s and r not in done:
            done[r] = t
    return (max(done.values()) if len(done) == world else t_new), t_new, s, pid


def survivor_repeats(steps: list[tuple[float, int, int, int]]) -> int:
    """Steps a process logged again after it had completed them (a survivor of an in-process
    recovery must repeat none; a restarted process is a new pid and is not counted)."""
    newest: dict[int, int] = {}
    repeats = 0
    for _t, s, _r, pid in steps:
        if pid in newest and s <= newest[pid]:
            repeats += 1
        newest[pid] = max(s, newest.get(pid, -1))
    return repeats


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------


def table(results: list[Result], step_s: float) -> list[str]:
    lines = [
        "| mode | K | goodput | useful steps | MTTR p50 / p95 [s] | steps lost per fault (mean) | faults: whole group restarted | "
        "faults: failed ranks replaced alone | steps repeated by survivors | faults recovered | failures to recover |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        recov = [f["recovery_s"] for f in r.faults if f.get("recovery_s") is not None]
        lost = [f["steps_lost"] for f in r.faults if "steps_lost" in f]
        failure = r.failed_to_recover or "0"
        lines.append(
            f"| {r.mode} | {r.k} | {fmt(r.goodput, '.3f')} | {r.useful_steps} | {fmt(pct(recov, 0.5))} / {fmt(pct(recov, 0.95))} | "
            f"{fmt(statistics.mean(lost) if lost else None, '.1f')} | {r.group_starts} | {r.replaced_alone} | "
            f"{r.repeats_by_survivors} | {len(recov)} of {len(r.faults)} | {failure} |"
        )
    return lines


def mttr_by_kind(results: list[Result]) -> list[str]:
    """p50 / p95 of fault → next completed step per kind and mode, and the in-process ratios."""
    kinds = sorted({f["kind"] for r in results for f in r.faults})
    lines = [
        "| mode | " + " | ".join(f"{k} p50 / p95 [s] (n)" for k in kinds) + " | all p50 / p95 [s] (n) |",
        "|---|" + "---|" * (len(kinds) + 1),
    ]
    p95 = {}
    for r in results:
        cells = []
        for kind in [*kinds, None]:
            vals = [f["recovery_s"] for f in r.faults if f.get("recovery_s") is not None and kind in (None, f["kind"])]
            cells.append(f"{fmt(pct(vals, 0.5))} / {fmt(pct(vals, 0.95))} ({len(vals)})")
            if kind is None:
                p95[r.mode] = pct(vals, 0.95)
        lines.append(f"| {r.mode} | " + " | ".join(cells) + " |")
    inproc = p95.get("fsm-inprocess")
    for other, goal in (("fsm-memory", 0.5), ("torchrun", 0.05)):
        if inproc is not None and p95.get(other):
            ratio = inproc / p95[other]
            verdict = "met" if ratio <= goal else "not met"
            lines.append(f"\nfsm-inprocess p95 / {other} p95 = {ratio:.3f} (goal <= {goal}: {verdict})")
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--modes", default=",".join(MODES), help="comma separated: " + ",".join(MODES))
    add("--duration", type=float, help="measured window per mode [s] (default 300; --quick: 60)")
    add("--fault-interval", type=float, help="one fault per this many s, the MTBF (default 20)")
    add("--fault-count", type=int, help="this many faults: the window is fault-count x fault-interval s")
    add("--all-faults", action="store_true", help="extend a mode's window until every fault was injected")
    add("--kinds", help=f"fault kinds, comma separated: {', '.join(KINDS)} or {', '.join(KIND_ALIASES)}")
    add("--seed", type=int, default=0)
    add("--state-mib", type=int, help="float32 state per rank [MiB] (default 64; --quick: 8)")
    add("--compute-s", type=float, default=0.2, help="compute time per step [s]")
    add("--calib-steps", type=int)
    add("--k", action="append", default=[], metavar="MODE=K", help="K for a mode instead of Young/Daly")
    add(
        "--hang-timeout",
        type=float,
        help="--hang-timeout of every fsm mode (default: max(5, 3 x max(T + C) of the fsm modes))",
    )
    add("--pg-timeout", type=float, help="gloo timeout, every mode (default: max(20, 3 x max(T + C)))")
    add("--inprocess-timeout", type=float, default=10.0, help="fsm-inprocess: --inprocess-timeout [s]")
    add("--persist-every", type=int, default=10, help="memory modes: persist every Nth checkpoint to disk")
    add("--no-preload", action="store_true", help="fsm-memory: the subprocess launcher")
    add("--torchrun-shared-store", action="store_true")
    add("--no-spare", action="store_true", help="no hot spare in any mode: a lost node's seat waits")
    add("--torchrun-spare", action="store_true", help="give torchrun a spare too (see the docstring)")
    add("--deadline", type=float, default=120.0, help="no step this long after a fault: failed to recover")
    add("--quick", action="store_true", help="60 s per mode, 3 faults, 8 MiB, 15 calibration steps")
    add("--netns", action="store_true", help="every host in a network namespace of its own (root, ip)")
    add("--agents", type=int, help=f"agents, the spare not counted (default {NODES}; --netns: {NETNS_NODES})")
    add("--markdown", type=Path)
    add("--json", type=Path)
    add("--keep", type=Path, help="keep the runs' logs in this folder")
    args = parser.parse_args(argv)
    defaults = (60.0, 20.0, 8, 15) if args.quick else (300.0, 20.0, 64, 30)
    for name, value in zip(("duration", "fault_interval", "state_mib", "calib_steps"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.fault_count:
        args.duration = args.fault_count * args.fault_interval
    if args.quick:
        args.deadline = min(args.deadline, 60.0)
    if args.agents is None:
        args.agents = NETNS_NODES if args.netns else NODES
    if args.agents < 2:
        parser.error("--agents: at least 2 (node 0 hosts the store and is never a fault's target)")
    spec = args.kinds or ",".join(QUICK_KINDS if args.quick else KINDS)
    args.kind_list = tuple(KIND_ALIASES.get(k.strip(), k.strip()) for k in spec.split(",") if k.strip())
    for kind in args.kind_list:
        if kind not in KINDS:
            parser.error(f"--kinds: {kind!r} is not one of {', '.join(KINDS)}")
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in args.mode_list:
        if m not in MODES:
            parser.error(f"--modes: {m!r} is not one of {', '.join(MODES)}")
    return args


def settings_for(args: argparse.Namespace, calibrations: dict[str, Calibration] | None = None) -> Settings:
    """The settings of every mode: with calibrations, the gloo timeout from the longest step of any
    mode (a checkpoint step, T + C) and the hang timeout from the longest of the fsm modes', each
    with a margin of 3 for the machine's load (the hang timeout at least 5 s: 3 s gave false hangs at load 15-20); the same for every mode."""
    cals = calibrations or {}
    longest = max((c.step_s + c.checkpoint_s for c in cals.values()), default=None)
    fsm_longest = max((c.step_s + c.checkpoint_s for m, c in cals.items() if m != "torchrun"), default=None)
    pg = args.pg_timeout or (max(20.0, round(3 * longest)) if longest else 60.0)
    hang = args.hang_timeout or (max(5.0, math.ceil(3 * fsm_longest)) if fsm_longest else 30.0)
    return Settings(
        args.state_mib, args.compute_s, pg, hang, args.persist_every, args.torchrun_shared_store,
        not args.no_preload, args.inprocess_timeout, args.agents, args.netns,
    )  # fmt: skip


def measure(args: argparse.Namespace, faults: list[Fault], base: Path) -> list[Result]:
    """Calibrate every mode first (the timeouts are common), then run each mode's window."""
    forced = dict(item.split("=", 1) for item in args.k)
    calibrations: dict[str, Calibration] = {}
    for mode in args.mode_list:
        log(f"{mode}: calibrating ({args.calib_steps} steps, a checkpoint every {CALIB_K}), load {loadavg()}")
        cal = calibrate(
            mode, base / f"{mode}-calibration", settings_for(args), args.calib_steps, max(args.deadline, 120)
        )
        calibrations[mode] = cal
        log(
            f"{mode}: step {cal.step_s:.3f} s, checkpoint cost {cal.checkpoint_s:.3f} s (median of {cal.checkpoints}) {cal.note}"
        )
    settings = settings_for(args, calibrations)
    log(f"gloo timeout {settings.pg_timeout_s:.0f} s, --hang-timeout {settings.hang_timeout_s:.0f} s (every mode)")
    results = []
    for mode in args.mode_list:
        cal = calibrations[mode]
        k = int(forced[mode]) if mode in forced else young_daly(cal.checkpoint_s, args.fault_interval, cal.step_s)
        log(f"{mode}: K = {k} ({'given' if mode in forced else 'Young/Daly'}), load {loadavg()}")
        spare = not args.no_spare and (mode != "torchrun" or args.torchrun_spare)
        result, job = run_mode(
            mode, base / mode, settings, k, cal, faults, args.duration, args.deadline, spare, args.all_faults
        )
        result.settings = settings  # type: ignore[attr-defined]
        result.shm_dirs = sorted(job.shm_dirs)  # type: ignore[attr-defined]
        result.namespaces = job.namespaces()  # type: ignore[attr-defined]
        results.append(result)
        log(
            f"{mode}: {result.useful_steps} useful steps, {len(result.faults)} faults, load {result.load_end}"
            + (f"; FAILED TO RECOVER: {result.failed_to_recover}" if result.failed_to_recover else "")
        )
    return results


def report(args: argparse.Namespace, faults: list[Fault], results: list[Result], started, step_s: float) -> str:
    ended = datetime.datetime.now(datetime.timezone.utc)
    settings = results[0].settings if results else settings_for(args)  # type: ignore[attr-defined]
    spare = "" if args.no_spare else " + 1 spare (fsm-agent" + (", torchrun" if args.torchrun_spare else "") + ")"
    lines = [
        f"Goodput run: {started:%Y-%m-%d %H:%M} UTC, {(ended - started).total_seconds() / 60:.1f} min; seed {args.seed}; "
        f"window {args.duration:.0f} s per mode{' (or until every fault was injected)' if args.all_faults else ''}, "
        f"one fault per {args.fault_interval:.0f} s ({len(faults)} scheduled: {', '.join(args.kind_list)}); "
        f"{settings.nodes} agents x {NPROC} workers{spare} "
        f"{'each in a network namespace of its own (veths on a bridge)' if settings.netns else 'on 127.0.0.1'}; state {args.state_mib} MiB/rank; compute {args.compute_s} s/step; "
        f"T (step time, median of the modes' calibrations) = {step_s:.3f} s; gloo timeout {settings.pg_timeout_s:.0f} s, "
        f"--hang-timeout {settings.hang_timeout_s:.0f} s, --inprocess-timeout {settings.inprocess_timeout_s:.0f} s; cpus {os.cpu_count()}.",
        "",
        *table(results, step_s),
        "",
        *mttr_by_kind(results),
        "",
    ]
    for r in results:
        c = r.calibration
        lines.append(
            f"- {r.mode}: calibration T = {c.step_s:.3f} s, checkpoint cost C = {c.checkpoint_s:.3f} s → K = {r.k} "
            f"(sqrt(2 C MTBF)/T = {math.sqrt(2 * c.checkpoint_s * args.fault_interval) / c.step_s:.1f}); load average {r.load_start} → {r.load_end}; "
            f"recovery phases (median): fault → new workers started {fmt(pct(r.phases.get('detect_to_start', []), 0.5))} s, "
            f"started → restored (import, process group, load) {fmt(pct(r.phases.get('start_to_restored', []), 0.5))} s, "
            f"restored → every rank's first step {fmt(pct(r.phases.get('restored_to_step', []), 0.5))} s"
        )
        by_kind: dict[str, list[float]] = {}
        for f in r.faults:
            if f.get("recovery_s") is not None:
                by_kind.setdefault(f["kind"], []).append(f["recovery_s"])
        lines.append(
            "  - recovery by kind [s]: "
            + "; ".join(f"{kind} {', '.join(f'{v:.1f}' for v in vals)}" for kind, vals in sorted(by_kind.items()))
        )
        sources = sorted({str(f.get("source")) for f in r.faults if f.get("recovery_s") is not None})
        lines.append(f"  - restored from: {', '.join(sources) or '-'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def interrupted(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")  # the same cleanup as Ctrl-C (the namespaces too)

    signal.signal(signal.SIGTERM, interrupted)
    faults = schedule(args.seed, args.duration, args.fault_interval, args.kind_list, args.agents * NPROC, args.agents)
    started = datetime.datetime.now(datetime.timezone.utc)
    log(
        f"load average {loadavg()}; schedule (seed {args.seed}): "
        + ", ".join(f"+{f.offset:.0f}s {f.kind}/{f.target}" for f in faults)
    )
    with tempfile.TemporaryDirectory(prefix="goodput-runs-") as scratch:
        base = args.keep or Path(scratch)
        base.mkdir(parents=True, exist_ok=True)
        unavailable: tuple[type[Exception], ...] = ()
        if args.netns:
            from _netns import NetnsUnavailable

            unavailable = (NetnsUnavailable,)
        try:
            results = measure(args, faults, base)
        except unavailable as exc:  # nothing of it is left: each job removed its namespaces
            log(f"--netns: {exc}")
            return 3
    calibrated = [r.calibration.step_s for r in results if r.calibration.checkpoints or r.calibration.ok]
    step_s = statistics.median(calibrated) if calibrated else args.compute_s
    for r in results:
        r.goodput = r.useful_steps * step_s / r.window_s if r.window_s else 0.0
    text = report(args, faults, results, started, step_s)
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n", encoding="utf-8")
    if args.json:
        data = {
            "step_s": step_s,
            "faults": [f.__dict__ for f in faults],
            "results": [
                {**r.__dict__, "calibration": r.calibration.__dict__, "settings": r.settings.__dict__}  # type: ignore[attr-defined]
                for r in results
            ],
        }
        args.json.write_text(json.dumps(data, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
