"""A preempted node (its agent SIGTERMed, as Slurm or Kubernetes do) is a membership change for
the others, not a failure: real agents on loopback (``fsm``, ``--nnodes 2:2``, a hot spare), real
gloo workers in an ``all_reduce`` loop, ``--max-restarts 0``.

The SIGTERMed agent stops its workers before it leaves the round; the survivor's workers, in a
collective with them, fail some 100 ms later, before the survivor can see the node leave. The
leaving agent tells the round first (``NodeDrain.announce_leaving``, the ``stop_requested`` row's
``_announce_leaving``), so the survivor takes its failed workers as the lost node
(``membership_changed``, ``node_lost``, not counted); the spare takes the seat and the job
completes. Before that, the survivor counted a restart and, with none left, failed the job
(reliably under ``--launcher preload``, whose agent leaves the round after its zygote's shutdown).
"""

from __future__ import annotations

import signal

import pytest

from fsm_agent.testing.node_loss import NodeLossJob
from tests.agent.test_hot_spares import AFTER_LOSS, PROMOTED, fsm_flags, start_host_then, wait_for_standby
from tests.conftest import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

#: NodeLossJob's worker contract (a start record ``start_<name>_<world>_<pid>.json``; ``out/finish``
#: read at start ends the next world), with a gloo ``all_reduce`` every 50 ms: a peer's workers
#: stopping breaks this one's collective, as in training.
#: The start record and the loop (``STEP`` is one step's work) of the workers below.
_START_AND_LOOP = r"""
record = {"name": name, "pid": os.getpid(), "ts": time.time(), "world": int(os.environ["WORLD_SIZE"]),
          "group_rank": int(os.environ["GROUP_RANK"]), "group_world": int(os.environ["GROUP_WORLD_SIZE"]),
          "restart_count": int(os.environ["TORCHELASTIC_RESTART_COUNT"])}
path = os.path.join(out, "start_%s_%d_%d.json" % (name, record["world"], os.getpid()))
with open(path + ".tmp", "w") as f:
    json.dump(record, f)
os.replace(path + ".tmp", path)
deadline = time.time() + 600
steps = 0
while time.time() < deadline and not (finish and steps >= 20):  # until stopped, or 20 steps
    STEP
    steps += 1
    time.sleep(0.05)
"""
GLOO_WORKER = (
    r"""
import datetime, json, os, sys, time
import torch
import torch.distributed as dist

out, name = sys.argv[1], sys.argv[2]
finish = os.path.exists(os.path.join(out, "finish"))
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
dist.all_reduce(torch.ones(1))  # the group is formed: record the start
"""
    + _START_AND_LOOP.replace("STEP", "dist.all_reduce(torch.ones(1))")
    + """
dist.destroy_process_group()
sys.exit(0 if finish else 5)
"""
)


def preempt_b(job_factory, worker: str, *flags: str) -> tuple[NodeLossJob, float]:
    """Nodes a (the store's host) and b run ``worker``, c waits as the spare; the world is told to
    finish next, and b's agent is SIGTERMed. Returns the job and the time of the signal."""
    port = free_port()
    job: NodeLossJob = job_factory([*fsm_flags(port), *flags])
    job.script.write_text(worker)
    start_host_then(job, port, "b")  # a hosts the store: b is the node to preempt
    job.wait_for_world(2, {"a", "b"}, timeout=180)
    job.start("c")
    wait_for_standby(job, "c")
    job.finish_next_world()
    preempted_at = job.lose("b", signal.SIGTERM)  # returns once b's agent has exited
    assert job.agent("b").returncode == 128 + signal.SIGTERM, job.diagnostics()
    return job, preempted_at


@pytest.mark.parametrize("launcher", ["preload", "subprocess"])
def test_sigtermed_node_is_a_membership_change_not_a_restart(job_factory, launcher):
    job, preempted_at = preempt_b(job_factory, GLOO_WORKER, "--launcher", launcher, "--shutdown-timeout", "10")
    job.wait_for_world(2, {"a", "c"}, timeout=180, since=preempted_at, running={"a", "c"})
    codes = {name: job.agent(name).wait(120) for name in "ac"}
    assert codes == {"a": 0, "c": 0}, job.diagnostics()

    # the survivor re-rendezvoused without counting (its failed workers were the lost node)
    assert job.transitions("a", since=preempted_at) == AFTER_LOSS, job.diagnostics()
    assert job.first_transition("a", "membership_changed", preempted_at)["failure_class"] == "node_lost"
    assert job.transitions("c") == PROMOTED, job.diagnostics()
    after = sorted((r["name"], r["group_world"], r["restart_count"]) for r in job.records() if r["ts"] >= preempted_at)
    assert after == [("a", 2, 0), ("c", 2, 0)], job.records()
    assert all(e["restart_count"] == 0 for name in "ac" for e in job.events(name)), job.diagnostics()


#: The worker contract above without collectives (so nothing here fails when a peer's workers stop,
#: as under ``--restart-mode inprocess``, where survivors wait for a new generation instead), and
#: node b's workers take STALL_S seconds to stop on SIGTERM (a checkpoint on the way out).
STALL_S = 6
QUIET_WORKER = (
    f"""
import json, os, signal, sys, time

out, name = sys.argv[1], sys.argv[2]
finish = os.path.exists(os.path.join(out, "finish"))
def stop(*_):
    if name == "b":
        time.sleep({STALL_S})
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
"""
    + _START_AND_LOOP.replace("STEP", "pass")
    + """
sys.exit(0 if finish else 5)
"""
)


def test_a_survivor_whose_workers_do_not_fail_hears_the_announcement_before_the_node_has_left(job_factory):
    """The announcement itself is the membership change (the store tells the survivor through its
    held watch): the survivor stops its workers while the preempted node is still stopping its own
    (STALL_S seconds), not once that node has left the round. (The next round still forms once it
    has left: until then it holds its seat, and its workers may be saving a checkpoint the round
    restores from.)"""
    job, preempted_at = preempt_b(job_factory, QUIET_WORKER, "--shutdown-timeout", "30")
    b_ended = next(e["ts"] for e in job.events("b") if e["kind"] == "run_end")
    assert b_ended - preempted_at >= STALL_S - 0.5, job.diagnostics()
    heard = job.first_transition("a", "membership_changed", preempted_at)
    assert heard["failure_class"] == "node_lost" and heard["ts"] < b_ended - 1, job.diagnostics()
    job.wait_for_world(2, {"a", "c"}, timeout=180, since=preempted_at, running={"a", "c"})
    codes = {name: job.agent(name).wait(120) for name in "ac"}
    assert codes == {"a": 0, "c": 0}, job.diagnostics()
    assert job.transitions("a", since=preempted_at) == AFTER_LOSS, job.diagnostics()
    assert job.transitions("c") == PROMOTED, job.diagnostics()
