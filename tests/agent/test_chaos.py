"""Seeded chaos: random faults against real agents and workers, with invariants checked per trial.

CI runs a few trials; run more with ``CHAOS_TRIALS=100 CHAOS_SEED=7 python -m pytest tests/agent/test_chaos.py -q -s``
(``-s`` shows the report line). The seed draws the order of the faults (each stretch of
``len(FAULTS)`` trials is a seeded shuffle of FAULTS, so with ``CHAOS_TRIALS >= len(FAULTS)`` every
fault appears at least once; the CI default of 6 covers them all) and each trial's parameters; a
longer run with the same seed starts with the same trials as a shorter one.

Single-node faults (``worker_crash``, ``worker_sigkill``, ``worker_hang``, ``agent_sigterm``,
``agent_sigkill``): one ``fsm-agent run --standalone --nproc-per-node 2 --max-restarts 1
--hang-timeout 1`` on a worker that heartbeats for about 1.5 s; the fault hits a drawn rank after a
drawn delay. Checked: zero processes of the job survive, no worker cgroup of its agent is left
(the keeper of a SIGKILLed agent removes it), the exit code and the verdict fit the fault, and
every worker's logs are kept.

``node_loss``: two agents on loopback form one job with the ``fsm`` rendezvous backend
(``--nnodes 1:2 --rdzv-endpoint 127.0.0.1:<free port> --local-addr 127.0.0.1 --nproc-per-node 2
--max-restarts 1 --rdzv-conf last_call_timeout=1``); node ``n0`` starts first and hosts the store,
``n1`` joins once it listens. When the 2-node round runs its 4 workers (WORLD_SIZE=4; they wait,
as training would, until a node is lost), the drawn victim dies as a node does: SIGKILL to its
agent's process group and to each of its workers' process groups at once. The victim is drawn:

- ``peer`` (n1): the survivor (the store host) sees the lost lease at once: its first transition
  after the kill is ``membership_changed`` with ``failure_class`` ``node_lost`` (its workers do not
  talk to each other, so they cannot fail first: a ``workers_failed`` would be a bug here), then
  ``restart`` and ``workers_succeeded``: it re-rendezvouses alone, runs 2 workers with WORLD_SIZE=2
  (restart count still 0: a node loss is not counted) and exits 0;
- ``store_host`` (n0): docs/failure-handling.md ("Which rendezvous backend survives what") promises
  that the survivors of the store host's loss *fail* with one line naming the endpoint, unless the
  store runs outside the agents: the survivor's trace after the kill is ``membership_changed``
  (``node_lost``), ``rendezvous_failed``, its exit code 1 and its ``Root Cause`` names
  ``endpoint=127.0.0.1:<port>``.

Either way: the survivor ends within NODE_LOSS_BOUND_S, the victim died of SIGKILL, zero
processes of either node survive (the pids the workers recorded, the agents, and every descendant
of the agents seen at the kill, cgroup keepers included), no worker cgroup of either agent is
left, and the worker logs of both nodes (``--log-dir``) hold what their last round printed.
The survivor keeps its logs of the WORLD_SIZE=4 round too: the re-rendezvous is not a counted
restart, so the new round reuses ``attempt_0`` and the earlier one moves to ``attempt_0.1``.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import psutil
import pytest

from fsm_agent.testing.conformance import free_port
from fsm_agent.testing.processes import remove_worker_cgroups, tmpdir_env, wait_until
from tests.helpers.events import read_events

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

TRIALS = int(os.environ.get("CHAOS_TRIALS", "12"))  # two rounds of FAULTS: both node_loss victims
SEED = int(os.environ.get("CHAOS_SEED", "20261130"))
FAULTS = ("worker_crash", "worker_sigkill", "worker_hang", "agent_sigterm", "agent_sigkill", "node_loss")
VICTIMS = ("store_host", "peer")  # node_loss: n0 (hosts the fsm store) or n1
#: the kill -> the survivor's exit. Measured on loopback: about 0.1 s after a peer's loss; 3 s after the
#: store host's (the survivor's store client retries the dead endpoint for handshake_timeout first).
NODE_LOSS_BOUND_S = 90.0

WORKER = textwrap.dedent("""
    import glob, os, sys, time
    import fsm_agent
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank = int(os.environ["RANK"])
    fault, fault_rank, delay = os.environ.get("CHAOS_FAULT", "none:0:0").split(":")
    print(f"worker {rank} attempt {attempt} running", flush=True)  # before the pid file the harness waits for
    open(os.path.join(os.environ["CHAOS_DIR"], f"pid_{attempt}_{rank}_{os.getpid()}"), "w").close()
    if fault == "worker_crash" and attempt == 0 and rank == int(fault_rank):
        # Crash only once every peer has printed: the restart stops a peer that has not, and the
        # invariants check every attempt-0 stdout.log. Outside the 1.5 s loop: a slow peer must
        # not turn the crash into no crash.
        peers = [r for r in range(int(os.environ["WORLD_SIZE"])) if r != rank]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(
                glob.glob(os.path.join(os.environ["CHAOS_DIR"], f"pid_0_{r}_*")) for r in peers):
            time.sleep(0.01)
    start = time.monotonic()
    while time.monotonic() - start < 1.5:
        fsm_agent.heartbeat(0.05)
        if attempt == 0 and rank == int(fault_rank) and time.monotonic() - start > float(delay):
            if fault == "worker_crash":
                print("crashing on purpose", file=sys.stderr, flush=True)
                sys.exit(3)
            if fault == "worker_hang":
                time.sleep(600)
        time.sleep(0.02)
    print(f"worker {rank} attempt {attempt} done", flush=True)
""")

#: node_loss: trains (sleeps) until the harness says a node is lost, at most 60 s; a round after the
#: loss (WORLD_SIZE=2) ends at once. A 1-node round formed before n1 joined (WORLD_SIZE=2, no loss
#: yet) trains on too, until n1's join re-rendezvouses it into the 2-node round.
NODE_WORKER = textwrap.dedent("""
    import os, time
    chaos_dir = os.environ["CHAOS_DIR"]
    node, world, rank = os.environ["CHAOS_NODE"], int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    open(os.path.join(chaos_dir, f"pid_{node}_{world}_{attempt}_{rank}_{os.getpid()}"), "w").close()
    print(f"worker {rank} world {world} attempt {attempt} running", flush=True)
    lost = os.path.join(chaos_dir, "node_lost")
    deadline = time.monotonic() + 60
    while (world != 2 or not os.path.exists(lost)) and time.monotonic() < deadline:
        time.sleep(0.05)
    print(f"worker {rank} world {world} attempt {attempt} done", flush=True)
""")


# -- the draw ----------------------------------------------------------------------------------------


def draw_trials(rng: random.Random, trials: int) -> list[dict]:
    """Each trial's fault and parameters. Every ``len(FAULTS)`` trials are a seeded shuffle of FAULTS;
    node_loss victims likewise cycle through a seeded shuffle of VICTIMS (two node losses: both)."""
    plan, order, victims = [], [], []
    for _ in range(trials):
        if not order:
            order = rng.sample(FAULTS, len(FAULTS))
        trial = {"fault": order.pop(0), "rank": rng.randrange(2), "delay": round(rng.uniform(0.2, 0.8), 2)}
        if trial["fault"] == "node_loss":
            if not victims:
                victims = rng.sample(VICTIMS, len(VICTIMS))
            trial["victim"] = victims.pop(0)
        plan.append(trial)
    return plan


# -- processes ---------------------------------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _job_pids(chaos_dir: Path) -> list[int]:
    return [int(p.name.rsplit("_", 1)[1]) for p in chaos_dir.glob("pid_*")]


def _descendants(pid: int) -> set[int]:
    try:
        return {p.pid for p in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def _listens(pid: int, port: int) -> bool:
    try:
        return any(
            c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
            for c in psutil.Process(pid).net_connections("tcp")
        )
    except psutil.Error:
        return False


def _killpg(pgid: int) -> None:
    if pgid == os.getpgrp():  # never the test's own group
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def _end_all(agents: list[subprocess.Popen], pids: set[int]) -> tuple[bool, list[int], list[str]]:
    """Teardown, also after a failed assertion: SIGKILL each agent's process group, reap the agents,
    then wait a little for every tracked pid to end by itself and SIGKILL (by pid) what did not.
    The tracked pids include the agents' cgroup keepers: each gets those seconds to remove its
    agent's worker cgroup; one killed here cannot, so what is left of the agents' worker cgroups
    is then removed too.
    Returns (everything ended by itself, the pids that had to be killed, the worker cgroups that were left)."""
    for agent in agents:
        if agent.poll() is None:
            pids |= _descendants(agent.pid)
        _killpg(agent.pid)
    for agent in agents:
        try:
            agent.wait(timeout=10)
        except subprocess.TimeoutExpired:
            agent.kill()
    gone = wait_until(lambda: not any(_alive(p) for p in pids), 10)
    leftover = [p for p in sorted(pids) if _alive(p)]
    for pid in leftover:  # never leave them behind, even when the invariant failed
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return gone, leftover, remove_worker_cgroups(agent.pid for agent in agents)


def _start_agent(tmp: Path, name: str, args: list[str], env: dict) -> subprocess.Popen:
    """An agent in its own session; its stdout and stderr go to files (no pipe to fill while we wait).
    Its TMPDIR is ``tmp/tmp``: a SIGKILLed agent's heartbeat directory stays there."""
    with open(tmp / f"{name}.out", "w") as out, open(tmp / f"{name}.err", "w") as err:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "fsm_agent",
                "run",
                "--monitor-interval",
                "0.1",
                "--shutdown-timeout",
                "2",
                "-r",
                "3",
                *args,
            ],
            env={**env, **tmpdir_env(tmp / "tmp")},
            stdout=out,
            stderr=err,
            start_new_session=True,
        )


# -- single-node faults ------------------------------------------------------------------------------


def run_trial(tmp: Path, fault: str, rank: int, delay: float) -> dict:
    chaos_dir, log_dir = tmp / "chaos", tmp / "logs"
    chaos_dir.mkdir(parents=True)
    script = tmp / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "CHAOS_DIR": str(chaos_dir), "CHAOS_FAULT": f"{fault}:{rank}:{delay}"}
    agent = _start_agent(
        tmp,
        "agent",
        [
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--hang-timeout",
            "1",
            "--log-dir",
            str(log_dir),
            "--events-file",
            str(tmp / "events.jsonl"),
            str(script),
        ],
        env,
    )
    tracked: set[int] = {agent.pid}
    try:
        if fault.startswith("agent_") or fault == "worker_sigkill":
            assert wait_until(lambda: len(list(chaos_dir.glob("pid_0_*"))) == 2, 60), "workers never started"
            time.sleep(delay)
            tracked |= _descendants(agent.pid)
            if fault == "worker_sigkill":
                victim = next(p for p in chaos_dir.glob(f"pid_0_{rank}_*"))
                os.kill(int(victim.name.rsplit("_", 1)[1]), signal.SIGKILL)
            else:
                agent.send_signal(signal.SIGTERM if fault == "agent_sigterm" else signal.SIGKILL)
        agent.wait(timeout=120)
    finally:
        tracked |= set(_job_pids(chaos_dir))
        survivors_gone, leftover, cgroups_left = _end_all([agent], tracked)
    out, err = (tmp / "agent.out").read_text(), (tmp / "agent.err").read_text()
    events = read_events(tmp / "events.jsonl", missing_ok=True)
    return {
        "fault": fault,
        "rank": rank,
        "delay": delay,
        "rc": agent.returncode,
        "stderr": err,
        "stdout": out,
        "survivors_gone": survivors_gone,
        "leftover": leftover,
        "cgroups_left": cgroups_left,
        "events": events,
        "log_dir": log_dir,
        "triggers": [e["trigger"] for e in events if e["kind"] == "transition"],
        "notes": [],
    }


def check_invariants(t: dict) -> list[str]:
    if t["fault"] == "node_loss":
        return check_node_loss(t)
    problems = []
    if not t["survivors_gone"]:
        problems.append(f"processes survived: {t['leftover']}")
    if t["cgroups_left"]:
        problems.append(f"worker cgroups outlived their agents and keepers: {t['cgroups_left']}")
    fault, rc, triggers = t["fault"], t["rc"], t["triggers"]
    if fault in ("worker_crash", "worker_sigkill", "worker_hang"):
        if rc != 0:
            problems.append(f"expected a restart and exit 0, got {rc}")
        expected = (
            ["start", "workers_hung", "workers_failed", "restart", "workers_succeeded"]
            if fault == "worker_hang"
            else ["start", "workers_failed", "restart", "workers_succeeded"]
        )
        if triggers != expected:
            problems.append(f"trace {triggers} != {expected}")
    elif fault == "agent_sigterm":
        if rc != 128 + signal.SIGTERM:
            problems.append(f"expected exit 143, got {rc}")
        if "Root Cause" not in t["stderr"] or "signal 15" not in t["stderr"]:
            problems.append("no verdict naming the signal")
        if triggers[-1:] != ["stop_requested"]:
            problems.append(f"trace {triggers} does not end in stop_requested")
    elif fault == "agent_sigkill" and rc != -signal.SIGKILL:
        problems.append(f"expected the agent killed by SIGKILL, got {rc}")
    attempts = list(t["log_dir"].glob("*/attempt_0/*/stdout.log"))
    if len(attempts) != 2 or not all(p.read_text() for p in attempts):
        problems.append(f"worker logs of attempt 0 missing or empty: {attempts}")
    return problems


# -- node loss ---------------------------------------------------------------------------------------


def _markers(chaos_dir: Path, node: str, world: int, skip: frozenset[str] = frozenset()) -> list[tuple[int, int, int]]:
    """(attempt, rank, pid) of the workers node ``node`` ran with WORLD_SIZE=``world`` (but those in ``skip``)."""
    found = []
    for p in chaos_dir.glob(f"pid_{node}_{world}_*"):
        if p.name in skip:
            continue
        _, _, _, attempt, rank, pid = p.name.split("_")
        found.append((int(attempt), int(rank), int(pid)))
    return sorted(found)


def _logs_saying(log_dir: Path, text: str) -> list[Path]:
    return sorted(p for p in log_dir.glob("*/attempt_*/*/stdout.log") if text in p.read_text())


def run_node_loss_trial(tmp: Path, fault: str, rank: int, delay: float, victim: str) -> dict:
    """Two agents, one job; the victim node (n0 hosts the store, n1 does not) dies once 4 workers run."""
    chaos_dir = tmp / "chaos"
    chaos_dir.mkdir(parents=True)
    script = tmp / "worker.py"
    script.write_text(NODE_WORKER)
    port = free_port()
    run_id = f"chaos-{uuid.uuid4().hex[:12]}"
    common = (
        "--nnodes",
        "1:2",
        "--rdzv-backend",
        "fsm",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        run_id,
        "--local-addr",
        "127.0.0.1",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--rdzv-conf",
        "last_call_timeout=1",
    )
    nodes = ("n0", "n1")
    agents: list[subprocess.Popen] = []
    tracked: set[int] = set()
    v = 0 if victim == "store_host" else 1
    killed_at = ended_at = None
    before_kill: frozenset[str] = frozenset()
    survivor_timed_out = False

    def start(node: str) -> subprocess.Popen:
        agent = _start_agent(
            tmp,
            node,
            [*common, "--log-dir", str(tmp / f"logs_{node}"), "--events-file", str(tmp / f"{node}.jsonl"), str(script)],
            {**os.environ, "CHAOS_DIR": str(chaos_dir), "CHAOS_NODE": node},
        )
        agents.append(agent)
        tracked.add(agent.pid)
        return agent

    def exited() -> list[str]:
        return [f"{n} exited {a.returncode}" for n, a in zip(nodes, agents) if a.poll() is not None]

    try:
        host = start("n0")
        assert wait_until(lambda: _listens(host.pid, port) or host.poll() is not None, 60), (
            f"n0 never listened on 127.0.0.1:{port}"
        )
        assert host.poll() is None, f"n0 exited {host.returncode} before n1 started"
        start("n1")

        def four():
            return sum(len(_markers(chaos_dir, n, 4)) for n in nodes) >= 4

        assert wait_until(lambda: four() or exited(), 60) and four(), (
            f"the 2-node round never ran 4 workers ({exited()}; markers {sorted(p.name for p in chaos_dir.iterdir())})"
        )
        time.sleep(delay)
        for agent in agents:
            tracked.update(_descendants(agent.pid))  # workers and cgroup keepers of both nodes
        doomed = [pid for *_, pid in _markers(chaos_dir, nodes[v], 4)]
        before_kill = frozenset(p.name for p in chaos_dir.glob("pid_*"))
        (chaos_dir / "node_lost").touch()  # a round after the loss may end at once
        killed_at = time.time()
        # A node dies: its agent and every worker at once (the launcher gives each worker its own
        # session, so the agent's process group alone would leave them to the parent-death signal).
        _killpg(agents[v].pid)
        for pid in doomed:
            with contextlib.suppress(ProcessLookupError):
                _killpg(os.getpgid(pid))
        try:
            agents[1 - v].wait(timeout=NODE_LOSS_BOUND_S)
            ended_at = time.time()
        except subprocess.TimeoutExpired:
            survivor_timed_out = True
    finally:
        tracked |= set(_job_pids(chaos_dir))
        survivors_gone, leftover, cgroups_left = _end_all(agents, tracked)
    events = read_events(tmp / f"{nodes[1 - v]}.jsonl", missing_ok=True)
    after = [e for e in events if e["kind"] == "transition" and e["ts"] >= killed_at]
    return {
        "fault": fault,
        "rank": rank,
        "delay": delay,
        "victim": victim,
        "port": port,
        "rc": None if survivor_timed_out else agents[1 - v].returncode,
        "victim_rc": agents[v].returncode,
        "stdout": (tmp / f"{nodes[1 - v]}.out").read_text(),
        "stderr": (tmp / f"{nodes[1 - v]}.err").read_text(),
        "survivors_gone": survivors_gone,
        "leftover": leftover,
        "cgroups_left": cgroups_left,
        "tracked": sorted(tracked),
        "events": events,
        "after": after,
        "triggers": [e["trigger"] for e in after],
        "recovery_s": None if ended_at is None else ended_at - killed_at,
        "chaos_dir": chaos_dir,
        "before_kill": before_kill,
        "survivor": nodes[1 - v],
        "lost": nodes[v],
        "log_dir": tmp / f"logs_{nodes[1 - v]}",
        "victim_log_dir": tmp / f"logs_{nodes[v]}",
        "notes": [],
    }


def check_node_loss(t: dict) -> list[str]:
    problems = []
    chaos_dir, survivor = t["chaos_dir"], t["survivor"]
    if not t["survivors_gone"]:
        problems.append(f"processes survived: {t['leftover']}")
    if t["cgroups_left"]:
        problems.append(f"worker cgroups outlived their agents and keepers: {t['cgroups_left']}")
    if t["rc"] is None:
        problems.append(f"the survivor {survivor} did not exit within {NODE_LOSS_BOUND_S:g} s of the loss")
    if t["victim_rc"] != -signal.SIGKILL:
        problems.append(f"expected the lost node's agent killed by SIGKILL, got {t['victim_rc']}")
    # The 2-node round: the store host n0 ranks first (global ranks 0, 1), n1 next (2, 3).
    for node, ranks in (("n0", [0, 1]), ("n1", [2, 3])):
        got = [r for _, r, _ in _markers(chaos_dir, node, 4)]
        if got != ranks:
            problems.append(f"{node}'s workers had ranks {got} of WORLD_SIZE=4, expected {ranks}")
    triggers, after = t["triggers"], t["after"]
    if not after or after[0]["trigger"] != "membership_changed" or after[0].get("failure_class") != "node_lost":
        problems.append(
            f"the survivor's first transition after the loss is not membership_changed/node_lost: "
            f"{[(e['trigger'], e.get('failure_class')) for e in after]}"
        )
    if t["victim"] == "peer":
        if t["rc"] not in (None, 0):
            problems.append(f"expected the survivor to re-rendezvous alone and exit 0, got {t['rc']}")
        if triggers != ["membership_changed", "restart", "workers_succeeded"]:
            problems.append(f"trace after the loss {triggers} != membership_changed, restart, workers_succeeded")
        final = _markers(chaos_dir, survivor, 2, skip=t["before_kill"])
        restarted = {w["pid"]: w["world_size"] for e in after if e["trigger"] == "restart" for w in e["workers"]}
        if [(a, r) for a, r, _ in final] != [(0, 0), (0, 1)] or restarted != {pid: 2 for *_, pid in final}:
            problems.append(
                f"the survivor's workers after the loss were not ranks 0, 1 of WORLD_SIZE=2 at restart "
                f"count 0: markers {final}, restart event {restarted}"
            )
        others = (
            {p.name for p in chaos_dir.glob("pid_*")}
            - t["before_kill"]
            - {f"pid_{survivor}_2_{a}_{r}_{pid}" for a, r, pid in final}
        )
        if others:
            problems.append(f"other workers ran after the loss: {sorted(others)}")
        ends = [e for e in t["events"] if e["kind"] == "run_end"]
        if not ends or ends[-1].get("restart_count") != 0:
            problems.append(f"the node loss was counted as a restart: {ends[-1:]}")
        final_logs = _logs_saying(t["log_dir"], "world 2 attempt 0 done")
        if len(final_logs) != 2:
            problems.append(f"the survivor's logs of its WORLD_SIZE=2 round are missing: {final_logs}")
        if len(_logs_saying(t["log_dir"], "world 4 attempt 0 running")) != 2:
            problems.append(f"the survivor's logs of the WORLD_SIZE=4 round are missing: {t['log_dir']}")
    else:
        if t["rc"] not in (None, 1):
            problems.append(f"expected the survivor of the store host's loss to fail with exit 1, got {t['rc']}")
        if triggers != ["membership_changed", "rendezvous_failed"]:
            problems.append(f"trace after the loss {triggers} != membership_changed, rendezvous_failed")
        if "Root Cause" not in t["stderr"] or f"endpoint=127.0.0.1:{t['port']}" not in t["stderr"]:
            problems.append(f"no verdict naming the store's endpoint 127.0.0.1:{t['port']}")
        others = {p.name for p in chaos_dir.glob("pid_*")} - t["before_kill"]
        if others:
            problems.append(f"workers ran after the store host was lost: {sorted(others)}")
        if len(_logs_saying(t["log_dir"], "world 4 attempt 0 running")) != 2:
            problems.append(f"the survivor's logs of the WORLD_SIZE=4 round are missing: {t['log_dir']}")
    if len(_logs_saying(t["victim_log_dir"], "world 4 attempt 0 running")) != 2:
        problems.append(f"the lost node's logs of the WORLD_SIZE=4 round are missing: {t['victim_log_dir']}")
    return problems


# -- the test ----------------------------------------------------------------------------------------


def test_every_fault_is_drawn_when_trials_allow():
    for seed in (SEED, 7, 0):
        plan = draw_trials(random.Random(seed), len(FAULTS))
        assert sorted(t["fault"] for t in plan) == sorted(FAULTS)
        longer = draw_trials(random.Random(seed), 3 * len(FAULTS) + 1)
        assert longer[: len(FAULTS)] == plan  # more trials extend the same run
        two_rounds = draw_trials(random.Random(seed), 2 * len(FAULTS))
        assert sorted(t["victim"] for t in two_rounds if "victim" in t) == sorted(VICTIMS)


def test_chaos(tmp_path):
    plan = draw_trials(random.Random(SEED), TRIALS)
    report = []
    started = time.monotonic()
    for trial, params in enumerate(plan):
        began = time.monotonic()
        run = run_node_loss_trial if params["fault"] == "node_loss" else run_trial
        result = run(tmp_path / f"trial_{trial}", **params)
        problems = check_invariants(result)
        what = params["fault"] + (f"({params['victim']})" if "victim" in params else "")
        report.append((trial, what, result["rc"], time.monotonic() - began, result["notes"], problems))
        assert not problems, (
            f"trial {trial} ({what} rank {params['rank']} after {params['delay']}s): "
            f"{problems}\n{result['stderr'][-3000:]}"
        )
    held = sum(1 for *_, p in report if not p)
    notes = sorted({n for *_, ns, _ in report for n in ns})
    print(
        f"\nchaos: seed={SEED} trials={TRIALS} invariants held in {held}/{TRIALS} "
        f"({time.monotonic() - started:.1f} s): "
        + ", ".join(f"{w}->{rc} {s:.1f}s" for _, w, rc, s, _, _ in report)
        + "".join(f"\nchaos: note: {n}" for n in notes)
    )
