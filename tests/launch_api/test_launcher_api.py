"""torchrun parity of the launcher API, ``--master-port`` and the defaults (issue #13), with real workers.

- ``launch_agent``/``elastic_launch`` take torch's own ``LaunchConfig``, return ``{global_rank: value}``
  and raise an error that *is a* torch ``ChildFailedError``; ``run_agent`` returns the RunResult.
- An in-process launch is a child subreaper only while workers run, and reaps what it adopted.
- Static rendezvous: workers see exactly ``--master-addr``/``--master-port`` (torchrun's), yet a
  restarted group never sees a previous attempt's keys (pytorch/pytorch#135712).
- torchrun's defaults: static waits 900 s; ``--rdzv-backend etcd``/``etcd-v2`` is a one-line error.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fsm_agent import LaunchConfig, run_agent
from fsm_agent.errors import ConfigError
from fsm_agent.plugins.launcher_subprocess import is_subreaper
from tests.agent.test_agent_behaviour import _fail_on_rank_one, _square_rank
from tests.conftest import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.usefixtures("own_tempdir")]


def write(path, body: str) -> str:
    path.write_text(textwrap.dedent(body))
    return str(path)


def torch_config(**changes):
    from torch.distributed.launcher.api import LaunchConfig as TorchLaunchConfig

    fields = dict(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=2,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        run_id="api",
        max_restarts=0,
    )
    return TorchLaunchConfig(**{**fields, **changes})


# -- 1. the Python API --------------------------------------------------------------------------


def test_torch_launch_config_runs_and_returns_values_by_global_rank(tmp_path):
    """torch's LaunchConfig with torch's LogsSpecs instance: {global_rank: value}, logs where it says."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    from fsm_agent import elastic_launch, launch_agent

    config = torch_config(nproc_per_node=3, logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path)))
    assert launch_agent(config, _square_rank, [10]) == {0: 10, 1: 11, 2: 14}
    assert elastic_launch(config, _square_rank)(1) == {0: 1, 1: 2, 2: 5}
    # torch's DefaultLogsSpecs layout: <log_dir>/<run_id>_<random>/attempt_0/<local_rank>/
    attempts = {p.relative_to(tmp_path).parts[1:] for p in tmp_path.glob("api_*/attempt_0/*")}
    assert attempts == {("attempt_0", str(r)) for r in range(3)}


def test_failure_is_torchs_child_failed_error_with_fsm_agents_details(tmp_path, monkeypatch):
    """``except ChildFailedError`` catches it; torch's ``@record`` copies the root cause's error file."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure, record

    import fsm_agent
    from fsm_agent import elastic_launch

    parent_error_file = tmp_path / "launcher_error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(parent_error_file))
    config = torch_config(rdzv_configs={"join_timeout": 60})

    @record
    def main():
        return elastic_launch(config, _fail_on_rank_one)()

    with pytest.raises(ChildFailedError) as info:
        main()
    error = info.value
    assert isinstance(error, fsm_agent.WorkerGroupFailedError)
    rank, failure = error.get_first_failure()
    assert rank == 1 and isinstance(failure, ProcessFailure) and failure.exitcode == 1
    assert os.path.isfile(failure.error_file)
    # fsm-agent's details: the RunResult, the WorkerFailures, the summary as the message.
    assert error.result.exit_code == 1 and error.root_cause.global_rank == 1
    assert "ValueError: rank one refuses" in error.root_cause.message
    assert "Root Cause (first observed failure):" in str(error) and "rank one refuses" in str(error)
    # torch's @record handled it as a ChildFailedError: the worker's error.json, errorCode set.
    copied = json.loads(parent_error_file.read_text())
    assert "rank one refuses" in copied["message"]["message"] and copied["message"]["errorCode"] == 1


def test_run_agent_returns_the_run_result(tmp_path):
    config = LaunchConfig(
        nproc_per_node=2, rdzv_backend="c10d", rdzv_endpoint="localhost:0", run_id="api", log_dir=str(tmp_path)
    )
    result = run_agent(config, _fail_on_rank_one)
    assert result.is_failed() and result.exit_code == 1 and sorted(result.failures) == [1]


def test_a_stop_signal_raises_torchs_signal_exception():
    """SIGTERM to the agent (this process) mid-run: workers stopped, torch's SignalException, as torch."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from fsm_agent import elastic_launch

    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SignalException) as info:
        elastic_launch(torch_config(nproc_per_node=1, run_id="sig"), _terminate_the_agent)()
    assert info.value.sigval == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is handler  # the caller's handler is back


def _terminate_the_agent():
    import os
    import signal
    import time

    os.kill(os.getppid(), signal.SIGTERM)
    time.sleep(60)  # stopped by the agent


def test_a_rendezvous_that_never_completes_raises_agent_failed_error():
    """No worker failed: fsm_agent.AgentFailedError with the RunResult (torch lets its error through)."""
    from fsm_agent import AgentFailedError, launch_agent

    config = LaunchConfig(
        min_nodes=2, max_nodes=2, rdzv_backend="static", rdzv_endpoint=f"127.0.0.1:{free_port()}", rdzv_timeout=2
    )
    with pytest.raises(AgentFailedError, match=r"not all 2 nodes came within 2 s") as info:
        launch_agent(config, sys.executable, ["-c", "pass"])
    assert info.value.result.is_failed() and info.value.result.failures == {}


def test_torch_field_names_on_fsm_agents_launch_config(tmp_path):
    """rdzv_timeout, metrics_cfg, numa_options and a LogsSpecs instance, as torch's LaunchConfig takes them."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.numa.binding import AffinityMode, NumaOptions

    from fsm_agent import launch_agent

    config = LaunchConfig(
        nproc_per_node=2,
        rdzv_backend="static",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        rdzv_timeout=60,
        metrics_cfg={"handler": "null"},
        numa_options=NumaOptions(affinity_mode=AffinityMode.NODE),
        logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path)),
    )
    assert config.rdzv_configs["timeout"] == 60 and config.numa_binding == "node"
    assert launch_agent(config, _square_rank, (3,)) == {0: 3, 1: 4}
    assert len(list(tmp_path.glob("none_*/attempt_0/*"))) == 2


def test_torch_defaults_backend_etcd_is_a_one_line_error_naming_etcd_v3():
    """torch's LaunchConfig defaults to rdzv_backend="etcd" (and rdzv_configs timeout=900)."""
    from torch.distributed.launcher.api import LaunchConfig as TorchLaunchConfig

    from fsm_agent import launch_agent

    config = TorchLaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1, run_id="etcd")
    assert (config.rdzv_backend, config.rdzv_configs) == ("etcd", {"timeout": 900})
    with pytest.raises(ConfigError, match=r"^--rdzv-backend etcd: .*--rdzv-backend etcd-v3") as info:
        launch_agent(config, sys.executable, ["-c", "pass"])
    assert "\n" not in str(info.value)


def test_an_agent_that_never_imports_torch_still_does_not(tmp_path):
    """The fsm backend runs a program without torch; the error class is made only when raised."""
    script = write(
        tmp_path / "probe.py",
        """
        import sys
        import fsm_agent
        from fsm_agent import LaunchConfig, launch_agent, run_agent, AgentFailedError
        config = LaunchConfig(nproc_per_node=2, rdzv_backend="fsm", rdzv_endpoint="127.0.0.1:0", run_id="lazy")
        assert launch_agent(config, sys.executable, ["-c", "pass"]) == {0: None, 1: None}  # as torch: every rank
        assert run_agent(config, sys.executable, ["-c", "pass"]).exit_code == 0
        print("torch" in sys.modules)
        try:
            launch_agent(config, sys.executable, ["-c", "import sys; sys.exit(3)"])
        except fsm_agent.WorkerGroupFailedError as error:
            from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
            print(isinstance(error, ChildFailedError), error.result.exit_code)
    """,
    )
    done = subprocess.run([sys.executable, script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True", "3"]


def test_a_preload_agent_never_imports_torch(tmp_path):
    """--launcher preload with torch preloaded: the zygote imports torch, the agent process itself
    never does; the workers' rank 0 hosts their store (``TORCHELASTIC_USE_AGENT_STORE=False``)."""
    script = write(
        tmp_path / "probe.py",
        """
        import json, sys
        from fsm_agent import LaunchConfig, launch_agent
        check = ("import json, os; "
                 "print(json.dumps([os.environ['TORCHELASTIC_USE_AGENT_STORE'], 'torch' in __import__('sys').modules]))")
        config = LaunchConfig(nproc_per_node=2, rdzv_backend="fsm", rdzv_endpoint="127.0.0.1:0", run_id="pre",
                              launcher="preload")
        assert launch_agent(config, sys.executable, ["-c", check]) == {0: None, 1: None}
        print("agent-torch", "torch" in sys.modules)
    """,
    )
    done = subprocess.run([sys.executable, script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    # ``-c`` runs exec'd (not forked): no torch in the workers. Counted in
    # the whole output, not by line: the two workers share the pipe, and with PYTHONUNBUFFERED a print's
    # text and its newline are two writes, so their lines may come out joined.
    assert done.stdout.count('["False", false]') == 2, done.stdout
    assert "agent-torch False" in done.stdout.split("\n"), done.stdout


def test_in_process_launch_is_a_subreaper_only_while_workers_run(tmp_path):
    """A worker's orphan is adopted (and reaped) during the launch; afterwards the caller is as before."""
    import psutil

    from fsm_agent import elastic_launch

    before = is_subreaper()
    config = torch_config(nproc_per_node=1, run_id="reaper")
    ((orphan_pid, adopted_by),) = elastic_launch(config, _orphan_and_report_its_parent)(str(tmp_path)).values()
    assert adopted_by == os.getpid(), "while workers run, their orphans are the agent's"
    assert not psutil.pid_exists(orphan_pid), "the adopted orphan was left a zombie"
    assert is_subreaper() == before
    if before:
        return  # this process was a subreaper before: nothing more to show
    # After the launch, an orphan of anything this process runs goes to init (or an outer subreaper).
    made = subprocess.run([sys.executable, "-c", _MAKE_ORPHAN], capture_output=True, text=True, timeout=30)
    orphan = int(made.stdout)
    try:
        assert psutil.Process(orphan).ppid() != os.getpid()
    except psutil.NoSuchProcess:
        pass  # already gone and reaped by its new parent: not ours either
    deadline = time.monotonic() + 30
    while psutil.pid_exists(orphan) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not psutil.pid_exists(orphan)


#: Prints the pid of a grandchild that outlives its parent by 0.5 s.
_MAKE_ORPHAN = "import os, time\npid = os.fork()\nif pid == 0:\n    time.sleep(0.5)\n    os._exit(0)\nprint(pid)"


def _orphan_and_report_its_parent(directory):
    """Worker: fork a child that forks a grandchild and exits; the grandchild reports its new parent."""
    import os
    import time

    report = os.path.join(directory, "orphan.json")
    child = os.fork()
    if child == 0:
        if os.fork() == 0:
            first_parent = os.getppid()
            deadline = time.monotonic() + 10
            while os.getppid() == first_parent and time.monotonic() < deadline:
                time.sleep(0.01)  # until the child is gone and this one is adopted
            with open(report + ".tmp", "w") as f:
                json.dump({"pid": os.getpid(), "ppid": os.getppid()}, f)
            os.replace(report + ".tmp", report)
            os._exit(0)
        os._exit(0)
    os.waitpid(child, 0)
    deadline = time.monotonic() + 20
    while not os.path.exists(report) and time.monotonic() < deadline:
        time.sleep(0.01)
    with open(report) as f:
        seen = json.load(f)
    time.sleep(0.2)  # the orphan exits: a zombie of its adopter until reaped
    return seen["pid"], seen["ppid"]


# -- 2. --master-port finds the agents, and restarts still meet in an empty store ------------------


def test_static_workers_meet_at_master_addr_and_restarts_never_see_old_keys(tmp_path, agents):
    """Two static nodes that meet at --master-port / PET_MASTER_PORT, two counted restarts: every
    attempt's workers get --master-addr and a port node rank 0 published for their own store (its
    rank 0 hosts it, TORCHELASTIC_USE_AGENT_STORE=False), and none sees a key an earlier attempt wrote."""
    script = write(
        tmp_path / "w.py",
        """
        import json, os, sys, time
        from datetime import timedelta
        from torch.distributed import TCPStore
        # as init_process_group("env://") does when no agent hosts the store: rank 0 hosts it
        store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         is_master=os.environ["RANK"] == "0", timeout=timedelta(seconds=60))
        attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), os.environ["RANK"]
        stale = [k for k in (f"attempt_{a}/rank_{r}" for a in range(attempt) for r in "01") if store.check([k])]
        with open(f"seen_{attempt}_{rank}.tmp", "w") as f:
            json.dump({"stale": stale, "addr": os.environ["MASTER_ADDR"], "port": os.environ["MASTER_PORT"],
                       "agent_store": os.environ["TORCHELASTIC_USE_AGENT_STORE"]}, f)
        os.replace(f"seen_{attempt}_{rank}.tmp", f"seen_{attempt}_{rank}.json")
        store.set(f"attempt_{attempt}/rank_{rank}", "x")
        store.wait([f"attempt_{attempt}/rank_{1 - int(rank)}"], timedelta(seconds=60))
        if attempt < 2:
            sys.exit(1)  # both ranks fail (as a collective would fail them), each once the other wrote its key
        # rank 0's store ends with it: it waits until rank 1 is done with it
        store.set("done_1", "x") if rank == "1" else store.wait(["done_1"], timedelta(seconds=60))
    """,
    )
    port = free_port()
    common = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--master-addr",
        "127.0.0.1",
        "--max-restarts",
        "2",
        "--monitor-interval",
        "0.2",
    ]
    # Node 0 names the port with the flag, node 1 with torchrun's environment variable.
    nodes = [
        agents.start(*common, "--node-rank", "0", "--master-port", str(port), script),
        agents.start(*common, "--node-rank", "1", script, env={"PET_MASTER_PORT": str(port)}),
    ]
    outputs = [node.communicate(timeout=180) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(err for _, err in outputs)
    seen = {(a, r): json.loads((tmp_path / f"seen_{a}_{r}.json").read_text()) for a in range(3) for r in (0, 1)}
    assert {(s["addr"], s["agent_store"]) for s in seen.values()} == {("127.0.0.1", "False")}
    for attempt in range(3):  # both ranks of an attempt meet at one port, not the agents' own
        ports = {seen[attempt, r]["port"] for r in (0, 1)}
        assert len(ports) == 1 and ports != {str(port)}, seen
    assert all(s["stale"] == [] for s in seen.values()), seen


@pytest.mark.parametrize("trial", range(3))
def test_training_restarts_under_static_master_port(tmp_path, agents, trial):
    """examples/train_digits.py, rank 1 crashing once, under --master-port: gloo's restarted group
    meets (under torchrun some tries fail: gloo connects to the previous attempt's addresses)."""
    example = Path(__file__).resolve().parents[2] / "examples" / "train_digits.py"
    result = agents.run(
        "--master-port",
        str(free_port()),
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        str(example),
        "--epochs",
        "4",
        "--crash-rank",
        "1",
        "--crash-epoch",
        "2",
        "--checkpoint",
        str(tmp_path / "ck.pt"),
        "--result-file",
        str(tmp_path / "res.json"),
        timeout=240,
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "res.json").read_text())
    assert summary["restart_count"] == 1 and summary["resumed_from"] == 1


def test_torch_launch_config_static_endpoint_is_where_the_agents_meet(tmp_path):
    """The API as torch: a static LaunchConfig's endpoint host is MASTER_ADDR (torch's _get_addr_and_port).
    Its port is the agents' store; the workers get a port of that host for their own store (#39.1),
    where torch hands them the endpoint's."""
    from fsm_agent import launch_agent

    port = free_port()
    config = torch_config(rdzv_backend="static", rdzv_endpoint=f"127.0.0.1:{port}", rdzv_configs={"rank": 0})
    masters = launch_agent(config, _master)
    assert set(masters) == {0, 1} and masters[0] == masters[1], masters
    addr, worker_port = masters[0]
    assert addr == "127.0.0.1" and 0 < int(worker_port) < 65536 and int(worker_port) != port, masters


def _master():
    import os

    return os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]


# -- 3. torchrun's defaults and names -----------------------------------------------------------


def test_static_rendezvous_waits_900_seconds_by_default():
    """torchrun's static timeout (its LaunchConfig's default) unless rdzv_configs sets one."""
    from fsm_agent.launch import create_agent

    def timeout_of(**configs):
        config = LaunchConfig(rdzv_backend="static", rdzv_endpoint=f"127.0.0.1:{free_port()}", rdzv_configs=configs)
        agent = create_agent(config, sys.executable, ("-c", "pass"))
        try:
            return agent._rdzv_handler.timeout.total_seconds()
        finally:
            agent.close()

    assert timeout_of() == 900
    assert timeout_of(timeout=30) == 30


@pytest.mark.parametrize("name", ["etcd", "etcd-v2"])
@pytest.mark.parametrize("plugin", ["installed", "disabled"])
def test_rdzv_backend_etcd_names_etcd_v3_and_how_to_get_it(tmp_path, agents, name, plugin):
    pytest.importorskip("fsm_agent_etcd")
    write(tmp_path / "w.py", "pass\n")
    extra = ["--disable-plugin", "etcd"] if plugin == "disabled" else []
    done = agents.run(*extra, "--rdzv-backend", name, "--rdzv-endpoint", "127.0.0.1:2379", "w.py", timeout=60)
    assert done.returncode == 2
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"fsm-agent: error: --rdzv-backend {name}: ") and "--rdzv-backend etcd-v3" in line
    assert ("(installed)" in line) == (plugin == "installed")
    assert ("pip install fsm-agent-etcd" in line) == (plugin == "disabled")


def test_a_bad_loglevel_is_a_config_error_in_the_python_api_too(monkeypatch):
    """``LOGLEVEL=NOPE`` and ``elastic_launch``: fsm-agent's ConfigError naming it, as the CLI's
    one line says (it was logging's ``ValueError: Unknown level``), before any worker."""
    from fsm_agent import elastic_launch

    monkeypatch.setenv("LOGLEVEL", "NOPE")
    with pytest.raises(ConfigError, match="LOGLEVEL='NOPE': not a log level"):
        elastic_launch(torch_config(nproc_per_node=1, run_id="loglevel"), _square_rank)(1)
