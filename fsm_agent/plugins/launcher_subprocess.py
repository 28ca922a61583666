"""Built-in launcher ``subprocess``: workers as child processes, exits seen through pidfds.

Programs (``python -u script``, ``python -m mod``, ``--no-python`` binaries) run with
``subprocess.Popen``; Python callables (``--run-path``, ``elastic_launch(fn)``) with
``multiprocessing`` and return their values through a file. Each worker leads its own process
group (so grandchildren are signalled with it). Where cgroup v2 is writable, every worker and all
it starts live in one cgroup per launcher, emptied and removed even if the agent is SIGKILLed
(``fsm_agent.plugins.containment``); elsewhere each worker gets SIGKILL when the agent dies
(``PR_SET_PDEATHSIG``).
Exits are noticed when the worker's pidfd/sentinel becomes readable: no sleep-polling.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import multiprocessing
import os
import pickle
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs

from fsm_agent.env import substitute_local_rank
from fsm_agent.logs import WorkerLogs
from fsm_agent.pg_generations import install as install_pg_generations
from fsm_agent.pg_generations import with_generations_site
from fsm_agent.plugins import hookimpl
from fsm_agent.plugins.containment import Keeper, WorkerCgroup, enter_cgroup, keeper_pids

log = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37


@hookimpl
def fsm_agent_register_backends(registry):
    registry.add_launcher("subprocess", SubprocessLauncher)


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux only)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def become_subreaper(on: bool = True) -> bool:
    """Make orphaned descendants (daemonized grandchildren of workers) reparent to this process.

    Linux's ``PR_SET_CHILD_SUBREAPER``: a worker's double-forked daemon then becomes our child
    instead of init's, so ``sweep_orphans`` can find and stop it. ``on=False`` clears the flag.
    Returns whether the call succeeded (False off Linux).
    """
    if not sys.platform.startswith("linux"):
        return False
    return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0


def is_subreaper() -> bool:
    """Whether this process is a child subreaper now (``PR_GET_CHILD_SUBREAPER``; False off Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    flag = ctypes.c_int(0)
    ctypes.CDLL(None, use_errno=True).prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0)
    return bool(flag.value)


def _helper_pids() -> set[int]:
    """Our own helper processes that are not workers (multiprocessing's resource tracker, cgroup keepers)."""
    pids = keeper_pids()
    # Not imported means not started (and importing them would cost milliseconds per restart).
    resource_tracker = sys.modules.get("multiprocessing.resource_tracker")
    forkserver = sys.modules.get("multiprocessing.forkserver")
    try:
        for pid in (
            getattr(getattr(resource_tracker, "_resource_tracker", None), "_pid", None),
            getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None),
        ):
            if pid:
                pids.add(pid)
    except Exception:  # private attributes: best effort
        pass
    return pids


def sweep_orphans(keep: set[int] = frozenset()) -> list[int]:
    """SIGKILL and reap every descendant of this process except ``keep`` and our helpers.

    Called once the workers are stopped: whatever is left (daemonized grandchildren reparented
    to us as subreaper, or a worker's children in other process groups) must not outlive the
    attempt. Returns the pids that were killed.
    """
    import psutil

    me = psutil.Process()
    skip = set(keep) | _helper_pids()
    victims = [p for p in me.children(recursive=True) if p.pid not in skip]
    for proc in victims:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(victims, timeout=5)
    _reap_children(skip)
    return [p.pid for p in victims]


def _direct_children() -> set[int]:
    """Pids of this process's children: ``/proc/self/task/*/children``, a few small reads (psutil
    scans every process on the machine instead, milliseconds on a busy node; it is the fallback)."""
    try:
        pids: set[int] = set()
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/children") as f:
                pids.update(int(pid) for pid in f.read().split())
        return pids
    except (OSError, ValueError):
        import psutil

        return {proc.pid for proc in psutil.Process().children()}


def _reap_children(skip: set[int]) -> None:
    """Reap the zombies among our direct children (reparented orphans), except ``skip``."""
    for pid in _direct_children() - skip:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


def _child_preexec(cgroup: str | None = None) -> None:
    # Runs in the forked child before exec: into the worker cgroup, new session (own process
    # group) + death signal.
    if cgroup:
        enter_cgroup(cgroup)
    os.setsid()
    set_parent_death_signal()


@attrs.define
class _Handle:
    local_rank: int
    pid: int
    wait_fd: int
    popen: subprocess.Popen | None = None
    process: Any = None
    result_path: str | None = None
    readers: list = attrs.Factory(list)
    exitcode: int | None = None
    exited_at: float | None = None
    owns_fd: bool = False

    def poll(self) -> int | None:
        if self.exitcode is None:
            code = self.popen.poll() if self.popen is not None else self.process.exitcode
            if code is not None:
                self.exitcode, self.exited_at = code, time.time()
        return self.exitcode


class SubprocessLauncher:
    """Starts, watches and stops one attempt's workers on this node.

    The launcher interface the agent relies on (a third-party launcher implements the same):

    - ``start(spec, envs, logs, filtered) -> {local_rank: pid}``
    - ``wait_fds() -> {fd: local_rank}``: fds that become readable when that worker exits
    - ``poll() -> {local_rank: exitcode}`` of the workers that have exited (never blocks)
    - ``stop(sig, timeout)``: signal every live worker's process group, SIGKILL after ``timeout`` seconds
    - ``return_values() -> {local_rank: value}`` for callable entrypoints
    - ``pids() -> {local_rank: pid}``
    - ``signal_worker(local_rank, sig)``: deliver a signal to one running worker (stack dumps, forwarding)
    """

    #: True when this process forks the workers itself (then it steps into their cgroup to do it).
    workers_are_our_children = True

    def __init__(self, agent: Any = None) -> None:
        self._handles: dict[int, _Handle] = {}
        #: Handles of workers replaced in process (``replace_workers``), released at ``close()``.
        self._retired: list[_Handle] = []
        self._filtered: list = []
        self._not_ours: set[int] = set()
        self._cgroup: WorkerCgroup | None = None
        self._keeper: Keeper | None = None
        self._cgroup_tried = False
        #: Whether this process was a subreaper before start() made it one (None: not holding the flag).
        self._was_subreaper: bool | None = None

    # -- start ----------------------------------------------------------------------------------
    def start(
        self,
        spec,
        envs: dict[int, dict[str, str]],
        logs: dict[int, WorkerLogs],
        filtered: tuple[str | None, str | None] = (None, None),
    ) -> dict[int, int]:
        self._ensure_cgroup()
        self._hold_subreaper()
        # Processes that exist before the workers (e.g. servers a test harness started) are not
        # ours to sweep or reap. With a cgroup the sweep is the cgroup's, so only children count.
        if self._cgroup is not None:
            self._not_ours = _direct_children()
        else:
            import psutil

            self._not_ours = {p.pid for p in psutil.Process().children(recursive=True)}
        self._handles = {}
        self._filtered = [
            _FilteredSink(path, filters) if path and filters else None
            for path, filters in zip(
                filtered, (getattr(spec, "duplicate_stdout_filters", ()), getattr(spec, "duplicate_stderr_filters", ()))
            )
        ]
        self._spawn(spec, envs, logs)
        return self.pids()

    def replace_workers(self, spec, envs: dict[int, dict[str, str]], logs: dict[int, WorkerLogs]) -> dict[int, int]:
        """Start a new process for each local rank in ``envs``, whose worker has exited; the other
        workers keep running (in-process restart, ``fsm_agent.inprocess``). The preload launcher
        inherits it and forks the new ones from its warm zygote.

        Returns:
            ``{local_rank: pid}`` of the new processes.

        Raises:
            ValueError: a local rank in ``envs`` whose worker still runs, or that never started.
        """
        running = [r for r in envs if r not in self._handles or self._handles[r].poll() is None]
        if running:
            raise ValueError(f"replace_workers: local rank(s) {running} still running or never started")
        for local_rank in envs:
            handle = self._handles.pop(local_rank)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(handle.pid, signal.SIGKILL)  # grandchildren left in its group (never a reused pid)
            self._retired.append(handle)  # its log readers may still drain: joined at close()
        self._spawn(spec, envs, logs)
        return {r: self._handles[r].pid for r in envs}

    def _spawn(self, spec, envs: dict[int, dict[str, str]], logs: dict[int, WorkerLogs]) -> None:
        """Start one worker per local rank in ``envs`` (its handle replaces any old one)."""
        # Not for callables: multiprocessing may start its helpers (resource tracker, forkserver)
        # on the way, and those must live outside; a callable worker enters the cgroup itself.
        step_in = self._cgroup is not None and self.workers_are_our_children and not callable(spec.entrypoint)
        with self._cgroup.born_inside() if step_in else contextlib.nullcontext(False) as inside:
            for local_rank in sorted(envs):
                if callable(spec.entrypoint):
                    handle = self._start_callable(spec, local_rank, envs[local_rank], logs[local_rank])
                else:
                    handle = self._start_program(spec, local_rank, envs[local_rank], logs[local_rank], inside)
                self._handles[local_rank] = handle

    @staticmethod
    def _close_handle(handle: _Handle) -> None:
        """Release what an exited worker's handle holds: its log readers' threads and its wait fd."""
        for reader in handle.readers:
            reader.join(2.0)
        handle.readers.clear()
        if handle.owns_fd:
            with contextlib.suppress(OSError):
                os.close(handle.wait_fd)
            handle.owns_fd = False

    def _ensure_cgroup(self) -> None:
        """On the first start: the workers' cgroup and its keeper (none where cgroup v2 is not writable)."""
        if self._cgroup_tried:
            return
        self._cgroup_tried = True
        self._cgroup = WorkerCgroup.create()
        if self._cgroup is None:
            return
        try:
            self._keeper = Keeper(self._cgroup)  # no wait: it only has to read its stdin eventually
        except OSError as exc:  # a cgroup nobody removes if we are SIGKILLed: rather none
            log.warning("workers are not put in a cgroup: its keeper did not start: %s", exc)
            self._cgroup.remove(0.0)
            self._cgroup = None
            return
        log.debug("workers are contained in %s (keeper pid %s)", self._cgroup.path, self._keeper.pid)

    @property
    def _cgroup_path(self) -> str | None:
        return self._cgroup.path if self._cgroup is not None else None

    def _start_program(
        self, spec, local_rank: int, env: dict[str, str], wlogs: WorkerLogs, born_in_cgroup: bool = False
    ) -> _Handle:
        args = [spec.entrypoint, *map(str, substitute_local_rank(tuple(spec.args), local_rank))]
        args = _numa_wrap(args, spec.numa_binding, local_rank)
        streams = [
            self._stream_target(path, tee)
            for path, tee in ((wlogs.stdout, wlogs.tee_stdout), (wlogs.stderr, wlogs.tee_stderr))
        ]
        if born_in_cgroup:
            # No preexec_fn, so subprocess spawns with vfork (about 0.1 ms against several ms
            # for fork + a Python hook on a busy machine: it is on every restart's path). The
            # cgroup's keeper stands in for the parent-death signal.
            spawn = {"start_new_session": True}
        else:
            spawn = {"preexec_fn": functools.partial(_child_preexec, self._cgroup_path)}
        if spec.entrypoint == sys.executable:
            env = with_generations_site(env)
        popen = subprocess.Popen(
            args, env=env, stdout=streams[0][0], stderr=streams[1][0], stdin=subprocess.DEVNULL, close_fds=True, **spawn
        )
        for target in streams:
            if target[1] is not None:
                target[1].close()
        handle = _Handle(
            local_rank=local_rank, pid=popen.pid, wait_fd=os.pidfd_open(popen.pid), popen=popen, owns_fd=True
        )
        for index, (pipe, path, _tee, console) in enumerate(
            (
                (popen.stdout, wlogs.stdout, wlogs.tee_stdout, sys.stdout),
                (popen.stderr, wlogs.stderr, wlogs.tee_stderr, sys.stderr),
            )
        ):
            if pipe is not None:
                handle.readers.append(_TeeReader(pipe, path, console, wlogs.prefix, self._filtered[index]))
        return handle

    @staticmethod
    def _stream_target(path: str | None, tee: bool):
        """(Popen stdout/stderr argument, file to close after spawn)."""
        if tee:
            return subprocess.PIPE, None
        if path:
            f = open(path, "ab")
            return f, f
        return None, None

    def _start_callable(self, spec, local_rank: int, env: dict[str, str], wlogs: WorkerLogs) -> _Handle:
        ctx = multiprocessing.get_context(spec.start_method)
        result_dir = os.path.dirname(wlogs.error_file) if wlogs.error_file else None
        result_path = os.path.join(result_dir, "return_value.pkl") if result_dir else None
        if result_path is None:
            import tempfile

            fd, result_path = tempfile.mkstemp(prefix="fsm_agent_ret_")
            os.close(fd)
        process = ctx.Process(
            target=_callable_worker,
            args=(
                spec.entrypoint,
                substitute_local_rank(tuple(spec.args), local_rank),
                env,
                wlogs.stdout,
                wlogs.stderr,
                result_path,
                self._cgroup_path,
            ),
            name=f"{spec.role}{local_rank}",
            daemon=False,
        )
        process.start()
        handle = _Handle(
            local_rank=local_rank, pid=process.pid, wait_fd=process.sentinel, process=process, result_path=result_path
        )
        for path, tee, console in (
            (wlogs.stdout, wlogs.tee_stdout, sys.stdout),
            (wlogs.stderr, wlogs.tee_stderr, sys.stderr),
        ):
            if tee and path:
                handle.readers.append(_FileTailer(path, console, wlogs.prefix, handle))
        return handle

    # -- watch ----------------------------------------------------------------------------------
    def wait_fds(self) -> dict[int, int]:
        return {h.wait_fd: r for r, h in self._handles.items() if h.exitcode is None}

    def poll(self) -> dict[int, int]:
        return {r: code for r, h in self._handles.items() if (code := h.poll()) is not None}

    def exit_times(self) -> dict[int, float]:
        return {r: h.exited_at for r, h in self._handles.items() if h.exited_at is not None}

    def pids(self) -> dict[int, int]:
        return {r: h.pid for r, h in self._handles.items()}

    def signal_worker(self, local_rank: int, sig: int) -> None:
        """Send ``sig`` to one running worker's process group (no-op if it has exited)."""
        handle = self._handles.get(local_rank)
        if handle is not None and handle.poll() is None:
            _killpg(handle.pid, sig)

    def return_values(self) -> dict[int, Any]:
        values = {}
        for r, h in self._handles.items():
            if h.exitcode != 0 or not h.result_path:
                continue
            try:
                with open(h.result_path, "rb") as f:
                    data = f.read()
            except FileNotFoundError:  # exit 0 without a value (os._exit(0)): None, as torch's
                data = b""
            values[r] = pickle.loads(data) if data else None
        return values

    # -- stop -----------------------------------------------------------------------------------
    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
        """Stop every live worker: ``sig`` to each process group, SIGKILL after ``timeout`` s.

        All workers are signalled at once, so each one gets the full grace period.
        """
        live = [h for h in self._handles.values() if h.poll() is None]
        for h in live:
            _killpg(h.pid, sig)
        if live and self._cgroup is not None and self.workers_are_our_children:
            self._cgroup.prime_move()  # likely a restart: its spawn's move into the cgroup gets quick
        deadline = time.monotonic() + timeout
        while live and (remaining := deadline - time.monotonic()) > 0:
            select.select([h.wait_fd for h in live], [], [], remaining)
            live = [h for h in live if h.poll() is None]
        for h in live:
            log.warning(
                "worker local_rank=%s pid=%s ignored signal %s for %.1fs; sending SIGKILL",
                h.local_rank,
                h.pid,
                sig,
                timeout,
            )
            _killpg(h.pid, signal.SIGKILL)
        for h in live:
            (h.popen.wait() if h.popen is not None else h.process.join())
            h.poll()
        self.close()

    def close(self) -> None:
        """Sweep what is left of the workers (their groups, orphaned daemons); release fds and threads."""
        live = {h.pid for h in self._handles.values() if h.poll() is None}
        for h in self._handles.values():
            if h.pid not in live:
                _killpg(h.pid, signal.SIGKILL)  # leftover grandchildren in the worker's group
        if self._cgroup is not None:
            # Everything the workers started is in the cgroup: one read of cgroup.procs finds
            # what is left (daemons included), where a sweep would walk the whole process table.
            if not live and (left := self._cgroup.pids()):
                log.warning("stopped %d leftover process(es) of the workers: %s", len(left), left)
                self._cgroup.kill()
                self._cgroup.wait_empty(5.0)
            if self._handles:
                _reap_children(live | self._not_ours | _helper_pids())  # orphans that died as our children
        else:
            swept = sweep_orphans(keep=live | self._not_ours) if self._handles else []
            if swept:
                log.warning("stopped %d leftover process(es) of the workers: %s", len(swept), swept)
        if not live:
            self._release_subreaper()
        for h in [*self._handles.values(), *self._retired]:
            self._close_handle(h)
        self._retired = []
        for sink in self._filtered:
            if sink is not None:
                sink.close()

    def _hold_subreaper(self) -> None:
        """Be a child subreaper while workers run (an in-process caller must not stay one)."""
        if self._was_subreaper is None:
            self._was_subreaper = is_subreaper()
            become_subreaper()

    def _release_subreaper(self) -> None:
        """Put the flag back as start() found it, then reap the orphans adopted meanwhile that died
        (the sweep has stopped the rest): none of them is left as a zombie of the caller."""
        if self._was_subreaper is None:
            return
        if not self._was_subreaper:
            become_subreaper(False)
        self._was_subreaper = None
        _reap_children(self._not_ours | _helper_pids())

    def shutdown(self) -> None:
        """Remove the workers' cgroup and reap its keeper (called when the agent is done)."""
        if self._keeper is not None:
            if not self._keeper.close():
                log.warning("the worker cgroup keeper (pid %s) did not end cleanly", self._keeper.pid)
            self._keeper = None
        if self._cgroup is not None:
            self._cgroup.wait_primed()
            self._cgroup.kill()  # a no-op after the keeper, unless the keeper was lost
            self._cgroup.remove()
            self._cgroup = None


def _killpg(pgid: int, sig: int) -> None:
    """Signal the process group led by worker ``pgid``; the worker alone if it has no group yet
    (a preload worker is reported by its zygote right after the fork, before its ``setsid``)."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pgid, sig)
    except PermissionError:
        pass


def _numa_wrap(args: list[str], binding: str | None, local_rank: int) -> list[str]:
    """Wrap a program with numactl for ``--numa-binding`` (GPU index = local rank, as torch)."""
    if not binding:
        return args
    if shutil.which("numactl") is None:
        log.warning("--numa-binding %s not applied to local_rank %s: numactl is not installed", binding, local_rank)
        return args
    try:
        from torch.numa.binding import AffinityMode, NumaOptions, _maybe_wrap_command_args_with_numa_binding

        return list(
            _maybe_wrap_command_args_with_numa_binding(
                tuple(args), gpu_index=local_rank, numa_options=NumaOptions(affinity_mode=AffinityMode(binding))
            )
        )
    except Exception as exc:  # no GPU / no numactl: run unbound, as torch does on failure
        log.warning("--numa-binding %s not applied to local_rank %s: %s", binding, local_rank, exc)
        return args


class _FilteredSink:
    """``filtered_stdout.log``: a copy of every tee'd line containing one of the filter strings,
    with the console's ``[role rank]:`` prefix, as torchrun writes it (``tail_log``'s header)."""

    def __init__(self, path: str, filters: tuple[str, ...]):
        self._file = open(path, "ab")
        self._filters = [f.encode() for f in filters]
        self._lock = threading.Lock()

    def offer(self, prefix: bytes, line: bytes) -> None:
        if any(f in line for f in self._filters):
            with self._lock:
                self._file.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
                self._file.flush()

    def close(self) -> None:
        self._file.close()


def _to_console(console: Any, data: bytes) -> bool:
    """Write ``data`` to the agent's console (a binary stream) and flush it; False when the console
    is gone (its pipe's reader closed, as ``fsm-agent run -t 3 ... | head`` does): the caller stops
    copying there, where an error would end its thread with a traceback and, for a tee, the
    worker with a broken pipe."""
    try:
        console.write(data)
        console.flush()
    except (BrokenPipeError, ValueError):  # ValueError: the stream was closed
        return False
    return True


class _TeeReader(threading.Thread):
    """Copies a worker's pipe to its log file and, line-whole with a prefix, to the console."""

    def __init__(self, pipe, path, console, prefix: str, filtered: _FilteredSink | None):
        super().__init__(daemon=True, name=f"tee{prefix}")
        self._pipe, self._path, self._console = pipe, path, console
        self._prefix, self._filtered = prefix.encode(), filtered
        self.start()

    def run(self) -> None:
        out = open(self._path, "ab") if self._path else None
        console = getattr(self._console, "buffer", None)
        try:
            for line in iter(self._pipe.readline, b""):  # whole lines: no interleaved halves
                if out is not None:
                    out.write(line)
                    out.flush()
                if console is not None and not _to_console(
                    console, self._prefix + line if line.endswith(b"\n") else self._prefix + line + b"\n"
                ):
                    console = None  # the console's reader is gone (`| head`): the log file goes on
                if self._filtered is not None:
                    self._filtered.offer(self._prefix, line)
        finally:
            if out is not None:
                out.close()
            self._pipe.close()


class _FileTailer(threading.Thread):
    """Tee for callable workers (their fds are redirected inside the child): follow the file."""

    def __init__(self, path: str, console, prefix: str, handle: _Handle):
        super().__init__(daemon=True, name=f"tail{prefix}")
        self._path, self._console, self._prefix, self._handle = path, console, prefix.encode(), handle
        # A replaced worker's log already holds its predecessor's output: follow only what is new.
        self._offset = os.path.getsize(path) if os.path.exists(path) else 0
        self.start()

    def run(self) -> None:
        console = getattr(self._console, "buffer", None)
        pending = b""
        while not os.path.exists(self._path):
            if self._handle.exitcode is not None:
                return
            time.sleep(0.05)
        with open(self._path, "rb") as f:
            f.seek(self._offset)
            while True:
                chunk = f.read(65536)
                if chunk:
                    pending += chunk
                    *lines, pending = pending.split(b"\n")
                    if lines and not _to_console(console, b"".join(self._prefix + line + b"\n" for line in lines)):
                        return  # the console's reader is gone (`| head`): nothing left to do here
                elif self._handle.exitcode is not None:
                    if pending:
                        _to_console(console, self._prefix + pending + b"\n")
                    return
                else:
                    time.sleep(0.05)


def _callable_worker(
    fn: Callable,
    args: tuple,
    env: dict[str, str],
    stdout: str | None,
    stderr: str | None,
    result_path: str,
    cgroup: str | None = None,
) -> None:
    """Body of a callable worker process: cgroup, environment, redirects, ``@record``, return value."""
    # The child enters the cgroup itself, before any user code: had the parent moved it after
    # start(), a fork-started worker could already have forked children that would stay outside.
    if cgroup:
        enter_cgroup(cgroup)
    os.setsid()
    set_parent_death_signal()
    os.environ.clear()
    os.environ.update(env)
    install_pg_generations()
    for path, fd in ((stdout, 1), (stderr, 2)):
        if path:
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            sys.stdout.flush() if fd == 1 else sys.stderr.flush()
            os.dup2(target, fd)
            os.close(target)
    try:
        from torch.distributed.elastic.multiprocessing.errors import record
    except ImportError:  # torch missing: run without the error file

        def record(f):
            return f

    def run_and_keep() -> None:  # under @record, so a value that cannot go back is the error recorded
        try:
            value = fn(*args)
        except SystemExit as exc:
            # A script run by --run-path that ends in sys.exit(0) (or sys.exit()) succeeded: its
            # value is None, as under torch's record, which swallows SystemExit(0) the same way.
            if exc.code not in (None, 0):
                raise
            value = None
        try:
            data = pickle.dumps(value)
        except Exception as exc:
            raise TypeError(
                f"the return value of {getattr(fn, '__qualname__', fn)!s} ({type(value).__name__}) "
                f"cannot be pickled, so the agent cannot hand it back: {type(exc).__name__}: {exc}; "
                f"return something picklable"
            ) from None
        with open(result_path, "wb") as f:
            f.write(data)

    record(run_and_keep)()
    sys.stdout.flush()
    sys.stderr.flush()
