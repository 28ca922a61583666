"""NodeLossJob: real agents on loopback forming one elastic job, one of which dies or leaves.

For backends' node-loss tests (``c10d``, ``etcd-v3``, ...): every agent runs
``python -m fsm_agent run --events-file ... FLAGS worker.py OUT NAME``. Each worker writes one
record (``start_<name>_<world>_<pid>.json`` in ``out``: its pid, WORLD_SIZE, GROUP_RANK,
TORCHELASTIC_RESTART_COUNT, the time) and then sleeps until its agent stops it, unless the file
``out/finish`` exists: then it exits 0 at once (the survivors' new world ends the job). A worker
of agent ``name`` exits 3 once ``crash(name)`` made ``out/crash_<name>``::

    job = NodeLossJob(tmp_path, flags)
    try:
        a, b = job.start("a"), job.start("b")
        job.wait_for_world(2, {"a", "b"})
        job.lose("b", signal.SIGKILL)
        job.wait_for_world(1, {"a"})
        assert job.agent("a").wait(60) == 0
    finally:
        job.close()

``lose(name, SIGKILL)`` is a machine dying: the agent's process group and each of its workers'
get SIGKILL. ``lose(name, SIGTERM)`` stops the agent the way an operator does; it stops its
workers itself. ``close`` SIGKILLs every agent's process group and every recorded worker by pid
(never by name), reaps the agents and removes every agent's ``TMPDIR``.
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
from pathlib import Path

from fsm_agent.testing.processes import remove_worker_cgroups, tmpdir_env, wait_until

WORKER = r"""
import json, os, sys, time
out, name = sys.argv[1], sys.argv[2]
world = int(os.environ["WORLD_SIZE"])
record = {"name": name, "pid": os.getpid(), "ts": time.time(), "world": world,
          "group_rank": int(os.environ["GROUP_RANK"]), "group_world": int(os.environ["GROUP_WORLD_SIZE"]),
          "restart_count": int(os.environ["TORCHELASTIC_RESTART_COUNT"])}
path = os.path.join(out, "start_%s_%d_%d.json" % (name, world, os.getpid()))
with open(path + ".tmp", "w") as f:
    json.dump(record, f)
os.replace(path + ".tmp", path)
crash = os.path.join(out, "crash_" + name)
deadline = time.time() + 600
if not os.path.exists(os.path.join(out, "finish")):  # read at start only: it ends the *next* world
    while time.time() < deadline:  # until the agent stops us (a membership change)
        if os.path.exists(crash):  # crash(name): this worker fails once
            os.remove(crash)
            sys.exit(3)
        time.sleep(0.1)
    sys.exit(5)
"""


class NodeLossJob:
    """Agents of one job on this machine; see the module docstring.

    Args:
        workdir: the test's directory (scripts, records, agents' output files, events files).
        flags: ``fsm-agent run`` flags shared by every agent (rendezvous, ``--nnodes``, ...).
        env: added to every agent's environment.
    """

    def __init__(self, workdir: Path | str, flags: list[str], env: dict[str, str] | None = None):
        self.dir = Path(workdir)
        self.out = self.dir / "out"
        self.out.mkdir(parents=True, exist_ok=True)
        self.script = self.dir / "node_loss_worker.py"
        self.script.write_text(WORKER)
        self.flags, self.env = list(flags), dict(env or {})
        self.tmp = Path(tempfile.mkdtemp(prefix="fsm_node_loss_"))
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, *extra: str, command: list[str] | None = None) -> subprocess.Popen:
        """Start agent ``name`` (``command`` replaces ``python -m fsm_agent run``, e.g. torchrun)."""
        launcher = command or [sys.executable, "-m", "fsm_agent", "run", "--events-file", str(self.events_path(name))]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **tmpdir_env(self.tmp), **self.env}
        with open(self.dir / f"agent_{name}.out", "w") as out, open(self.dir / f"agent_{name}.err", "w") as err:
            proc = subprocess.Popen(
                [*launcher, *self.flags, *extra, str(self.script), str(self.out), name],
                cwd=self.dir,
                env=env,
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.procs[name] = proc
        return proc

    def agent(self, name: str) -> subprocess.Popen:
        return self.procs[name]

    def events_path(self, name: str) -> Path:
        return self.dir / f"events_{name}.jsonl"

    # -- what happened ------------------------------------------------------------------------------
    def records(self) -> list[dict]:
        found = []
        for path in sorted(self.out.glob("start_*.json")):
            with contextlib.suppress(OSError, ValueError):
                found.append(json.loads(path.read_text()))
        return found

    def names_in_world(self, world: int, since: float = 0.0) -> set[str]:
        return {r["name"] for r in self.records() if r["world"] == world and r["ts"] >= since}

    def events(self, name: str) -> list[dict]:
        path = self.events_path(name)
        if not path.exists():
            return []
        events = []
        for line in path.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:  # a line being written
                pass
        return events

    def transitions(self, name: str, since: float = 0.0) -> list[tuple[str, str, str]]:
        return [
            (e["source"], e["dest"], e["trigger"])
            for e in self.events(name)
            if e["kind"] == "transition" and e["ts"] >= since
        ]

    def first_transition(self, name: str, trigger: str, since: float) -> dict:
        """The first ``trigger`` transition event of agent ``name`` at or after ``since``."""
        for event in self.events(name):
            if event["kind"] == "transition" and event["trigger"] == trigger and event["ts"] >= since:
                return event
        raise AssertionError(f"agent {name} recorded no {trigger} transition since {since}\n{self.diagnostics()}")

    def diagnostics(self, tail: int = 4000) -> str:
        text = ""
        for name in self.procs:
            for kind in ("out", "err"):
                path = self.dir / f"agent_{name}.{kind}"
                body = path.read_text(errors="replace") if path.exists() else ""
                text += f"--- agent {name} std{kind} (last {tail} chars) ---\n{body[-tail:]}\n"
        return text

    def wait_for_world(
        self, world: int, names: set[str], timeout: float = 120.0, since: float = 0.0, running: set[str] | None = None
    ) -> float:
        """Wait until every agent in ``names`` has a worker in a world of ``world`` (started at or
        after ``since``); fail at once when an agent of ``running`` (default ``names``) exits.
        Returns the start time of the last of those workers."""
        watched = names if running is None else running

        def ready() -> bool:
            if names <= self.names_in_world(world, since):  # first: a worker of that world may end the job at once
                return True
            ended = {n: self.procs[n].poll() for n in watched if self.procs[n].poll() is not None}
            if ended and not names <= self.names_in_world(world, since):
                raise AssertionError(
                    f"waiting for a world of {world} with {sorted(names)}: agents ended {ended}\n{self.diagnostics()}"
                )
            return False

        if not wait_until(ready, timeout=timeout):
            raise AssertionError(
                f"no world of {world} with {sorted(names)} within {timeout:.0f}s "
                f"(records: {self.records()})\n{self.diagnostics()}"
            )
        return max(r["ts"] for r in self.records() if r["world"] == world and r["ts"] >= since and r["name"] in names)

    # -- faults -------------------------------------------------------------------------------------
    def finish_next_world(self) -> None:
        """Workers started from now on exit 0 at once (so the survivors' next world ends the job)."""
        (self.out / "finish").touch()

    def kill_and_wait_for_the_standby(self, lost: str, survivors: set[str]) -> tuple[float, float]:
        """SIGKILL agent ``lost`` once the next world is set to finish; wait until ``survivors``
        (one of them a standby) run a world of their size and exit 0. Returns ``(lost_at,
        seconds from the SIGKILL to that world running)``."""
        self.finish_next_world()
        lost_at = self.lose(lost, signal.SIGKILL)
        restarted = self.wait_for_world(len(survivors), survivors, since=lost_at, running=survivors)
        for name in sorted(survivors):
            assert self.agent(name).wait(60) == 0, self.diagnostics()
        print(f"\nSIGKILL -> standby promoted, world of {len(survivors)} running again: {restarted - lost_at:.2f}s")
        return lost_at, restarted - lost_at

    def crash(self, name: str) -> float:
        """The running worker of agent ``name`` exits 3 within 0.1 s; returns the time."""
        at = time.time()
        (self.out / f"crash_{name}").touch()
        return at

    def lose(self, name: str, sig: int = signal.SIGKILL) -> float:
        """SIGKILL agent ``name`` and its workers (a machine dying), or send ``sig`` to the agent
        alone (SIGTERM: it leaves); returns the time (``time.time()``) of the signal."""
        proc = self.procs[name]
        at = time.time()
        if sig == signal.SIGKILL:
            self._killpg(proc.pid)
            for record in self.records():
                if record["name"] == name:
                    self._killpg(record["pid"])  # each worker leads its own process group
        else:
            proc.send_signal(sig)
        proc.wait(timeout=60)
        return at

    def close(self) -> None:
        for proc in self.procs.values():
            self._killpg(proc.pid)
        for record in self.records():
            self._killpg(record["pid"])
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(record["pid"], signal.SIGKILL)
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
        remove_worker_cgroups(proc.pid for proc in self.procs.values())
        shutil.rmtree(self.tmp, ignore_errors=True)

    @staticmethod
    def _killpg(pgid: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
