"""The store's cost of an idle, healthy job, per node (issue #38, its second point, with real agents).

``--sizes`` jobs one after another, each of N real fsm-agents on 127.0.0.1 (``--rdzv-backend fsm``
against a store in its own process, ``python -m fsm_agent.store``, so its CPU is its own; every
agent ``is_host=0``), one light worker each (``workers/soak_worker.py``: a step and a heartbeat
every 0.5 s, no torch), default settings plus ``--agent-flags``. Once every rank steps and
``--settle`` s have passed, the store's counters (the ``stats`` op: requests by op, bytes) and its
CPU time (``/proc``, user + system) are read, again ``--seconds`` s later; the row is the
difference: store requests per second per node (total and by op), bytes per second per node, and
the store's CPU as a share of one core. What a node does to the store while its workers run and
nothing happens (keep-alives, the job-wide drain look-up, the membership watch, status, step
times) is what is measured; what is simulated is only the training (the workers) and the nodes
(all on one machine, which is why N stops at what 2 cores run: 64).

    python benchmarks/idle_cost.py                          # N = 8, 32, 64; 60 s each (~5 min)
    python benchmarks/idle_cost.py --sizes 8 --seconds 20 --agent-flags="--straggler-window 5"
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from _jobs import REPO, Job, free_port, listening, loadavg, log

WORKER = Path(__file__).resolve().parent / "workers" / "soak_worker.py"


class IdleJob(Job):
    """N agents, none of them the store's host, against the store at ``store_port``."""

    def __init__(self, folder: Path, nodes: int, store_port: int, agent_flags: list[str]):
        super().__init__("idle", folder, nodes, 1)
        self.port, self.agent_flags = store_port, agent_flags

    def command(self, slot: int) -> list[str]:
        return [
            sys.executable, "-m", "fsm_agent", "run", "--rdzv-backend", "fsm",
            "--nnodes", f"{self.nodes}:{self.nodes}", "--nproc-per-node", "1",
            "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", self.run_id, "--rdzv-conf", "is_host=0",
            "--local-addr", "127.0.0.1", *self.agent_flags,
            str(WORKER), str(self.out), "0.5",
        ]  # fmt: skip

    def job_env(self, slot: int) -> dict[str, str]:
        return {"LOGLEVEL": "WARNING"}

    def all_stepping(self) -> bool:
        first = {r["pid"] for r in self.events() if r["kind"] == "first_step"}
        newest = self.newest_workers()
        return len(newest) == self.world and all(r["pid"] in first for r in newest.values())


def snapshot(store: psutil.Process, port: int) -> dict:
    from fsm_agent.plugins.rendezvous_fsm.store import StoreClient

    client = StoreClient("127.0.0.1", port, connect_timeout=30)
    try:
        stats = client.stats()
    finally:
        client.close()
    cpu = store.cpu_times()
    return {**stats, "cpu_s": cpu.user + cpu.system, "t": time.monotonic()}


def measure(nodes: int, args: argparse.Namespace, folder: Path) -> dict:
    port = free_port()
    store_cmd = [sys.executable, "-m", "fsm_agent.store", "--host", "127.0.0.1", "--port", str(port)]
    store_proc = subprocess.Popen(store_cmd, cwd=REPO, stdout=subprocess.DEVNULL, start_new_session=True)
    job = IdleJob(folder / f"n{nodes}", nodes, port, args.agent_flags.split())
    try:
        end = time.monotonic() + 30
        while not listening(port) and time.monotonic() < end:
            time.sleep(0.05)
        for _ in range(nodes):
            job.start_agent()
        end = time.monotonic() + args.deadline
        while not job.all_stepping() and time.monotonic() < end and job.any_agent_alive():
            time.sleep(0.2)
        if not job.all_stepping():
            return {"nodes": nodes, "error": f"the job was not stepping within {args.deadline:.0f} s"}
        time.sleep(args.settle)
        store = psutil.Process(store_proc.pid)
        before = snapshot(store, port)
        time.sleep(args.seconds)
        after = snapshot(store, port)
        restarted = any(r.get("restart") for r in job.events())
    finally:
        job.close()
        store_proc.kill()
        store_proc.wait(timeout=30)
    seconds = after["t"] - before["t"]
    per_node_s = seconds * nodes
    by_op = {op: (after["ops"].get(op, 0) - before["ops"].get(op, 0)) / per_node_s for op in after["ops"]}
    return {
        "nodes": nodes,
        "seconds": round(seconds, 1),
        "requests_per_node_s": (after["requests"] - before["requests"]) / per_node_s,
        "by_op": {op: round(v, 4) for op, v in sorted(by_op.items(), key=lambda kv: -kv[1]) if v > 0},
        "bytes_per_node_s": (after["bytes_in"] + after["bytes_out"] - before["bytes_in"] - before["bytes_out"])
        / per_node_s,
        "store_cpu_share": (after["cpu_s"] - before["cpu_s"]) / seconds,
        "connections": after["connections"],
        "restarted": restarted,
        "load": loadavg(),
    }


def markdown(rows: list[dict], args: argparse.Namespace, command: str) -> list[str]:
    lines = [
        f"Idle cost: real fsm-agents, one light worker each, the store in its own process; {args.seconds:g} s "
        f"measured after {args.settle:g} s settled; agent flags: `{args.agent_flags or '(defaults)'}`. `{command}`",
        "",
        "| nodes | store requests/s per node | by op (requests/s per node) | store bytes/s per node "
        "| store CPU (share of one core) | connections | load average |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['nodes']} | {r['error']} |  |  |  |  |  |")
            continue
        ops = ", ".join(f"{op} {v:.3f}" for op, v in r["by_op"].items())
        note = " (a worker restarted: not idle)" if r["restarted"] else ""
        lines.append(
            f"| {r['nodes']} | {r['requests_per_node_s']:.3f}{note} | {ops} | {r['bytes_per_node_s']:.0f} B "
            f"| {100 * r['store_cpu_share']:.2f} % | {r['connections']} | {r['load']} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="8,32,64", help="the numbers of agents, comma separated")
    parser.add_argument("--seconds", type=float, default=60.0, help="how long each job is measured")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds waited once every rank steps")
    parser.add_argument("--deadline", type=float, default=180.0, help="seconds a job may take to start")
    parser.add_argument("--agent-flags", default="", help="more fsm-agent run flags, one string")
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    parser.add_argument("--markdown", type=Path, help="write the table here too")
    args = parser.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--sizes {args.sizes!r}: give whole numbers, comma separated, such as 8,32,64")
    if not sizes or min(sizes) < 2:
        parser.error(f"--sizes {args.sizes!r}: at least 2 agents a job")
    rows = []
    with tempfile.TemporaryDirectory(prefix="idle-cost-") as scratch:
        for nodes in sizes:
            log(f"{nodes} agents; load {loadavg()}")
            rows.append(measure(nodes, args, Path(scratch)))
            log(f"  {json.dumps(rows[-1])}")
    command = "python benchmarks/idle_cost.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = markdown(rows, args, command)
    print("\n".join(lines))
    if args.markdown:
        args.markdown.write_text("\n".join(lines) + "\n")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
