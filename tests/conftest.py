"""Shared helpers for the tests that start real agents, real workers, real TCPStores.

Every process a test starts gets a private token in its environment (``FSM_E2E_TOKEN``), and
workers inherit it from their agent. Teardown SIGKILLs the process group of every process the
test started, then looks for any process still carrying the token (an orphaned worker, a
grandchild) and kills it by pid; if one was left behind after its agent ended on its own the
test fails, since that is an fsm-agent bug (workers must die with their agent). Nothing is ever
killed by name. Every process's ``TMPDIR`` is a fresh temporary directory of the test's, removed
at teardown: what an agent the test kills cannot remove (its temporary log and heartbeat
directories) and torchrun's ``torchelastic_*`` log directories (torchrun never removes them) go
with it. It is not in ``tmp_path``: multiprocessing's forkserver makes a socket in it, whose path
must be short.

Network: rendezvous endpoints and addresses are 127.0.0.1; ports come from binding port 0.

Probe workers (``PROBE``) import nothing heavy: each writes one JSON record (its environment,
argv, pid, loaded fsm_agent modules...) to ``$FSM_E2E_OUT/<tag>rank<RANK>.json`` and prints one
line to stdout and one to stderr.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from fsm_agent.testing.conformance import free_port  # noqa: F401 (one helper for every test: a free 127.0.0.1 port)
from fsm_agent.testing.node_loss import NodeLossJob
from fsm_agent.testing.processes import remove_worker_cgroups, tmpdir_env
from tests.helpers.events import read_events, transitions
from tests.netns import netns_hosts  # noqa: F401 (the fixture of the multi-host tests: agent, schedulers, parity)

# A suite started as a background job of a non-interactive shell (`... &`) inherits SIGINT and SIGQUIT
# ignored, and every agent and worker it starts would too: the Ctrl-C tests would test the shell, not
# the agent. Give this process the dispositions of a foreground one; its children inherit them.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
if signal.getsignal(signal.SIGQUIT) is signal.SIG_IGN:
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)

#: Seconds an agent may take before a test gives up on it (the machine may have 2 slow cores).
AGENT_TIMEOUT = 120.0
TOKEN_VAR = "FSM_E2E_TOKEN"
OUT_VAR = "FSM_E2E_OUT"
TAG_VAR = "FSM_E2E_TAG"
PORT_VAR = "FSM_E2E_PROBE_PORT"

#: Variables that would change how a launcher or a worker behaves; removed from the test env.
_SCRUB_PREFIXES = ("PET_", "FSM_AGENT_", "TORCHELASTIC_", "TORCH_ELASTIC_")
_SCRUB_KEYS = frozenset(
    {
        "OMP_NUM_THREADS",
        "MASTER_ADDR",
        "MASTER_PORT",
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_NAME",
        "ROLE_WORLD_SIZE",
        "PYTHON_EXEC",
        "LOGLEVEL",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
        "CUDA_VISIBLE_DEVICES",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "PYTEST_CURRENT_TEST",
        "PYTEST_XDIST_WORKER",
    }
)

PROBE = r"""
import json, os, socket, sys
rank = os.environ["RANK"]
record = {
    "env": dict(os.environ),
    "argv": list(sys.argv),
    "orig_argv": list(getattr(sys, "orig_argv", [])),
    "name": __name__,
    "pid": os.getpid(),
    "ppid": os.getppid(),
    "fsm_modules": sorted(m for m in sys.modules if m.startswith("fsm_agent")),
    "torch_loaded": "torch" in sys.modules,
}
port = os.environ.get("FSM_E2E_PROBE_PORT")
if port:
    try:
        socket.create_connection(("127.0.0.1", int(port)), timeout=5).close()
        record["port_open"] = True
    except OSError:
        record["port_open"] = False
out = os.environ["FSM_E2E_OUT"]
path = os.path.join(out, os.environ.get("FSM_E2E_TAG", "") + "rank" + rank + ".json")
with open(path + ".tmp", "w") as f:
    json.dump(record, f)
os.replace(path + ".tmp", path)
print("probe-out rank=%s local_rank=%s" % (rank, os.environ["LOCAL_RANK"]), flush=True)
print("probe-err rank=%s local_rank=%s" % (rank, os.environ["LOCAL_RANK"]), file=sys.stderr, flush=True)
"""


def fsm_agent_cmd() -> list[str]:
    """The ``fsm-agent`` console script of this interpreter (``python -m fsm_agent`` if absent)."""
    script = Path(sys.executable).with_name("fsm-agent")
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-m", "fsm_agent"]


def fsmrun_cmd() -> list[str]:
    script = Path(sys.executable).with_name("fsmrun")
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    found = shutil.which("fsmrun")
    if found is None:
        pytest.skip("the fsmrun console script is not installed")
    return [found]


def torchrun_cmd() -> list[str]:
    """The real torchrun, as ``python -m torch.distributed.run``."""
    return [sys.executable, "-m", "torch.distributed.run"]


def write_script(directory: Path, name: str, body: str, executable: bool = False) -> Path:
    path = Path(directory) / name
    path.write_text(body)
    if executable:
        path.chmod(0o755)
    return path


def one_error_line(stderr: str) -> str:
    """The single non-empty stderr line of a rejected command (fails the test otherwise)."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected exactly one stderr line, got {len(lines)}:\n{stderr}"
    assert "Traceback" not in stderr
    return lines[0]


@dataclass
class Result:
    """A finished process: exit code, captured output, wall time in seconds."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str
    duration: float

    def check(self, code: int = 0) -> Result:
        assert self.returncode == code, (
            f"exit code {self.returncode} (expected {code}) for {self.args}\n"
            f"--- stdout ---\n{self.stdout}\n--- stderr ---\n{self.stderr}"
        )
        return self


class Proc:
    """A started process (its own session and process group); output goes to files."""

    def __init__(self, args: list[str], popen: subprocess.Popen, stdout: Path, stderr: Path):
        self.args, self.popen, self._stdout, self._stderr = args, popen, stdout, stderr
        self.started = time.monotonic()
        self.finished: float | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def output(self) -> tuple[str, str]:
        return (self._stdout.read_text(errors="replace"), self._stderr.read_text(errors="replace"))

    def send_signal(self, sig: int) -> None:
        self.popen.send_signal(sig)

    def wait(self, timeout: float = AGENT_TIMEOUT) -> Result:
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _killpg(self.pid)
            self.popen.wait()
            out, err = self.output()
            pytest.fail(f"{self.args} did not finish within {timeout}s\n--- stdout ---\n{out}\n--- stderr ---\n{err}")
        if self.finished is None:
            self.finished = time.monotonic()
        out, err = self.output()
        return Result(self.args, self.popen.returncode, out, err, self.finished - self.started)


def _killpg(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


class Launcher:
    """Starts agents (fsm-agent, torchrun) and tracks every process for teardown.

    Attributes:
        dir: the test's tmp_path (default cwd of every process; scripts live here).
        out: where probe workers write their records (``$FSM_E2E_OUT``).
        token: marks every process this test started (``$FSM_E2E_TOKEN``).
    """

    def __init__(self, tmp_path: Path):
        self.dir = tmp_path
        self.out = tmp_path / "out"
        self.out.mkdir()
        self.token = uuid.uuid4().hex
        self.procs: list[Proc] = []
        self._count = 0
        self.probe = write_script(tmp_path, "probe.py", PROBE)
        self.tmp = Path(tempfile.mkdtemp(prefix="fsm_e2e_"))  # every process's TMPDIR; removed by cleanup()

    # -- environment ---------------------------------------------------------------------------
    def env(self, extra: dict[str, str] | None = None, unset: tuple[str, ...] = ()) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _SCRUB_KEYS and not k.startswith(_SCRUB_PREFIXES)}
        env.update({TOKEN_VAR: self.token, OUT_VAR: str(self.out), "PYTHONUNBUFFERED": "1"})
        env.update(tmpdir_env(self.tmp))
        env.update(extra or {})
        for key in unset:
            env.pop(key, None)
        return env

    # -- starting processes ----------------------------------------------------------------------
    def start(
        self,
        args: list[str],
        *,
        env: dict[str, str] | None = None,
        unset: tuple[str, ...] = (),
        cwd: Path | None = None,
        cpus: int | None = None,
    ) -> Proc:
        """Start ``args`` in a new session; ``cpus`` pins it (and so its workers) to that many CPUs."""
        self._count += 1
        stdout = self.dir / f"proc{self._count}.stdout"
        stderr = self.dir / f"proc{self._count}.stderr"
        if cpus is not None:  # pin, then exec the real command (no preexec_fn: pytest may have threads)
            allowed = sorted(os.sched_getaffinity(0))[:cpus]
            pin = f"import os, sys; os.sched_setaffinity(0, {allowed!r}); os.execvp(sys.argv[1], sys.argv[1:])"
            args = [sys.executable, "-c", pin, *args]
        with open(stdout, "wb") as out, open(stderr, "wb") as err:
            popen = subprocess.Popen(
                args,
                cwd=cwd or self.dir,
                env=self.env(env, unset),
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        proc = Proc(list(args), popen, stdout, stderr)
        self.procs.append(proc)
        return proc

    def fsm(self, *args: str, **kwargs) -> Proc:
        """Start ``fsm-agent run ARGS``."""
        return self.start([*fsm_agent_cmd(), "run", *map(str, args)], **kwargs)

    def torchrun(self, *args: str, **kwargs) -> Proc:
        """Start the real torchrun with ARGS."""
        return self.start([*torchrun_cmd(), *map(str, args)], **kwargs)

    def run_fsm(self, *args: str, timeout: float = AGENT_TIMEOUT, **kwargs) -> Result:
        """Run ``fsm-agent run ARGS`` to the end."""
        return self.fsm(*args, **kwargs).wait(timeout)

    def run(self, args: list[str], timeout: float = AGENT_TIMEOUT, **kwargs) -> Result:
        return self.start(args, **kwargs).wait(timeout)

    # -- probe records -------------------------------------------------------------------------
    def records(self, tag: str = "") -> dict[int, dict]:
        """{RANK: record} written by probe workers (with ``$FSM_E2E_TAG`` == tag)."""
        found = {}
        for path in self.out.glob(f"{tag}rank*.json"):
            rank = path.name[len(tag) + len("rank") : -len(".json")]
            if rank.isdigit():
                found[int(rank)] = json.loads(path.read_text())
        return found

    def wait_for_file(self, path: Path, timeout: float = 60.0) -> None:
        """Wait until ``path`` exists; fail early (with the output) if every started process has ended."""
        deadline = time.monotonic() + timeout
        while not Path(path).exists():
            ended = not any(p.alive() for p in self.procs)
            if time.monotonic() > deadline or ended:
                why = "every process ended before it appeared" if ended else f"not within {timeout}s"
                pytest.fail(
                    f"{path}: {why}\n"
                    + "\n".join(
                        f"{p.args} rc={p.popen.poll()}\n--- stdout ---\n{p.output()[0]}\n--- stderr ---\n{p.output()[1]}"
                        for p in self.procs
                    )
                )
            time.sleep(0.05)

    # -- teardown ------------------------------------------------------------------------------
    def _token_pids(self) -> list[psutil.Process]:
        found = []
        for proc in psutil.process_iter():
            try:
                if (
                    proc.pid != os.getpid()
                    and proc.environ().get(TOKEN_VAR) == self.token
                    and proc.status() != psutil.STATUS_ZOMBIE
                ):
                    found.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
                continue
        return found

    def cleanup(self) -> list[str]:
        """Kill everything this test started; return descriptions of processes left behind.

        A process counts as left behind when it still carries the token a few seconds after
        every agent has ended (workers are expected to die with their agent; a SIGKILLed agent's
        cgroup keeper, which carries it too, by then has removed the workers' cgroup). So does a
        worker cgroup of one of the agents still there at the end (it is removed).
        """
        for proc in self.procs:
            if proc.alive():
                _killpg(proc.pid)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(timeout=30)
        deadline = time.monotonic() + 5.0
        leftovers = self._token_pids()
        while leftovers and time.monotonic() < deadline:
            time.sleep(0.1)
            leftovers = self._token_pids()
        described = []
        for proc in leftovers:
            try:
                described.append(f"pid {proc.pid}: {' '.join(proc.cmdline())}")
                proc.kill()  # by pid
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(leftovers, timeout=10)
        # A keeper killed above (it had not ended by itself) leaves its agent's worker cgroup.
        described += [
            f"worker cgroup {path}: its keeper did not remove it"
            for path in remove_worker_cgroups(proc.pid for proc in self.procs)
        ]
        shutil.rmtree(self.tmp, ignore_errors=True)
        return described


@pytest.fixture
def launcher(tmp_path):
    """A Launcher for this test; teardown kills every process it started (and fails on orphans)."""
    launch = Launcher(tmp_path)
    yield launch
    leftovers = launch.cleanup()
    assert not leftovers, "processes left behind after their agent ended:\n" + "\n".join(leftovers)


@pytest.fixture
def own_tempdir(monkeypatch, tmp_path):  # tmp_path first: pytest makes its base directory once, in the real one
    """An agent run in the test's own process (``elastic_launch`` with torch's ``LaunchConfig``, no
    ``log_dir``) makes torch's ``torchelastic_*`` log directory, which torch never removes, in the
    temporary directory: here a fresh one (short: forkserver sockets), removed afterwards, and the
    workers' ``TMPDIR`` too."""
    directory = tempfile.mkdtemp(prefix="fsm_t_")
    monkeypatch.setattr(tempfile, "tempdir", directory)
    monkeypatch.setenv("TMPDIR", directory)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def job_factory(tmp_path):
    """``make(flags)``: a ``NodeLossJob`` (agents as separate "nodes" with real workers) with those
    flags; every job made is closed (its agents and workers stopped by process group) afterwards."""
    jobs = []

    def make(flags: list[str]) -> NodeLossJob:
        jobs.append(NodeLossJob(tmp_path, flags))
        return jobs[-1]

    yield make
    for job in jobs:
        job.close()


# -- events files and the test kit's agent processes (tests of the agent, launchers, launch API) --


def assert_excluded_node_left(excluded: Path, survivor: Path) -> None:
    """The excluded node's events end UNHEALTHY -> FAILED; the survivor's first change after is a
    lost node (``membership_changed``, ``node_lost``) and it ends without spending a restart."""
    assert transitions(excluded)[-1] == ("UNHEALTHY", "FAILED", "workers_failed")
    events = read_events(survivor)
    changed = [
        e for e in events if e["kind"] == "transition" and e["trigger"] in ("membership_changed", "workers_failed")
    ]
    assert changed and changed[0]["trigger"] == "membership_changed" and changed[0]["failure_class"] == "node_lost", (
        changed
    )
    assert events[-1]["kind"] == "run_end" and events[-1]["restart_count"] == 0


@pytest.fixture
def agents(agent_processes):
    """Real ``fsm-agent run`` processes in tmp_path (the test kit's AgentProcesses)."""
    return agent_processes
