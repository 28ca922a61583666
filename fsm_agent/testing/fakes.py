"""Scriptable stand-ins for the two backends an ElasticAgent talks to: FakeRendezvous and FakeLauncher.

Both implement the real interfaces (torch's ``RendezvousHandler``; the launcher interface of
``fsm_agent.plugins.launcher_subprocess.SubprocessLauncher``), so the agent runs unchanged:
rank assignment goes through a real ``torch.distributed.HashStore`` and the run loop selects on
real file descriptors (one ``os.pipe`` per fake worker, written when the worker "exits").

Time in the fake launcher is counted in *ticks*, not seconds: tick ``k`` of an attempt ends when
the agent has polled the launcher ``k`` times (tick 0 ends when ``start`` returns). A worker
scripted to exit at tick ``k`` exits at the end of tick ``k``, so the agent's select wakes at
once and poll number ``k + 1`` reports it. Scripts therefore give the same observations on any
machine, however slow.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs
from torch.distributed.elastic.rendezvous import RendezvousHandler

__all__ = [
    "Attempt",
    "FakeLauncher",
    "FakeLauncherError",
    "FakeRendezvous",
    "Round",
    "StartRecord",
    "StopRecord",
    "send_signal",
]

log = logging.getLogger(__name__)


def send_signal(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """An action that delivers ``sig`` to this process, as a scheduler or a user would.

    Refuses (RuntimeError) when nothing handles ``sig``, instead of killing the test process:
    use it only while an agent's ``run()`` has its signal handlers installed.
    """

    def deliver() -> None:
        handler = signal.getsignal(sig)
        if handler in (signal.SIG_DFL, signal.SIG_IGN, None):
            raise RuntimeError(
                f"send_signal({signal.Signals(sig).name}): no Python handler is installed; "
                "deliver it only while agent.run() is running"
            )
        os.kill(os.getpid(), sig)

    deliver.__qualname__ = f"send_signal({signal.Signals(sig).name})"
    return deliver


def _call(action: Callable[[], Any] | None) -> None:
    if action is not None:
        action()


# =============================================================================================
# rendezvous
# =============================================================================================

_ROUND_ERRORS = {
    "timeout": "RendezvousTimeoutError",
    "closed": "RendezvousClosedError",
    "graceful_exit": "RendezvousGracefulExitError",
    "connection": "RendezvousConnectionError",
    "error": "RendezvousError",
}


def rendezvous_error(kind: str | BaseException | type, message: str | None = None) -> BaseException:
    """``"timeout"`` -> ``RendezvousTimeoutError(...)``; also ``closed``, ``graceful_exit``,
    ``connection``, ``error``; an exception class or instance is returned as an instance."""
    from torch.distributed.elastic.rendezvous import api

    if isinstance(kind, BaseException):
        return kind
    if isinstance(kind, type):
        return kind(message or f"scripted {kind.__name__}")
    try:
        cls = getattr(api, _ROUND_ERRORS[kind])
    except KeyError:
        raise ValueError(f"unknown rendezvous error {kind!r}; use one of {sorted(_ROUND_ERRORS)}") from None
    return cls(message or f"scripted rendezvous {kind}")


@attrs.frozen
class Round:
    """One scripted rendezvous round (one ``next_rendezvous`` call).

    Attributes:
        rank / world_size: the group rank and group world size this node gets.
        raises: ``"timeout"``, ``"closed"``, ``"graceful_exit"``, ``"connection"``, ``"error"``, or an
            exception (class or instance) that ``next_rendezvous`` raises instead of returning.
        waiting: what ``num_nodes_waiting()`` answers while this round is current (late joiners).
        waiting_raises: ``num_nodes_waiting()`` raises this (an error name as for ``raises``, or an
            exception) while this round is current, e.g. ``"connection"`` for a lost rendezvous store.
        action: called first thing inside ``next_rendezvous`` (e.g. ``send_signal()``; the agent
            treats the rendezvous as interruptible, so a signal ends the call at once).
        delay: seconds ``next_rendezvous`` blocks (after ``action``) before answering.
        peer_local_world_size: workers on each simulated peer node (None: as many as this node).
        peer_role: the simulated peers' role (None: this node's role).
        peer_restart_count: the restart count the simulated peers report (None: this node's).
        peers_reach_exit_barrier: the simulated peers check in at the exit barrier, so a
            multi-node success does not wait ``exit_barrier_timeout``.
    """

    rank: int = 0
    world_size: int = 1
    raises: Any = None
    waiting: int = 0
    waiting_raises: Any = None
    action: Callable[[], Any] | None = None
    delay: float = 0.0
    peer_local_world_size: int | None = None
    peer_role: str | None = None
    peer_restart_count: int | None = None
    peers_reach_exit_barrier: bool = True

    def __attrs_post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"Round(rank={self.rank}, world_size={self.world_size}): need 0 <= rank < world_size")


def as_round(item: Any) -> Round:
    """Accept a Round, ``(rank, world_size)``, a dict of Round fields, an error name or an exception."""
    if isinstance(item, Round):
        return item
    if item is None:
        return Round()
    if isinstance(item, (str, BaseException)) or (isinstance(item, type) and issubclass(item, BaseException)):
        return Round(raises=item)
    if isinstance(item, tuple):
        return Round(*item)
    if isinstance(item, Mapping):
        return Round(**item)
    raise TypeError(f"cannot make a rendezvous Round from {item!r}")


class FakeRendezvous(RendezvousHandler):
    """A torch ``RendezvousHandler`` whose rounds are scripted; peers are simulated in-process.

    Args:
        rounds: one entry per ``next_rendezvous`` call (see ``as_round``); calls beyond the script
            repeat the last entry (or a single-node ``Round()`` if the script is empty).
        run_id: what ``get_run_id()`` answers.
        master_addr / master_port: the ``RendezvousStoreInfo`` every round returns.
        store_timeout: seconds a store ``get``/``wait`` may block before it raises (keeps a
            mis-scripted multi-node test from hanging).

    Each round gets a fresh ``PrefixStore`` over one ``HashStore`` (``self.store``), as torch's
    c10d handler prefixes each round. For ``world_size > 1`` daemon threads play the other group
    ranks: once this node has written its role info, each peer runs fsm-agent's own
    ``assign_ranks`` (so group rank 0 assigns the ranks wherever it is), then the peers check in
    at the exit barrier.

    Recorded for assertions: ``calls`` (next_rendezvous calls), ``infos`` (RendezvousInfo
    returned), ``waiting_queries``, ``shutdown_calls``.
    """

    use_agent_store = False

    def __init__(
        self,
        rounds: Any = (),
        *,
        run_id: str = "fake-run",
        master_addr: str = "127.0.0.1",
        master_port: int = 29500,
        store_timeout: float = 30.0,
    ):
        import torch.distributed as dist

        self.rounds: list[Round] = [as_round(r) for r in rounds]
        self.run_id = run_id
        self.master_addr, self.master_port = master_addr, master_port
        self.store = dist.HashStore()
        self.store.set_timeout(datetime.timedelta(seconds=store_timeout))
        self.store_timeout = store_timeout
        self.calls = 0
        self.infos: list[Any] = []
        self.waiting_queries = 0
        self.shutdown_calls = 0
        self._closed = False
        self._waiting = 0
        self._lost = 0
        self._current: Round | None = None
        self._peers: threading.Thread | None = None
        self._stop_peers = threading.Event()

    # -- scripting -------------------------------------------------------------------------------
    def round_for(self, index: int) -> Round:
        if index < len(self.rounds):
            return self.rounds[index]
        return self.rounds[-1] if self.rounds else Round()

    def add_waiting(self, count: int = 1) -> None:
        """Late nodes arrive: ``num_nodes_waiting()`` answers ``count`` more until the next round."""
        self._waiting += count

    def add_lost(self, count: int = 1) -> None:
        """Peers die: ``num_nodes_lost()`` answers ``count`` more until the next round."""
        self._lost += count

    def peer_gives_up(self, global_rank: int) -> None:
        """A peer of the current round gives the job up: its verdict (``global_rank`` raised, the
        root cause) is published in the round's store as a real decider does (``fsm_agent.job_verdict``),
        for the agent's job-wide look to find."""
        import json

        from fsm_agent import job_verdict
        from fsm_agent.attribution import FailureReport
        from fsm_agent.drain import JOB_DRAIN_KEY

        store = self.infos[-1].store
        report = FailureReport(
            global_rank=global_rank, group_rank=1, hostname="fake-peer", message="RuntimeError: peer"
        )
        record = job_verdict.verdict_record([report], global_rank + 1, "fake-peer (group_rank 1)", lambda r: None, None)
        store.set(job_verdict.VERDICT_KEY, json.dumps(record))
        job_verdict.announce(store, record, JOB_DRAIN_KEY)

    # -- RendezvousHandler ----------------------------------------------------------------------
    def get_backend(self) -> str:
        return "fake"

    def next_rendezvous(self):
        from torch.distributed import PrefixStore
        from torch.distributed.elastic.rendezvous import RendezvousInfo
        from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

        index = self.calls
        self.calls += 1
        script = self.round_for(index)
        self._stop_peers.set()
        _call(script.action)
        if script.delay:
            time.sleep(script.delay)
        if script.raises is not None:
            raise rendezvous_error(script.raises)
        if self._closed:
            raise rendezvous_error("closed", "the fake rendezvous is closed")
        self._current, self._waiting, self._lost = script, script.waiting, 0
        store = PrefixStore(f"fake_rdzv/round_{index}/", self.store)
        if script.world_size > 1:
            self._stop_peers = threading.Event()
            self._peers = threading.Thread(
                target=self._play_peers,
                args=(store, script, self._stop_peers),
                name=f"FakeRendezvous-peers-{index}",
                daemon=True,
            )
            self._peers.start()
        info = RendezvousInfo(
            store, script.rank, script.world_size, RendezvousStoreInfo(self.master_addr, self.master_port)
        )
        self.infos.append(info)
        return info

    def num_nodes_waiting(self) -> int:
        self.waiting_queries += 1
        if self._current is not None and self._current.waiting_raises is not None:
            raise rendezvous_error(self._current.waiting_raises)
        return self._waiting

    def num_nodes_lost(self) -> int:
        """Peers of the current round that stopped keeping the rendezvous alive (fsm-agent's optional API)."""
        return self._lost

    def get_run_id(self) -> str:
        return self.run_id

    def is_closed(self) -> bool:
        return self._closed

    def set_closed(self) -> None:
        self._closed = True

    def shutdown(self) -> bool:
        """Close the rendezvous, as torch's c10d handler does when its agent finishes."""
        self.shutdown_calls += 1
        self._closed = True
        self._stop_peers.set()
        return True

    # -- simulated peers ------------------------------------------------------------------------
    def _play_peers(self, store, script: Round, stop: threading.Event) -> None:
        """Once this node has written its role info, every other group rank runs fsm-agent's own
        ``assign_ranks`` (one thread each), then the peers check in at the exit barrier."""
        from fsm_agent.exit_barrier import EXIT_BARRIER_PREFIX
        from fsm_agent.ranks import ROLE_INFO_PREFIX

        own_key = f"{ROLE_INFO_PREFIX}{script.rank}"
        deadline = time.monotonic() + self.store_timeout
        while not store.check([own_key]):
            if stop.is_set() or time.monotonic() > deadline:
                return
            time.sleep(0.002)
        own = json.loads(bytes(store.get(own_key)).decode())
        peers = [
            threading.Thread(
                target=self._play_peer, args=(store, rank, script, own), daemon=True, name=f"FakeRendezvous-peer-{rank}"
            )
            for rank in range(script.world_size)
            if rank != script.rank
        ]
        for peer in peers:
            peer.start()
        for peer in peers:
            peer.join(self.store_timeout)
        # torch's barrier: whoever brings the count to world_size sets last_member
        if (
            script.peers_reach_exit_barrier
            and store.add(f"{EXIT_BARRIER_PREFIX}/num_members", script.world_size - 1) == script.world_size
        ):
            store.set(f"{EXIT_BARRIER_PREFIX}/last_member", "<val_ignored>")

    @staticmethod
    def _play_peer(store, rank: int, script: Round, own: dict) -> None:
        from fsm_agent.ranks import assign_ranks

        role = script.peer_role or own["role"]
        local_world_size = script.peer_local_world_size or own["local_world_size"]
        restart_count = own.get("restart_count") if script.peer_restart_count is None else script.peer_restart_count
        extra = () if restart_count is None else (restart_count,)
        try:
            assign_ranks(store, rank, script.world_size, role, local_world_size, *extra)
            FakeRendezvous._pass_node_checks(store, rank)
        except Exception as exc:  # the agent left the round (signal, error): nothing to assign any more
            log.debug("simulated peer %s gave up: %s", rank, exc)

    @staticmethod
    def _pass_node_checks(store, rank: int) -> None:
        """A simulated peer's part of the node checks' exchange (``fsm_agent.node_checks``): no
        check results; as group rank 0, a decision that excludes no one."""
        from fsm_agent import node_checks

        store.set(node_checks.RESULT_KEY.format(rank), json.dumps([f"peer{rank} (fake)", []]))
        if rank == 0:
            store.set(node_checks.DECISION_KEY, json.dumps(node_checks.Decision().record()))


# =============================================================================================
# launcher
# =============================================================================================


#: Fake pids start here: above Linux's PID_MAX_LIMIT (4194304), so os.kill on one finds no process.
PID_BASE = 2**22 + 100_000


class FakeLauncherError(RuntimeError):
    """A FakeLauncher script is inconsistent with what the agent did (too many polls, bad rank)."""


@attrs.frozen
class Attempt:
    """What the workers of one start/restart do.

    Attributes:
        exits: ``{local_rank: exit code}`` (negative: killed by that signal), ``"all_ok"`` (every
            worker exits 0) or ``"never"`` (no worker exits by itself). Workers not listed keep
            running until the agent stops them.
        at: ``{local_rank: tick}`` when each scripted exit happens (default tick 0: at once).
        hangs: ``{local_rank: tick}``: at the end of that tick the worker stops making progress,
            as the agent's hang detection sees it (its heartbeat file, ``FSM_AGENT_HEARTBEAT_FILE``
            in the worker's env, is dated long ago). Needs an agent built with ``hang_timeout``.
        return_values: ``{local_rank: value}`` reported by ``return_values()`` for workers that exited 0.
        actions: ``{tick: callable}`` run at the end of that tick (``send_signal()``,
            ``rendezvous.add_waiting``, ...); several actions for one tick: pass a list.
        start_raises: ``start`` raises this exception (the workers never start).
        stop_raises: ``stop`` raises this exception, the first ``stop_raises_times`` times in this attempt.
        stop_raises_times: how many ``stop`` calls raise (default: every one).
        poll_raises: ``poll`` raises this exception (from ``poll_raises_at`` on, default the first poll).
        ignores_stop: workers ignore the stop signal and end by SIGKILL (exit code -9).
        on_stop: called inside ``stop`` (e.g. ``send_signal()`` to signal the agent mid-restart).
    """

    exits: Mapping[int, int] | str = "all_ok"
    at: Mapping[int, int] = attrs.field(factory=dict)
    hangs: Mapping[int, int] = attrs.field(factory=dict)
    return_values: Mapping[int, Any] = attrs.field(factory=dict)
    actions: Mapping[int, Any] = attrs.field(factory=dict)
    start_raises: BaseException | None = None
    stop_raises: BaseException | None = None
    stop_raises_times: int | None = None
    poll_raises: BaseException | None = None
    poll_raises_at: int = 1
    ignores_stop: bool = False
    on_stop: Callable[[], Any] | None = None

    def __attrs_post_init__(self) -> None:
        if isinstance(self.exits, str) and self.exits not in ("all_ok", "never"):
            raise ValueError(f"Attempt(exits={self.exits!r}): use a {{local_rank: code}} dict, 'all_ok' or 'never'")

    def exit_plan(self, local_world_size: int) -> dict[int, tuple[int, int]]:
        """``{local_rank: (exit code, tick)}`` for the workers that exit by themselves."""
        if self.exits == "never":
            codes: dict[int, int] = {}
        elif self.exits == "all_ok":
            codes = {r: 0 for r in range(local_world_size)}
        else:
            codes = dict(self.exits)
        for rank in (*codes, *self.at, *self.hangs):
            if not 0 <= rank < local_world_size:
                raise FakeLauncherError(
                    f"{self!r} scripts local rank {rank}, but the group has {local_world_size} workers"
                )
        return {r: (code, int(self.at.get(r, 0))) for r, code in codes.items()}


def as_attempt(item: Any) -> Attempt:
    """Accept an Attempt, ``"all_ok"``/``"never"``, a ``{local_rank: code}`` dict, or a dict of Attempt fields."""
    if isinstance(item, Attempt):
        return item
    if isinstance(item, str):
        return Attempt(exits=item)
    if isinstance(item, Mapping):
        if all(isinstance(k, int) for k in item):
            return Attempt(exits=dict(item))
        return Attempt(**item)
    raise TypeError(f"cannot make a launcher Attempt from {item!r}")


@attrs.define
class _FakeWorker:
    local_rank: int
    pid: int
    read_fd: int
    write_fd: int
    planned: tuple[int, int] | None  # (exit code, tick) or None: runs until stopped
    exitcode: int | None = None  # set when the worker "exits" (its fd becomes readable)
    exited_at: float | None = None
    observed: bool = False  # reported by poll() (the real launcher's handle.exitcode)
    stopped_by: int | None = None

    def exit(self, code: int) -> None:
        if self.exitcode is None:
            self.exitcode, self.exited_at = code, time.time()
            if self.write_fd >= 0:
                os.write(self.write_fd, b"x")


@attrs.frozen
class StartRecord:
    """One ``start`` call: the attempt index, what the agent passed, and the pids handed back."""

    attempt: int
    spec: Any
    envs: dict[int, dict[str, str]]
    logs: dict[int, Any]
    filtered: tuple
    pids: dict[int, int]


@attrs.frozen
class StopRecord:
    """One ``stop`` call: attempt index (None before any start), signal, timeout, ranks it stopped."""

    attempt: int | None
    sig: int
    timeout: float
    stopped: tuple[int, ...]


class FakeLauncher:
    """The launcher interface with no processes; each attempt follows a scripted ``Attempt``.

    Args:
        attempts: one entry per ``start`` call (see ``as_attempt``); starts beyond the script repeat
            the last entry (or ``"all_ok"`` if the script is empty).
        pid_base: fake pids are ``pid_base + 100 * attempt + local_rank``. The default lies beyond
            Linux's PID_MAX_LIMIT (2**22), so no fake pid can name a real process: the agent
            signals ``pids()`` itself (SIGABRT to a hung worker).
        max_polls: polls per attempt after which ``poll`` raises FakeLauncherError (a script that
            never ends, e.g. hung workers and nothing to stop them).

    Recorded for assertions: ``started`` (StartRecord per successful start), ``start_calls`` (a
    scripted ``start_raises`` counts as an attempt too), ``stops`` (StopRecord per stop), ``polls``
    (polls of the current attempt), ``close_calls``.
    """

    def __init__(self, attempts: Any = (), *, pid_base: int = PID_BASE, max_polls: int = 500):
        self.attempts: list[Attempt] = [as_attempt(a) for a in attempts]
        self.pid_base = pid_base
        self.max_polls = max_polls
        self.started: list[StartRecord] = []
        self.stops: list[StopRecord] = []
        self.signals: list[tuple[int, int]] = []  # (local_rank, signal) sent through signal_worker
        self.polls = 0
        self.start_calls = 0
        self.close_calls = 0
        self._workers: dict[int, _FakeWorker] = {}
        self._envs: dict[int, dict[str, str]] = {}
        self._script: Attempt | None = None
        self._stop_raised = 0

    # -- scripting -------------------------------------------------------------------------------
    def attempt_for(self, index: int) -> Attempt:
        if index < len(self.attempts):
            return self.attempts[index]
        return self.attempts[-1] if self.attempts else Attempt()

    @property
    def attempt(self) -> int | None:
        """Index of the current attempt, i.e. of the last ``start`` call (None before the first)."""
        return self.start_calls - 1 if self.start_calls else None

    def __call__(self, agent: Any = None) -> FakeLauncher:
        """Registry factory form: ``registry.add_launcher("fake", launcher)`` returns this instance."""
        return self

    # -- launcher interface -----------------------------------------------------------------------
    def start(
        self, spec, envs: dict[int, dict[str, str]], logs: dict[int, Any], filtered: tuple = (None, None)
    ) -> dict[int, int]:
        index = self.start_calls
        self.start_calls += 1
        script = self.attempt_for(index)
        self._release_fds()
        self._script, self.polls, self._stop_raised = script, 0, 0
        self._workers, self._envs = {}, {r: dict(e) for r, e in envs.items()}
        if script.start_raises is not None:
            raise script.start_raises
        plan = script.exit_plan(len(envs))
        for rank in sorted(envs):
            r, w = os.pipe()
            os.set_blocking(r, False)
            self._workers[rank] = _FakeWorker(
                local_rank=rank, pid=self.pid_base + 100 * index + rank, read_fd=r, write_fd=w, planned=plan.get(rank)
            )
        pids = self.pids()
        self.started.append(
            StartRecord(
                attempt=index,
                spec=spec,
                envs={r: dict(e) for r, e in envs.items()},
                logs=dict(logs),
                filtered=tuple(filtered),
                pids=dict(pids),
            )
        )
        self._end_tick(0)
        return pids

    def wait_fds(self) -> dict[int, int]:
        return {w.read_fd: r for r, w in self._workers.items() if not w.observed}

    def poll(self) -> dict[int, int]:
        if self._script is None:
            return {}
        self.polls += 1
        if self._script.poll_raises is not None and self.polls >= self._script.poll_raises_at:
            raise self._script.poll_raises
        if self.polls > self.max_polls:
            raise FakeLauncherError(
                f"FakeLauncher attempt {self.attempt}: workers still running after {self.max_polls} polls; "
                "script an exit, a signal or a join, or raise max_polls"
            )
        for worker in self._workers.values():
            if worker.exitcode is not None:
                worker.observed = True
        report = self._exits()
        self._end_tick(self.polls)
        return report

    def exit_times(self) -> dict[int, float]:
        return {r: w.exited_at for r, w in self._workers.items() if w.observed and w.exited_at is not None}

    def pids(self) -> dict[int, int]:
        return {r: w.pid for r, w in self._workers.items()}

    def signal_worker(self, local_rank: int, sig: int) -> None:
        """Record the signal; fake workers do not react to signals (``stop`` ends them)."""
        self.signals.append((local_rank, int(sig)))

    def return_values(self) -> dict[int, Any]:
        values = self._script.return_values if self._script is not None else {}
        return {r: values[r] for r, code in self._exits().items() if code == 0 and r in values}

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
        script = self._script
        if script is not None and script.on_stop is not None:
            script.on_stop()
        if (
            script is not None
            and script.stop_raises is not None
            and (script.stop_raises_times is None or self._stop_raised < script.stop_raises_times)
        ):
            self._stop_raised += 1
            raise script.stop_raises
        stopped = []
        for rank, worker in self._workers.items():
            if worker.exitcode is None:
                worker.stopped_by = sig
                worker.exit(-signal.SIGKILL if script is not None and script.ignores_stop else -int(sig))
                stopped.append(rank)
            worker.observed = True
        self.stops.append(StopRecord(attempt=self.attempt, sig=int(sig), timeout=timeout, stopped=tuple(stopped)))

    def close(self) -> None:
        self.close_calls += 1
        self._release_fds()

    # -- views for assertions --------------------------------------------------------------------
    def envs(self, attempt: int = -1) -> dict[int, dict[str, str]]:
        """The worker environments the agent passed to ``start`` for one attempt (default: the last)."""
        return self.started[attempt].envs

    def running(self) -> list[int]:
        """Local ranks of the current attempt that have not exited (nor been stopped)."""
        return [r for r, w in self._workers.items() if w.exitcode is None]

    # -- internals -------------------------------------------------------------------------------
    def _exits(self) -> dict[int, int]:
        return {r: w.exitcode for r, w in self._workers.items() if w.observed and w.exitcode is not None}

    def _end_tick(self, tick: int) -> None:
        """Tick ``tick`` ends: scripted exits of that tick happen, then its actions run."""
        for worker in self._workers.values():
            if worker.planned is not None and worker.planned[1] == tick:
                worker.exit(worker.planned[0])
        for rank, hang_tick in self._script.hangs.items() if self._script is not None else ():
            if hang_tick == tick and self._workers[rank].exitcode is None:
                self._stop_progress(rank)
        action = self._script.actions.get(tick) if self._script is not None else None
        for fn in action if isinstance(action, (list, tuple)) else [action]:
            _call(fn)

    def _stop_progress(self, rank: int) -> None:
        from fsm_agent.heartbeat import HEARTBEAT_FILE_ENV

        path = self._envs.get(rank, {}).get(HEARTBEAT_FILE_ENV)
        if not path:
            raise FakeLauncherError(
                f"attempt {self.attempt} scripts local rank {rank} to hang, but its env has no "
                f"{HEARTBEAT_FILE_ENV}: build the agent with hang_timeout=..."
            )
        with open(path, "a"):
            pass
        os.utime(path, (0, 0))  # the last heartbeat was long ago

    def _release_fds(self) -> None:
        for worker in self._workers.values():
            for fd in (worker.read_fd, worker.write_fd):
                with contextlib.suppress(OSError):
                    os.close(fd)
            worker.read_fd = worker.write_fd = -1
        # keep the records (exit codes) but drop the fds: wait_fds() must not return closed fds
        for worker in self._workers.values():
            worker.observed = True
