"""A real Slurm cluster for the tests of this directory: slurmctld and two slurmd nodes, each node in
its own network namespace (``node1`` 10.77.0.11, ``node2`` 10.77.0.12, on a bridge whose .1 is the
controller), started once per session by ``.ci/slurm-up.sh`` and always removed by
``.ci/slurm-down.sh`` (jobs cancelled, every process left in a node's namespace SIGKILLed by pid,
daemons stopped by their saved pids, namespaces, veths, bridge and the cluster's directory deleted).

Jobs run fsm-agent from this checkout: the tests' environment (``PYTHONPATH`` included) is exported
to every job. Agents the tests start record their pids (``agent.pids``) so that the worker cgroups
of agents killed with their node are removed afterwards (``remove_worker_cgroups``).

Skips, with the reason, where the cluster cannot be had: not root, no ``ip``/``nsenter``/``unshare``,
network namespaces refused, or Slurm not installed and ``.ci/install-slurm.sh`` unable to install it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from fsm_agent.testing.processes import remove_worker_cgroups, tmpdir_env, wait_until

REPO = Path(__file__).resolve().parents[3]
UP, DOWN, INSTALL = REPO / ".ci" / "slurm-up.sh", REPO / ".ci" / "slurm-down.sh", REPO / ".ci" / "install-slurm.sh"
NODES = 2
SLURM_BINARIES = ("/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/munged")
#: Job states a job does not leave (``scontrol show job``).
TERMINAL = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY"}
)


def _cannot_run_a_cluster() -> str | None:
    if os.geteuid() != 0:
        return "a Slurm cluster in network namespaces needs root"
    missing = [tool for tool in ("ip", "nsenter", "unshare", "setsid") if shutil.which(tool) is None]
    if missing:
        return f"missing tools for the Slurm cluster: {', '.join(missing)}"
    probe = f"fsmslurm_probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"network namespaces are refused here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    if subprocess.run(["ip", "link", "show", "fsmslurm0"], capture_output=True).returncode == 0:
        return "another Slurm test cluster (bridge fsmslurm0) is running on this machine"
    if not all(os.access(path, os.X_OK) for path in SLURM_BINARIES):
        installed = subprocess.run(["bash", str(INSTALL)], capture_output=True, text=True, timeout=900)
        if installed.returncode != 0:
            return f"Slurm is not installed and .ci/install-slurm.sh failed: {installed.stderr.strip()[-300:]}"
    return None


class SlurmCluster:
    """The running cluster: its environment and the few operations the tests need."""

    def __init__(self, directory: Path):
        self.dir = directory
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PET_", "FSM_AGENT_"))}
        self.env["SLURM_CONF"] = str(directory / "slurm.conf")
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        self.env["PYTHONUNBUFFERED"] = "1"
        # Agents that die with a killed node leave their temporary directories: in the cluster's
        # directory, removed with it, not in /tmp.
        self.env.update(tmpdir_env(directory / "tmp"))
        self.killed: set[int] = set()

    def run(self, *argv: str, timeout: float = 60, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        done = subprocess.run(
            list(argv),
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=kwargs.pop("cwd", REPO),
            **kwargs,
        )
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {done.returncode}: {done.stdout}{done.stderr}")
        return done

    def sbatch(self, *argv: str, env: dict[str, str] | None = None) -> int:
        done = subprocess.run(
            ["sbatch", "--parsable", *argv],
            env={**self.env, **(env or {})},
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, f"sbatch {' '.join(argv)}: {done.stderr}"
        return int(done.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, Restarts, ExitCode, Reason, ...); {} once it is gone."""
        done = self.run("scontrol", "-o", "show", "job", str(job_id), check=False)
        return dict(re.findall(r"(\w+)=(\S*)", done.stdout)) if done.returncode == 0 else {}

    def wait_job(self, job_id: int, states: tuple[str, ...], timeout: float) -> dict[str, str]:
        seen: dict[str, str] = {}

        def reached() -> bool:
            seen.update(self.job(job_id))
            return seen.get("JobState") in states or seen.get("JobState") in TERMINAL

        wait_until(reached, timeout=timeout, interval=0.5)
        assert seen.get("JobState") in states, (
            f"job {job_id} did not reach {states} within {timeout:.0f}s: {seen.get('JobState')} {seen.get('Reason')}"
        )
        return seen

    def node_pids(self, node: int) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", f"fsmslurm_n{node}"], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def kill_node(self, node: int) -> None:
        """The node dies: SIGKILL every process in its namespace (slurmd, slurmstepd, agents, workers)."""
        self.killed.add(node)
        for _ in range(3):  # a process may fork while the first ones are killed
            for pid in self.node_pids(node):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 9)
            time.sleep(0.1)

    def revive(self) -> None:
        """Start the killed nodes' slurmd again and wait until every node is idle."""
        for node in sorted(self.killed):
            self.run("bash", str(self.dir / f"start-node{node}.sh"))
            self.run("scontrol", "update", f"NodeName=node{node}", "State=RESUME", check=False)
        self.killed.clear()

    def idle(self) -> bool:
        out = self.run("sinfo", "-h", "-N", "-p", "debug", "-o", "%N %t", check=False).stdout.split("\n")
        return sum(1 for line in out if line.strip().endswith(" idle")) == NODES

    def cancel_all(self) -> None:
        jobs = self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
        if jobs:
            self.run("scancel", *jobs, check=False)


@pytest.fixture(scope="session")
def slurm_cluster():
    reason = _cannot_run_a_cluster()
    if reason:
        pytest.skip(reason)
    directory = Path(tempfile.mkdtemp(prefix="fsm-slurm-"))
    env = {**os.environ, "SLURMCI_DIR": str(directory), "SLURMCI_NODES": str(NODES), "SLURMCI_CPUS": "2"}
    started = time.monotonic()
    try:
        up = subprocess.run(["bash", str(UP)], env=env, capture_output=True, text=True, timeout=120)
        assert up.returncode == 0, f".ci/slurm-up.sh failed: {up.stdout}{up.stderr}"
        sys.stderr.write(f"\nSlurm cluster up in {time.monotonic() - started:.1f}s ({directory})\n")
        yield SlurmCluster(directory)
    finally:
        subprocess.run(["bash", str(DOWN)], env=env, capture_output=True, text=True, timeout=120)
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def slurm(slurm_cluster, tmp_path):
    """The cluster, for one test: its jobs write under ``slurm.out`` (a directory of the test's); at
    the end every job of the test is cancelled, killed nodes come back, the worker cgroups of agents
    that died with their node are removed, and the test waits for every node to be idle again."""
    cluster = slurm_cluster
    cluster.out = tmp_path / f"job-{uuid.uuid4().hex[:6]}"
    cluster.out.mkdir()
    try:
        assert wait_until(cluster.idle, timeout=60, interval=0.2), "the nodes are not idle before the test"
        yield cluster
    finally:
        cluster.cancel_all()
        wait_until(
            lambda: not cluster.run("squeue", "-h", "-o", "%i", check=False).stdout.strip(), timeout=60, interval=0.2
        )
        cluster.revive()
        pids = [int(p) for f in cluster.out.glob("agent.*.pid") for p in f.read_text().split()]
        remove_worker_cgroups(pids)
        assert wait_until(cluster.idle, timeout=60, interval=0.2), "the nodes did not come back to idle"
