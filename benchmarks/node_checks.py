#!/usr/bin/env python3
"""Node checks (issue #36): the time the network check adds to a healthy start, and its store requests.

    python benchmarks/node_checks.py                  # 3 runs each way at 8 hosts, 3 rounds at 64 nodes
    python benchmarks/node_checks.py --quick          # 1 run each way, 1 round: a smoke run
    python benchmarks/node_checks.py --json out.json  # every per-run value kept

What is measured, and what is real or simulated:

1. **8 hosts** (real agents; Linux network namespaces, root and ``ip`` needed, else skipped with
   the reason): 8 namespaces on one bridge (``tests/netns.py``'s ``NetnsHosts``), one real
   ``python -m fsm_agent run --nnodes 8:8 --nproc-per-node 1 --rdzv-backend fsm`` per namespace
   (host 0 hosts the store at the endpoint), each running ``tests/netns.py``'s ``WORKER`` (a gloo
   ``all_reduce``, then exit 0). Each run launches all 8 agents at once, **with**
   ``--node-check-network true`` and **without** it, the two alternating (with/without on even
   runs, without/with on odd ones), ``--runs`` times each. Timed: the harness's ``time.time()``
   just before the first agent is started → the last host's first worker ``start`` record (the
   worker's own first statement, ``time.time()``): "all workers started". Also the ``node_check``
   event's ``seconds`` (checks + exchange) on every agent. "Added" is the with-run minus the
   without-run of the same pair. Every agent must exit 0 and no node may be excluded.
   The hosts are namespaces on one 2-core machine: 8 agents and 8 workers share its CPUs.
2. **64 simulated nodes** (``--nodes``): one process per node on loopback (``127.0.0.1``; each
   node's check opens its own TCP server port), forked from one process that imported torch and
   fsm_agent, all against one real torch ``TCPStore`` hosted by this harness. Each round, every
   node meets the others at a barrier in the store (as after a rendezvous), then runs the real
   ``fsm_agent.node_checks.run_checks`` with the real ``node-check-network`` plugin (pluggy, as
   the agent) and ``exchange`` on a fresh key prefix. Timed: the round's wall time, the first
   node's start after the barrier → the last node's decision (``time.time()``), over ``--rounds``
   rounds. Counted per node: the network check's own store requests (its ``store_requests``
   measurement, from its counting store) and the exchange's, by op (the same kind of counting
   wrapper around the store ``exchange`` gets). Also who was excluded or blamed (must be nobody).
   Simulated: no agent, no rendezvous, no workers; 64 processes share 2 cores and one loopback
   device, so each link's bandwidth is a share of what the CPUs move (the table gives the
   median), not a network's, and the round is CPU-bound; its times compare like with like only
   against runs on the same machine.

Clean-up, also on failure: every process started is killed by process group (and, for the
namespaces, every pid still inside them), the namespaces are deleted (``NetnsHosts.destroy``),
the temporary directory is removed.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

HOSTS = 8
AGENT_TIMEOUT_S = 180.0


def med_range(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# ------------------------------------------------------------------------------------------------
# 1. Eight namespaced hosts, real agents
# ------------------------------------------------------------------------------------------------
def netns_skip_reason() -> str | None:
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "the 'ip' command (iproute2) is not installed"
    return None


def agent_flags(hosts, run_id: str, network: bool) -> list[str]:
    flags = ["--nnodes", f"{HOSTS}:{HOSTS}", "--nproc-per-node", "1", "--max-restarts", "0"]
    flags += ["--monitor-interval", "0.1", "--rdzv-backend", "fsm", "--rdzv-endpoint", hosts.endpoint()]
    flags += ["--rdzv-id", run_id, "--rdzv-conf", "join_timeout=120"]
    if network:
        flags += ["--node-check-network", "true", "--node-check-timeout", "20"]
    return flags


def one_job(hosts, run: int, network: bool) -> dict:
    """8 agents launched at once; the time to every host's first worker start, the checks' seconds."""
    tag = f"r{run}{'w' if network else 'n'}"
    run_id = f"bench-node-checks-{tag}"
    launched = time.time()
    agents = [
        hosts.start_agent(i, *agent_flags(hosts, run_id, network), final_world=HOSTS, name=f"{tag}h{i}")
        for i in range(HOSTS)
    ]
    codes = []
    deadline = time.monotonic() + AGENT_TIMEOUT_S
    for agent in agents:
        try:
            codes.append(agent.proc.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    for agent in agents:  # a hung one: its group goes now (destroy() kills the rest at the end)
        if agent.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.pid, signal.SIGKILL)
    starts: dict[str, float] = {}
    for record in hosts.records("start"):
        if record["host"].startswith(tag + "h"):
            starts[record["host"]] = min(record["ts"], starts.get(record["host"], float("inf")))
    checks, excluded = [], 0
    for agent in agents:
        for event in agent.events_list():
            if event["kind"] == "node_check":
                checks.append(event["seconds"])
                excluded += len(event["excluded"])
    error = None
    if any(code != 0 for code in codes):
        bad = next(a for a, c in zip(agents, codes, strict=True) if c != 0)
        error = f"exit codes {codes}; {bad.name}:\n{bad.output(2000)}"
    elif len(starts) != HOSTS:
        error = f"worker start records from {len(starts)} of {HOSTS} hosts"
    elif network and (len(checks) != HOSTS or excluded):
        error = f"{len(checks)} node_check events, {excluded} exclusions"
    return {
        "run": run,
        "network": network,
        "exit_codes": codes,
        "all_started_s": (max(starts.values()) - launched) if len(starts) == HOSTS else None,
        "check_seconds": checks,
        "excluded": excluded,
        "error": error,
    }


def bench_hosts(runs: int, workdir: Path) -> dict:
    reason = netns_skip_reason()
    if reason:
        return {"skipped": reason}
    from tests.netns import NetnsHosts

    hosts = NetnsHosts(workdir / "netns", count=HOSTS)
    try:
        try:
            hosts.create()
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
            detail = (getattr(exc, "stderr", None) or str(exc)).strip().splitlines()
            return {"skipped": f"cannot create network namespaces: {detail[-1] if detail else exc}"}
        jobs = []
        for run in range(runs):
            for network in (True, False) if run % 2 == 0 else (False, True):
                job = one_job(hosts, run, network)
                jobs.append(job)
                print(
                    f"  8 hosts run {run} {'with   ' if network else 'without'} network check: "
                    f"all workers started {job['all_started_s'] or float('nan'):.2f} s"
                    + (f", check {med_range(job['check_seconds'])} s" if network else "")
                    + (f"  FAILED: {job['error']}" if job["error"] else ""),
                    flush=True,
                )
        return {"jobs": jobs}
    finally:
        hosts.destroy()


def summarize_hosts(result: dict) -> dict:
    if "skipped" in result:
        return result
    good = [j for j in result["jobs"] if not j["error"]]
    with_ = {j["run"]: j for j in good if j["network"]}
    without = {j["run"]: j for j in good if not j["network"]}
    added = [with_[r]["all_started_s"] - without[r]["all_started_s"] for r in with_ if r in without]
    return {
        "with_s": [j["all_started_s"] for j in with_.values()],
        "without_s": [j["all_started_s"] for j in without.values()],
        "added_s": added,
        "check_s": [s for j in with_.values() for s in j["check_seconds"]],
        "check_max_s": [max(j["check_seconds"]) for j in with_.values()],
        "failed": [j["error"] for j in result["jobs"] if j["error"]],
    }


# ------------------------------------------------------------------------------------------------
# 2. 64 simulated nodes on loopback
# ------------------------------------------------------------------------------------------------
class CountingStore:
    """The store ``exchange`` gets, counting its requests by op (as the network check's own
    ``_CountingStore`` counts its requests)."""

    def __init__(self, store):
        self.store, self.ops = store, collections.Counter()

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def call(*args):
            self.ops[name] += 1
            return method(*args)

        return call


def sim_node(rank: int, nodes: int, port: int, rounds: int, timeout_s: float) -> None:
    """One simulated node (a forked child): ``rounds`` rounds of run_checks + exchange."""
    import pluggy
    import torch.distributed as dist

    from fsm_agent import node_checks
    from fsm_agent.plugins import PROJECT_NAME, hookspecs
    from fsm_agent.plugins.node_check_network import PLUGIN_NAME, NetworkCheck

    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    pm.register(NetworkCheck(), PLUGIN_NAME)
    hook = pm.hook.fsm_agent_node_check
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=datetime.timedelta(seconds=120)
    )
    for run in range(rounds):
        scoped = dist.PrefixStore(f"round{run}/", store)  # a fresh key space each round, as each agent round
        if scoped.add("ready", 1) == nodes:
            scoped.set("go", "1")
        scoped.wait(["go"])
        began, started = time.time(), time.monotonic()
        check_round = node_checks.CheckRound(
            store=scoped,
            key_prefix=node_checks.KEY_PREFIX,
            group_rank=rank,
            group_world_size=nodes,
            node_addr="127.0.0.1",
            hostname=f"sim{rank}",
            timeout_s=timeout_s,
            deadline=started + timeout_s,
        )
        results = node_checks.run_checks(hook, check_round)
        check_done = time.monotonic()
        counting = CountingStore(scoped)
        decision = node_checks.exchange(node_checks.CheckRound(**{**_fields(check_round), "store": counting}), results)
        ended = time.time()
        network = next((r for r in results if r.check == "network"), None)
        record = {
            "round": run,
            "rank": rank,
            "began": began,
            "ended": ended,
            "seconds": ended - began,
            "check_s": check_done - started,
            "check_requests": network.measurements.get("store_requests") if network else None,
            "check_rounds": network.measurements.get("rounds") if network else None,
            "mbps": [network.measurements.get(k) for k in ("up_mbps", "down_mbps")] if network else None,
            "ok": all(r.ok for r in results),
            "blamed": {k: v for r in results for k, v in r.blamed.items()},
            "exchange_ops": dict(counting.ops),
            "excluded": {str(k): v for k, v in decision.excluded.items()},
        }
        emit(record)
        scoped.add("done", 1)


def emit(record: dict) -> None:
    """One JSON line in one write (the forked nodes share stdout: ``print`` writes twice)."""
    os.write(1, (json.dumps(record) + "\n").encode())


def _fields(check_round) -> dict:
    import attrs

    return attrs.asdict(check_round, recurse=False)


def sim_parent(nodes: int, port: int, rounds: int, timeout_s: float) -> int:
    """Imports once, then forks one child per node (each a process of this process group)."""
    import pluggy  # noqa: F401  (imported before the fork: the children share the pages)
    import torch.distributed  # noqa: F401

    import fsm_agent.node_checks  # noqa: F401
    import fsm_agent.plugins.node_check_network  # noqa: F401

    children = []
    for rank in range(nodes):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                sim_node(rank, nodes, port, rounds, timeout_s)
            except BaseException as exc:  # one line on stdout; the harness reports it
                emit({"rank": rank, "error": f"{type(exc).__name__}: {exc}"[:300]})
                code = 1
            finally:
                sys.stdout.flush()
                os._exit(code)
        children.append(pid)
    code = 0
    for pid in children:
        _, status = os.waitpid(pid, 0)
        code = code or os.waitstatus_to_exitcode(status)
    return code


def bench_simulated(nodes: int, rounds: int, timeout_s: float, workdir: Path) -> dict:
    import torch.distributed as dist

    master = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=120)
    )
    log = workdir / "sim.out"
    argv = [sys.executable, str(Path(__file__).resolve()), "--_sim-parent", str(master.port)]
    argv += ["--nodes", str(nodes), "--rounds", str(rounds), "--timeout", str(timeout_s)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)  # fmt: skip
    try:
        code = proc.wait(timeout=120 + rounds * (timeout_s + 20))
    except subprocess.TimeoutExpired:
        code = None
    finally:
        with contextlib.suppress(ProcessLookupError):  # the parent and its forked children: one group
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    del master
    lines = log.read_text(errors="replace").splitlines()
    records = [json.loads(line) for line in lines if line.startswith("{")]
    errors = [r for r in records if "error" in r]
    rows = []
    for run in range(rounds):
        mine = [r for r in records if r.get("round") == run]
        if len(mine) != nodes:
            errors.append({"round": run, "error": f"{len(mine)} of {nodes} nodes reported"})
            continue
        rank0 = next(r for r in mine if r["rank"] == 0)
        others = [r for r in mine if r["rank"] != 0]
        rates = [v for r in mine for v in (r["mbps"] or []) if v is not None]
        rows.append(
            {
                "round": run,
                "wall_s": max(r["ended"] for r in mine) - min(r["began"] for r in mine),
                "check_s_max": max(r["check_s"] for r in mine),
                "check_rounds": rank0["check_rounds"],
                "check_requests_rank0": rank0["check_requests"],
                "check_requests_others": sorted({r["check_requests"] for r in others}),
                "exchange_ops_rank0": rank0["exchange_ops"],
                "exchange_ops_others": [
                    json.loads(o) for o in sorted({json.dumps(r["exchange_ops"], sort_keys=True) for r in others})
                ],
                "exchange_requests_others": sorted({sum(r["exchange_ops"].values()) for r in others}),
                "median_mbps": statistics.median(rates) if rates else None,
                "not_ok": sum(not r["ok"] for r in mine),
                "blamed": sorted({k for r in mine for k in r["blamed"]}),
                "excluded": sorted({k for r in mine for k in r["excluded"]}),
            }
        )
        row = rows[-1]
        print(
            f"  {nodes} simulated nodes round {run}: {row['wall_s']:.2f} s; check requests rank 0 "
            f"{row['check_requests_rank0']:g}, others {row['check_requests_others']}; exchange rank 0 "
            f"{row['exchange_ops_rank0']}, others {row['exchange_requests_others']}; blamed {row['blamed']}, "
            f"excluded {row['excluded']}; median {row['median_mbps'] or 0:.0f} Mbit/s",
            flush=True,
        )
    if code != 0:
        errors.append({"error": f"simulation exit code {code}: {' | '.join(lines[-5:])[:600]}"})
    return {"nodes": nodes, "rounds": rows, "errors": errors}


# ------------------------------------------------------------------------------------------------
def markdown(args, hosts: dict, sim: dict, when: str, load_before: str, load_after: str) -> str:
    command = "python benchmarks/node_checks.py" + (" --quick" if args.quick else "")
    out = [
        f"### Node checks (issue #36): `{command}`",
        "",
        f"{when}, {os.cpu_count()} cores, load average {load_before} (start) / {load_after} (end).",
        "",
    ]
    if "skipped" in hosts:
        out += [f"8 hosts: skipped ({hosts['skipped']}).", ""]
    else:
        runs = len(hosts["with_s"])
        out += [
            f"**8 hosts** (network namespaces, real agents, `--nnodes 8:8`, `fsm`, gloo worker; {runs} run(s) each, "
            "alternating): launch → every host's first worker started, median [min-max] s",
            "",
            "| | without the check | with `--node-check-network true` | added (pairwise) | check `seconds` (all agents) | slowest agent's check |",
            "|---|---|---|---|---|---|",
            f"| 8 hosts | {med_range(hosts['without_s'])} | {med_range(hosts['with_s'])} | "
            f"{med_range(hosts['added_s'])} | {med_range(hosts['check_s'])} | {med_range(hosts['check_max_s'])} |",
            "",
        ]
        if hosts["failed"]:
            out += [f"Failed runs (left out): {len(hosts['failed'])}.", ""]
    rows = sim["rounds"]
    if rows:
        walls = [r["wall_s"] for r in rows]
        req0 = sorted({r["check_requests_rank0"] for r in rows})
        reqo = sorted({v for r in rows for v in r["check_requests_others"]})
        exo = sorted({v for r in rows for v in r["exchange_requests_others"]})
        ops0 = collections.Counter()
        for r in rows:
            ops0.update(r["exchange_ops_rank0"])
        ops0 = {k: round(v / len(rows), 1) for k, v in sorted(ops0.items())}
        others_ops = rows[0]["exchange_ops_others"][0] if rows[0]["exchange_ops_others"] else {}
        blamed = sorted({b for r in rows for b in r["blamed"] + r["excluded"]})
        out += [
            f"**{sim['nodes']} simulated nodes** (processes on loopback, one real TCPStore, real `run_checks` + "
            f"`exchange` with the network check; {len(rows)} rounds)",
            "",
            "| round wall s p50 / max | check store requests per node (rank 0 / others) | exchange requests per node "
            "(others / rank 0, mean by op) | check rounds | blamed or excluded |",
            "|---|---|---|---|---|",
            f"| {statistics.median(walls):.2f} / {max(walls):.2f} | {'/'.join(f'{v:g}' for v in req0)} / "
            f"{'/'.join(f'{v:g}' for v in reqo)} | {'/'.join(str(v) for v in exo)} ({others_ops}) / {ops0} | "
            f"{sorted({r['check_rounds'] for r in rows})} | {len(blamed)} {blamed if blamed else ''} |",
            "",
        ]
    mbps = [r["median_mbps"] for r in rows if r["median_mbps"]]
    sim_mbps = f"{min(mbps):.0f}-{max(mbps):.0f} Mbit/s per round" if mbps else "not measured"
    if sim["errors"]:
        out += [f"Simulation errors: {sim['errors'][:3]}", ""]
    out += [
        "Limits: the 8 hosts are namespaces on one machine (veth + bridge, no real NIC); their agents and "
        "workers share its cores. The simulated nodes are processes sharing the cores and loopback "
        f"(median link bandwidth {sim_mbps}): the round is CPU-bound, and there is no agent, rendezvous "
        "or worker in it. Compare these times only with runs on the same machine.",
    ]
    return "\n".join(out) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 run each way, 1 simulated round")
    parser.add_argument("--runs", type=int, default=None, help="8-host runs each way (default 3; --quick 1)")
    parser.add_argument("--rounds", type=int, default=None, help="simulated rounds (default 3; --quick 1)")
    parser.add_argument("--nodes", type=int, default=64, help="simulated nodes (default 64)")
    parser.add_argument("--timeout", type=float, default=30.0, help="simulated --node-check-timeout (s)")
    parser.add_argument("--skip", choices=("hosts", "simulated"), action="append", default=[])
    parser.add_argument("--json", type=Path, help="write every value here")
    parser.add_argument("--markdown", type=Path, help="write the Markdown section here")
    parser.add_argument("--_sim-parent", dest="sim_parent", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sim_parent is not None:
        return sim_parent(args.nodes, args.sim_parent, args.rounds or 1, args.timeout)
    runs = args.runs or (1 if args.quick else 3)
    rounds = args.rounds or (1 if args.quick else 3)
    when = time.strftime("%Y-%m-%d %H:%M %Z")
    load_before = load_average()
    print(f"node checks benchmark, {when}, load average {load_before}", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="fsmbench_nodechecks_"))
    try:
        hosts_raw = {"skipped": "--skip hosts"} if "hosts" in args.skip else bench_hosts(runs, workdir)
        if "skipped" in hosts_raw:
            print(f"  8 hosts: skipped: {hosts_raw['skipped']}", flush=True)
        sim = {"nodes": args.nodes, "rounds": [], "errors": []}
        if "simulated" not in args.skip:
            sim = bench_simulated(args.nodes, rounds, args.timeout, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    hosts = summarize_hosts(hosts_raw)
    text = markdown(args, hosts, sim, when, load_before, load_average())
    print("\n" + text)
    if args.markdown:
        args.markdown.write_text(text)
    if args.json:
        args.json.write_text(json.dumps({"hosts": hosts_raw, "hosts_summary": hosts, "simulated": sim}, indent=1))
    failed = (hosts.get("failed") if "skipped" not in hosts else None) or sim["errors"]
    blamed = any(r["blamed"] or r["excluded"] or r["not_ok"] for r in sim["rounds"])
    return 1 if failed or blamed or ("simulated" not in args.skip and not sim["rounds"]) else 0


if __name__ == "__main__":
    sys.exit(main())
