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
    python benchmarks/idle_cost.py --sizes '' --simulated 1024,4096      # simulated nodes (below)

``--simulated`` sizes: N simulated nodes, as threads in processes of ``--per-proc`` (64), under
``SCHED_IDLE`` (512 KiB thread stacks) so that they do not take the store's CPU on this machine.
Each is what an idle agent has that talks to the store: a real ``FsmRendezvousHandler`` (its two
connections, its keep-alive thread holding the membership watch) in a round of N:N, and the
agent's own ``NodeDrain`` watching for a peer's job-wide drain, driven by one loop per process as
the agent's HEALTHY watch drives it (``look_if_due`` when its wake-up pipe or its next look says).
What is left out: the workers, the agent's state machine and everything it does without the
store (the 8-64 real-agent rows show an idle agent makes no other request). After the idle
window two checks, not timed to pass: the harness sets the job-wide drain key, and the row shows
the seconds until every node's ``NodeDrain`` requested the drain; then it SIGKILLs one process
(its nodes' connections close) and the row shows the seconds until every other node's
membership fd was readable.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import select
import subprocess
import sys
import tempfile
import threading
import time
import types
import uuid
from pathlib import Path
from typing import Any

import attrs
import psutil
from _jobs import REPO, Job, free_port, listening, loadavg, log

WORKER = Path(__file__).resolve().parent / "workers" / "soak_worker.py"
#: Seconds a simulated check (a drain reaching every node, a loss seen by every node) may take.
CHECK_LIMIT_S = 120.0


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
    return {**rates(nodes, before, after), "simulated": False, "restarted": restarted, "load": loadavg()}


# -- simulated nodes: one participants process ----------------------------------------------------------
@attrs.define
class SimGroup:
    """The part of the agent's ``WorkerGroup`` that ``NodeDrain`` reads."""

    store: Any
    group_world_size: int
    group_rank: int


@attrs.define
class SimNode:
    """One simulated node: its rendezvous handler, its round, its drain service."""

    handler: Any
    group: SimGroup
    drain: Any


def participants_main(args: argparse.Namespace) -> int:
    """``--participants``: ``--count`` simulated nodes of one job; talks to the harness on stdin/stdout."""
    from fsm_agent.drain import NodeDrain
    from fsm_agent.plugins.rendezvous_fsm import FsmRendezvousHandler, FsmRendezvousSettings

    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # the store's CPU is what is measured
    threading.stack_size(512 * 1024)
    conf = dict(kv.split("=", 1) for kv in args.rdzv_conf.split(",") if kv)
    settings = FsmRendezvousSettings.from_params(types.SimpleNamespace(config={"is_host": "0", **conf}))
    endpoint = f"127.0.0.1:{args.port}"
    handlers = [
        FsmRendezvousHandler(args.run_id, endpoint, args.nodes, args.nodes, local_addr="127.0.0.1", settings=settings)
        for _ in range(args.count)
    ]
    print("ready", flush=True)
    sys.stdin.readline()
    infos: list[Any] = [None] * len(handlers)

    def join(i: int) -> None:
        try:
            infos[i] = handlers[i].next_rendezvous()
        except BaseException as exc:  # noqa: BLE001 - reported to the harness
            infos[i] = exc

    threads = [threading.Thread(target=join, args=(i,), daemon=True) for i in range(len(handlers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [f"{type(x).__name__}: {x}"[:300] for x in infos if isinstance(x, BaseException)]
    if errors:
        print(json.dumps({"error": errors[0], "errors": len(errors)}), flush=True)
        return 1
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    nodes = [
        SimNode(h, SimGroup(info.store, info.world_size, info.rank), NodeDrain("sim", wake_w))
        for h, info in zip(handlers, infos, strict=True)
    ]
    threading.Thread(target=agent_loops, args=(nodes, wake_r), daemon=True).start()
    print(json.dumps({"ranked": len(nodes), "prefix": nodes[0].group.store.prefix}), flush=True)
    for line in sys.stdin:
        if line.strip() == "drain":
            done = wait_until(lambda: all(n.drain.request is not None for n in nodes))
            print(json.dumps({"at": done, "nodes": sum(n.drain.request is not None for n in nodes)}), flush=True)
        elif line.strip() == "lost":
            print(json.dumps({"at": wait_for_membership(nodes)}), flush=True)
        else:
            break
    os._exit(0)  # the harness stops the job: the connections close with the process


def agent_loops(nodes: list[SimNode], wake_r: int) -> None:
    """The agent's HEALTHY watch, as far as the drain goes, for every node of this process: sleep
    until the wake-up pipe or the next look is due, then ``look_if_due`` (the agent's own code)."""
    from fsm_agent.interrupts import empty_pipe

    while True:
        timeout = min(n.drain.seconds_to_next_look() for n in nodes)
        select.select([wake_r], [], [], timeout)
        empty_pipe(wake_r)
        for n in nodes:
            n.drain.look_if_due(n.group, healthy=True)


def wait_until(done: Any) -> float | None:
    """``time.time()`` once ``done()`` holds (polled locally, no store request), None after the limit."""
    end = time.monotonic() + CHECK_LIMIT_S
    while time.monotonic() < end:
        if done():
            return time.time()
        time.sleep(0.01)
    return None


def wait_for_membership(nodes: list[SimNode]) -> float | None:
    """``time.time()`` once every node's membership fd is readable, None after the limit."""
    pending = {n.handler.membership_fd() for n in nodes}
    end = time.monotonic() + CHECK_LIMIT_S
    while pending and time.monotonic() < end:
        ready, _, _ = select.select(list(pending), [], [], max(0.0, end - time.monotonic()))
        pending -= set(ready)
    return None if pending else time.time()


# -- simulated nodes: the harness ------------------------------------------------------------------------
def raise_nofile() -> None:
    """As many file descriptors as this user may have: the store holds 2 connections per node."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def start_participants(nodes: int, args: argparse.Namespace, port: int, run_id: str) -> list[subprocess.Popen]:
    procs = max(2, -(-nodes // args.per_proc))  # two at least: one is SIGKILLed, the others watch
    counts = [nodes // procs + (1 if i < nodes % procs else 0) for i in range(procs)]
    command = [sys.executable, __file__, "--participants", "--port", str(port), "--run-id", run_id]
    command += ["--nodes", str(nodes), "--rdzv-conf", args.rdzv_conf]
    return [
        subprocess.Popen(
            [*command, "--count", str(count)],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for count in counts
    ]


def read_json(proc: subprocess.Popen, deadline: float) -> dict:
    remaining = deadline - time.monotonic()
    if remaining <= 0 or not select.select([proc.stdout], [], [], remaining)[0]:
        return {"error": "no answer in time"}
    line = proc.stdout.readline()
    try:
        return json.loads(line)
    except ValueError:
        return {"error": f"answered {line[:200]!r}"}


def tell_all(procs: list[subprocess.Popen], line: str) -> None:
    for p in procs:
        p.stdin.write(line + "\n")
        p.stdin.flush()


def measure_simulated(nodes: int, args: argparse.Namespace) -> dict:
    port, run_id = free_port(), f"idle-sim-{uuid.uuid4().hex[:6]}"
    store_cmd = [sys.executable, "-m", "fsm_agent.store", "--host", "127.0.0.1", "--port", str(port)]
    store_proc = subprocess.Popen(store_cmd, cwd=REPO, stdout=subprocess.DEVNULL, start_new_session=True)
    procs: list[subprocess.Popen] = []
    try:
        end = time.monotonic() + 30
        while not listening(port) and time.monotonic() < end:
            time.sleep(0.05)
        procs = start_participants(nodes, args, port, run_id)
        end = time.monotonic() + args.deadline
        for p in procs:
            if p.stdout.readline() != "ready\n":
                return {"nodes": nodes, "simulated": True, "error": "a participants process did not start"}
        tell_all(procs, "go")
        ranked = [read_json(p, end) for p in procs]
        bad = next((r for r in ranked if "error" in r), None)
        if bad is not None:
            return {"nodes": nodes, "simulated": True, "error": f"rendezvous: {bad['error']}"}
        time.sleep(args.settle)
        store = psutil.Process(store_proc.pid)
        before = snapshot(store, port)
        time.sleep(args.seconds)
        after = snapshot(store, port)
        checks = simulated_checks(procs, port, ranked[0]["prefix"])
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)
        store_proc.kill()
        store_proc.wait(timeout=30)
    return {**rates(nodes, before, after), "simulated": True, "restarted": False, **checks, "load": loadavg()}


def simulated_checks(procs: list[subprocess.Popen], port: int, prefix: str) -> dict:
    """A peer's job-wide drain reaching every node, then one process's nodes SIGKILLed: seconds
    until every other node saw each (the store's clock is not needed: one machine)."""
    from fsm_agent.drain import JOB_DRAIN_KEY
    from fsm_agent.plugins.rendezvous_fsm.store import StoreClient

    client = StoreClient("127.0.0.1", port, connect_timeout=30)
    try:
        announced = time.time()
        client.set(f"{prefix}/{JOB_DRAIN_KEY}", "the idle-cost harness")
        tell_all(procs, "drain")
        end = time.monotonic() + CHECK_LIMIT_S + 30
        drained = [read_json(p, end).get("at") for p in procs]
    finally:
        client.close()
    victim, others = procs[0], procs[1:]
    killed = time.time()
    victim.kill()
    tell_all(others, "lost")
    end = time.monotonic() + CHECK_LIMIT_S + 30
    seen = [read_json(p, end).get("at") for p in others]
    return {
        "drain_reached_all_s": None if None in drained else round(max(drained) - announced, 3),
        "loss_seen_by_all_s": None if None in seen or not seen else round(max(seen) - killed, 3),
    }


def rates(nodes: int, before: dict, after: dict) -> dict:
    """Per node and second between two snapshots: requests (total and by op), bytes, store CPU."""
    seconds = after["t"] - before["t"]
    per_node_s = seconds * nodes
    ops = {op: after["ops"].get(op, 0) - before["ops"].get(op, 0) for op in after["ops"]}
    # the second snapshot's own connection and stats request are the harness's, not the nodes'
    ops["hello"], ops["stats"] = ops.get("hello", 0) - 1, ops.get("stats", 0) - 1
    by_op = {op: n / per_node_s for op, n in ops.items()}
    return {
        "nodes": nodes,
        "seconds": round(seconds, 1),
        "requests_per_node_s": (after["requests"] - before["requests"] - 2) / per_node_s,
        "by_op": {op: round(v, 4) for op, v in sorted(by_op.items(), key=lambda kv: -kv[1]) if v > 0},
        "bytes_per_node_s": (after["bytes_in"] + after["bytes_out"] - before["bytes_in"] - before["bytes_out"])
        / per_node_s,
        "store_cpu_share": (after["cpu_s"] - before["cpu_s"]) / seconds,
        "connections": after["connections"],
    }


def markdown(rows: list[dict], args: argparse.Namespace, command: str) -> list[str]:
    lines = [
        f"Idle cost: the store in its own process; {args.seconds:g} s measured after {args.settle:g} s settled; "
        f"real agents (one light worker each) with flags `{args.agent_flags or '(defaults)'}`; simulated nodes "
        f"with `--rdzv-conf {args.rdzv_conf or '(defaults)'}`. `{command}`",
        "",
        "| nodes | store requests/s per node | by op (requests/s per node) | store bytes/s per node "
        "| store CPU (share of one core) | connections | drain reached all | loss seen by all | load average |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        what = f"{r['nodes']} {'simulated' if r.get('simulated') else 'real agents'}"
        if "error" in r:
            lines.append(f"| {what} | {r['error']} |  |  |  |  |  |  |  |")
            continue
        ops = ", ".join(f"{op} {v:.3f}" for op, v in r["by_op"].items()) or "none"
        note = " (a worker restarted: not idle)" if r["restarted"] else ""
        checks = [r.get(k, "-") for k in ("drain_reached_all_s", "loss_seen_by_all_s")]
        checks = [f"{c:.2f} s" if isinstance(c, float) else ("not seen" if c is None else c) for c in checks]
        lines.append(
            f"| {what} | {r['requests_per_node_s']:.3f}{note} | {ops} | {r['bytes_per_node_s']:.0f} B "
            f"| {100 * r['store_cpu_share']:.2f} % | {r['connections']} | {checks[0]} | {checks[1]} | {r['load']} |"
        )
    return lines


def sizes(text: str, parser: argparse.ArgumentParser, flag: str) -> list[int]:
    try:
        out = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        parser.error(f"{flag} {text!r}: give whole numbers, comma separated, such as 8,32,64")
    if out and min(out) < 2:
        parser.error(f"{flag} {text!r}: at least 2 nodes a job")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="8,32,64", help="the numbers of real agents, comma separated")
    parser.add_argument("--simulated", default="", help="the numbers of simulated nodes, comma separated")
    parser.add_argument("--per-proc", type=int, default=64, help="simulated nodes per process")
    parser.add_argument("--rdzv-conf", default="", help="the simulated nodes' --rdzv-conf (k=v,...)")
    parser.add_argument("--seconds", type=float, default=60.0, help="how long each job is measured")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds waited once every rank steps")
    parser.add_argument("--deadline", type=float, default=180.0, help="seconds a job may take to start")
    parser.add_argument("--agent-flags", default="", help="more fsm-agent run flags, one string")
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    parser.add_argument("--markdown", type=Path, help="write the table here too")
    parser.add_argument("--participants", action="store_true", help=argparse.SUPPRESS)
    for name in ("--port", "--count", "--nodes"):
        parser.add_argument(name, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--run-id", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.participants:
        return participants_main(args)
    real, simulated = sizes(args.sizes, parser, "--sizes"), sizes(args.simulated, parser, "--simulated")
    if not real and not simulated:
        parser.error("give --sizes or --simulated")
    raise_nofile()
    rows = []
    with tempfile.TemporaryDirectory(prefix="idle-cost-") as scratch:
        for nodes in real:
            log(f"{nodes} agents; load {loadavg()}")
            rows.append(measure(nodes, args, Path(scratch)))
            log(f"  {json.dumps(rows[-1])}")
    for nodes in simulated:
        log(f"{nodes} simulated nodes; load {loadavg()}")
        rows.append(measure_simulated(nodes, args))
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
