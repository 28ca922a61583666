"""Helpers for torchrun-parity tests: run one scenario under ``torchrun`` and under ``fsm-agent run``.

A parity test writes its scenario once, as a function of a ``Tool`` (which command starts the
agent) and a ``Launcher`` of the e2e kit (tests/conftest.py: each process in its own session,
a private token in its environment, ``TMPDIR`` removed at teardown). ``parity.both(scenario)``
runs it under each tool, each in a fresh Launcher of its own, one after the other, and returns an
``Outcome`` per tool: the exit code and its class (``exit_class``: "killed by N" and "exit 128+N"
are one result), the agent's output, what the workers wrote (``SIGNAL_PROBE`` records), and the
processes left behind (a leftover of torchrun's is reported, one of fsm-agent's fails the test).
The assertions then say "fsm-agent is at least as good as torchrun" (``assert_at_least_as_good``)::

    def test_x(parity):
        def scenario(tool, launcher):
            proc = tool.start(launcher, "--standalone", "--nproc-per-node", "2", launcher.signal_probe)
            ...
            return proc.wait()
        out = parity.both(scenario)
        assert_at_least_as_good(out, expected_exit=128 + signal.SIGTERM)

Every scenario is written so that torchrun can run it (the flags both know); fsm-agent-only
checks go in the fsm-agent outcome's assertions.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from fsm_agent.testing.processes import wait_until
from tests import conftest as e2e
from tests.conftest import Launcher, Proc, Result, free_port, write_script

TORCHRUN, FSM_AGENT = "torchrun", "fsm-agent"
TOOLS = (TORCHRUN, FSM_AGENT)

#: A worker that records what reached it: ``$FSM_E2E_OUT/<tag>started_rank<R>.json`` once its
#: handlers are in place, then ``<tag>signal_rank<R>.json`` with the first signal (``SIGTERM``,
#: ``SIGHUP``, ``SIGUSR1``, ``SIGQUIT`` by handler; ``KeyboardInterrupt`` for SIGINT) and exits
#: quietly by that signal's default action (SIGINT: exit 130), as a program that cleans up would.
#: ``SIGNAL_PROBE_IGNORE=1``: it records each signal and keeps running (a worker that ignores
#: them: only SIGKILL ends it). ``SIGNAL_PROBE_EXIT_AFTER=S``: exit 0 after S seconds (default 120).
SIGNAL_PROBE = r"""
import json, os, signal, sys, time
out, tag, rank = os.environ["FSM_E2E_OUT"], os.environ.get("FSM_E2E_TAG", ""), os.environ["RANK"]
ignore = os.environ.get("SIGNAL_PROBE_IGNORE") == "1"
seen = []

def record(kind, **fields):
    path = os.path.join(out, "%s%s_rank%s.json" % (tag, kind, rank))
    with open(path + ".tmp", "w") as f:
        json.dump(dict(fields, pid=os.getpid(), env={k: v for k, v in os.environ.items()}), f)
    os.replace(path + ".tmp", path)

def got(name, signum):
    seen.append(name)
    record("signal", signal=name, seen=list(seen))
    if not ignore:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT):
    signal.signal(s, lambda signum, frame: got(signal.Signals(signum).name, signum))
if ignore:
    signal.signal(signal.SIGINT, lambda signum, frame: got("KeyboardInterrupt", signum))
record("started")
deadline = time.monotonic() + float(os.environ.get("SIGNAL_PROBE_EXIT_AFTER", "120"))
try:
    while time.monotonic() < deadline:
        time.sleep(0.05)
except KeyboardInterrupt:
    got("KeyboardInterrupt", signal.SIGINT)
"""


def exit_class(returncode: int) -> int:
    """The shell's view of an exit: "killed by N" (Popen's -N) is 128+N, like ``exit 128+N``."""
    return 128 - returncode if returncode < 0 else returncode


@dataclass
class Tool:
    """One agent command: ``torchrun`` (``python -m torch.distributed.run``) or ``fsm-agent run``."""

    name: str

    def start(self, launcher: Launcher, *args: object, **kwargs) -> Proc:
        """Start this tool with ``args`` (flags both tools know) in ``launcher``."""
        if self.name == TORCHRUN:
            return launcher.torchrun(*map(str, args), **kwargs)
        return launcher.fsm(*map(str, args), **kwargs)

    @property
    def is_fsm(self) -> bool:
        return self.name == FSM_AGENT


@dataclass
class Outcome:
    """One tool's run of a scenario.

    Attributes:
        tool: ``torchrun`` or ``fsm-agent``.
        result: what the scenario returned (usually the agent's ``Result``), or None.
        exit_class: ``exit_class(result.returncode)`` when ``result`` is a Result.
        records: ``{kind: {rank: record}}`` the signal probes wrote (kinds ``started``, ``signal``).
        leftovers: processes (and worker cgroups) still there after the agent ended.
    """

    tool: str
    result: object
    records: dict[str, dict[int, dict]] = field(default_factory=dict)
    leftovers: list[str] = field(default_factory=list)

    @property
    def exit_class(self) -> int | None:
        return exit_class(self.result.returncode) if isinstance(self.result, Result) else None

    def signals(self) -> dict[int, str]:
        """``{RANK: first signal the worker saw}``."""
        return {rank: rec["signal"] for rank, rec in self.records.get("signal", {}).items()}

    def describe(self) -> str:
        head = f"{self.tool}: exit {getattr(self.result, 'returncode', None)} (class {self.exit_class})"
        body = ""
        if isinstance(self.result, Result):
            body = f"\n--- stdout ---\n{self.result.stdout[-3000:]}\n--- stderr ---\n{self.result.stderr[-3000:]}"
        return f"{head}, worker signals {self.signals()}, leftovers {self.leftovers}{body}"


def probe_records(out_dir: Path, kind: str, tag: str = "") -> dict[int, dict]:
    """``{RANK: record}`` of the signal probes' ``kind`` files in ``out_dir``."""
    found = {}
    prefix = f"{tag}{kind}_rank"
    for path in Path(out_dir).glob(f"{prefix}*.json"):
        rank = path.name[len(prefix) : -len(".json")]
        if rank.isdigit():
            found[int(rank)] = json.loads(path.read_text())
    return found


#: The e2e kit's fixture, for parity-module tests of fsm-agent alone.
launcher = e2e.launcher


class Parity:
    """Runs scenarios under each tool; see the module docstring."""

    def __init__(self, tmp_path: Path):
        self.dir = tmp_path

    def run(self, tool: str, scenario: Callable[[Tool, Launcher], object]) -> Outcome:
        """Run ``scenario(Tool(tool), launcher)`` in a fresh Launcher; collect what it left."""
        workdir = self.dir / tool
        workdir.mkdir()
        launcher = Launcher(workdir)
        launcher.signal_probe = write_script(workdir, "signal_probe.py", SIGNAL_PROBE)
        try:
            result = scenario(Tool(tool), launcher)
        finally:
            leftovers = launcher.cleanup()
        records = {kind: probe_records(launcher.out, kind) for kind in ("started", "signal")}
        return Outcome(tool, result, records, leftovers)

    def both(self, scenario: Callable[[Tool, Launcher], object], tools: tuple[str, ...] = TOOLS) -> dict[str, Outcome]:
        """``{tool: Outcome}``: the scenario under torchrun, then under fsm-agent."""
        return {tool: self.run(tool, scenario) for tool in tools}


@pytest.fixture
def parity(tmp_path):
    return Parity(tmp_path)


def assert_at_least_as_good(
    outcomes: dict[str, Outcome], *, expected_exit: int | None = None, same_worker_signals: bool = True
) -> None:
    """fsm-agent did at least as well as torchrun on each count:

    - the exit class is ``expected_exit`` when given (torchrun's may be worse: it exits 1 on a
      signal once workers run), else the same as torchrun's;
    - each worker saw the same signal as under torchrun (``same_worker_signals``);
    - no traceback from the agent where torchrun printed none;
    - nothing of fsm-agent's left running (torchrun's leftovers are only reported).
    """
    fsm, ref = outcomes[FSM_AGENT], outcomes.get(TORCHRUN)
    report = "\n\n".join(o.describe() for o in outcomes.values())
    if expected_exit is not None:
        assert fsm.exit_class == expected_exit, (
            f"fsm-agent: exit class {fsm.exit_class}, want {expected_exit}\n{report}"
        )
    elif ref is not None:
        assert fsm.exit_class == ref.exit_class, report
    if ref is not None and same_worker_signals:
        assert fsm.signals() == ref.signals(), f"the workers saw other signals\n{report}"
    if ref is not None and isinstance(ref.result, Result) and "Traceback" not in ref.result.stderr:
        assert "Traceback" not in fsm.result.stderr, report
    assert not fsm.leftovers, f"fsm-agent left processes behind\n{report}"


def wait_for_probes(
    launcher: Launcher,
    count: int,
    kind: str = "started",
    timeout: float = 90.0,
    proc: Proc | None = None,
    tag: str = "",
) -> dict[int, dict]:
    """Wait until ``count`` signal probes (``$FSM_E2E_TAG`` = ``tag``) wrote their ``kind`` record;
    fail with the agents' output on timeout or once ``proc`` ended."""

    def ready():
        return len(probe_records(launcher.out, kind, tag)) >= count or (proc is not None and not proc.alive())

    if not wait_until(ready, timeout) or len(probe_records(launcher.out, kind, tag)) < count:
        outputs = "\n".join(
            f"{p.args} rc={p.popen.poll()}\n{p.output()[0][-3000:]}\n{p.output()[1][-3000:]}" for p in launcher.procs
        )
        pytest.fail(f"{count} probe(s) did not write {kind!r} within {timeout}s\n{outputs}")
    return probe_records(launcher.out, kind, tag)


def wait_listening(port: int, proc: Proc, timeout: float = 90.0, host: str = "127.0.0.1") -> None:
    """Wait until something accepts connections on ``host:port`` (the agent is in its rendezvous)."""

    def listening():
        if not proc.alive():
            return True
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            return False

    assert wait_until(listening, timeout, interval=0.1), f"nothing listens on {host}:{port} after {timeout}s"
    assert proc.alive(), "the agent ended before it listened:\n" + "\n".join(proc.output())


class ConnectWatch:
    """A listener on a free port that notes the first connection and then closes: point a
    non-host agent's store endpoint at ``port``, and ``wait(proc)`` returns once that agent tried
    to connect (it is in its rendezvous, retrying, since nothing answers there any more)."""

    def __init__(self, host: str = "127.0.0.1"):
        self._sock = socket.socket()
        self._sock.bind((host, 0))
        self._sock.listen(16)
        self._sock.settimeout(0.2)
        self.port = self._sock.getsockname()[1]

    def wait(self, proc: Proc, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline and proc.alive():
                try:
                    conn, _ = self._sock.accept()
                except (TimeoutError, BlockingIOError):
                    continue
                conn.close()
                return
            pytest.fail(f"the agent did not connect to port {self.port}:\n" + "\n".join(proc.output()))
        finally:
            self.close()

    def close(self) -> None:
        self._sock.close()


def catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` now (``SigCgt`` in ``/proc/PID/status``)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except OSError:
        pass
    return False


def wait_catching(proc: Proc, sig: int, timeout: float = 60.0) -> None:
    """Wait until the agent handles ``sig`` (its Python code runs; before that, any program dies of
    the default action); fail with its output if it ends or does not within ``timeout``."""
    assert wait_until(lambda: catches(proc.pid, sig) or not proc.alive(), timeout, interval=0.005), (
        f"{proc.args} does not handle {sig!r} after {timeout}s"
    )
    assert proc.alive(), "\n".join(proc.output())


def send_and_time(proc: Proc, sig: int, timeout: float = 60.0) -> tuple[Result, float]:
    """Send ``sig`` to the agent; its Result and the seconds it took to end after the signal."""
    sent = time.monotonic()
    proc.send_signal(sig)
    result = proc.wait(timeout)
    return result, (proc.finished or time.monotonic()) - sent


__all__ = [
    "FSM_AGENT",
    "SIGNAL_PROBE",
    "TOOLS",
    "TORCHRUN",
    "ConnectWatch",
    "Outcome",
    "Parity",
    "Tool",
    "assert_at_least_as_good",
    "catches",
    "exit_class",
    "free_port",
    "probe_records",
    "send_and_time",
    "wait_catching",
    "wait_for_probes",
    "wait_listening",
]
