#!/usr/bin/env python3
"""Rendezvous at scale: N participants against one store, fsm-agent's ``fsm`` backend beside
torch's c10d (``DynamicRendezvousHandler`` on a ``TCPStore``).

    python benchmarks/rendezvous_scale.py --markdown /tmp/scale.md            # N = 64, 256, 1024, 4096
    python benchmarks/rendezvous_scale.py --sizes 64,256 --c10d-sizes 16,64    # a subset
    python benchmarks/rendezvous_scale.py --rerendezvous --c10d-sizes ''       # one lost node, a spare promoted

What is real and what is simulated:

- The store is its own process: ``python -m fsm_agent.store`` for ``fsm``; a ``TCPStore`` master
  for c10d. Its CPU seconds (user + system), peak RSS (VmHWM) and the bytes it read and wrote
  (``/proc/PID/io`` rchar + wchar, i.e. every socket byte) are measured from the moment the
  participants are told to go until the last one has its rank.
- A participant is one real rendezvous handler (``FsmRendezvousHandler`` / torch's
  ``DynamicRendezvousHandler``: the product's own protocol code, imported, not a copy), each with
  its own store connections and keep-alive thread, as an agent would have. What is simulated is
  the node: participants are threads, spread over ``--procs`` processes on this one machine, all
  on loopback, and no workers are started. One round, ``--nnodes N:N``, default settings.
- Time until all ranked: the harness stamps ``time.time()`` and tells every process to go at
  once (one line on each stdin); each participant stamps the moment its ``next_rendezvous``
  returned; the row shows the last stamp minus the go stamp. The processes have created their
  handlers (no connection yet) before go.
- Every participant holds 2 connections to the store (fsm: the join's, and the keep-alive's,
  which carries the membership watch), so the harness raises ``RLIMIT_NOFILE`` (soft and hard,
  for itself and the processes it starts) as far as it may, and says so in the output. The listen
  backlog is capped by ``net.core.somaxconn`` (left as it is).
- Simulation artefacts, said in the output: the participant processes run under ``SCHED_IDLE``
  with 512 KiB thread stacks, 64 participants per process by default (``--procs 0``).
  ``--phases`` prints when each kind of request started and ended (median, 90%, max), and the
  store's request counts by op and its answers by status.
- c10d runs at the sizes given by ``--c10d-sizes`` with ``--c10d-limit`` seconds each; a size
  that does not finish in time is shown as "not done in N s" (its limit).

Every process started is killed at the end of its row (by pid); nothing is found by name.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import select
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
NOFILE = 262144
#: Participants per process when ``--procs`` is 0 (auto): each process's threads share one GIL, and
#: a few hundred threads waking at once on one GIL is the simulation's cost, not the protocol's.
PER_PROC = 64


# -- a participants process ---------------------------------------------------------------------------
def fsm_handlers(args) -> list:
    from fsm_agent.plugins.rendezvous_fsm import FsmRendezvousHandler, FsmRendezvousSettings

    settings = FsmRendezvousSettings(
        is_host=False, join_timeout=args.join_timeout, keep_alive_interval=args.keep_alive_interval
    )
    return [
        FsmRendezvousHandler(
            args.run_id, f"127.0.0.1:{args.port}", args.nodes, args.nodes, local_addr="127.0.0.1", settings=settings
        )
        for _ in range(args.count)
    ]


def c10d_handlers(args) -> list:
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    out = []
    for _ in range(args.count):
        params = RendezvousParameters(
            backend="c10d",
            endpoint=f"127.0.0.1:{args.port}",
            run_id=args.run_id,
            min_nodes=args.nodes,
            max_nodes=args.nodes,
            local_addr="127.0.0.1",
            join_timeout=str(int(args.join_timeout)),
        )
        store = TCPStore(
            "127.0.0.1",
            args.port,
            is_master=False,
            timeout=timedelta(seconds=args.join_timeout),
            wait_for_workers=False,
        )
        out.append(create_handler(store, C10dRendezvousBackend(store, args.run_id), params))
    return out


def record_phases(handler) -> list:
    """Stamp every store request of ``handler``'s clients (``--phases``): ``[client, op, start, end]``
    per request (``time.time()``; op ``connect`` for opening a connection), wrapping the real client's
    methods on the instance, so the protocol code that runs is the product's own."""
    from fsm_agent.plugins.rendezvous_fsm.store import StoreClient

    events: list = []
    for name, client in list(vars(handler).items()):
        if not isinstance(client, StoreClient):
            continue

        def wrap(method, label=name.strip("_"), what=None):  # noqa: B008 (binds this client's name now)
            def stamped(*a, **kw):
                t0 = time.time()
                try:
                    return method(*a, **kw)
                finally:
                    events.append([label, what or str(a[0].get("op")), t0, time.time()])

            return stamped

        client._request = wrap(client._request)
        client._open = wrap(client._open, what="connect")
    return events


def participants_main(args) -> int:
    # The simulated nodes share this machine's cores with the store; in a job each has its own
    # machine. Under SCHED_IDLE (inherited by every thread started here) they run only when the
    # store does not: nice is per thread, and at nice 10 a thousand runnable threads out-weigh it.
    # Small thread stacks: thousands of threads share this machine's memory.
    # ``--participant-sched normal`` (the test's smoke run) leaves them at the normal policy: on a
    # machine whose cores other busy processes hold, SCHED_IDLE threads barely run at all.
    if args.participant_sched == "idle":
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    threading.stack_size(512 * 1024)
    handlers = (fsm_handlers if args.backend == "fsm" else c10d_handlers)(args)
    events = [record_phases(h) if args.phases else None for h in handlers]
    done: list = [None] * len(handlers)
    again: list = [None] * len(handlers)  # --again: the round after the membership change
    go = threading.Event()
    ranked = threading.Semaphore(0)

    def rendezvous(h) -> dict:
        try:
            rank = h.next_rendezvous().rank
            return {"t": time.time(), "rank": rank}  # stamped when it returned
        except BaseException as exc:  # noqa: BLE001 - reported to the harness
            return {"t": time.time(), "error": f"{type(exc).__name__}: {exc}"[:300]}

    def run(i, h):
        go.wait()
        done[i] = rendezvous(h)
        if events[i] is not None:
            done[i]["events"] = list(events[i])
        ranked.release()
        if args.again and "rank" in done[i]:
            # as an agent does: its membership fd says a peer was lost (or waits), then the next round
            select.select([h.membership_fd()], [], [], args.join_timeout)
            again[i] = rendezvous(h)

    threads = [threading.Thread(target=run, args=(i, h), daemon=True) for i, h in enumerate(handlers)]
    for t in threads:
        t.start()
    print("ready", flush=True)
    sys.stdin.readline()
    go.set()
    for _ in threads:
        ranked.acquire()
    print(json.dumps({"done": done, "torch": "torch" in sys.modules}), flush=True)
    if args.again:
        for t in threads:
            t.join()
        print(json.dumps({"again": again}), flush=True)
    sys.stdin.readline()  # the harness reads everyone's results before the connections close
    os._exit(0)


# -- the harness --------------------------------------------------------------------------------------
def raise_nofile() -> str:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, max(hard, NOFILE)))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    now = resource.getrlimit(resource.RLIMIT_NOFILE)
    if now == (soft, hard):
        return f"RLIMIT_NOFILE {soft}/{hard} (soft/hard): already as high as this user may raise it"
    return f"RLIMIT_NOFILE raised from {soft}/{hard} to {now[0]}/{now[1]} (soft/hard)"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_stats(pid: int, backend: str, port: int) -> dict:
    """The store process's CPU seconds, peak RSS and (fsm) the bytes and requests it served."""
    ticks = os.sysconf("SC_CLK_TCK")
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / ticks
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    hwm = int(status["VmHWM"].split()[0]) * 1024
    io, requests = None, None
    if backend == "fsm":  # the server counts its socket bytes (recv/send are not in /proc/PID/io)
        from fsm_agent.plugins.rendezvous_fsm.store import StoreClient

        c = StoreClient("127.0.0.1", port, connect_timeout=30)
        try:
            stats = c.stats()
        finally:
            c.close()
        io, requests = stats["bytes_in"] + stats["bytes_out"], stats["requests"]
        return {"cpu": cpu, "io": io, "requests": requests, "hwm": hwm, "ops": stats["ops"]}
    return {"cpu": cpu, "io": io, "requests": requests, "hwm": hwm}


def start_store(backend: str, port: int, env: dict) -> subprocess.Popen:
    if backend == "fsm":
        cmd = [sys.executable, "-m", "fsm_agent.store", "--host", "127.0.0.1", "--port", str(port)]
    else:
        code = (
            "import sys, time; from datetime import timedelta; from torch.distributed import TCPStore; "
            f"s = TCPStore('127.0.0.1', {port}, is_master=True, wait_for_workers=False, "
            "timeout=timedelta(seconds=900)); print('listening', flush=True); sys.stdin.read()"
        )
        cmd = [sys.executable, "-c", code]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    proc.stdout.readline()  # "fsm store listening ..." / "listening"
    return proc


def readline(proc: subprocess.Popen, deadline: float) -> str | None:
    remaining = deadline - time.monotonic()
    if remaining <= 0 or not select.select([proc.stdout], [], [], remaining)[0]:
        return None
    return proc.stdout.readline()


def phase_summary(results: list, t0: float) -> list[str]:
    """Per (client, op, nth call): when it started and ended after go (median / 90% / max, seconds),
    and how many participants made it; the wall time's breakdown that ``--phases`` prints."""
    table: dict = {}
    for r in results:
        seen: dict = {}
        for client, op, start, end in sorted(r.get("events", ()), key=lambda e: e[2]):
            k = seen[(client, op)] = seen.get((client, op), 0) + 1
            table.setdefault((client, op, k), []).append((start - t0, end - t0))
    lines = []
    for (client, op, k), spans in sorted(table.items(), key=lambda kv: sorted(s for s, _ in kv[1])[len(kv[1]) // 2]):
        starts, ends = sorted(s for s, _ in spans), sorted(e for _, e in spans)

        def q(xs, f):
            return xs[min(len(xs) - 1, int(f * len(xs)))]

        lines.append(
            f"  {client:>9} {op:<12} #{k} x{len(spans):<5} start {q(starts, 0.5):6.2f} {q(starts, 0.9):6.2f} "
            f"{starts[-1]:6.2f}  end {q(ends, 0.5):6.2f} {q(ends, 0.9):6.2f} {ends[-1]:6.2f}"
        )
    return lines


def one_row(
    backend: str,
    n: int,
    procs: int,
    limit: float,
    env: dict,
    keep_alive_interval: float,
    phases: bool = False,
    participant_sched: str = "idle",
) -> dict:
    port, run_id = free_port(), f"scale-{uuid.uuid4().hex[:8]}"
    store = start_store(backend, port, env)
    workers: list[subprocess.Popen] = []
    try:
        p = max(1, min(procs or max(8, -(-n // PER_PROC)), n))
        counts = [n // p + (1 if i < n % p else 0) for i in range(p)]
        for count in counts:
            workers.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        __file__,
                        "--participants",
                        backend,
                        "--port",
                        str(port),
                        "--run-id",
                        run_id,
                        "--nodes",
                        str(n),
                        "--count",
                        str(count),
                        "--join-timeout",
                        str(int(limit) + 60),
                        "--keep-alive-interval",
                        str(keep_alive_interval),
                        *(["--phases"] if phases else []),
                        "--participant-sched",
                        participant_sched,
                    ],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    env=env,
                )
            )
        setup_deadline = time.monotonic() + 300
        for w in workers:
            if readline(w, setup_deadline) != "ready\n":
                return {"backend": backend, "n": n, "error": "a participants process did not start"}
        before = proc_stats(store.pid, backend, port)
        t0 = time.time()
        for w in workers:
            w.stdin.write("go\n")
            w.stdin.flush()
        deadline = time.monotonic() + limit
        results, torch_loaded = [], []
        for w in workers:
            line = readline(w, deadline)
            if line is None:
                row = {"backend": backend, "n": n, "timeout": limit}
                if backend == "fsm":  # where it stood: for the report
                    from fsm_agent.plugins.rendezvous_fsm.store import StoreClient

                    c = StoreClient("127.0.0.1", port, connect_timeout=30, handshake_timeout=30)
                    try:
                        row["state"] = {**c.rendezvous("status", run=run_id), **c.stats()}
                    finally:
                        c.close()
                    row["store_cpu_s"] = proc_stats(store.pid, "", port)["cpu"] - before["cpu"]
                return row
            out = json.loads(line)
            results += out["done"]
            torch_loaded.append(out["torch"])
        after = proc_stats(store.pid, backend, port)
        if phases:
            print(f"{backend} N={n}: phases after go (s: median 90% max), client op #nth xparticipants:")
            print("\n".join(phase_summary(results, t0)), flush=True)
            if after.get("ops"):
                ops = {k: v - before["ops"].get(k, 0) for k, v in after["ops"].items()}
                print(f"  store ops: {dict(sorted(ops.items()))}", flush=True)
        errors = [r["error"] for r in results if "error" in r]
        ranks = sorted(r["rank"] for r in results if "rank" in r)
        return {
            "backend": backend,
            "n": n,
            "procs": p,
            "seconds": max(r["t"] for r in results) - t0,
            "store_cpu_s": after["cpu"] - before["cpu"],
            "store_peak_rss": after["hwm"],
            "bytes_per_participant": None if after["io"] is None else (after["io"] - before["io"]) / n,
            "requests_per_participant": None if after["io"] is None else (after["requests"] - before["requests"]) / n,
            "errors": errors[:3],
            "n_errors": len(errors),
            "ranks_ok": ranks == list(range(n)),
            "torch_in_participants": any(torch_loaded),
        }
    finally:
        for w in workers:
            w.kill()
        for w in [*workers, store]:
            if w is store:
                w.kill()
            w.wait()


def participants(
    count: int, port: int, run_id: str, n: int, limit: float, env: dict, extra: list[str]
) -> subprocess.Popen:
    """A process of ``count`` fsm participants of a ``--nnodes n:n`` run (``participants_main``)."""
    cmd = [sys.executable, __file__, "--participants", "fsm", "--port", str(port), "--run-id", run_id]
    cmd += ["--nodes", str(n), "--count", str(count), "--join-timeout", str(int(limit) + 60), *extra]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def tell(proc: subprocess.Popen, line: str) -> None:
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def rerendezvous_row(n: int, procs: int, limit: float, env: dict, keep_alive_interval: float, sched: str) -> dict:
    """One lost node at N (``--rerendezvous``): N participants ranked, then one more joins as a hot
    spare; the process of one participant is SIGKILLed (its connections close, so its lease goes at
    once, as a killed agent's); each survivor, woken by its membership fd as an agent is, joins the
    next round, where the spare takes the lost seat. Time: the SIGKILL -> the last of the N ranked
    again; the store's CPU and requests over the same span."""
    port, run_id = free_port(), f"rerdzv-{uuid.uuid4().hex[:8]}"
    store = start_store("fsm", port, env)
    extra = ["--keep-alive-interval", str(keep_alive_interval), "--participant-sched", sched]
    nodes: list[subprocess.Popen] = []
    spare = None
    try:
        p = max(1, min(procs or max(8, -(-(n - 1) // PER_PROC)), n - 1))
        counts = [(n - 1) // p + (1 if i < (n - 1) % p else 0) for i in range(p)]
        nodes = [participants(c, port, run_id, n, limit, env, [*extra, "--again"]) for c in [*counts, 1]]
        victim = nodes[-1]
        spare = participants(1, port, run_id, n, limit, env, extra)
        deadline = time.monotonic() + 300
        if any(readline(w, deadline) != "ready\n" for w in [*nodes, spare]):
            return {"backend": "fsm", "n": n, "error": "a participants process did not start"}
        for w in nodes:
            tell(w, "go")
        deadline = time.monotonic() + limit
        first = []
        for w in nodes:
            line = readline(w, deadline)
            if line is None:
                return {"backend": "fsm", "n": n, "timeout": limit, "what": "the first round"}
            first += json.loads(line)["done"]
        if sorted(r.get("rank", -1) for r in first) != list(range(n)):
            return {"backend": "fsm", "n": n, "error": f"first round: {[r for r in first if 'error' in r][:2]}"}
        tell(spare, "go")
        from fsm_agent.plugins.rendezvous_fsm.store import StoreClient

        c = StoreClient("127.0.0.1", port, connect_timeout=30, handshake_timeout=30)
        try:
            while c.rendezvous("status", run=run_id)["waiting"] < 1:  # the spare waits: a standby
                if time.monotonic() > deadline:
                    return {"backend": "fsm", "n": n, "timeout": limit, "what": "the spare's join"}
                time.sleep(0.05)
        finally:
            c.close()
        before = proc_stats(store.pid, "fsm", port)
        t0 = time.time()
        victim.kill()
        again = []
        deadline = time.monotonic() + limit
        for w in nodes[:-1]:
            line = readline(w, deadline)
            if line is None:
                return {"backend": "fsm", "n": n, "timeout": limit, "what": "the survivors' round"}
            again += [
                r or {"t": time.time(), "error": "no second round (the first failed)"}
                for r in json.loads(line)["again"]
            ]
        line = readline(spare, deadline)
        if line is None:
            return {"backend": "fsm", "n": n, "timeout": limit, "what": "the spare's seat"}
        again += json.loads(line)["done"]
        after = proc_stats(store.pid, "fsm", port)
        errors = [r["error"] for r in again if "error" in r]
        early = [r for r in again if r["t"] < t0]  # re-ranked before the loss (e.g. a lapsed lease): not this row
        if early:
            errors.insert(0, f"{len(early)} ranked again before the SIGKILL")
        return {
            "backend": "fsm",
            "n": n,
            "procs": p + 2,
            "seconds": max(r["t"] for r in again) - t0,
            "store_cpu_s": after["cpu"] - before["cpu"],
            "store_peak_rss": after["hwm"],
            "bytes_per_participant": (after["io"] - before["io"]) / n,
            "requests_per_participant": (after["requests"] - before["requests"]) / n,
            "errors": errors[:3],
            "n_errors": len(errors),
            "ranks_ok": sorted(r.get("rank", -1) for r in again) == list(range(n)),
            "torch_in_participants": False,
        }
    finally:
        for w in [*nodes, *([spare] if spare else []), store]:
            w.kill()
            w.wait()


def summarize(runs: list[dict]) -> dict:
    """One table row from ``--repeat`` runs of one size: the median run's figures, and the
    range of the time and of the store CPU per participant over every run (a failed run is the row)."""
    failed = [r for r in runs if "seconds" not in r]
    if failed:
        return failed[0]
    by_time = sorted(runs, key=lambda r: r["seconds"])
    row = dict(by_time[len(by_time) // 2])
    if len(runs) > 1:
        cpu = sorted(r["store_cpu_s"] / r["n"] for r in runs)
        row["runs"] = len(runs)
        row["seconds_range"] = (by_time[0]["seconds"], by_time[-1]["seconds"])
        row["cpu_per_participant_median"] = cpu[len(cpu) // 2]
        row["cpu_per_participant_range"] = (cpu[0], cpu[-1])
    return row


def fmt_row(row: dict) -> list[str]:
    if "timeout" in row:
        state = row.get("state")
        where = (
            (
                f" (store: {state['participants']} joined, {state['nodes']} live, {state['requests']} requests "
                f"served, {row['store_cpu_s']:.1f} s CPU)"
            )
            if state
            else ""
        )
        return [row["backend"], str(row["n"]), f"not done in {row['timeout']:g} s{where}"]
    if "error" in row:
        return [row["backend"], str(row["n"]), row["error"]]
    ok = "yes" if row["ranks_ok"] and not row["n_errors"] else f"no ({row['n_errors']} errors: {row['errors'][:1]})"
    seconds = f"{row['seconds']:.2f} s"
    cpu_per = f"{row['store_cpu_s'] / row['n'] * 1000:.2f} ms"
    if "runs" in row:  # --repeat: the median, then [min-max] over the runs
        lo, hi = row["seconds_range"]
        seconds += f" [{lo:.2f}-{hi:.2f}]"
        lo, hi = row["cpu_per_participant_range"]
        cpu_per = f"{row['cpu_per_participant_median'] * 1000:.2f} ms [{lo * 1000:.2f}-{hi * 1000:.2f}]"
    return [
        row["backend"],
        str(row["n"]),
        seconds,
        f"{row['store_cpu_s']:.2f} s",
        cpu_per,
        f"{row['store_peak_rss'] / 2**20:.0f} MiB",
        "-" if row["bytes_per_participant"] is None else f"{row['bytes_per_participant']:.0f} B",
        "-" if row["requests_per_participant"] is None else f"{row['requests_per_participant']:.1f}",
        ok,
    ]


HEADER = [
    "backend",
    "N",
    "all ranked after",
    "store CPU",
    "store CPU per participant",
    "store peak RSS",
    "store bytes per participant",
    "store requests per participant",
    "ranks 0..N-1, no error",
]


def markdown(rows: list[dict], command: str, notes: list[str], header: list[str] = HEADER) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = fmt_row(row)
        cells += [""] * (len(header) - len(cells))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join([f"`{command}`", "", *[f"- {n}" for n in notes], "", *lines, ""])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="64,256,1024,4096", help="N for the fsm backend (comma-separated)")
    parser.add_argument("--c10d-sizes", default="16,64,256", help="N for torch's c10d ('' for none)")
    parser.add_argument("--c10d-limit", type=float, default=120.0, help="seconds c10d gets per size")
    parser.add_argument("--limit", type=float, default=120.0, help="seconds fsm gets per size")
    parser.add_argument(
        "--procs", type=int, default=0, help=f"participant processes per row (0: N/{PER_PROC}, at least 8)"
    )
    parser.add_argument(
        "--keep-alive-interval",
        type=float,
        default=15.0,
        help="fsm keep_alive_interval (s; the product's default is 0.5, stretched to N/2000 s at N nodes): "
        "thousands of simulated nodes share this machine's cores, and a starved keep-alive thread is a "
        "silent node; its lease (x3) must outlast the simulated rendezvous (at 5 s a slow 4,096 row "
        "lapsed leases, re-joined and took 58 s)",
    )
    parser.add_argument(
        "--phases", action="store_true", help="print when each participant's store requests started and ended"
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs per size, interleaved (every size once, then again): the table shows the median run "
        "and [min-max] of the time and of the store CPU per participant",
    )
    parser.add_argument(
        "--participant-sched",
        choices=["idle", "normal"],
        default="idle",
        help="scheduling policy of the participant processes: idle (SCHED_IDLE, the default: the simulated "
        "nodes never take the store's CPU) or normal (for a smoke run on a machine other busy processes "
        "share, where SCHED_IDLE threads would barely run)",
    )
    parser.add_argument(
        "--rerendezvous",
        action="store_true",
        help="fsm only: after the first round at each size, one more participant joins as a hot spare and "
        "one participant's process is SIGKILLed; the row is the re-rendezvous (survivors re-ranked, the "
        "spare promoted): SIGKILL -> all N ranked again, and the store's work over that span",
    )
    parser.add_argument("--markdown", help="write the table to this file too")
    parser.add_argument("--json", help="write the rows (and every run of each) as JSON to this file")
    # participants mode (started by the harness)
    parser.add_argument("--participants", choices=["fsm", "c10d"], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--run-id", help=argparse.SUPPRESS)
    parser.add_argument("--nodes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--join-timeout", type=float, default=600.0, help=argparse.SUPPRESS)
    parser.add_argument("--again", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    nofile = raise_nofile()
    if args.participants:
        args.backend = args.participants
        return participants_main(args)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    command = "python " + " ".join(
        [str(Path(sys.argv[0]).relative_to(REPO) if Path(sys.argv[0]).is_absolute() else sys.argv[0]), *sys.argv[1:]]
    )
    load = os.getloadavg()
    notes = [
        nofile,
        f"{platform.node()}: {os.cpu_count()} CPUs, load average {load[0]:.1f} at start "
        f"(other work shares the machine: the numbers are pessimistic)",
        f"participants: threads in {args.procs or f'N/{PER_PROC} (at least 8)'} processes, each a real "
        f"rendezvous handler with its own store connections and keep-alive thread; the store in its own process; "
        f"loopback only",
        f"participant processes run under {'SCHED_IDLE' if args.participant_sched == 'idle' else 'the normal policy'} "
        "(the store under the normal policy), with 512 KiB thread stacks: in a real job each node has its own machine, so the simulated nodes should not take the "
        "store's CPU; what the time still includes is thousands of threads waking on a few GILs of 2 cores",
        f"fsm: --rdzv-conf keep_alive_interval={args.keep_alive_interval:g} (x3 attempts) for the simulated nodes, "
        f"whose keep-alive threads share the machine's cores (a lease must outlast the simulated rendezvous); "
        f"every other setting is the default",
    ]
    rows = []
    c10d_sizes = "" if args.rerendezvous else args.c10d_sizes  # the re-rendezvous row is fsm's only
    if args.rerendezvous and args.c10d_sizes:
        notes.append("c10d not run: --rerendezvous measures the fsm backend only")
    plan = [("fsm", int(n), args.limit) for n in args.sizes.split(",") if n] + [
        ("c10d", int(n), args.c10d_limit) for n in c10d_sizes.split(",") if n
    ]
    if args.repeat < 1:
        parser.error(f"--repeat {args.repeat}: give 1 or more runs per size")
    runs: dict[tuple[str, int], list[dict]] = {(backend, n): [] for backend, n, _ in plan}
    for attempt in range(args.repeat):
        for backend, n, limit in plan:
            if args.rerendezvous and backend == "fsm":
                row = rerendezvous_row(n, args.procs, limit, env, args.keep_alive_interval, args.participant_sched)
            else:
                row = one_row(
                    backend, n, args.procs, limit, env, args.keep_alive_interval, args.phases, args.participant_sched
                )
            runs[backend, n].append(row)
            print(f"run {attempt + 1}/{args.repeat}: " + " | ".join(fmt_row(row)), flush=True)
            time.sleep(2.0)  # let the last row's threads and sockets go before the next row starts
    rows = [summarize(r) for r in runs.values()]
    if args.repeat > 1:
        notes.append(
            f"{args.repeat} runs per size, interleaved; each row is the run of median time, with [min-max] of the "
            f"time and of the store CPU per participant (its median) over the {args.repeat} runs"
        )
    header = HEADER
    if args.rerendezvous:
        header = [*HEADER[:2], "all ranked again after (from the SIGKILL)", *HEADER[3:]]
        notes.append(
            "--rerendezvous (fsm rows): N ranked, then one more participant (its own process) joins as a hot spare; "
            "the process of one participant is SIGKILLed; each survivor joins the next round when its membership "
            "fd says so (as an agent does) and the spare takes the lost seat; time and store work from the SIGKILL "
            "until all N are ranked again (a killed process's connections close at once: a host that goes "
            "silent is found later, by the keep-alive's TCP probes)"
        )
    text = markdown(rows, command, notes + [f"load average {os.getloadavg()[0]:.1f} at the end"], header)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)
    if args.json:
        every = [{"backend": b, "n": n, "runs": r} for (b, n), r in runs.items()]
        Path(args.json).write_text(json.dumps({"rows": rows, "every_run": every}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
