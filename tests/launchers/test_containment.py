"""Worker containment in a cgroup v2 (fsm_agent.plugins.containment): nothing a worker starts survives its agent.

Real processes throughout: agents, workers that double-fork daemons, ``sleep`` children, the
keeper. Every process is killed by pid or process group at the end (the ``launcher`` fixture
for agents, ``sleepers`` here), and every cgroup a test created or saw is removed (``cgroups``).
Skipped where this process's cgroup v2 directory is not writable (``cgroup_unavailable``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
from pathlib import Path

import psutil
import pytest

from fsm_agent.plugins.containment import (
    ENV_VAR,
    PREFIX,
    Keeper,
    WorkerCgroup,
    cgroup_dir,
    cgroup_unavailable,
    keeper_pids,
)
from fsm_agent.testing.processes import wait_until
from tests.conftest import write_script

UNAVAILABLE = cgroup_unavailable()
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no writable cgroup v2: {UNAVAILABLE}"),
]

#: Each worker double-forks a daemon (its own session) that records its pid and cgroup, then sleeps.
DAEMON_WORKER = r"""
import json, os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        from fsm_agent.plugins.containment import cgroup_dir
        path = os.path.join(os.environ["FSM_E2E_OUT"], "daemon_%d" % os.getpid())
        with open(path + ".tmp", "w") as f:
            json.dump({"pid": os.getpid(), "cgroup": cgroup_dir()}, f)
        os.replace(path + ".tmp", path)
        time.sleep(300)
    os._exit(0)
time.sleep(300)
"""

#: Records the worker's cgroup and its agent's other children (the keeper, if any) in
#: worker<restart count>.json, then exits 0 (1 on the first attempt with $FAIL_FIRST_ATTEMPT set).
RECORDING_WORKER = r"""
import json, os, sys, psutil
from fsm_agent.plugins.containment import cgroup_dir
count = os.environ["TORCHELASTIC_RESTART_COUNT"]
helpers = [(p.pid, p.cmdline()) for p in psutil.Process(os.getppid()).children() if p.pid != os.getpid()]
with open(os.path.join(os.environ["FSM_E2E_OUT"], "worker%s.json" % count), "w") as f:
    json.dump({"cgroup": cgroup_dir(), "agent_cgroup": cgroup_dir(os.getppid()), "helpers": helpers}, f)
sys.exit(1 if count == "0" and os.environ.get("FAIL_FIRST_ATTEMPT") else 0)
"""


def gone(pid: int) -> bool:
    """True once ``pid`` has ended (a zombie counts as ended; reaped here if it is our child)."""
    try:
        if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
            return False
    except psutil.NoSuchProcess:
        return True
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    return True


@pytest.fixture
def cgroups():
    """Paths of cgroups a test made or saw; each is emptied and removed at teardown."""
    paths: list[str] = []
    yield paths
    for path in paths:
        cgroup = WorkerCgroup(path)
        cgroup.kill()
        assert cgroup.remove(5.0), path


@pytest.fixture
def sleepers():
    """Popen objects of ``sleep`` helpers; teardown SIGKILLs each process group by pid and reaps it."""
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def start_in(cgroup: WorkerCgroup, sleepers: list) -> list[int]:
    """Start ``sleep 60`` inside ``cgroup`` plus a daemonized one (own session); return both pids."""
    script = 'echo 0 > "$1/cgroup.procs" && { setsid sleep 60 & exec sleep 60; }'
    proc = subprocess.Popen(["sh", "-c", script, "sh", cgroup.path], start_new_session=True)
    sleepers.append(proc)
    assert wait_until(lambda: len(cgroup.pids()) == 2, 10), cgroup.pids()
    assert proc.pid in cgroup.pids()
    return cgroup.pids()


@pytest.mark.parametrize("kill", ["kill", "_kill_each"], ids=["cgroup.kill", "pid-by-pid"])
def test_kill_and_remove_stop_every_process_in_the_cgroup(cgroups, sleepers, kill):
    cgroup = WorkerCgroup.create()
    assert cgroup is not None
    cgroups.append(cgroup.path)
    assert os.path.basename(cgroup.path).startswith(f"{PREFIX}{os.getpid()}-")
    assert os.path.dirname(cgroup.path) == cgroup_dir()
    pids = start_in(cgroup, sleepers)
    getattr(cgroup, kill)()
    assert cgroup.wait_empty(5.0)
    assert sleepers[0].wait(5) == -signal.SIGKILL
    assert wait_until(lambda: all(gone(pid) for pid in pids), 5)
    assert cgroup.pids() == []
    assert cgroup.remove(5.0)
    assert not os.path.exists(cgroup.path)
    assert cgroup.remove(1.0)  # removing a removed cgroup is fine


def test_keeper_empties_and_removes_the_cgroup_when_its_stdin_closes(cgroups, sleepers):
    cgroup = WorkerCgroup.create()
    assert cgroup is not None
    cgroups.append(cgroup.path)
    pids = start_in(cgroup, sleepers)
    keeper = Keeper(cgroup)
    try:
        assert keeper.pid in keeper_pids()
        assert os.getsid(keeper.pid) == keeper.pid  # its own session: a terminal's SIGINT misses it
        assert wait_until(lambda: cgroup_dir(keeper.pid) is not None, 5)
        assert cgroup_dir(keeper.pid) == cgroup_dir()  # outside the cgroup it kills
        assert wait_until(lambda: "python" in psutil.Process(keeper.pid).name(), 5)
        assert set(cgroup.pids()) == set(pids)  # waiting on its stdin, it touches nothing
        assert keeper.close()
    finally:
        if keeper.process.poll() is None:
            keeper.process.kill()
            keeper.process.wait()
    assert keeper.process.returncode == 0
    assert keeper.pid not in keeper_pids()
    assert not os.path.exists(cgroup.path)
    assert wait_until(lambda: all(gone(pid) for pid in pids), 5)


def test_children_started_inside_born_inside_are_born_in_the_cgroup(cgroups, sleepers):
    home = cgroup_dir()
    cgroup = WorkerCgroup.create()
    cgroups.append(cgroup.path)
    cgroup.prime_move()  # a no-op move, as a launcher starts one when it stops workers
    with cgroup.born_inside() as inside:  # waits for it first: it must not move us back home later
        assert inside and cgroup_dir() == cgroup.path
        # No preexec_fn: spawned with vfork, nothing runs in the child to move it.
        sleepers.append(subprocess.Popen(["sleep", "60"], start_new_session=True))
    assert cgroup_dir() == home and cgroup._primer is None
    assert cgroup_dir(sleepers[-1].pid) == cgroup.path
    assert cgroup.pids() == [sleepers[-1].pid]


def test_a_new_cgroup_removes_the_empty_cgroups_of_agents_that_are_gone(cgroups, sleepers):
    """Only empty ones of dead agent pids: one with a process in it, or of a live pid, stays."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    parent = cgroup_dir()
    gone_empty, gone_busy, alive_empty = (
        os.path.join(parent, f"{PREFIX}{pid}-{suffix}")
        for pid, suffix in ((dead.pid, "deadbeef"), (dead.pid, "0badf00d"), (os.getpid(), "cafef00d"))
    )
    for path in (gone_empty, gone_busy, alive_empty):
        os.mkdir(path)
        cgroups.append(path)
    os.mkdir(os.path.join(gone_empty, "nested"))  # e.g. the cgroup of an agent run by a worker
    start_in(WorkerCgroup(gone_busy), sleepers)
    new = WorkerCgroup.create()
    cgroups.append(new.path)
    assert not os.path.exists(gone_empty)
    assert os.path.isdir(gone_busy) and os.path.isdir(alive_empty) and os.path.isdir(new.path)


SLEEPING_WORKER = r"""
import os, time
open(os.path.join(os.environ["FSM_E2E_OUT"], "started"), "w").close()
time.sleep(120)
"""


@pytest.mark.slow
def test_the_next_agent_removes_what_an_agent_killed_with_its_keeper_left(launcher, cgroups):
    """A harness SIGKILLs the agent, its keeper and its worker: the empty cgroup stays until an agent starts."""
    script = write_script(launcher.dir, "w.py", SLEEPING_WORKER)
    agent = launcher.fsm("--standalone", "--nproc-per-node", "1", script)
    launcher.wait_for_file(launcher.out / "started")
    (path,) = Path(cgroup_dir()).glob(f"{PREFIX}{agent.pid}-*")
    cgroups.append(str(path))
    children = psutil.Process(agent.pid).children()
    keepers = [p.pid for p in children if "--keep" in p.cmdline()]
    workers = [p.pid for p in children if p.pid not in keepers]
    assert len(keepers) == 1 and len(workers) == 1
    for pid in (agent.pid, *keepers, *workers):
        os.kill(pid, signal.SIGKILL)
    agent.popen.wait(10)
    assert wait_until(lambda: all(gone(pid) for pid in (*keepers, *workers)), 10)
    assert WorkerCgroup(str(path)).wait_empty(15)
    assert path.is_dir()  # left behind
    launcher.run_fsm("--standalone", launcher.probe).check()
    assert not path.exists()


def test_off_switch_creates_no_cgroup(monkeypatch, caplog):
    monkeypatch.setenv(ENV_VAR, "off")
    before = set(os.listdir(cgroup_dir()))
    with caplog.at_level(logging.DEBUG, logger="fsm_agent.plugins.containment"):
        assert WorkerCgroup.create() is None
    assert [r.getMessage() for r in caplog.records] == [f"workers are not put in a cgroup: {ENV_VAR}=off"]
    assert set(os.listdir(cgroup_dir())) == before


def _keepers(record: dict) -> list[int]:
    return [pid for pid, cmdline in record["helpers"] if "--keep" in cmdline]


def _cgroup_of_daemons(launcher, count: int) -> tuple[list[int], str]:
    """Wait for ``count`` daemon records; return their pids and their (single) cgroup directory."""
    records = []
    assert wait_until(lambda: len(list(launcher.out.glob("daemon_*[0-9]"))) >= count, 60), [
        p.output() for p in launcher.procs
    ]
    for path in launcher.out.glob("daemon_*[0-9]"):
        records.append(json.loads(path.read_text()))
    cgroups = {r["cgroup"] for r in records}
    assert len(cgroups) == 1, records
    return [r["pid"] for r in records], cgroups.pop()


@pytest.mark.slow
@pytest.mark.parametrize(
    "launch",
    [(), ("--launcher", "preload", "--preload-modules", "json"), ("--run-path", "--start-method", "fork")],
    ids=["subprocess", "preload", "run-path-fork"],
)
def test_sigkill_of_the_agent_kills_daemonized_descendants(launcher, cgroups, launch):
    """Only the agent is SIGKILLed: workers die by parent-death signal, their daemons by the keeper."""
    script = write_script(launcher.dir, "w.py", DAEMON_WORKER)
    agent = launcher.fsm("--standalone", "--nproc-per-node", "2", *launch, script)
    daemons, path = _cgroup_of_daemons(launcher, 2)
    cgroups.append(path)
    assert os.path.basename(path).startswith(f"{PREFIX}{agent.pid}-"), path
    assert os.path.dirname(path) == cgroup_dir()
    keepers = [p.pid for p in psutil.Process(agent.pid).children() if "--keep" in p.cmdline()]
    assert len(keepers) == 1
    os.kill(agent.pid, signal.SIGKILL)  # the agent alone, not its process group
    agent.popen.wait(10)
    assert wait_until(lambda: all(gone(pid) for pid in daemons + keepers), 15), [
        (pid, not gone(pid)) for pid in daemons + keepers
    ]
    assert wait_until(lambda: not os.path.exists(path), 5)


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["auto", "off"])
def test_normal_exit_removes_the_cgroup_and_off_creates_none(launcher, cgroups, setting):
    script = write_script(launcher.dir, "w.py", RECORDING_WORKER)
    agent = launcher.fsm("--standalone", "--nproc-per-node", "1", script, env={ENV_VAR: setting})
    agent.wait().check()
    record = json.loads((launcher.out / "worker0.json").read_text())
    keepers = _keepers(record)
    if setting == "off":
        assert record["cgroup"] == cgroup_dir()
        assert keepers == []
    else:
        cgroups.append(record["cgroup"])
        assert os.path.basename(record["cgroup"]).startswith(f"{PREFIX}{agent.pid}-")
        assert len(keepers) == 1
        assert not psutil.pid_exists(keepers[0])  # reaped by the agent, not left as a zombie
    assert not list(Path(cgroup_dir()).glob(f"{PREFIX}{agent.pid}-*"))


@pytest.mark.slow
def test_one_cgroup_and_keeper_serve_every_attempt(launcher, cgroups):
    """The restart's sweep spares the keeper; the second attempt's worker joins the same cgroup."""
    script = write_script(launcher.dir, "w.py", RECORDING_WORKER)
    agent = launcher.fsm(
        "--standalone", "--nproc-per-node", "1", "--max-restarts", "1", script, env={"FAIL_FIRST_ATTEMPT": "1"}
    )
    agent.wait().check()
    first, second = (json.loads((launcher.out / f"worker{n}.json").read_text()) for n in (0, 1))
    cgroups.append(first["cgroup"])
    assert first["cgroup"] == second["cgroup"]
    assert os.path.basename(first["cgroup"]).startswith(f"{PREFIX}{agent.pid}-")
    # The agent steps into the cgroup only while it spawns its workers.
    assert first["agent_cgroup"] == second["agent_cgroup"] == cgroup_dir()
    assert len(_keepers(first)) == 1 and _keepers(first) == _keepers(second)
    assert not os.path.exists(first["cgroup"])
    assert not psutil.pid_exists(_keepers(first)[0])


@pytest.mark.slow
@pytest.mark.parametrize("hang_timeout", [(), ("--hang-timeout", "600")], ids=["logs", "logs-and-heartbeats"])
def test_sigkill_of_the_agent_leaves_no_temporary_directory(launcher, cgroups, hang_timeout):
    """The agent's temporary log directory (no --log-dir) and heartbeat directory: the keeper
    removes them once the agent alone is SIGKILLed (#30.7; each stayed in /tmp before)."""
    script = write_script(launcher.dir, "w.py", DAEMON_WORKER)
    agent = launcher.fsm("--standalone", "--nproc-per-node", "1", *hang_timeout, script)
    daemons, path = _cgroup_of_daemons(launcher, 1)
    cgroups.append(path)
    made = sorted(p.name for p in launcher.tmp.glob("fsm_agent_*"))
    assert len(made) == (2 if hang_timeout else 1), made
    keepers = [p.pid for p in psutil.Process(agent.pid).children() if "--keep" in p.cmdline()]
    os.kill(agent.pid, signal.SIGKILL)
    agent.popen.wait(10)
    assert wait_until(lambda: all(gone(pid) for pid in daemons + keepers), 15)
    assert sorted(p.name for p in launcher.tmp.glob("fsm_agent_*")) == []


@pytest.mark.slow
def test_sigkill_of_the_agent_keeps_a_directory_with_the_only_copy_of_output(launcher, cgroups):
    """--redirects 3 without --log-dir: the worker's output is only in the temporary directory,
    which the agent keeps on its way out; the keeper keeps it too."""
    script = write_script(launcher.dir, "w.py", DAEMON_WORKER)
    agent = launcher.fsm("--standalone", "--nproc-per-node", "1", "--redirects", "3", script)
    daemons, path = _cgroup_of_daemons(launcher, 1)
    cgroups.append(path)
    keepers = [p.pid for p in psutil.Process(agent.pid).children() if "--keep" in p.cmdline()]
    os.kill(agent.pid, signal.SIGKILL)
    agent.popen.wait(10)
    assert wait_until(lambda: all(gone(pid) for pid in daemons + keepers), 15)
    assert len(list(launcher.tmp.glob("fsm_agent_*"))) == 1
