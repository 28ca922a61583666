"""fsm-agent under a real Slurm cluster (tests/schedulers/slurm/conftest.py): srun, sbatch, preemption, lost nodes.

Every job runs examples/train_digits.py (DDP, gloo between the nodes' namespaces over the veth
network) with ``fsm-agent run`` and nothing but ``--nproc-per-node`` and the test's own flags:
nodes, node rank, endpoint and run id come from the job step (scheduler-slurm).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsm_agent.testing.processes import wait_until

from .conftest import REPO

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

ACCURACY = 0.95  # what the example reaches (tests/agent/test_train_example.py)


def agent_command(out: Path, *flags: str, epochs: int = 10, train: tuple[str, ...] = ()) -> list[str]:
    """One task's command: record the node and the agent's pid, then exec fsm-agent."""
    run = [
        sys.executable,
        "-m",
        "fsm_agent",
        "run",
        "--nproc-per-node",
        "1",
        *flags,
        "examples/train_digits.py",
        "--epochs",
        str(epochs),
        "--checkpoint",
        str(out / "ckpt.pt"),
        "--result-file",
        str(out / "result.json"),
        *train,
    ]
    record = f'hostname >> {out}/host.$SLURM_NODEID; echo $$ >> {out}/agent.$SLURM_NODEID.pid; exec "$@"'
    return ["bash", "-c", record, "agent", *run]


class Step:
    """An ``srun`` in the background, its output in a file."""

    def __init__(self, slurm, srun_flags: tuple[str, ...], command: list[str]):
        self.slurm, self.log = slurm, slurm.out / "srun.out"
        self.started = time.monotonic()
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                ["srun", *srun_flags, *command],
                env=slurm.env,
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, text: str, timeout: float) -> None:
        assert (
            wait_until(lambda: text in self.output() or self.proc.poll() is not None, timeout=timeout, interval=0.2)
            and text in self.output()
        ), f"no {text!r} within {timeout}s:\n{self.output()[-3000:]}"

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise AssertionError(f"srun did not end within {timeout}s:\n{self.output()[-3000:]}") from None

    def result(self) -> dict:
        path = self.slurm.out / "result.json"
        assert path.exists(), f"no result file:\n{self.output()[-3000:]}"
        return json.loads(path.read_text())


@pytest.fixture
def steps():
    started: list[Step] = []
    yield started
    for step in started:  # srun is this test's child: stop it by its process group
        if step.proc.poll() is None:
            os.killpg(step.proc.pid, signal.SIGKILL)
            step.proc.wait()


def srun(slurm, steps, *srun_flags: str, command: list[str]) -> Step:
    step = Step(slurm, ("-N2", "--ntasks-per-node=1", *srun_flags), command)
    steps.append(step)
    return step


def test_srun_trains_with_ddp_across_two_nodes(slurm, steps):
    step = srun(slurm, steps, command=agent_command(slurm.out))
    assert step.wait(timeout=240) == 0, step.output()[-3000:]
    result = step.result()
    assert result["world_size"] == 2 and result["test_accuracy"] >= ACCURACY
    assert result["run_id"].startswith("slurm-") and result["run_id"].endswith(".0.0")
    hosts = {(slurm.out / f"host.{i}").read_text().strip() for i in (0, 1)}
    assert hosts == {"node1", "node2"}  # one agent per namespaced node, gloo between them
    sys.stderr.write(f"\nsrun DDP training on 2 nodes: {time.monotonic() - step.started:.1f}s\n")


def test_a_failed_worker_restarts_the_group_on_the_same_nodes(slurm, steps):
    step = srun(
        slurm,
        steps,
        command=agent_command(slurm.out, "--max-restarts", "1", train=("--crash-rank", "1", "--crash-epoch", "3")),
    )
    assert step.wait(timeout=240) == 0, step.output()[-3000:]
    result = step.result()
    assert result["world_size"] == 2 and result["restart_count"] == 1 and result["resumed_from"] == 2
    assert result["test_accuracy"] >= ACCURACY
    assert "injecting crash at epoch 3" in step.output()


def test_several_tasks_per_node_is_a_one_line_error(slurm, steps):
    step = Step(
        slurm, ("-N1", "--ntasks-per-node=2"), [sys.executable, "-m", "fsm_agent", "run", "examples/train_digits.py"]
    )
    steps.append(step)
    assert step.wait(timeout=120) == 2
    errors = [line for line in step.output().splitlines() if line.startswith("fsm-agent: error:")]
    assert len(errors) == 2, step.output()
    assert all("Slurm started 2 fsm-agent tasks on this node" in e and "one task per node" in e for e in errors)
    assert "Traceback" not in step.output()


def survivor_result(step: Step) -> dict:
    result = step.result()
    assert result["world_size"] == 1 and result["test_accuracy"] >= ACCURACY
    assert result["resumed_from"] is not None  # from the checkpoint of the two-node round
    return result


def test_a_killed_agent_is_survived_with_nnodes_min_max(slurm, steps):
    """A task exit (the agent on node2 SIGKILLed): the first node's agent carries on alone."""
    step = srun(slurm, steps, command=agent_command(slurm.out, "--nnodes", "1:2", epochs=25))
    step.wait_for("epoch 3/", timeout=180)
    os.kill(int((slurm.out / "agent.1.pid").read_text().split()[0]), signal.SIGKILL)
    rc = step.wait(timeout=240)
    assert rc == 137 or rc == 9, step.output()[-3000:]  # srun reports the killed task
    survivor_result(step)


def node_down(slurm, node: int) -> bool:
    return "down" in slurm.run("sinfo", "-h", "-n", f"node{node}", "-o", "%t", check=False).stdout


def test_a_lost_node_is_survived_with_no_kill(slurm, steps):
    """node2 dies (every process in its namespace, slurmd included): with --no-kill the step goes on
    on node1, whose agent re-rendezvouses alone (--nnodes 1:2) and finishes the training, after
    Slurm has declared node2 down (SlurmdTimeout)."""
    stop = slurm.out / "stop"
    step = srun(
        slurm,
        steps,
        "--no-kill",
        command=agent_command(slurm.out, "--nnodes", "1:2", epochs=100000, train=("--stop-file", str(stop))),
    )
    step.wait_for("epoch 3/", timeout=180)
    slurm.kill_node(2)
    assert wait_until(lambda: node_down(slurm, 2), timeout=90, interval=0.5), "Slurm did not see node2 fail"
    assert step.proc.poll() is None, f"the step ended with the node:\n{step.output()[-2000:]}"
    stop.touch()  # Slurm declared the node down and the step lives on: let the survivor finish
    step.wait(timeout=300)
    survivor_result(step)
    assert "appeared: training ends" in step.output()


def test_a_lost_node_without_no_kill_ends_the_step(slurm, steps):
    """The same loss without --no-kill: Slurm ends the whole step once it declares the node down."""
    step = srun(slurm, steps, command=agent_command(slurm.out, "--nnodes", "1:2", epochs=100000))
    step.wait_for("epoch 3/", timeout=180)
    slurm.kill_node(2)
    assert step.wait(timeout=180) != 0
    assert node_down(slurm, 2)
    assert not (slurm.out / "result.json").exists(), step.output()[-3000:]


def test_train_sbatch_checkpoints_on_usr1_and_resumes_after_preemption_and_requeue(slurm):
    """examples/slurm/train.sbatch: the time-limit warning (SIGUSR1 to the batch shell, as
    --signal=B:USR1@N sends it) makes a checkpoint and training go on; a job of the higher
    partition preempts it (SIGTERM, GraceTime): the workers checkpoint, fsm-agent exits 143, the
    script requeues the job, and the requeued job resumes from the checkpoint under a new run id."""
    started = time.monotonic()
    log = slurm.out / "train.out"
    job = slurm.sbatch(
        "--output",
        str(log),
        "examples/slurm/train.sbatch",
        "--epochs",
        "40",
        "--result-file",
        str(slurm.out / "result.json"),
        env={"CHECKPOINT": str(slurm.out / "ckpt.pt"), "PYTHON": sys.executable},
    )

    def text() -> str:
        return log.read_text(errors="replace") if log.exists() else ""

    def wait_text(needle: str, timeout: float) -> None:
        assert wait_until(lambda: needle in text(), timeout=timeout, interval=0.2), (
            f"no {needle!r} in the job's output within {timeout}s:\n{text()[-3000:]}"
        )

    wait_text("epoch 2/", timeout=180)
    slurm.run("scancel", "--signal=USR1", "--batch", str(job))
    wait_text("[rank 0] checkpoint saved on SIGUSR1", timeout=60)
    urgent = slurm.sbatch(
        "-p", "urgent", "-N2", "--exclusive", "--output", str(slurm.out / "urgent.out"), "--wrap", "hostname"
    )
    info = slurm.wait_job(job, ("PENDING",), timeout=120)
    assert info["Restarts"] == "1", info
    assert "[rank 0] checkpoint saved on SIGTERM" in text() and "fsm-digits: requeueing" in text()
    slurm.wait_job(urgent, ("COMPLETED",), timeout=60)
    # A requeued job may not start before a BeginTime Slurm sets 2 minutes ahead; start it 3 s from
    # now instead (not at once: a launch within the second of the requeue finds the job's credential
    # revoked, and Slurm fails the job).
    slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now+3")
    slurm.wait_job(job, ("COMPLETED",), timeout=240)
    result = json.loads((slurm.out / "result.json").read_text())
    assert result["run_id"] == f"slurm-{job}.0.1"  # the requeued job met a fresh rendezvous
    assert result["resumed_from"] is not None and result["resumed_from"] >= 1
    assert result["world_size"] == 2 and result["test_accuracy"] >= ACCURACY
    assert "requeued 1 times" in text()
    sys.stderr.write(f"\ntrain.sbatch preempted, requeued and finished: {time.monotonic() - started:.1f}s\n")


def test_salloc_shell_is_not_a_step_and_srun_inside_it_is_discovered(slurm):
    """``fsm-agent config`` in salloc's shell discovers nothing (no job step); in an srun step of the
    same allocation each node's values come from Slurm, with source ``slurm``."""
    config = f"{sys.executable} -m fsm_agent config --json"
    script = (
        f"{config} > {slurm.out}/shell.json && "
        f"srun --ntasks-per-node=1 bash -c '{config} > {slurm.out}/step.$SLURM_NODEID.json'"
    )
    done = slurm.run("salloc", "-N2", "bash", "-c", script, timeout=120)
    shell = json.loads((slurm.out / "shell.json").read_text())["values"]
    assert shell["nnodes"]["source"] == "default" and shell["rendezvous.node_rank"]["source"] == "default", done.stderr
    for node_id in (0, 1):
        values = json.loads((slurm.out / f"step.{node_id}.json").read_text())["values"]
        assert values["rendezvous.node_rank"] == {"value": node_id, "source": "slurm SLURM_NODEID"}
        assert values["nnodes"] == {"value": "2:2", "source": "slurm SLURM_STEP_NUM_NODES"}
        assert values["rendezvous.endpoint"]["value"].startswith("node1:")
        assert values["rendezvous.backend"]["value"] == "fsm"
        assert re.fullmatch(r"slurm-\d+\.0\.0", values["rendezvous.run_id"]["value"])
