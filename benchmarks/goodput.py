"""Goodput under a replayed fault schedule (issue #34 part 1): torchrun against fsm-agent.

A job of 4 agents x 2 workers on 127.0.0.1 (dynamic rendezvous, ``--nnodes 4:4``, fsm-agent with one
hot spare, ``--max-restarts 1000``) runs ``workers/goodput_worker.py``: gloo all_reduce every step, a fixed
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

K per mode (Young/Daly): a calibration run of the same job (no faults, a checkpoint every 3 steps)
measures the step time T and the checkpoint's cost C (a checkpoint step's extra time, median); then
K = max(1, round(sqrt(2 C MTBF) / T)), MTBF = ``--fault-interval``.

Measured from the workers' step logs (``steps.<rank>.log``: step, wall time, pid): the window starts
at the first completed step and lasts ``--duration`` s. Useful steps = the highest step completed in
the window minus the highest at its start (a step repeated after a restore counts once); goodput =
useful steps x T / window, T the median of the modes' calibrated step times (the same for every
mode); time to recovery = the fault's injection → the first step completed by a worker started
after it; steps lost per fault = the newest step completed before the fault minus the step the job
resumed from. A fault is injected at its offset or, when the job is still recovering from the last
one, as soon as it has recovered (a slow launcher meets fewer faults: in its favour). After the
window the job runs on, without new faults, until the last fault's recovery is timed. A mode whose job ends, or makes no step for ``--deadline`` s after
a fault, has failed to recover: the rest of its window counts as lost.

    python benchmarks/goodput.py                       # 5 min per mode, a fault every 20 s
    python benchmarks/goodput.py --quick               # 60 s per mode, 3 faults, 8 MiB: a smoke run
    python benchmarks/goodput.py --modes fsm-memory --duration 120 --keep /tmp/goodput-logs

Every process a run starts is stopped by process group, then by pid (a private token in the
environment finds torchrun's workers and replacement agents); worker cgroups a killed agent left,
/dev/shm checkpoint directories of killed agents and temporary directories are removed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
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
MODES = ("torchrun", "fsm-disk", "fsm-memory")
#: --quick's three faults: a worker's death, a node's loss (the spare takes its seat), a preemption
QUICK_KINDS = ("worker_sigkill", "agent_sigkill", "node_sigterm")
NODES, NPROC = 4, 2
WORLD = NODES * NPROC
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


class GoodputJob(Job):
    """One mode's job: 4 agents x 2 workers of ``workers/goodput_worker.py``."""

    def __init__(self, mode: str, folder: Path, settings: Settings, k: int, max_steps: int):
        super().__init__(f"goodput-{mode}", folder, NODES, NPROC)
        self.mode, self.settings, self.k, self.max_steps = mode, settings, k, max_steps
        self.ckpt = folder / "ckpt"
        self.ckpt.mkdir(parents=True, exist_ok=True)
        (self.ckpt / "torch").mkdir(exist_ok=True)

    def command(self, slot: int) -> list[str]:
        s = self.settings
        common = [
            "--nnodes", f"{NODES}:{NODES}", "--nproc-per-node", str(NPROC),
            "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", self.run_id,
            "--max-restarts", "1000", "--local-addr", "127.0.0.1",
        ]  # fmt: skip
        script = [
            str(WORKER), str(self.out), "memory" if self.mode == "fsm-memory" else "disk", str(s.state_mib),
            str(s.compute_s), str(self.k), str(self.max_steps), str(s.pg_timeout_s),
        ]  # fmt: skip
        if self.mode == "torchrun":
            conf = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=5"
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
        if self.mode == "fsm-memory":
            cmd += ["--checkpoint-memory", f"{s.state_mib + 1}MiB", "--checkpoint-dir", str(self.ckpt / "agent")]
            if s.preload:
                cmd += ["--launcher", "preload"]
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
        return Calibration(settings.compute_s, 0.0, 0, False, "no steps")
    step_s = statistics.median(g for _, g in plain)
    costs = [g - step_s for s, g in after_ckpt if s > 2 * CALIB_K + 1] or [g - step_s for _, g in after_ckpt]
    cost = max(0.001, statistics.median(costs)) if costs else 0.001
    return Calibration(step_s, cost, len(costs), ok, "" if ok else "the calibration job did not end cleanly")


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
) -> tuple[Result, GoodputJob]:
    result = Result(mode, k, calibration, load_start=loadavg())
    job = GoodputJob(mode, folder, settings, k, 10**9)
    injected: list[InjectedFault] = []
    t0 = None
    try:
        job.start(spare=spare, deadline=deadline)
        start_end = time.monotonic() + deadline
        while t0 is None and time.monotonic() < start_end:
            steps = job.steps()
            if steps:
                t0 = steps[0][0]
                break
            if not job.any_agent_alive():
                break
            time.sleep(0.1)
        if t0 is None:
            result.failed_to_recover = "the job never made a step"
            return result, job
        log(f"{mode}: first step at +{t0 - job.agents[0].started:.1f} s after launch; window {duration:.0f} s")
        queue = list(faults)
        last_fault: InjectedFault | None = None
        next_shm_note = 0.0
        while True:
            now = time.time()
            if now >= t0 + duration and (last_fault is None or now >= t0 + duration + deadline):
                break
            job.tend()
            if mode == "fsm-memory" and now >= next_shm_note:
                job.note_shm()
                next_shm_note = now + 5
            steps = job.steps()
            last_step_t = steps[-1][0] if steps else t0
            starts = {r["pid"]: r["t"] for r in job.events() if r["kind"] == "start"}
            recovered = last_fault is None or any(
                t > last_fault.at and starts.get(pid, 0) > last_fault.at for t, _s, _r, pid in steps[-3 * WORLD :]
            )
            if not job.any_agent_alive():
                if now < t0 + duration:
                    result.failed_to_recover = f"every agent ended (at +{now - t0:.0f} s)"
                break
            if last_fault is not None and not recovered and now - max(last_fault.at, last_step_t) > deadline:
                if last_fault.at + deadline < t0 + duration:  # past the window's end it is only unmeasured
                    result.failed_to_recover = (
                        f"no step for {deadline:.0f} s after {last_fault.fault.kind} (at +{last_fault.at - t0:.0f} s)"
                    )
                break
            if now >= t0 + duration:
                if recovered:  # past the window, only to time the last fault's recovery
                    break
            elif queue and now >= t0 + queue[0].offset and recovered:
                done = job.inject(queue[0])
                if done is not None:
                    injected.append(done)
                    last_fault = done
                    log(f"  +{done.at - t0:6.1f} s {queue.pop(0).kind}: {done.detail}")
            time.sleep(0.05)
        t_end = time.time()
    finally:
        result.load_end = loadavg()
        job.close()
    analyse(result, job, injected, t0, t0 + duration, t_end)
    return result, job


def analyse(
    result: Result, job: GoodputJob, injected: list[InjectedFault], t0: float, t_window_end: float, t_stop: float
) -> None:
    steps = [s for s in job.steps() if s[0] <= t_stop]
    in_window = [s for s in steps if s[0] <= t_window_end]
    events = job.events()
    starts = {r["pid"]: r for r in events if r["kind"] == "start"}
    restored = {r["pid"]: r for r in events if r["kind"] == "restored"}
    result.window_s = t_window_end - t0
    result.start_step = max((s for t, s, _r, _p in steps if t <= t0), default=-1)
    result.end_step = max((s for _t, s, _r, _p in in_window), default=-1)
    result.useful_steps = max(0, result.end_step - result.start_step)
    result.group_starts = len({r["pid"] for r in starts.values() if r["rank"] == 0 and t0 < r["t"] <= t_window_end})
    phases: dict[str, list[float]] = {"detect_to_start": [], "start_to_restored": [], "restored_to_step": []}
    for i, inj in enumerate(injected):
        next_at = injected[i + 1].at if i + 1 < len(injected) else t_stop
        if inj.at > t_window_end:
            continue
        before = max((s for t, s, _r, _p in steps if t <= inj.at), default=-1)
        after = [(t, s, p) for t, s, _r, p in steps if t > inj.at and starts.get(p, {}).get("t", 0) > inj.at]
        entry = {"offset": round(inj.at - t0, 1), "kind": inj.fault.kind, "target": inj.detail}
        if after:
            t, s, pid = after[0]
            entry.update(recovery_s=round(t - inj.at, 2), steps_lost=max(0, before - (s - 1)), resumed_from=s - 1)
            entry["source"] = restored.get(pid, {}).get("source")
            # where the time went, seen from the rank that completed the first step again
            group = [r for r in starts.values() if r["t"] > inj.at and r["t"] < t]
            if group:
                first_start = min(r["t"] for r in group)
                ready = max((restored[r["pid"]]["t"] for r in group if r["pid"] in restored), default=None)
                phases["detect_to_start"].append(first_start - inj.at)
                if ready is not None:
                    phases["start_to_restored"].append(ready - first_start)
                    phases["restored_to_step"].append(t - ready)
            if t > next_at and i + 1 < len(injected):
                entry["note"] = "recovered after the next fault"
        else:
            entry["recovery_s"] = None
            entry["note"] = "not recovered"
        result.faults.append(entry)
    result.phases = phases
    result.goodput = None  # set by the caller once the modes' step time is known


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------


def table(results: list[Result], step_s: float) -> list[str]:
    lines = [
        "| mode | K | goodput | useful steps | MTTR p50 / p95 [s] | steps lost per fault (mean) | group (re)starts | faults recovered | failures to recover |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        recov = [f["recovery_s"] for f in r.faults if f.get("recovery_s") is not None]
        lost = [f["steps_lost"] for f in r.faults if "steps_lost" in f]
        failure = r.failed_to_recover or "0"
        lines.append(
            f"| {r.mode} | {r.k} | {fmt(r.goodput, '.3f')} | {r.useful_steps} | {fmt(pct(recov, 0.5))} / {fmt(pct(recov, 0.95))} | "
            f"{fmt(statistics.mean(lost) if lost else None, '.1f')} | {r.group_starts} | {len(recov)} of {len(r.faults)} | {failure} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default=",".join(MODES), help="comma separated: " + ",".join(MODES))
    parser.add_argument("--duration", type=float, help="measured window per mode [s] (default 300; --quick: 60)")
    parser.add_argument(
        "--fault-interval", type=float, help="one fault per this many s, the MTBF (default 20; --quick: 25)"
    )
    parser.add_argument(
        "--kinds", help=f"the fault kinds drawn from, comma separated (default: all; --quick: {','.join(QUICK_KINDS)})"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--state-mib", type=int, help="float32 state per rank [MiB]")
    parser.add_argument("--compute-s", type=float, default=0.2, help="compute time per step [s]")
    parser.add_argument("--calib-steps", type=int)
    parser.add_argument("--k", action="append", default=[], metavar="MODE=K", help="K for a mode instead of Young/Daly")
    parser.add_argument("--hang-timeout", type=float, help="fsm-agent's --hang-timeout (default: max(5, 3 x (T + C)))")
    parser.add_argument("--pg-timeout", type=float, help="gloo timeout, every mode (default: max(20, 3 x (T + C)))")
    parser.add_argument(
        "--persist-every", type=int, default=10, help="fsm-memory: persist every Nth checkpoint to disk"
    )
    parser.add_argument("--no-preload", action="store_true", help="fsm-memory: the subprocess launcher")
    parser.add_argument("--torchrun-shared-store", action="store_true")
    parser.add_argument(
        "--no-spare",
        action="store_true",
        help="no hot spare in any mode: a lost node's seat waits for its replacement agent",
    )
    parser.add_argument(
        "--torchrun-spare",
        action="store_true",
        help="give torchrun a spare too (off by default: c10d's spare makes every restart a re-rendezvous livelock, see the docstring)",
    )
    parser.add_argument(
        "--deadline", type=float, default=120.0, help="no step this long after a fault: failed to recover"
    )
    parser.add_argument("--quick", action="store_true", help="60 s per mode, 3 faults, 8 MiB, 15 calibration steps")
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--keep", type=Path, help="keep the runs' logs in this folder")
    args = parser.parse_args(argv)
    defaults = (60.0, 20.0, 8, 15) if args.quick else (300.0, 20.0, 64, 30)
    for name, value in zip(("duration", "fault_interval", "state_mib", "calib_steps"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.quick:
        args.deadline = min(args.deadline, 60.0)
    kinds = tuple(
        k.strip() for k in (args.kinds or ",".join(QUICK_KINDS if args.quick else KINDS)).split(",") if k.strip()
    )
    for kind in kinds:
        if kind not in KINDS:
            parser.error(f"--kinds: {kind!r} is not one of {', '.join(KINDS)}")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            parser.error(f"--modes: {m!r} is not one of {', '.join(MODES)}")
    forced = dict(item.split("=", 1) for item in args.k)
    faults = schedule(args.seed, args.duration, args.fault_interval, kinds, WORLD, NODES)
    started = datetime.datetime.now(datetime.timezone.utc)
    log(
        f"load average {loadavg()}; schedule (seed {args.seed}): "
        + ", ".join(f"+{f.offset:.0f}s {f.kind}/{f.target}" for f in faults)
    )

    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="goodput-runs-") as scratch:
        base = args.keep or Path(scratch)
        base.mkdir(parents=True, exist_ok=True)
        for mode in modes:
            base_settings = Settings(
                args.state_mib,
                args.compute_s,
                args.pg_timeout or 60.0,
                args.hang_timeout or 30.0,
                args.persist_every,
                args.torchrun_shared_store,
                not args.no_preload,
            )
            log(f"{mode}: calibrating ({args.calib_steps} steps, a checkpoint every {CALIB_K}), load {loadavg()}")
            cal = calibrate(
                mode, base / f"{mode}-calibration", base_settings, args.calib_steps, max(args.deadline, 120)
            )
            k = int(forced[mode]) if mode in forced else young_daly(cal.checkpoint_s, args.fault_interval, cal.step_s)
            longest = cal.step_s + cal.checkpoint_s
            settings = Settings(
                args.state_mib, args.compute_s, args.pg_timeout or max(20.0, round(3 * longest)),
                args.hang_timeout or max(5.0, round(3 * longest)), args.persist_every, args.torchrun_shared_store, not args.no_preload,
            )  # fmt: skip
            log(
                f"{mode}: step {cal.step_s:.3f} s, checkpoint cost {cal.checkpoint_s:.3f} s (median of {cal.checkpoints}){' ' + cal.note if cal.note else ''}; "
                f"K = {k} ({'given' if mode in forced else 'Young/Daly'}); gloo timeout {settings.pg_timeout_s:.0f} s"
                + ("" if mode == "torchrun" else f", --hang-timeout {settings.hang_timeout_s:.0f} s")
            )
            result, _job = run_mode(
                mode,
                base / mode,
                settings,
                k,
                cal,
                faults,
                args.duration,
                args.deadline,
                spare=not args.no_spare and (mode != "torchrun" or args.torchrun_spare),
            )
            result.settings = settings  # type: ignore[attr-defined]
            result.shm_dirs = sorted(_job.shm_dirs)  # type: ignore[attr-defined]
            results.append(result)
            log(
                f"{mode}: {result.useful_steps} useful steps, {len(result.faults)} faults, load {result.load_end}"
                + (f"; FAILED TO RECOVER: {result.failed_to_recover}" if result.failed_to_recover else "")
            )

    calibrated = [r.calibration.step_s for r in results if r.calibration.checkpoints or r.calibration.ok]
    step_s = statistics.median(calibrated) if calibrated else args.compute_s
    for r in results:
        r.goodput = r.useful_steps * step_s / r.window_s if r.window_s else 0.0
    ended = datetime.datetime.now(datetime.timezone.utc)
    lines = [
        f"Goodput run: {started:%Y-%m-%d %H:%M} UTC, {(ended - started).total_seconds() / 60:.1f} min; seed {args.seed}; "
        f"window {args.duration:.0f} s per mode, one fault per {args.fault_interval:.0f} s ({len(faults)} scheduled); "
        f"{NODES} agents x {NPROC} workers{'' if args.no_spare else ' + 1 spare (fsm-agent' + (', torchrun' if args.torchrun_spare else '') + ')'} on 127.0.0.1; state {args.state_mib} MiB/rank; compute {args.compute_s} s/step; "
        f"T (step time, median of the modes' calibrations) = {step_s:.3f} s; cpus {os.cpu_count()}.",
        "",
        *table(results, step_s),
        "",
    ]
    for r in results:
        c = r.calibration
        recov = [f for f in r.faults if f.get("recovery_s") is not None]
        lines.append(
            f"- {r.mode}: calibration T = {c.step_s:.3f} s, checkpoint cost C = {c.checkpoint_s:.3f} s → K = {r.k} "
            f"(sqrt(2 C MTBF)/T = {math.sqrt(2 * c.checkpoint_s * args.fault_interval) / c.step_s:.1f}); load average {r.load_start} → {r.load_end}; "
            f"recovery phases (median): fault → new workers started {fmt(pct(r.phases.get('detect_to_start', []), 0.5))} s, "
            f"started → restored (import, process group, load) {fmt(pct(r.phases.get('start_to_restored', []), 0.5))} s, "
            f"restored → first step {fmt(pct(r.phases.get('restored_to_step', []), 0.5))} s"
        )
        by_kind: dict[str, list[float]] = {}
        for f in recov:
            by_kind.setdefault(f["kind"], []).append(f["recovery_s"])
        lines.append(
            "  - recovery by kind [s]: "
            + "; ".join(f"{kind} {', '.join(f'{v:.1f}' for v in vals)}" for kind, vals in sorted(by_kind.items()))
        )
        sources = sorted({str(f.get("source")) for f in recov})
        lines.append(f"  - restored from: {', '.join(sources) or '-'}")
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n", encoding="utf-8")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "step_s": step_s,
                    "faults": [f.__dict__ for f in faults],
                    "results": [
                        {
                            **r.__dict__,
                            "calibration": r.calibration.__dict__,
                            "settings": getattr(r, "settings", None).__dict__,
                        }
                        for r in results
                    ],
                },
                indent=1,
                default=str,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
