"""fsm_agent.testing.processes: what a test that SIGKILLs agents would otherwise leave on the machine.

- ``AgentProcesses`` gives its agents a ``TMPDIR`` of their own and removes it in ``kill_all``: a
  SIGKILLed agent's temporary log and heartbeat directories go with it.
- ``remove_worker_cgroups``: a cleanup that kills an agent's cgroup keeper (by pid, before it was
  done) leaves the agent's worker cgroup behind; this removes it.
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from fsm_agent.plugins.containment import PREFIX, cgroup_dir, cgroup_unavailable
from fsm_agent.testing import AgentProcesses
from fsm_agent.testing.conformance import free_port
from fsm_agent.testing.processes import is_cgroup_keeper, remove_worker_cgroups, tmpdir_env, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SLEEPER = "import os, time\nopen('ready_' + os.environ['RANK'], 'w').close()\ntime.sleep(120)\n"


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_tmpdir_env_makes_the_directory(tmp_path):
    assert tmpdir_env(tmp_path / "a" / "tmp") == {"TMPDIR": str(tmp_path / "a" / "tmp")}
    assert (tmp_path / "a" / "tmp").is_dir()


def test_a_sigkilled_agent_s_temporary_directories_go_with_kill_all(tmp_path):
    """An agent waiting for a second node has made its temporary log and heartbeat directories;
    SIGKILLed by kill_all it cannot remove them: they are in the AgentProcesses' TMPDIR, removed with it."""
    (tmp_path / "worker.py").write_text("")
    with AgentProcesses(tmp_path, command=()) as processes:
        agent = processes.start(
            "run",
            "--nnodes",
            "2",
            "--rdzv-backend",
            "fsm",
            "--rdzv-endpoint",
            f"127.0.0.1:{free_port()}",
            "--hang-timeout",
            "30",
            "worker.py",
        )
        tmp_dir = processes.tmp_dir
        assert tmp_dir is not None and tmp_dir.is_dir()

        def made() -> list[str]:
            def kind(p):
                if p.name.startswith("fsm_agent_hb_"):
                    return "heartbeat"
                return "log" if p.name.startswith("fsm_agent_") else p.name

            return sorted(kind(p) for p in tmp_dir.iterdir())

        assert wait_until(lambda: made() == ["heartbeat", "log"] or agent.poll() is not None), made()
        assert agent.poll() is None, agent.communicate()
        assert psutil.Process(agent.pid).environ()["TMPDIR"] == str(tmp_dir)
    assert agent.returncode == -signal.SIGKILL
    assert processes.tmp_dir is None and not tmp_dir.exists()


def test_start_env_may_set_its_own_tmpdir(tmp_path):
    """The agent (and so its workers) sees the TMPDIR a call gives; read by a worker, so no race
    with a process that exits before psutil could read its environment."""
    (tmp_path / "w.py").write_text("import os\nopen('seen_tmpdir', 'w').write(os.environ['TMPDIR'])\n")
    with AgentProcesses(tmp_path) as processes:
        proc = processes.start("--standalone", "--nproc-per-node", "1", "w.py", env={"TMPDIR": str(tmp_path)})
        proc.communicate(timeout=120)
    assert proc.returncode == 0
    assert (tmp_path / "seen_tmpdir").read_text() == str(tmp_path)


def test_is_cgroup_keeper():
    assert is_cgroup_keeper(
        ["/usr/bin/python3", "-I", "-S", "/x/fsm_agent/plugins/containment.py", "--keep", "/cg/fsm-agent-1-a"]
    )
    assert not is_cgroup_keeper(["/usr/bin/python3", "-m", "fsm_agent", "run", "--keep", "train.py"])
    assert not is_cgroup_keeper(["/usr/bin/python3", "/x/fsm_agent/plugins/containment.py"])


@pytest.mark.skipif(cgroup_unavailable() is not None, reason=f"no worker cgroups here: {cgroup_unavailable()}")
def test_remove_worker_cgroups_after_the_keeper_was_killed_first(tmp_path):
    """The keeper killed by pid before its agent (as a cleanup sweeping every process of a job may do):
    the agent's worker cgroup stays; remove_worker_cgroups kills what is in it and removes it."""
    (tmp_path / "w.py").write_text(SLEEPER)
    with AgentProcesses(tmp_path) as processes:
        agent = processes.start("--standalone", "--nproc-per-node", "1", "w.py")
        assert wait_until(lambda: (tmp_path / "ready_0").exists() or agent.poll() is not None)
        assert agent.poll() is None, agent.communicate()
        children = psutil.Process(agent.pid).children()
        (keeper,) = [p for p in children if is_cgroup_keeper(p.cmdline())]
        keep_argv = keeper.cmdline()
        path = keep_argv[keep_argv.index("--keep") + 1]  # the agent's temporary dirs follow it
        assert os.path.dirname(path) == cgroup_dir() and os.path.basename(path).startswith(f"{PREFIX}{agent.pid}-")
        (worker,) = [p for p in children if p.pid != keeper.pid]
        assert not is_cgroup_keeper(psutil.Process(agent.pid).cmdline())
        keeper.kill()
        assert wait_until(lambda: gone(keeper.pid), 10)
        assert remove_worker_cgroups([agent.pid]) == []  # the agent is alive: not a leftover yet
        os.killpg(agent.pid, signal.SIGKILL)
        assert agent.wait(10) == -signal.SIGKILL
        time.sleep(0.5)
        assert os.path.isdir(path)  # nobody removed it
        assert remove_worker_cgroups([agent.pid]) == [path]
        assert not os.path.exists(path)
        assert wait_until(lambda: gone(worker.pid), 10)
        assert remove_worker_cgroups([agent.pid]) == []


def test_remove_worker_cgroups_finds_nothing_of_an_agent_that_ended_by_itself(tmp_path):
    (tmp_path / "w.py").write_text("")
    with AgentProcesses(tmp_path) as processes:
        done = processes.run("--standalone", "--nproc-per-node", "1", "w.py")
        assert done.returncode == 0, done.stderr
        assert remove_worker_cgroups([processes.procs[0].pid]) == []
