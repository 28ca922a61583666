"""Conformance suites for the selectable kinds: rendezvous backends and launchers.

A plugin package that contributes a backend subclasses the suite in its own tests and supplies
its implementation; every test of the suite then runs against it (the built-ins pass them, in
``tests/plugins/test_builtin_backends.py``)::

    from fsm_agent.testing.conformance import LauncherConformance, RendezvousConformance

    class TestMyLauncher(LauncherConformance):
        def make_launcher(self):
            return MyLauncher()

    class TestMyRendezvous(RendezvousConformance):
        def make_handler(self, setup, node):
            return create_my_handler(setup.endpoint, setup.run_id, setup.min_nodes, setup.max_nodes,
                                     join_timeout=setup.join_timeout, is_host=(node == 0))

The class names do not start with ``Test``, so pytest collects only the subclasses. Capability
flags (class attributes) switch off what a backend legitimately does not do: a static
rendezvous is not ``elastic``; a launcher may not run Python ``callables`` or sweep
``daemons`` its workers leave behind. Override a test (and mark it) to record a known gap.

Everything is real: stores are the backend's own (a TCPStore on 127.0.0.1 for c10d), workers are
real ``python -u script.py`` processes. Every process a test starts is killed by pid at teardown, whatever
the launcher did. What each test checks is what ``ElasticAgent`` relies on; docs/testing.md
lists them.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import select
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest

from fsm_agent.plugins.protocols import LAUNCHER_OPTIONAL, RENDEZVOUS_OPTIONAL, optional_member_problems

__all__ = ["LauncherConformance", "RendezvousConformance", "RendezvousSetup", "free_port"]

LOCALHOST = "127.0.0.1"


def free_port(host: str = LOCALHOST) -> int:
    """A TCP port nobody listens on right now (bind to 0, read, close)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _classify(exc: BaseException) -> str | None:
    """How the agent treats an exception from a rendezvous: "failed", "not_needed" or None (a crash)."""
    from fsm_agent.rendezvous_errors import classify

    return classify(exc)


def _wait_until(predicate: Callable[[], Any], timeout: float, interval: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


# =============================================================================================
# rendezvous
# =============================================================================================


@attrs.frozen
class RendezvousSetup:
    """What one test asks of ``make_handler``: a fresh run on a free port of 127.0.0.1.

    Attributes:
        run_id: unique per test.
        host / port: where the rendezvous store listens (node 0 may host it there).
        min_nodes / max_nodes: the run's elastic bounds.
        join_timeout: seconds ``next_rendezvous`` may wait for enough nodes (whole seconds).
        last_call_timeout: seconds a round with ``min_nodes <= n < max_nodes`` waits for more (whole seconds).
        tmp_path: a private directory.
    """

    run_id: str
    host: str
    port: int
    min_nodes: int
    max_nodes: int
    join_timeout: int
    last_call_timeout: int
    tmp_path: Path

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"


class _Nodes:
    """The handlers one test created (shut down at teardown) and helpers to drive them."""

    def __init__(self, suite: RendezvousConformance, tmp_path: Path):
        self.suite, self.tmp_path = suite, tmp_path
        self.handlers: list[Any] = []

    def setup(self, min_nodes: int = 1, max_nodes: int = 1) -> RendezvousSetup:
        return RendezvousSetup(
            run_id=f"conformance-{uuid.uuid4().hex[:12]}",
            host=LOCALHOST,
            port=free_port(),
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            join_timeout=self.suite.join_timeout,
            last_call_timeout=self.suite.last_call_timeout,
            tmp_path=self.tmp_path,
        )

    def create(
        self,
        count: int = 1,
        min_nodes: int | None = None,
        max_nodes: int | None = None,
        setup: RendezvousSetup | None = None,
    ) -> list[Any]:
        """``count`` nodes of one run (node 0 first: it may host the store)."""
        if setup is None:
            setup = self.setup(count if min_nodes is None else min_nodes, count if max_nodes is None else max_nodes)
        handlers = []
        for node in range(count):
            handler = self.suite.make_handler(setup, node)
            self.handlers.append(handler)
            handlers.append(handler)
        return handlers

    def add(self, setup: RendezvousSetup, node: int) -> Any:
        handler = self.suite.make_handler(setup, node)
        self.handlers.append(handler)
        return handler

    def join(self, handlers: list[Any], timeout: float | None = None) -> list[Any]:
        """``next_rendezvous`` on every handler at once (one thread each); the RendezvousInfos in order.

        Raises the first node's exception, or AssertionError if a node is still waiting after ``timeout``.
        """
        return [
            call.result()
            for call in [self.start_join(h) for h in handlers]
            if call.wait(timeout or self.suite.wait_timeout)
        ]

    def start_join(self, handler: Any) -> _Call:
        return _Call(handler.next_rendezvous)

    def shutdown(self, handler: Any) -> Any:
        """``handler.shutdown()``, which must return within the suite's ``shutdown_timeout``."""
        call = _Call(handler.shutdown)
        try:
            call.wait(self.suite.shutdown_timeout)
        except AssertionError:
            raise AssertionError(
                f"{type(handler).__name__}.shutdown() did not return within "
                f"{self.suite.shutdown_timeout}s (a deadlock?); the agent calls it as it exits"
            ) from None
        return call.result()

    def shutdown_all(self) -> None:
        hung = []
        for handler in reversed(self.handlers):
            try:
                self.shutdown(handler)
            except AssertionError as exc:
                hung.append(str(exc))
            except Exception:  # the test may have broken it on purpose
                pass
        assert not hung, "; ".join(hung)


class _Call:
    """A call running in a daemon thread."""

    def __init__(self, fn: Callable[[], Any]):
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True, name="conformance-call")
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._value = fn()
        except BaseException as exc:
            self._error = exc

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float) -> bool:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise AssertionError(f"still waiting after {timeout}s")
        return True

    def result(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._value


class RendezvousConformance:
    """The contract of a rendezvous backend, as ``ElasticAgent`` uses it.

    Implement ``make_handler(setup, node)``: the handler of node ``node`` (0, 1, ...) of the run
    described by ``setup`` (a RendezvousSetup; node 0 is created first and may host the store).

    Capabilities (class attributes):
        elastic: ``min_nodes < max_nodes`` works and ``num_nodes_waiting()`` reports a node that
            wants to join a running round (False: a fixed world, it must answer 0).
        closable: ``set_closed()`` closes the run: ``is_closed()`` turns True and later rounds fail.
        nodes: how many nodes the multi-node tests start (>= 2).
        join_timeout / last_call_timeout: handed to ``make_handler`` through the setup (seconds).
        wait_timeout: how long a test waits for something that must happen.
        shutdown_timeout: how long ``shutdown()`` may take (every node is shut down at teardown).
    """

    elastic: bool = True
    closable: bool = True
    nodes: int = 2
    join_timeout: int = 5
    last_call_timeout: int = 1
    wait_timeout: float = 120.0
    shutdown_timeout: float = 60.0

    def make_handler(self, setup: RendezvousSetup, node: int) -> Any:
        raise NotImplementedError(f"{type(self).__name__}.make_handler(setup, node): return your handler")

    @pytest.fixture
    def rendezvous(self, tmp_path):
        """The nodes of the test: ``rendezvous.create(count, min_nodes, max_nodes)``, ``rendezvous.join(handlers)``."""
        nodes = _Nodes(self, tmp_path)
        yield nodes
        nodes.shutdown_all()

    # -- the interface ---------------------------------------------------------------------------
    def test_handler_has_the_interface_the_agent_calls(self, rendezvous):
        """Every method the agent calls exists; a new handler is not closed."""
        (handler,) = rendezvous.create(1)
        for name in (
            "next_rendezvous",
            "get_backend",
            "get_run_id",
            "is_closed",
            "set_closed",
            "num_nodes_waiting",
            "shutdown",
        ):
            assert callable(getattr(handler, name, None)), f"{type(handler).__name__} lacks {name}()"
        assert isinstance(handler.get_backend(), str) and handler.get_backend()
        assert handler.is_closed() is False
        # each optional member it has (fsm_agent/plugins/protocols.py) fits its declared kind
        assert optional_member_problems(handler, RENDEZVOUS_OPTIONAL) == []

    def test_get_run_id_is_the_configured_run_id(self, rendezvous):
        """get_run_id() answers the run id the handler was made for (TORCHELASTIC_RUN_ID)."""
        setup = rendezvous.setup()
        assert rendezvous.add(setup, 0).get_run_id() == setup.run_id

    # -- one node --------------------------------------------------------------------------------
    def test_single_node_round(self, rendezvous):
        """One node: rank 0 of 1, a usable MASTER_ADDR/MASTER_PORT, nobody waiting."""
        (handler,) = rendezvous.create(1)
        (info,) = rendezvous.join([handler])
        assert (info.rank, info.world_size) == (0, 1)
        bootstrap = info.bootstrap_store_info
        assert isinstance(bootstrap.master_addr, str) and bootstrap.master_addr
        assert isinstance(bootstrap.master_port, int) and 0 < bootstrap.master_port < 65536
        if not getattr(handler, "use_agent_store", False):
            # the workers' rank 0 binds a TCPStore at MASTER_ADDR:MASTER_PORT: it must be free there
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((bootstrap.master_addr, bootstrap.master_port))
        assert handler.num_nodes_waiting() == 0

    def test_round_store_has_what_rank_assignment_and_the_exit_barrier_use(self, rendezvous):
        """The round's store does set/get/multi_set/multi_get/add/check/wait (rank assignment, exit barrier)."""
        (handler,) = rendezvous.create(1)
        (info,) = rendezvous.join([handler])
        store = info.store
        store.set("conformance/a", b"1")
        assert bytes(store.get("conformance/a")) == b"1"
        store.multi_set(["conformance/b", "conformance/c"], ["2", "3"])
        assert [bytes(v) for v in store.multi_get(["conformance/b", "conformance/c"])] == [b"2", b"3"]
        assert store.add("conformance/n", 2) == 2 and store.add("conformance/n", 1) == 3
        assert store.check(["conformance/a"]) and not store.check(["conformance/missing"])
        store.wait(["conformance/a"], datetime.timedelta(seconds=5))

    def test_every_round_starts_with_fresh_keys(self, rendezvous):
        """Each round's store starts empty: rank assignment writes fixed keys every round."""
        (handler,) = rendezvous.create(1)
        (first,) = rendezvous.join([handler])
        first.store.set("torchelastic/assigned_ranks/0", b"stale")
        (second,) = rendezvous.join([handler])
        assert (second.rank, second.world_size) == (0, 1)
        assert not second.store.check(["torchelastic/assigned_ranks/0"])

    # -- several nodes ---------------------------------------------------------------------------
    def test_nodes_get_distinct_ranks_and_share_one_store(self, rendezvous):
        """Nodes joining together get ranks 0..n-1, one world size, one master, one store."""
        handlers = rendezvous.create(self.nodes)
        infos = rendezvous.join(handlers)
        assert sorted(i.rank for i in infos) == list(range(self.nodes))
        assert {i.world_size for i in infos} == {self.nodes}
        masters = {(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in infos}
        assert len(masters) == 1, f"the nodes disagree on MASTER_ADDR/MASTER_PORT: {masters}"
        for info in infos:
            info.store.set(f"conformance/from/{info.rank}", str(info.rank))
        for info in infos:
            got = [bytes(v) for v in info.store.multi_get([f"conformance/from/{i.rank}" for i in infos])]
            assert got == [str(i.rank).encode() for i in infos]

    def test_late_node_is_reported_waiting_and_joins_the_next_round(self, rendezvous):
        """A late node shows in num_nodes_waiting() (membership_changed) and joins the next round."""
        if not self.elastic:
            pytest.skip("not elastic: a fixed world has no late nodes")
        setup = rendezvous.setup(min_nodes=1, max_nodes=2)
        first = rendezvous.add(setup, 0)
        (alone,) = rendezvous.join([first])
        assert (alone.rank, alone.world_size) == (0, 1)
        assert first.num_nodes_waiting() == 0
        late = rendezvous.start_join(rendezvous.add(setup, 1))
        waiting = _wait_until(first.num_nodes_waiting, self.wait_timeout, 0.1)
        assert waiting and waiting >= 1, "num_nodes_waiting() never reported the late node"
        assert not late.done, "the late node completed a round while the first node was still in its own"
        again = rendezvous.start_join(first)
        infos = [call.result() for call in (again, late) if call.wait(self.wait_timeout)]
        assert sorted(i.rank for i in infos) == [0, 1] and {i.world_size for i in infos} == {2}

    def test_fixed_world_reports_no_waiting_nodes(self, rendezvous):
        """A fixed world never reports waiting nodes."""
        if self.elastic:
            pytest.skip("elastic: covered by test_late_node_is_reported_waiting_and_joins_the_next_round")
        (handler,) = rendezvous.create(1)
        rendezvous.join([handler])
        assert handler.num_nodes_waiting() == 0

    # -- errors ----------------------------------------------------------------------------------
    def test_join_timeout_is_a_rendezvous_error(self, rendezvous):
        """Too few nodes: a rendezvous error (the agent ends FAILED), not a crash (UNKNOWN)."""
        (handler,) = rendezvous.create(1, min_nodes=2, max_nodes=2)
        started = time.monotonic()
        with pytest.raises(Exception) as caught:
            rendezvous.join([handler], timeout=self.join_timeout + self.wait_timeout)
        elapsed = time.monotonic() - started
        assert _classify(caught.value) == "failed", (
            f"{type(caught.value).__name__}: {caught.value} is not a rendezvous error: the agent would end in "
            f"UNKNOWN; raise torch's RendezvousTimeoutError or fsm_agent.errors.RendezvousFailed"
        )
        assert elapsed < self.join_timeout + self.wait_timeout

    def test_closed_run_refuses_new_rounds(self, rendezvous):
        """After set_closed(), is_closed() is True and the next round fails with a rendezvous error."""
        if not self.closable:
            pytest.skip("set_closed() is a no-op for this backend")
        (handler,) = rendezvous.create(1)
        rendezvous.join([handler])
        handler.set_closed()
        assert handler.is_closed() is True
        with pytest.raises(Exception) as caught:
            rendezvous.join([handler])
        assert _classify(caught.value) in ("failed", "not_needed"), (
            f"{type(caught.value).__name__}: {caught.value} is not a rendezvous error"
        )

    def test_shutdown_after_a_round_returns_a_bool_and_may_be_repeated(self, rendezvous):
        """shutdown() after a round returns a bool and may be called again."""
        (handler,) = rendezvous.create(1)
        rendezvous.join([handler])
        assert rendezvous.shutdown(handler) in (True, False)
        rendezvous.shutdown(handler)


# =============================================================================================
# launcher
# =============================================================================================

_PROLOGUE = """
import json, os, signal, subprocess, sys, time
_dir, _rank = os.environ["FSM_CONFORMANCE_DIR"], int(os.environ["LOCAL_RANK"])
def mark(name, text=""):
    path = os.path.join(_dir, f"{name}-{_rank}")
    with open(path + ".tmp", "w") as f:
        f.write(str(text))
    os.replace(path + ".tmp", path)
"""


def conformance_callable(prefix: str) -> str:
    """A callable entrypoint for the suite: returns ``prefix + LOCAL_RANK``."""
    return f"{prefix}{os.environ['LOCAL_RANK']}"


class _Workers:
    """Starts workers through one launcher and kills by pid whatever is left at teardown."""

    def __init__(self, suite: LauncherConformance, tmp_path: Path):
        import psutil

        self._psutil = psutil
        self.suite = suite
        self.dir = tmp_path / "markers"
        self.dir.mkdir()
        self.logs_dir = tmp_path / "logs"
        self.token = uuid.uuid4().hex
        self.created = time.time()
        self.scripts = 0
        self.launcher = suite.make_launcher()
        self.attempt = -1
        self.logs: dict[int, Any] = {}
        self._processes: list[Any] = []

    # -- starting --------------------------------------------------------------------------------
    def spec(self, entrypoint: Any, args: tuple = (), count: int = 2):
        from fsm_agent.worker import WorkerSpec

        return WorkerSpec(
            role="conformance",
            local_world_size=count,
            entrypoint=entrypoint,
            args=tuple(args),
            shutdown_timeout=self.suite.grace,
        )

    def start(self, body: str, count: int = 2, args: tuple = ()) -> dict[int, int]:
        """Start ``count`` workers running ``PROLOGUE + body`` (``mark(name)``, ``_rank``) as a script,
        the way ``fsm-agent run script.py ARGS`` starts them: ``python -u script.py ARGS``."""
        self.scripts += 1
        script = self.dir.parent / f"worker_{self.scripts}.py"
        script.write_text(_PROLOGUE + body)
        return self.start_spec(self.spec(sys.executable, ("-u", str(script), *args), count))

    def start_spec(self, spec) -> dict[int, int]:
        from fsm_agent.logs import ALL, LogsLayout

        self.attempt += 1
        layout = LogsLayout(log_dir=str(self.logs_dir), run_id="conformance", redirects=ALL)
        self.logs = layout.reify(
            self.attempt, spec.local_world_size, spec.role, {r: r for r in range(spec.local_world_size)}
        )
        envs = {
            r: {
                **os.environ,
                "LOCAL_RANK": str(r),
                "RANK": str(r),
                "FSM_CONFORMANCE_DIR": str(self.dir),
                "FSM_CONFORMANCE_TOKEN": self.token,
                "PYTHONUNBUFFERED": "1",
            }
            for r in range(spec.local_world_size)
        }
        pids = self.launcher.start(spec, envs, self.logs, layout.filtered_paths(self.attempt))
        self.track(*pids.values())
        return pids

    def track(self, *pids: int) -> None:
        for pid in pids:
            with contextlib.suppress(self._psutil.NoSuchProcess):
                self._processes.append(self._psutil.Process(pid))

    # -- observing -------------------------------------------------------------------------------
    def marker(self, name: str, rank: int) -> Path:
        return self.dir / f"{name}-{rank}"

    def wait_marker(self, name: str, rank: int, timeout: float | None = None) -> str:
        path = self.marker(name, rank)
        assert _wait_until(path.exists, timeout or self.suite.wait_timeout), f"worker {rank} never wrote {name}"
        return path.read_text()

    def wait_exits(self, ranks, timeout: float | None = None) -> dict[int, int]:
        """Select on ``wait_fds()`` (no sleeping) until ``poll()`` reports every rank of ``ranks``."""
        ranks = set(ranks)
        deadline = time.monotonic() + (timeout or self.suite.wait_timeout)
        exits = self.launcher.poll()
        while not ranks <= set(exits):
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"workers {sorted(ranks - set(exits))} did not exit (poll: {exits})"
            fds = self.launcher.wait_fds()
            missing = sorted(ranks - set(exits))
            assert set(missing) <= set(fds.values()), f"workers {missing} are neither reported nor waited on"
            select.select(list(fds), [], [], remaining)
            exits = self.launcher.poll()
        return exits

    def shutdown(self) -> None:
        """The optional end-of-run call (``ElasticAgent`` calls ``launcher.shutdown()`` if it exists)."""
        getattr(self.launcher, "shutdown", lambda: None)()

    def descendants(self) -> list[Any]:
        """Live processes below this one that appeared since the launcher was made."""
        found = []
        for proc in self._psutil.Process().children(recursive=True):
            try:
                if proc.create_time() >= self.created - 1 and proc.status() != self._psutil.STATUS_ZOMBIE:
                    found.append(proc)
            except self._psutil.NoSuchProcess:
                pass
        return found

    def alive(self, pid: int) -> bool:
        try:
            return self._psutil.Process(pid).status() != self._psutil.STATUS_ZOMBIE
        except self._psutil.NoSuchProcess:
            return False

    # -- teardown --------------------------------------------------------------------------------
    def cleanup(self) -> None:
        for call in (lambda: self.launcher.stop(signal.SIGKILL, 0.0), self.launcher.close, self.shutdown):
            with contextlib.suppress(Exception):
                call()
        self.track(*(p.pid for p in self.descendants()))
        for proc in self._processes:
            try:
                proc.kill()  # psutil refuses if the pid was reused by another process
            except (self._psutil.NoSuchProcess, self._psutil.AccessDenied):
                pass
            try:
                os.waitpid(proc.pid, os.WNOHANG)  # an orphan reparented to us (a subreaper)
            except ChildProcessError:
                pass


class LauncherConformance:
    """The contract of a launcher, as ``ElasticAgent`` uses it, with real worker processes.

    Implement ``make_launcher()``: a new launcher (what your backend's factory returns). The
    interface: ``start``, ``wait_fds``, ``poll``, ``exit_times``, ``pids``, ``signal_worker``,
    ``return_values``, ``stop``, ``close``, and optionally ``shutdown`` (called once, last, when
    the agent is done: end helper processes there).

    Capabilities (class attributes):
        callables: runs Python callables (``spec.entrypoint`` a function) and returns their values.
        sweeps_daemons: after ``stop``/``close``, also kills what workers started in another
            session (daemons), not only their own process group.
        grace: the ``stop`` timeout the tests use (seconds).
        wait_timeout: how long a test waits for something that must happen.
    """

    callables: bool = True
    sweeps_daemons: bool = True
    grace: float = 2.0
    wait_timeout: float = 120.0

    def make_launcher(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__}.make_launcher(): return your launcher")

    @pytest.fixture
    def workers(self, tmp_path):
        """Starts workers through ``make_launcher()``; every process left at teardown is killed by pid."""
        harness = _Workers(self, tmp_path)
        yield harness
        harness.cleanup()

    def test_optional_members_fit_their_declared_kinds(self):
        """Each optional member the launcher has (``LAUNCHER_OPTIONAL``, fsm_agent/plugins/protocols.py)
        fits its declared kind; ``take_timings()`` answers a dict of seconds."""
        launcher = self.make_launcher()
        try:
            assert optional_member_problems(launcher, LAUNCHER_OPTIONAL) == []
            if hasattr(launcher, "take_timings"):
                timings = launcher.take_timings()
                assert isinstance(timings, dict) and all(isinstance(v, (int, float)) for v in timings.values())
        finally:
            launcher.close()
            if hasattr(launcher, "shutdown"):
                launcher.shutdown()

    # -- start -----------------------------------------------------------------------------------
    def test_start_runs_one_process_per_worker_with_its_env_and_args(self, workers):
        """start() runs one live process per worker, with its environment and arguments."""
        pids = workers.start(
            'mark("env", json.dumps({"rank": os.environ["LOCAL_RANK"], '
            '"token": os.environ["FSM_CONFORMANCE_TOKEN"], "argv": sys.argv[1:]}))\n'
            "time.sleep(120)\n",
            count=3,
            args=("--lr", "0.1"),
        )
        assert sorted(pids) == [0, 1, 2] and len(set(pids.values())) == 3
        assert workers.launcher.pids() == pids
        for rank in range(3):
            seen = json.loads(workers.wait_marker("env", rank))
            assert seen == {"rank": str(rank), "token": workers.token, "argv": ["--lr", "0.1"]}
            assert workers.alive(pids[rank])
        assert workers.launcher.poll() == {}

    def test_running_workers_are_neither_reported_nor_readable(self, workers):
        """While workers run, poll() reports nothing and no wait fd is readable."""
        workers.start('mark("ready")\ntime.sleep(120)\n')
        for rank in range(2):
            workers.wait_marker("ready", rank)
        fds = workers.launcher.wait_fds()
        assert {0, 1} <= set(fds.values()), "every running worker needs a wait fd"
        assert select.select(list(fds), [], [], 0.3)[0] == []
        assert workers.launcher.poll() == {} and workers.launcher.exit_times() == {}

    # -- exits -----------------------------------------------------------------------------------
    def test_an_exit_makes_a_wait_fd_readable_and_poll_reports_it(self, workers):
        """An exit makes a wait fd readable and poll() report the code; the fd then leaves wait_fds().

        The agent selects on wait_fds() (keys), then polls. Values are local ranks; a launcher may
        add helper fds under other values (e.g. a zygote's socket) that wake the agent too."""
        started = time.time()
        workers.start("if _rank == 1:\n    time.sleep(0.3)\n    sys.exit(3)\ntime.sleep(120)\n")
        fds = workers.launcher.wait_fds()
        ready, _, _ = select.select(list(fds), [], [], self.wait_timeout)
        assert ready and 0 not in [fds[fd] for fd in ready], "only the exited worker's (or a helper's) fd may wake"
        exits = workers.wait_exits([1])
        assert exits == {1: 3}
        assert started <= workers.launcher.exit_times()[1] <= time.time()
        assert 1 not in workers.launcher.wait_fds().values(), "a reported worker's fd must leave wait_fds()"
        assert 0 in workers.launcher.wait_fds().values()

    def test_exit_codes_and_deaths_by_signal(self, workers):
        """Exit codes are reported as such, deaths by signal N as -N."""
        workers.start(
            "if _rank == 1:\n    sys.exit(7)\nif _rank == 2:\n    os.kill(os.getpid(), signal.SIGKILL)\n", count=3
        )
        assert workers.wait_exits([0, 1, 2]) == {0: 0, 1: 7, 2: -signal.SIGKILL}
        assert not {0, 1, 2} & set(workers.launcher.wait_fds().values())
        assert workers.launcher.return_values() == {}  # programs return nothing
        assert sorted(workers.launcher.exit_times()) == [0, 1, 2]

    def test_output_is_in_the_log_files_once_the_exit_is_reported(self, workers):
        """A worker's stdout and stderr are in its log files once its exit is reported."""
        workers.start('print(f"out of {_rank}")\nprint(f"err of {_rank}", file=sys.stderr)\nsys.exit(_rank)\n')
        workers.wait_exits([0, 1])
        for rank in (0, 1):
            assert Path(workers.logs[rank].stdout).read_text() == f"out of {rank}\n"
            assert f"err of {rank}" in Path(workers.logs[rank].stderr).read_text()

    # -- stop ------------------------------------------------------------------------------------
    def test_stop_signals_every_worker_and_waits_for_it(self, workers):
        """stop(sig, timeout) signals every worker at once and returns when they are gone."""
        workers.start(
            'def bye(signum, frame):\n    time.sleep(0.5)\n    mark("stopped", signum)\n    sys.exit(0)\n'
            'signal.signal(signal.SIGTERM, bye)\nmark("ready")\ntime.sleep(120)\n'
        )
        pids = workers.launcher.pids()
        for rank in range(2):
            workers.wait_marker("ready", rank)
        started = time.monotonic()
        workers.launcher.stop(signal.SIGTERM, 10.0)
        elapsed = time.monotonic() - started
        assert 0.5 <= elapsed < 10.0, f"stop returned after {elapsed:.2f}s (workers need 0.5s, grace 10s)"
        for rank in range(2):  # every worker got its grace period at once, and the signal it was asked for
            assert workers.marker("stopped", rank).read_text() == str(int(signal.SIGTERM))
            assert not workers.alive(pids[rank])
        assert sorted(workers.launcher.poll()) == [0, 1]
        assert not {0, 1} & set(workers.launcher.wait_fds().values())

    def test_stop_kills_a_worker_that_outlives_the_grace_period(self, workers):
        """A worker that ignores the signal is killed (-9) after the grace period."""
        workers.start('signal.signal(signal.SIGTERM, signal.SIG_IGN)\nmark("ready")\ntime.sleep(120)\n')
        for rank in range(2):
            workers.wait_marker("ready", rank)
        started = time.monotonic()
        workers.launcher.stop(signal.SIGTERM, self.grace)
        elapsed = time.monotonic() - started
        assert self.grace <= elapsed < self.grace + self.wait_timeout
        assert workers.launcher.poll() == {0: -signal.SIGKILL, 1: -signal.SIGKILL}
        assert not any(workers.alive(pid) for pid in workers.launcher.pids().values())

    def test_stop_and_close_are_harmless_before_start_and_when_repeated(self, workers):
        """stop() before start() (rendezvous_failed in INIT), a second stop() or close() are harmless."""
        workers.launcher.stop(signal.SIGTERM, self.grace)  # rendezvous_failed in INIT stops "the workers"
        workers.start("sys.exit(0)\n")
        workers.wait_exits([0, 1])
        workers.launcher.stop(signal.SIGTERM, self.grace)
        workers.launcher.stop(signal.SIGTERM, self.grace)
        workers.launcher.close()
        workers.launcher.close()
        workers.shutdown()

    def test_signal_worker_delivers_a_signal_without_stopping_anyone(self, workers):
        """signal_worker() delivers a signal to one running worker; to an exited one it is a no-op."""
        workers.start(
            'signal.signal(signal.SIGUSR1, lambda s, f: mark("usr1"))\nmark("ready")\n'
            "if _rank == 1:\n    sys.exit(0)\ntime.sleep(120)\n"
        )
        workers.wait_marker("ready", 0)
        workers.wait_exits([1])
        workers.launcher.signal_worker(1, signal.SIGUSR1)  # exited: a no-op, not an error
        workers.launcher.signal_worker(0, signal.SIGUSR1)
        workers.wait_marker("usr1", 0)
        assert not workers.marker("usr1", 1).exists()
        assert workers.launcher.poll() == {1: 0}

    # -- attempts and leftovers ------------------------------------------------------------------
    def test_a_restart_starts_a_fresh_attempt_on_the_same_launcher(self, workers):
        """A restart reuses the launcher: new processes, and poll() reports only the new attempt."""
        first = workers.start('mark("ready")\ntime.sleep(120)\n')
        workers.wait_marker("ready", 0)
        workers.launcher.stop(signal.SIGTERM, self.grace)
        second = workers.start("sys.exit(0)\n")
        assert set(first.values()).isdisjoint(second.values())
        assert workers.launcher.pids() == second
        assert workers.wait_exits([0, 1]) == {0: 0, 1: 0}

    def test_nothing_is_left_running_after_stop_and_close(self, workers):
        """Nothing outlives stop() and close() (grandchildren included), nor shutdown() (helpers)."""
        body = (
            'child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])\n'
            'mark("child", child.pid)\n'
        )
        if self.sweeps_daemons:
            body += (
                'daemon = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], '
                'start_new_session=True)\nmark("daemon", daemon.pid)\n'
            )
        body += 'mark("ready")\ntime.sleep(120)\n'
        pids = workers.start(body)
        kinds = ["child", "daemon"] if self.sweeps_daemons else ["child"]
        leftovers = []
        for rank in range(2):
            workers.wait_marker("ready", rank)
            leftovers += [int(workers.marker(kind, rank).read_text()) for kind in kinds]
        workers.track(*leftovers)
        workers.launcher.stop(signal.SIGTERM, self.grace)
        workers.launcher.close()
        survivors = [
            pid for pid in [*pids.values(), *leftovers] if not _wait_until(lambda pid=pid: not workers.alive(pid), 10.0)
        ]
        assert survivors == [], f"processes left running after stop() and close(): {survivors}"
        workers.shutdown()  # the agent's last call, if the launcher has it: helpers (a zygote) go too
        assert _wait_until(lambda: not workers.descendants(), 10.0), (
            f"processes left after shutdown(): {[p.pid for p in workers.descendants()]}"
        )

    # -- callables -------------------------------------------------------------------------------
    def test_callable_workers_return_their_values(self, workers):
        """Python callables run as workers and return_values() gives their values by local rank."""
        if not self.callables:
            pytest.skip("this launcher runs programs only")
        workers.start_spec(workers.spec(conformance_callable, ("value-",)))
        assert workers.wait_exits([0, 1]) == {0: 0, 1: 0}
        assert workers.launcher.return_values() == {0: "value-0", 1: "value-1"}
