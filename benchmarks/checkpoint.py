"""Checkpoints held by the agent in memory (issue #32): save, restore, replication, memory.

Not a torchrun comparison (torchrun holds no checkpoint): ``fsm_agent.checkpoint`` against what a
job would do without it, side by side in one run of ``fsm-agent run --standalone --nproc-per-node 2
--max-restarts 1 --checkpoint-memory CAP workers/checkpoint_worker.py`` with ``--size-gib`` of
float32 state per worker (16 tensors):

(a) blocking time of ``fsm_agent.checkpoint.save`` against ``torch.save`` + ``fsync`` of the file
    and ``torch.distributed.checkpoint.save`` (``FileSystemWriter``, which fsyncs) into ``--dir``
    (default: a temporary directory under ``$TMPDIR`` or /tmp), rounds interleaved (the order
    rotates per round, a barrier before each call); the first two rounds are reported apart (a
    slot pair is two files: the first save into each maps fresh pages), the median is of the rest.
(b) restore after a SIGKILL: attempt 0's rank 1 SIGKILLs itself after the saves; attempt 1 times
    ``load(into=preallocated state)``, and the agent's staging for it (the ``checkpoint_restore``
    event: per rank, and the whole round, which attempt 1's workers wait for), against
    ``torch.load`` of the file (a) wrote (page cache warm), with ``copy_`` into the preallocated
    state, with ``mmap=True`` + ``copy_``, and ``dcp.load`` into it.
(c) replication to a peer: ``peers.send_replica`` of a ``--size-gib`` slot from one network
    namespace to a ``peers.ReplicaServer`` in another, veths on a bridge (``_netns.py``, the
    multi-host tests' topology: 10.231.x.0/24; every link at MTU 1500, then 9000), and over the
    sender namespace's loopback; needs root and ``ip``. The namespaces, the helper processes and
    their /dev/shm files are removed at the end, whatever happens.
(d) memory: ``du`` of the agent's ``/dev/shm/fsm-agent-ckpt-*`` directory while the job runs (one
    node, so no replicas), against 2 slots x workers x (CAP + 4 KiB) (+ as much again for a peer's
    replicas with ``--checkpoint-replicas 1`` on several nodes), and the workers' RSS growth.

Each timed value is the slower rank's (a synchronous job waits for it).

    python benchmarks/checkpoint.py                      # 1 GiB per worker, 5 measured rounds
    python benchmarks/checkpoint.py --quick              # 64 MiB, 1 measured round: a smoke run
    python benchmarks/checkpoint.py --size-gib 4 --dir /data/tmp --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from _netns import Hosts

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORKER = HERE / "workers" / "checkpoint_worker.py"
GIB = 1 << 30
MIB = 1 << 20
HEADER_AREA = 4096  # fsm_agent.checkpoint.slots.HEADER_AREA
SAVE_METHODS = {
    "fsm_save": "fsm_agent.checkpoint.save",
    "torch_save": "torch.save + fsync",
    "dcp_save": "dcp.save (FileSystemWriter, fsync)",
}
LOAD_METHODS = {
    "fsm_load": "fsm_agent.checkpoint.load(into=prealloc)",
    "torch_load": "torch.load (page cache warm)",
    "torch_load_copy": "torch.load + copy_ into prealloc",
    "torch_load_mmap_copy": "torch.load(mmap=True) + copy_",
    "dcp_load": "dcp.load into prealloc (page cache warm)",
}


def log(message: str) -> None:
    print(f"[checkpoint bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def spread(values: list[float], fmt: str = "{:.3f}") -> str:
    if not values:
        return "-"
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def fnum(value: float | None, fmt: str = "{:.3f}") -> str:
    return "-" if value is None else fmt.format(value)


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


# ------------------------------------------------------------------------------------------------
# Machine and cleanup helpers
# ------------------------------------------------------------------------------------------------


def machine(files_dir: str) -> dict[str, str]:
    info = {"cores": str(os.cpu_count()), "python": platform.python_version(), "os": platform.platform()}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["memory"] = f"{int(line.split()[1]) / 2**20:.1f} GiB"
        st = os.statvfs("/dev/shm")
        info["dev_shm"] = f"{st.f_blocks * st.f_frsize / GIB:.1f} GiB, {st.f_bavail * st.f_frsize / GIB:.1f} GiB free"
        info["load_average_start"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        df = subprocess.run(
            ["df", "--output=source,fstype", files_dir], capture_output=True, text=True, timeout=30
        ).stdout.split()
        info["files_on"] = f"{df[-2]} ({df[-1]})"
    from importlib import metadata

    for dist in ("torch", "fsm-agent"):
        try:
            info[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            info[dist] = "?"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        git = ["git", "-C", str(REPO), "describe", "--always", "--dirty"]
        info["fsm-agent"] += f" (git {subprocess.run(git, capture_output=True, text=True, timeout=30).stdout.strip()})"
    return info


def kill_group(proc: subprocess.Popen, term_wait: float = 0.0) -> None:
    """End ``proc``'s process group (it was started in a session of its own): SIGTERM first when
    ``term_wait`` > 0, then SIGKILL; reap it."""
    if proc.poll() is None and term_wait > 0:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(term_wait)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(30)


def kill_marked(token: str) -> list[int]:
    """SIGKILL every process whose environment carries ``FSMBENCH_TOKEN=token``; their pids."""
    marker = f"FSMBENCH_TOKEN={token}".encode()
    killed = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if marker in environ.split(b"\0"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry), signal.SIGKILL)
                killed.append(int(entry))
    return killed


def read_jsonl(path: Path) -> list[dict]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            out.append(json.loads(line))
    return out


def proc_status(pid: int) -> dict[str, int]:
    found = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            name, _, value = line.partition(":")
            if name in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                found[name] = int(value.split()[0]) * 1024
    return found


def du_bytes(path: str) -> dict[str, int]:
    """``du -sB1`` (allocated) and ``du -sb`` (apparent) of ``path``."""
    out = {}
    for key, flags in (("allocated", ["-sB1"]), ("apparent", ["-sb"])):
        result = subprocess.run(["du", *flags, path], capture_output=True, text=True, timeout=60)
        out[key] = int(result.stdout.split()[0]) if result.returncode == 0 and result.stdout else -1
    return out


def checksums_recorded(slots_dir: str) -> dict[str, bool | None]:
    """Per local slot pair: whether the agent has recorded the checksum of its newest checkpoint
    (None: no complete checkpoint). Only headers are read."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from fsm_agent.checkpoint.slots import SlotPair

    found: dict[str, bool | None] = {}
    for name in sorted(os.listdir(slots_dir)):
        if name.startswith("local-") and name.endswith("-a"):
            pair = SlotPair.open(os.path.join(slots_dir, name[:-2]))
            try:
                newest = pair.newest()
                found[name[:-2]] = None if newest is None else newest[1].has_checksum
            finally:
                pair.close()
    return found


# ------------------------------------------------------------------------------------------------
# (a), (b), (d): the job
# ------------------------------------------------------------------------------------------------


def run_job(size: int, tensors: int, rounds: int, files_parent: str, timeout: float, keep: bool) -> dict:
    """One fsm-agent run of the worker; every record it produced, and the measurements in between."""
    capacity = size + MIB  # the payload's meta and alignment take a few KiB
    token = uuid.uuid4().hex
    tmp = Path(tempfile.mkdtemp(prefix="fsm_bench_ckpt_", dir=files_parent))
    out, files = tmp / "out", tmp / "files"
    out.mkdir()
    files.mkdir()
    events = tmp / "agent-events.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "fsm_agent",
        "run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--checkpoint-memory",
        str(capacity),
        "--events-file",
        str(events),
        str(WORKER),
        str(out),
        str(size),
        str(tensors),
        str(rounds),
        str(files),
        "1",
    ]
    env = {
        **os.environ,
        "FSMBENCH_TOKEN": token,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    result: dict = {"command": shlex.join(["fsm-agent", *cmd[3:]]), "capacity": capacity, "tmp": str(tmp)}
    agent_log = open(tmp / "agent.log", "wb")  # noqa: SIM115 (closed in finally)
    slots_dir = None
    log(f"job: {result['command']}")
    proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=agent_log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout

        def wait_for(what: str, done) -> list[dict]:
            while True:
                records = read_jsonl(out / "records.jsonl")
                if done(records):
                    return records
                if proc.poll() is not None:
                    raise RuntimeError(f"the agent exited {proc.returncode} before {what}; see {tmp / 'agent.log'}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no {what} within {timeout:.0f} s; see {tmp / 'agent.log'}")
                time.sleep(0.1)

        records = wait_for("both ranks saved", lambda rs: sum(r["kind"] == "saved" for r in rs) == 2)
        saved = [r for r in records if r["kind"] == "saved"]
        slots_dir = saved[0]["slots_dir"]
        if not slots_dir.startswith("/dev/shm/fsm-agent-ckpt-"):
            raise RuntimeError(f"unexpected slot directory {slots_dir!r}")
        result["shm"] = {
            "dir": slots_dir,
            "du": du_bytes(slots_dir),
            "files": sorted(os.listdir(slots_dir)),
            "agent_rss": proc_status(proc.pid),
            "checksum_recorded": checksums_recorded(slots_dir),
        }
        log(f"job: saves done; /dev/shm {result['shm']['du']}; killing rank 1")
        (out / "go").touch()
        wait_for("attempt 1's loads", lambda rs: sum(r["kind"] == "done" for r in rs) == 2)
        try:
            rc = proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the agent did not exit after the workers finished; see {tmp / 'agent.log'}") from None
        if rc != 0:
            raise RuntimeError(f"the agent exited {rc}; see {tmp / 'agent.log'}")
        result["shm"]["removed_at_exit"] = not os.path.exists(slots_dir)
        result["records"] = read_jsonl(out / "records.jsonl")
        result["agent_events"] = [e for e in read_jsonl(events) if str(e.get("kind", "")).startswith("checkpoint")]
        return result
    finally:
        kill_group(proc, term_wait=30)
        agent_log.close()
        left = kill_marked(token)
        if left:
            log(f"job: killed processes left behind: {left}")
        if slots_dir and slots_dir.startswith("/dev/shm/fsm-agent-ckpt-") and os.path.exists(slots_dir):
            log(f"job: the agent left {slots_dir}: removed")
            result.setdefault("shm", {})["removed_at_exit"] = False
            shutil.rmtree(slots_dir, ignore_errors=True)
        if keep:
            log(f"job: kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def summarize_job(job: dict, size: int, workers: int = 2) -> dict:
    records = job["records"]

    def per_round(phase: str, method: str) -> list[float]:
        by_round: dict[int, list[float]] = {}
        for r in records:
            if r["kind"] == "time" and r["phase"] == phase and r["method"] == method:
                by_round.setdefault(r["round"], []).append(r["seconds"])
        return [max(v) for _, v in sorted(by_round.items())]

    def per_rank_first(method: str) -> dict[int, float]:
        return {
            r["rank"]: r["seconds"]
            for r in records
            if r["kind"] == "time" and r["phase"] == "load" and r["method"] == method and r["round"] == 0
        }

    save = {}
    for method in SAVE_METHODS:
        values = per_round("save", method)
        save[method] = {"rounds": values, "first": values[0], "second": values[1], "measured": values[2:]}
    load = {}
    for method in LOAD_METHODS:
        values = per_round("load", method)
        load[method] = {"rounds": values, "first": values[0], "measured": values[1:]}
    restores = [e for e in job["agent_events"] if e.get("kind") == "checkpoint_restore"]
    staged = next((e for e in restores if e.get("step") is not None), None)
    staging = {}
    if staged is not None:
        staging = {
            "step": staged["step"],
            "round_seconds": staged["seconds"],
            "ranks": {
                e["global_rank"]: {"source": e.get("source"), "seconds": e.get("seconds")} for e in staged["ranks"]
            },
            "at_start_round_seconds": next((e["seconds"] for e in restores if e.get("step") is None), None),
        }
    fsm_first = per_rank_first("fsm_load")
    with_rank_staging = None
    if staging and fsm_first:
        with_rank_staging = max(fsm_first[r] + (staging["ranks"].get(r, {}).get("seconds") or 0.0) for r in fsm_first)
    killing = next((r["t"] for r in records if r["kind"] == "killing"), None)
    restarted = [r["t"] for r in records if r["kind"] == "started" and r["attempt"] == 1]
    saved = {r["rank"]: r for r in records if r["kind"] == "saved"}
    done = {r["rank"]: r for r in records if r["kind"] == "done"}
    sources = sorted({r["source"] for r in records if r["kind"] == "restored"})

    def growth(rss: list[dict], key: str) -> int:
        return rss[2].get(key, 0) - rss[1].get(key, 0)

    capacity = job["capacity"]
    formula = 2 * (capacity + HEADER_AREA) * workers
    return {
        "save": save,
        "load": load,
        "staging": staging,
        "restore_sources": sources,
        "fsm_load_first_plus_rank_staging": with_rank_staging,
        "fsm_load_first_plus_round_staging": (load["fsm_load"]["first"] + staging["round_seconds"])
        if staging
        else None,
        "kill_to_attempt1_started": (min(restarted) - killing) if killing and restarted else None,
        "memory": {
            "shm_du": job["shm"]["du"],
            "shm_files": job["shm"]["files"],
            "shm_removed_at_exit": job["shm"].get("removed_at_exit"),
            "checksum_recorded_before_kill": job["shm"].get("checksum_recorded"),
            "formula_bytes": formula,
            "formula_with_replicas_bytes": 2 * formula,
            "agent_rss": job["shm"]["agent_rss"],
            "worker_state_rss": {
                r: s["rss"][1].get("RssAnon", 0) - s["rss"][0].get("RssAnon", 0) for r, s in saved.items()
            },
            "worker_growth_by_saves": {
                r: {k: growth(s["rss"], k) for k in ("RssAnon", "RssShmem")} for r, s in saved.items()
            },
            "worker_growth_by_loads": {
                r: {k: growth(s["rss"], k) for k in ("RssAnon", "RssShmem")} for r, s in done.items()
            },
        },
    }


# ------------------------------------------------------------------------------------------------
# (c): replication between network namespaces (helpers run inside them)
# ------------------------------------------------------------------------------------------------


def helper_serve(shm_dir: str, capacity: int, token: str, host: str) -> None:
    """``_serve``: a ReplicaServer on ``host``; prints its port, serves until stdin closes."""
    from fsm_agent.checkpoint import peers

    os.makedirs(shm_dir, exist_ok=True)
    server = peers.ReplicaServer(shm_dir, capacity, token, host=host)
    server.start()
    print(server.port, flush=True)
    sys.stdin.read()
    server.close()


def helper_send(shm_dir: str, size: int, token: str) -> None:
    """``_send``: make one complete slot of ``size`` bytes; then for each ``HOST PORT`` line on
    stdin, ``send_replica`` it there and print the result as one JSON line."""
    from fsm_agent.checkpoint import peers
    from fsm_agent.checkpoint.slots import Slot

    os.makedirs(shm_dir, exist_ok=True)
    slot = Slot.create(os.path.join(shm_dir, "source"), size, reserve=True)
    slot.begin(1, 0, 0, 1)
    block = bytes(range(256)) * (16 * MIB // 256)
    for start in range(0, size, len(block)):
        end = min(start + len(block), size)
        slot.payload[start:end] = block[: end - start]
    slot.commit(size)
    print("ready", flush=True)
    for line in sys.stdin:
        host, port = line.split()
        try:
            sent = peers.send_replica((host, int(port)), token, slot, timeout=120)
        except peers.PeerError as exc:
            print(json.dumps({"error": str(exc)}), flush=True)
            continue
        if sent is None:
            print(json.dumps({"error": "nothing consistent to send"}), flush=True)
        else:
            print(
                json.dumps({"bytes": sent.bytes, "seconds": sent.seconds, "reply": sent.reply, "reason": sent.reason}),
                flush=True,
            )
    slot.close()


def run_replication(size: int, rounds: int, mtus: list[int]) -> dict:
    """send_replica throughput between two network namespaces (two hosts on one bridge,
    ``_netns.py``), per MTU of every link, and over the sender namespace's loopback."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return {"skipped": "needs root and iproute2's ip (network namespaces)"}
    from _netns import NetnsUnavailable, hosts

    token = uuid.uuid4().hex
    shm = tempfile.mkdtemp(prefix=f"fsm-bench-ckpt-{os.getpid()}-", dir="/dev/shm")
    try:
        with hosts(2) as net:
            return replicate(net, shm, token, size, rounds, mtus)
    except NetnsUnavailable as exc:
        return {"skipped": str(exc)}
    finally:  # the namespaces are gone by now, with every process left in them
        shutil.rmtree(shm, ignore_errors=True)
        kill_marked(token)


def replicate(net: Hosts, shm: str, token: str, size: int, rounds: int, mtus: list[int]) -> dict:
    """``run_replication`` in the hosts ``net``: a ReplicaServer per path in host 0 and one on host
    1's loopback, the sender in host 1; its helpers are stopped (by process group) when it returns."""
    (ns_a, ns_b), (addr_a, addr_b) = net.names, net.addrs
    env = {
        **os.environ,
        "FSMBENCH_TOKEN": token,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    procs: list[subprocess.Popen] = []
    result: dict = {"network": f"{addr_a}/24 ({ns_a}) <-> {addr_b}/24 ({ns_b}), veths on a bridge", "samples": {}}

    def start(host: int, *args: str) -> subprocess.Popen:
        proc = subprocess.Popen(
            net.inside(host, [sys.executable, str(Path(__file__).resolve()), *args]),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
            start_new_session=True,
        )
        procs.append(proc)
        return proc

    try:
        capacity = size
        # one server per path, so each path's first two transfers fill fresh replica slots (a, b)
        servers = [start(0, "_serve", os.path.join(shm, f"peer-{m}"), str(capacity), token, addr_a) for m in mtus]
        local = start(1, "_serve", os.path.join(shm, "loopback"), str(capacity), token, "127.0.0.1")
        sender = start(1, "_send", os.path.join(shm, "sender"), str(size), token)
        ports = [int(proc.stdout.readline()) for proc in (*servers, local)]
        if sender.stdout.readline().strip() != "ready":
            raise RuntimeError("the sender helper did not start")
        targets = [(f"veths + bridge, MTU {m}", m, addr_a, port) for m, port in zip(mtus, ports)]
        targets.append(("loopback (same namespace)", None, "127.0.0.1", ports[-1]))
        log(f"replication: {len(targets)} paths x {rounds} rounds of {size / MIB:.0f} MiB")
        for rnd in range(rounds):
            k = rnd % len(targets)
            for label, mtu, host, port in targets[k:] + targets[:k]:
                if mtu is not None:
                    net.set_mtu(mtu)
                sender.stdin.write(f"{host} {port}\n")
                sender.stdin.flush()
                reply = json.loads(sender.stdout.readline())
                if "error" in reply or reply.get("reply") != "ok":
                    raise RuntimeError(f"replication over {label}: {reply}")
                result["samples"].setdefault(label, []).append(reply)
        return result
    finally:
        for proc in procs:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(15)
            kill_group(proc)
            if proc.stdout is not None:
                proc.stdout.close()


def summarize_replication(rep: dict) -> dict:
    if "skipped" in rep:
        return rep
    rows = {}
    for label, samples in rep["samples"].items():
        rates = [s["bytes"] / s["seconds"] / 1e6 for s in samples]
        rows[label] = {
            "mb_s": rates,
            "first": rates[0],
            "second": rates[1] if len(rates) > 1 else None,
            "measured": rates[2:],
        }
    return {"network": rep["network"], "paths": rows}


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------


def render(info: dict, args: argparse.Namespace, size: int, rounds: int, job: dict | None, rep: dict | None) -> str:
    gb = size / 1e9
    lines = [
        "# fsm-agent checkpoints in memory (issue #32)",
        "",
        f"- command: `{info['command']}`",
        f"- date: {info['date']}",
        f"- machine: {info['machine'].get('cores')} cores, {info['machine'].get('cpu', '?')}, "
        f"{info['machine'].get('memory', '?')} RAM, /dev/shm {info['machine'].get('dev_shm', '?')}; "
        f"{info['machine'].get('os')}; torch {info['machine'].get('torch')}; fsm-agent {info['machine'].get('fsm-agent')}",
        f"- load average: {info['machine'].get('load_average_start', '?')} at start, {info.get('load_average_end', '?')} at end",
        f"- state: {size / GIB:.3f} GiB float32 per worker ({args.tensors} tensors), 2 workers; "
        f"rounds: 2 reported apart + {rounds - 2} measured, interleaved; each value is the slower rank's",
    ]
    if job is not None:
        lines += [
            f"- job: `{job['command']}` (files: {info['machine'].get('files_on', '?')})",
            "",
            "## (a) blocking save, seconds",
            "",
            f"| method | 1st | 2nd | median [min-max] of {rounds - 2} | GB/s (median) |",
            "|---|---|---|---|---|",
        ]
        s = job["summary"]["save"]
        for method, label in SAVE_METHODS.items():
            m = median(s[method]["measured"])
            lines.append(
                f"| {label} | {s[method]['first']:.3f} | {s[method]['second']:.3f} | {spread(s[method]['measured'])} "
                f"| {fnum(ratio(gb, m), '{:.2f}')} |"
            )
        fsm = median(s["fsm_save"]["measured"])
        r_torch = ratio(fsm, median(s["torch_save"]["measured"]))
        r_dcp = ratio(fsm, median(s["dcp_save"]["measured"]))
        lines += [
            "",
            f"save / torch.save+fsync: **{fnum(r_torch)}**, save / dcp.save: **{fnum(r_dcp)}** (goal <= 0.05; medians)",
            "",
            "## (b) restore after a worker's SIGKILL, seconds",
            "",
            f"| method | first (fresh process) | median [min-max] of {rounds - 1} more |",
            "|---|---|---|",
        ]
        ld = job["summary"]["load"]
        st = job["summary"]["staging"]
        for method, label in LOAD_METHODS.items():
            lines.append(f"| {label} | {ld[method]['first']:.3f} | {spread(ld[method]['measured'])} |")
        if st:
            per_rank = ", ".join(
                f"rank {r}: {v['seconds']:.3f} ({v['source']})" for r, v in sorted(st["ranks"].items())
            )
            lines += [
                f"| agent staging per rank (`checkpoint_restore` ranks[].seconds: checksum of the slot) | {per_rank} | |",
                f"| agent's restore round (`checkpoint_restore` seconds: exchange + both ranks' staging, "
                f"before attempt 1 starts) | {st['round_seconds']:.3f} | |",
                f"| load + this rank's staging (slower rank) | {fnum(job['summary']['fsm_load_first_plus_rank_staging'])} | |",
                f"| load + the whole restore round | {fnum(job['summary']['fsm_load_first_plus_round_staging'])} | |",
            ]
        first = ld["fsm_load"]["first"]
        rows = []
        for base in ("torch_load", "torch_load_copy"):
            b_first, b_med = ld[base]["first"], median(ld[base]["measured"])
            rows.append(
                f"| {LOAD_METHODS[base]} | {fnum(ratio(first, b_first))} | {fnum(ratio(median(ld['fsm_load']['measured']), b_med))} "
                f"| {fnum(ratio(job['summary']['fsm_load_first_plus_rank_staging'], b_first))} "
                f"| {fnum(ratio(job['summary']['fsm_load_first_plus_round_staging'], b_first))} |"
            )
        lines += [
            "",
            "Ratios (goal <= 0.1): fsm load / baseline",
            "",
            "| baseline | first loads | medians | first + this rank's staging | first + whole restore round |",
            "|---|---|---|---|---|",
            *rows,
            "",
            f"Restored from: {', '.join(job['summary']['restore_sources']) or '?'}; step {st.get('step')}. "
            f"Kill -> attempt 1's workers started: {fnum(job['summary']['kill_to_attempt1_started'])} s. "
            f"The agent's round at the first start (nothing to restore): {fnum(st.get('at_start_round_seconds'), '{:.4f}')} s. "
            f"Checksum of the newest checkpoint recorded by the agent before the kill (what staging compares with): "
            + ", ".join(
                f"{pair}: {'no checkpoint' if v is None else ('yes' if v else 'no')}"
                for pair, v in (job["summary"]["memory"]["checksum_recorded_before_kill"] or {}).items()
            )
            + ". "
            "The torch.save/dcp files were written in attempt 0 and are still in the page cache (warm).",
            "",
            "## (d) memory per node (one node: no replicas)",
            "",
        ]
        mem = job["summary"]["memory"]
        lines += [
            "| du of the agent's /dev/shm dir (allocated) | apparent | formula 2 slots x 2 workers x (capacity + 4 KiB) "
            "| with a peer's replicas (x 2) |",
            "|---|---|---|---|",
            f"| {mem['shm_du']['allocated'] / GIB:.3f} GiB | {mem['shm_du']['apparent'] / GIB:.3f} GiB "
            f"| {mem['formula_bytes'] / GIB:.3f} GiB | {mem['formula_with_replicas_bytes'] / GIB:.3f} GiB |",
            "",
            f"Capacity (`--checkpoint-memory`) {job['capacity']} bytes = state + 1 MiB. Files: {', '.join(mem['shm_files'])}; "
            f"removed when the agent exited: {mem['shm_removed_at_exit']}. Agent RSS {mem['agent_rss'].get('VmRSS', 0) / MIB:.0f} MiB "
            f"(RssShmem {mem['agent_rss'].get('RssShmem', 0) / MIB:.0f} MiB).",
        ]
        for r in sorted(mem["worker_growth_by_saves"]):
            g = mem["worker_growth_by_saves"][r]
            lines.append(
                f"Worker rank {r}: state {mem['worker_state_rss'][r] / MIB:.0f} MiB anonymous; growth over the saves (all three kinds): "
                f"RssAnon {g['RssAnon'] / MIB:+.0f} MiB, RssShmem {g['RssShmem'] / MIB:+.0f} MiB (the slots' pages it mapped: the /dev/shm above, not extra)."
            )
    if rep is not None:
        lines += ["", "## (c) replication to a peer (`peers.send_replica` -> `ReplicaServer`), MB/s", ""]
        if "skipped" in rep:
            lines.append(f"skipped: {rep['skipped']}")
        else:
            lines += [
                f"{size / MIB:.0f} MiB slot; {rep['network']}; sender and receiver on the same {info['machine'].get('cores')} cores "
                "(both compute the CRC-32 checksum while streaming).",
                "",
                f"| path | 1st (receiver's slot a, fresh pages) | 2nd (slot b) | median [min-max] of {rounds - 2} |",
                "|---|---|---|---|",
            ]
            for label, row in rep["paths"].items():
                lines.append(
                    f"| {label} | {row['first']:.0f} | {fnum(row['second'], '{:.0f}')} | {spread(row['measured'], '{:.0f}')} |"
                )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_serve":
        helper_serve(argv[1], int(argv[2]), argv[3], argv[4])
        return 0
    if argv and argv[0] == "_send":
        helper_send(argv[1], int(argv[2]), argv[3])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=1.0, help="float32 state per worker, GiB (default 1.0)")
    parser.add_argument("--dir", help="directory for the torch.save and dcp.save files (default: $TMPDIR or /tmp)")
    parser.add_argument("--repeats", type=int, default=5, help="measured rounds after the first two (default 5)")
    parser.add_argument("--quick", action="store_true", help="64 MiB, 1 measured round: a smoke run")
    parser.add_argument("--tensors", type=int, default=16, help="tensors the state is split into (default 16)")
    parser.add_argument("--mtus", default="1500,9000", help="veth MTUs for (c), comma-separated")
    parser.add_argument(
        "--skip", default="", help="parts to leave out, comma-separated: job (a, b, d), replication (c)"
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds the job may take")
    parser.add_argument("--json", help="write every value to this file")
    parser.add_argument("--markdown", help="also write the report to this file")
    parser.add_argument("--keep-tmp", action="store_true", help="keep the job's directory (logs, records, files)")
    args = parser.parse_args(argv)
    if args.quick:
        args.size_gib, args.repeats = 64 / 1024, 1
    size = int(args.size_gib * GIB) // (4 * args.tensors) * (4 * args.tensors)
    rounds = args.repeats + 2
    files_parent = args.dir or tempfile.gettempdir()
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    info = {
        "command": shlex.join(["python", "benchmarks/checkpoint.py", *argv]),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "machine": machine(files_parent),
        "size_bytes": size,
        "rounds": rounds,
        "tensors": args.tensors,
    }
    job = rep = None
    if "job" not in skip:
        raw = run_job(size, args.tensors, rounds, files_parent, args.timeout, args.keep_tmp)
        job = {**raw, "summary": summarize_job(raw, size)}
    if "replication" not in skip:
        raw_rep = run_replication(size, rounds, [int(m) for m in args.mtus.split(",") if m.strip()])
        rep = {**summarize_replication(raw_rep), "raw": raw_rep}
    with contextlib.suppress(OSError):
        info["load_average_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    report = render(info, args, size, rounds, job, rep)
    print(report)
    if args.markdown:
        Path(args.markdown).write_text(report)
    if args.json:
        Path(args.json).write_text(
            json.dumps({"info": info, "job": job, "replication": rep}, indent=1, default=str) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
