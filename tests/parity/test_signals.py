"""Stop signals, as torchrun handles them and better: parity runs and fsm-agent's own guarantees.

(1) A stop signal ends the agent in every state and with every built-in rendezvous backend:
    before its options are read, while it waits for the other nodes (static: store host and the
    other nodes; c10d; fsm), while the workers run, and in the exit barrier. It ends within a
    bound well under the shutdown timeout, with 128+N, no traceback, nothing left running.
(2) The workers get the signal the agent got (torch's ``_shutdown(death_sig=e.sigval)``), SIGKILL
    after the grace; a second stop signal SIGKILLs them at once. ``--forward-signals`` only relays,
    and a relayed signal before there are workers is dropped.
(3) Where torchrun runs the same scenario, it runs first, and fsm-agent must do at least as well
    (``assert_at_least_as_good``): torchrun exits 1 once its workers run, and while waiting in
    its static rendezvous or exit barrier it does not end at all before its timeouts.

The multi-host variants (static rendezvous across network namespaces) are at the end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from fsm_agent.testing.processes import wait_until
from tests.conftest import Result, free_port
from tests.netns import NetnsHosts
from tests.parity.conftest import (
    FSM_AGENT,
    TORCHRUN,
    ConnectWatch,
    Tool,
    assert_at_least_as_good,
    exit_class,
    probe_records,
    wait_catching,
    wait_for_probes,
    wait_listening,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

#: Seconds a stopped agent may take to end: far below its shutdown timeout (``GRACE_S``) and any
#: rendezvous timeout, generous for two shared, slow cores.
STOP_BOUND_S = 20.0
#: The shutdown timeout of these runs: a run that waits it out is a failure.
GRACE_S = 90
#: How long a torchrun run may take to react before it counts as "did not stop" (and is killed).
TORCHRUN_PATIENCE_S = 25.0
ALL_STOP = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
ENV = {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(GRACE_S)}


def stop(proc, sig: int, patience: float) -> tuple[Result, float]:
    """Send ``sig``; the Result and the seconds to the end. Not ended within ``patience``: SIGKILL
    (the Result then says -9, so that run fails any check of its exit class)."""
    sent = time.monotonic()
    proc.send_signal(sig)
    if not wait_until(lambda: not proc.alive(), patience):
        os.killpg(proc.pid, signal.SIGKILL)
    result = proc.wait(60)
    return result, time.monotonic() - sent


def patience(tool: Tool) -> float:
    return STOP_BOUND_S if tool.is_fsm else TORCHRUN_PATIENCE_S


def check_stopped(result: Result, took: float, sig: int) -> None:
    why = f"exit {result.returncode} after {took:.1f}s\n--- stderr ---\n{result.stderr[-4000:]}"
    assert exit_class(result.returncode) == 128 + sig, why
    assert took < STOP_BOUND_S, why
    assert "Traceback" not in result.stderr, why


# -- (2)+(3) the workers get the agent's signal ------------------------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1], ids=lambda s: s.name)
def test_workers_get_the_signal_the_agent_got(parity, sig):
    """torchrun stops its workers with the signal it received (SIGINT: KeyboardInterrupt in the
    workers; SIGUSR1 listed in --signals-to-handle reaches their handler); so does fsm-agent, and it
    exits 128+N where torchrun exits 1."""

    def scenario(tool, launcher):
        proc = tool.start(
            launcher,
            "--standalone",
            "--nproc-per-node",
            "2",
            "--monitor-interval",
            "0.1",
            "--signals-to-handle",
            ALL_STOP,
            launcher.signal_probe,
            env=ENV,
        )
        wait_for_probes(launcher, 2, proc=proc)
        result, took = stop(proc, sig, patience(tool))
        if tool.is_fsm:
            check_stopped(result, took, sig)
            assert f"agent received signal {int(sig)} ({sig.name}) and stopped its workers" in result.stderr
        return result

    outcomes = parity.both(scenario)
    expected = "KeyboardInterrupt" if sig == signal.SIGINT else sig.name
    assert outcomes[TORCHRUN].signals() == {0: expected, 1: expected}, outcomes[TORCHRUN].describe()
    assert_at_least_as_good(outcomes, expected_exit=128 + sig)


def test_second_ctrl_c_kills_the_workers_at_once(parity):
    """Workers that ignore SIGINT: the first Ctrl-C reaches them, the second SIGKILLs them at once
    (torchrun sends SIGTERM and waits out the grace again)."""

    def scenario(tool, launcher):
        proc = tool.start(
            launcher,
            "--standalone",
            "--nproc-per-node",
            "2",
            "--monitor-interval",
            "0.1",
            launcher.signal_probe,
            env={**ENV, "SIGNAL_PROBE_IGNORE": "1"},
        )
        wait_for_probes(launcher, 2, proc=proc)
        proc.send_signal(signal.SIGINT)
        wait_for_probes(launcher, 2, kind="signal", proc=proc)
        result, took = stop(proc, signal.SIGINT, STOP_BOUND_S)
        check_stopped(result, took, signal.SIGINT)
        assert "killing the workers" in result.stderr, result.stderr
        return result

    outcomes = parity.both(scenario, tools=(FSM_AGENT,))
    assert outcomes[FSM_AGENT].signals() == {0: "KeyboardInterrupt", 1: "KeyboardInterrupt"}
    assert_at_least_as_good(outcomes, expected_exit=130)


# -- (1)+(3) stopped before its options are read ------------------------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_stop_signal_right_after_start(parity, sig):
    """As soon as fsm-agent's code runs (its package import; it still imports the CLI, reads its
    options, makes its rendezvous): 128+N, no traceback. torchrun gets it 0.1 s after start."""

    def scenario(tool, launcher):
        proc = tool.start(launcher, "--standalone", "--nproc-per-node", "1", launcher.signal_probe, env=ENV)
        if tool.is_fsm:
            wait_catching(proc, signal.SIGTERM)
        else:
            time.sleep(0.1)
        result, took = stop(proc, sig, patience(tool))
        if tool.is_fsm:
            check_stopped(result, took, sig)
        return result

    assert_at_least_as_good(parity.both(scenario), expected_exit=128 + sig)


# -- (1)+(3) stopped while waiting for the other nodes ----------------------------------------------------
WAITING = {
    # id: (flags with {port}; how to know it waits: "listens" on the port, tries to "connect" to it, or
    # "sleep" (a torch-free agent, up in well under the SETTLE_S); whether torchrun has the backend)
    "static-store-host": (
        ["--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", "{port}"],
        "listens",
        True,
    ),
    "static-other-node": (
        ["--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", "{port}"],
        "connect",
        True,
    ),
    "c10d-host": (
        ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:{port}", "--rdzv-id", "wait"],
        "listens",
        True,
    ),
    "c10d-other-node": (
        [
            "--nnodes",
            "2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "127.0.0.1:{port}",
            "--rdzv-id",
            "wait",
            "--rdzv-conf",
            "is_host=0",
        ],
        "connect",
        True,
    ),
    "fsm-host": (
        ["--nnodes", "2", "--rdzv-backend", "fsm", "--rdzv-endpoint", "127.0.0.1:{port}", "--rdzv-id", "wait"],
        "listens",
        False,
    ),
    # The fsm client gives up on a peer that closes the handshake: no ConnectWatch; nothing listens.
    "fsm-other-node": (
        [
            "--nnodes",
            "2",
            "--rdzv-backend",
            "fsm",
            "--rdzv-endpoint",
            "127.0.0.1:{port}",
            "--rdzv-id",
            "wait",
            "--rdzv-conf",
            "is_host=0",
        ],
        "sleep",
        False,
    ),
}
SETTLE_S = 4.0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
@pytest.mark.parametrize("case", list(WAITING))
def test_stop_while_waiting_for_the_other_nodes(parity, case, sig):
    """One node of two: the agent waits in its rendezvous (torch's StaticTCPRendezvous blocks in C++
    there); a stop signal ends it at once with 128+N. torchrun ends killed by SIGTERM, and not at
    all on SIGINT while it waits in the C++ store calls."""
    flags, mode, torch_knows = WAITING[case]

    def scenario(tool, launcher):
        watch = ConnectWatch() if mode == "connect" else None
        port = watch.port if watch else free_port()
        proc = tool.start(
            launcher, *(f.format(port=port) for f in flags), "--nproc-per-node", "1", launcher.signal_probe, env=ENV
        )
        if mode == "listens":
            wait_listening(port, proc)
        elif mode == "connect":
            watch.wait(proc)
        else:
            time.sleep(SETTLE_S)
        time.sleep(0.5)  # well inside the blocking wait
        assert proc.alive(), "\n".join(proc.output())
        result, took = stop(proc, sig, patience(tool))
        if tool.is_fsm:
            check_stopped(result, took, sig)
            # no worker ran: the summary says so, not "stopped its workers" (#30.9)
            assert f"agent received signal {int(sig)} ({sig.name}) while no worker ran" in result.stderr, result.stderr
        return result

    outcomes = parity.both(scenario, tools=(TORCHRUN, FSM_AGENT) if torch_knows else (FSM_AGENT,))
    assert not outcomes[FSM_AGENT].records["started"], "no worker may start"
    assert_at_least_as_good(outcomes, expected_exit=128 + sig)


# -- (1) stopped in the exit barrier --------------------------------------------------------------------
BARRIER = {
    "static": ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", "{port}"],
    "c10d": ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:{port}", "--rdzv-id", "bar"],
    "fsm": ["--nnodes", "2", "--rdzv-backend", "fsm", "--rdzv-endpoint", "127.0.0.1:{port}", "--rdzv-id", "bar"],
}


@pytest.mark.parametrize("backend", list(BARRIER))
def test_stop_in_the_exit_barrier(parity, backend):
    """The other node's worker is done, the store host's still runs: the other node waits in the
    exit barrier (a C++ ``store.wait`` for torch's stores) and ends at once on SIGTERM; then the
    store host on SIGINT (its worker gets KeyboardInterrupt)."""

    def scenario(tool, launcher):
        port = free_port()
        common = [
            *(f.format(port=port) for f in BARRIER[backend]),
            "--nproc-per-node",
            "1",
            "--monitor-interval",
            "0.1",
            "--exit-barrier-timeout",
            "200",
        ]
        static = backend == "static"
        host = tool.start(
            launcher,
            *common,
            *(["--node-rank", "0"] if static else []),
            launcher.signal_probe,
            env={**ENV, "FSM_E2E_TAG": "host_"},
        )
        if not static:
            wait_listening(port, host)  # the first agent up hosts the store
        other = tool.start(
            launcher,
            *common,
            *(["--node-rank", "1"] if static else []),
            launcher.signal_probe,
            env={**ENV, "SIGNAL_PROBE_EXIT_AFTER": "0", "FSM_E2E_TAG": "other_"},
        )
        wait_for_probes(launcher, 1, proc=host, tag="host_")
        done = next(iter(wait_for_probes(launcher, 1, proc=other, tag="other_").values()))["pid"]
        assert wait_until(lambda: not _alive(done), 30)
        time.sleep(1.0)  # the other node is in the barrier now (200 s long)
        assert other.alive(), "\n".join(other.output())
        result, took = stop(other, signal.SIGTERM, STOP_BOUND_S)
        check_stopped(result, took, signal.SIGTERM)
        result, took = stop(host, signal.SIGINT, STOP_BOUND_S)
        check_stopped(result, took, signal.SIGINT)
        seen = [rec["signal"] for rec in probe_records(launcher.out, "signal", "host_").values()]
        # The other node finished before it was stopped: no backend takes it for lost and restarts
        # the host's worker (#30 item 1), so that worker's first signal is the host's own SIGINT.
        assert seen == ["KeyboardInterrupt"], seen
        return result

    outcome = parity.run(FSM_AGENT, scenario)
    assert not outcome.leftovers, outcome.describe()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


# -- (2) --forward-signals relays only, and never kills the agent -----------------------------------------
def test_forwarded_signal_before_workers_is_dropped(parity):
    """SIGUSR1 as soon as the agent's code runs (the issue's "0.1 s after start"), and again while
    the rendezvous waits, is dropped (it used to kill the agent: exit 138); once the workers run it
    is relayed, and nothing is stopped."""

    def scenario(tool, launcher):
        port = free_port()
        env = {**ENV, "SIGNAL_PROBE_IGNORE": "1", "SIGNAL_PROBE_EXIT_AFTER": "8"}
        common = [
            "--nnodes",
            "2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--nproc-per-node",
            "1",
            "--monitor-interval",
            "0.1",
            "--forward-signals",
            "SIGUSR1",
        ]
        first = tool.start(launcher, *common, launcher.signal_probe, env=env)
        wait_catching(first, signal.SIGTERM)  # its first handlers: main's came with launch_agent
        first.send_signal(signal.SIGUSR1)
        wait_listening(port, first)
        first.send_signal(signal.SIGUSR1)
        time.sleep(0.5)
        assert first.alive(), "\n".join(first.output())
        second = tool.start(launcher, *common, launcher.signal_probe, env=env)
        probes = wait_for_probes(launcher, 2, proc=first)
        first.send_signal(signal.SIGUSR1)
        relayed = [rank for rank, rec in probes.items() if psutil.Process(rec["pid"]).ppid() == first.pid]
        assert relayed, probes
        assert wait_until(lambda: set(relayed) == set(probe_records(launcher.out, "signal")), 30)
        for proc in (first, second):
            proc.wait(90).check(0)
        return first.wait()

    outcome = parity.run(FSM_AGENT, scenario)
    assert set(outcome.signals().values()) == {"SIGUSR1"} and len(outcome.signals()) == 1, outcome.describe()
    assert not outcome.leftovers, outcome.describe()


# -- (1) multi-host: static rendezvous across network namespaces --------------------------------------------
def _static_flags(hosts: NetnsHosts, node_rank: int) -> list[str]:
    return [
        "--nnodes",
        "2",
        "--node-rank",
        str(node_rank),
        "--nproc-per-node",
        "1",
        "--master-addr",
        hosts.addrs[0],
        "--master-port",
        "29500",
        "--monitor-interval",
        "0.1",
        "--shutdown-timeout",
        str(GRACE_S),
    ]


@pytest.mark.multihost
@pytest.mark.parametrize("node_rank,sig", [(0, signal.SIGINT), (1, signal.SIGTERM)], ids=["store-host", "other-node"])
def test_netns_static_node_alone_stops_at_once(netns_hosts, node_rank, sig):
    """One static node on its own host waits for the other; a stop signal ends it with 128+N."""
    agent = netns_hosts.start_agent(node_rank, *_static_flags(netns_hosts, node_rank), final_world=99)
    time.sleep(6.0)  # started, imported torch, inside StaticTCPRendezvous (listening / retrying its connect)
    assert agent.poll() is None, agent.output()
    sent = time.monotonic()
    agent.proc.send_signal(sig)
    code = agent.wait(STOP_BOUND_S + 30)
    took = time.monotonic() - sent
    assert code == 128 + sig and took < STOP_BOUND_S, f"exit {code} after {took:.1f}s\n{agent.output()}"
    assert "Traceback" not in agent.stderr.read_text()
    assert not netns_hosts.pids_in(netns_hosts.names[node_rank]), "processes left in the host"


@pytest.mark.multihost
def test_netns_static_job_stops_with_the_signal(netns_hosts):
    """Both static nodes run their workers; SIGINT to one and SIGHUP to the other, sent together, end each with 128+N."""
    agents = [netns_hosts.start_agent(r, *_static_flags(netns_hosts, r), final_world=99) for r in (0, 1)]
    netns_hosts.wait_for(
        lambda: len(netns_hosts.records("reduced")) == 2, 120, "both workers reduced", expect_running=agents
    )
    # Both signals before either wait, node 1's first: node 1 stops on its own (exit 1, one line)
    # once the store's host ended before its workers succeeded, which is not what this test checks.
    signals = {1: signal.SIGHUP, 0: signal.SIGINT}
    sent = time.monotonic()
    for rank, sig in signals.items():
        agents[rank].proc.send_signal(sig)
    for rank, sig in signals.items():
        code = agents[rank].wait(STOP_BOUND_S + 30)
        took = time.monotonic() - sent
        assert code == 128 + sig and took < STOP_BOUND_S, f"exit {code} after {took:.1f}s\n{agents[rank].output()}"
    for name in netns_hosts.names[:2]:
        assert not netns_hosts.pids_in(name), "processes left in the hosts"


# -- the early handlers are the agent command's only ------------------------------------------------------
CHECK_DISPOSITIONS = (
    "import signal, sys, fsm_agent; "
    "ok = signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and "
    "signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL and "
    "signal.getsignal(signal.SIGINT) is signal.default_int_handler; sys.exit(0 if ok else 3)"
)


def test_importing_fsm_agent_elsewhere_keeps_the_default_signal_actions(launcher):
    """A worker (or any program) that imports fsm_agent, even with --forward-signals in its argv,
    keeps Python's signal dispositions: only ``fsm-agent run``/``fsmrun`` installs early handlers."""
    launcher.run([sys.executable, "-c", CHECK_DISPOSITIONS, "--forward-signals", "SIGUSR1"]).check(0)
    launcher.run([sys.executable, "-c", CHECK_DISPOSITIONS, "run"]).check(0)


# -- (1) two stop signals at once (a process group signalled by `timeout` or a scheduler) ---------------
#: Moments (s after start) the double signal lands: building the agent, joining, waiting in the rendezvous.
DOUBLE_AT = (0.8, 1.2, 1.6, 2.0, 3.0, 6.0)
#: From this many seconds after the start the agent has read its options even on a loaded 2-core CI
#: machine, so the signals meet the agent itself (its FAILED summary), not the early handlers.
OPTIONS_READ_BY_S = 6.0


@pytest.mark.parametrize(
    "flags",
    [
        ["--rdzv-backend", "fsm", "--rdzv-endpoint", "127.0.0.1:{port}", "--nnodes", "2"],
        ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", "{port}"],
    ],
    ids=["fsm", "static"],
)
def test_two_stop_signals_at_once_before_the_workers(launcher, flags):
    """Two SIGTERMs microseconds apart while the agent starts or waits for the other node: each
    try ends as a single one does (128+N, the FAILED summary, no traceback, the temporary log
    directory removed); the second never cuts the agent's way out short."""
    for at in DOUBLE_AT:
        port = free_port()
        proc = launcher.fsm(*(f.format(port=port) for f in flags), "--nproc-per-node", "1", launcher.probe, env=ENV)
        time.sleep(at)
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGTERM)
        if not wait_until(lambda proc=proc: not proc.alive(), STOP_BOUND_S):
            os.killpg(proc.pid, signal.SIGKILL)
        result = proc.wait(60)
        why = f"at {at}s: exit {result.returncode}\n--- stderr ---\n{result.stderr[-4000:]}"
        assert exit_class(result.returncode) == 128 + signal.SIGTERM, why
        assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr, why
        if at >= OPTIONS_READ_BY_S:  # the earliest signals end before any summary
            assert "FAILED" in result.stderr, why
        assert not list(launcher.tmp.glob("fsm_agent_*")), f"{why}\nleft: {list(launcher.tmp.rglob('*'))}"


def test_store_host_stopped_before_the_exit_barrier(parity):
    """Static, two nodes: the store host's worker is done and it gets SIGTERM while the other
    node's worker still runs. That node then finds the store gone at its exit barrier and says so
    truthfully (no claim that the barrier's timeout passed); its own result stands."""

    def scenario(tool, launcher):
        port = free_port()
        common = [
            "--nnodes",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            port,
            "--nproc-per-node",
            "1",
            "--monitor-interval",
            "0.1",
            "--exit-barrier-timeout",
            "200",
        ]
        host = tool.start(
            launcher,
            *common,
            "--node-rank",
            "0",
            launcher.signal_probe,
            env={**ENV, "SIGNAL_PROBE_EXIT_AFTER": "0", "FSM_E2E_TAG": "host_"},
        )
        other = tool.start(
            launcher,
            *common,
            "--node-rank",
            "1",
            launcher.signal_probe,
            env={**ENV, "SIGNAL_PROBE_EXIT_AFTER": "15", "FSM_E2E_TAG": "other_"},
        )
        done = next(iter(wait_for_probes(launcher, 1, proc=host, tag="host_").values()))["pid"]
        wait_for_probes(launcher, 1, proc=other, tag="other_")
        assert wait_until(lambda: not _alive(done), 30)
        time.sleep(1.0)  # the store host waits in its exit barrier now
        result, took = stop(host, signal.SIGTERM, STOP_BOUND_S)
        check_stopped(result, took, signal.SIGTERM)
        result = other.wait(60)
        assert "the store host left before the exit barrier completed" in result.stderr, result.stderr
        assert "did not complete within" not in result.stderr, result.stderr
        return result

    outcome = parity.run(FSM_AGENT, scenario)
    assert not outcome.leftovers, outcome.describe()


# -- the suite itself under nohup ----------------------------------------------------------------------
def test_the_sighup_tests_hold_when_the_suite_runs_under_nohup(tmp_path):
    """A suite started under nohup (or by a runner that detaches the same way) hands SIGHUP ignored
    to every agent it starts, and an agent keeps an inherited SIGHUP ignored on purpose; the
    suite's conftest.py gives its processes the default back, so the SIGHUP tests test the agent.
    (Before, test_workers_get_the_signal_the_agent_got[SIGHUP] failed there: "exit -9 after 20.0s".)"""
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "FSM_TEST_CPU_HOGS"}
    inner = subprocess.run(
        [
            "nohup",
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:randomly",
            "tests/parity/test_signals.py::test_workers_get_the_signal_the_agent_got[SIGHUP]",
        ],
        cwd=root,
        env={**env, "TMPDIR": str(tmp_path)},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert inner.returncode == 0, inner.stdout[-4000:]
