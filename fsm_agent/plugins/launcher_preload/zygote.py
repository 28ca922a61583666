"""The preload launcher's zygote: a process that imports heavy modules once, then forks workers.

Started (``fsm_agent._early_zygote.spawn``) as ``python .../launcher_preload/zygote.py MODULES FD``, where FD
is its end of a ``SOCK_SEQPACKET`` socket pair: a file, not ``-m``, so that the preload modules are
the first thing it imports (``-m`` would import the ``fsm_agent`` packages first, a few tenths of
a second on the first start's path); the two fsm-agent modules it needs, both standard library
only, are loaded by their files. One JSON object per packet:

- agent -> zygote: ``{"op": "spawn", "local_rank", "argv", "env", "cwd", "mode", "cgroup"}`` with two
  fds (stdout, stderr) attached by SCM_RIGHTS; ``mode`` is ``script`` | ``module`` | ``exec``;
  ``cgroup`` is the directory of the workers' cgroup (``fsm_agent.plugins.containment``) or null.
- zygote -> agent: first ``{"ready": true, "import_s": seconds}`` once the modules are imported
  (or ``{"ready": false, "module", "error"}``); ``{"spawned": local_rank, "pid": pid}`` and, when a
  worker ends, ``{"exited": pid, "code": exitcode}`` (``-N`` for death by signal N, as subprocess).

The zygote is single-threaded (forking a threaded process can deadlock the child): one
selector loop on the socket and on a SIGCHLD wakeup pipe. It has ``PR_SET_PDEATHSIG`` set, and
so does each worker (towards the zygote), so the chain dies with the agent; it ignores the signals
meant for the agent (``AGENT_SIGNALS``), so a signal to the agent's process group leaves it there
to report the exits of the workers the agent then stops. The zygote itself
stays out of the workers' cgroup (it outlives attempts); each worker enters it right after fork.
Workers are standbys made ahead of need: forks of the zygote, kept ready while it is idle
(``REFILL_DELAY_S`` after its last request), each waiting for the one request that makes it a
worker, so a restart costs a message per worker instead of a fork of a process that imported torch.
The workers' store is no business of the zygote's: the workers' rank 0 hosts it (torch's
``TORCHELASTIC_USE_AGENT_STORE=False``), a new one for each ``init_process_group``.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import time

MAX_FDS = 2
#: Signals the zygote ignores, torchrun's ``--signals-to-handle``: sent to the agent's whole
#: process group (Slurm's ``scancel``, a terminal's Ctrl-C, ``kill -TERM -PGID``), they are the
#: agent's to act on, and while it stops its workers it needs the zygote to report their exit
#: codes. The zygote ends when the agent closes its socket, or dies (``PR_SET_PDEATHSIG``).
#: Each standby and worker takes the default actions back (``_die_of_stop_signals``).
AGENT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
_HERE = os.path.dirname(os.path.abspath(__file__))
_helpers: dict = {}  # "boot": fsm_agent/_early_zygote.py, "containment": fsm_agent/plugins/containment.py,
# "pg_generations": fsm_agent/pg_generations.py, "stack_dump": fsm_agent/stack_dump.py


def _load(name: str, path: str):
    """The module in ``path``, without importing the ``fsm_agent`` package around it."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pdeathsig() -> None:
    _helpers["boot"].parent_death_signal()


def _send(sock: socket.socket, message: dict) -> None:
    sock.send(json.dumps(message).encode())


def _threads_from_env() -> None:
    """torch's intra-op threads as the worker's own OMP_NUM_THREADS says: OpenMP read the variable
    when the zygote imported torch, maybe before the agent set it (torchrun's default of 1)."""
    torch = sys.modules.get("torch")
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


def _die_of_stop_signals() -> None:
    """In a new standby: the default actions of the signals the zygote ignores. The agent stops a
    worker with the signal it got (SIGTERM, SIGINT, ...) the moment it knows its pid, which may be
    before the standby has read its request, or run at all (``_fork_standby`` blocks the signals
    across the fork, so none is lost); an exec'd binary would inherit an ignored one."""
    for sig in AGENT_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)


def _run_worker(request: dict, out_fd: int, err_fd: int) -> int:
    """In the forked child: become the worker. Returns the exit code (never returns for exec)."""
    os.setsid()  # first: the launcher signals the worker's process group as soon as it knows the pid
    signal.signal(signal.SIGINT, signal.default_int_handler)  # KeyboardInterrupt, as under python
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # one that came meanwhile lands now
    if request.get("cgroup"):
        _helpers["containment"].enter_cgroup(request["cgroup"])
    _pdeathsig()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.set_wakeup_fd(-1)
    for fd, target in ((out_fd, 1), (err_fd, 2)):
        if fd >= 0:
            os.dup2(fd, target)
            os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    _threads_from_env()
    _helpers["pg_generations"].install()
    argv, mode = request["argv"], request["mode"]
    if mode == "exec":
        os.execvpe(argv[0], argv, request["env"])
    # As `python -u`: unbuffered text streams.
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True, write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True, write_through=True)
    _helpers["stack_dump"].install()
    sys.argv = list(argv)
    try:
        if mode == "module":
            sys.path.insert(0, os.getcwd())  # as ``python -m``: the working directory first
            runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def _end_standby(link: socket.socket) -> None:
    """Run the standby (``_standby``) and end this forked child with its exit code. Whatever it
    raises never reaches the zygote's code above it (the fork's copy of its loop): a Ctrl-C that
    lands before the worker's script runs ends it as it would end ``python script.py``, by SIGINT."""
    code = 1
    try:
        code = _standby(link)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 128 + signal.SIGINT
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def _standby(link: socket.socket) -> int:
    """In a standby (a fork of the zygote made ahead of need): wait for the one request that makes
    it a worker. Returns the exit code."""
    data, fds, _flags, _addr = socket.recv_fds(link, 1 << 20, MAX_FDS)
    if not data:
        return 0  # the zygote is ending
    request = json.loads(data)
    link.close()
    out_fd, err_fd = (list(fds) + [-1, -1])[:2]
    return _run_worker(request, out_fd, err_fd)


#: Seconds after the last request before the zygote forks standbys again (the workers it just
#: started get the CPU first). A fork of a process that imported torch takes 10-70 ms here: made
#: ahead of need, the next attempt's workers are a message away, not P forks.
REFILL_DELAY_S = 0.1


class _Zygote:
    """The selector loop: requests from the agent, SIGCHLD, and standbys kept ready when idle."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd is written
        self.selector = selectors.DefaultSelector()
        self.selector.register(sock, selectors.EVENT_READ, "sock")
        self.selector.register(self.wake_r, selectors.EVENT_READ, "child")
        self.standbys: dict[int, socket.socket] = {}  # pid -> the zygote's end of its link, not yet used
        self.wanted = 0  # how many standbys one request round used, at most
        self.refill_at = 0.0

    # -- standbys ---------------------------------------------------------------------------------
    def _fork_standby(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # Blocked, a signal sent to the child before it has its own dispositions waits instead of
        # meeting the zygote's ignore: the agent may stop a worker the moment it learns its pid.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, AGENT_SIGNALS)
        pid = os.fork()
        if pid == 0:  # nothing of the zygote's stays open in a standby
            self.selector.close()
            self.sock.close()
            os.close(self.wake_r)
            os.close(self.wake_w)
            for link in (ours, *self.standbys.values()):
                link.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.set_wakeup_fd(-1)
            _die_of_stop_signals()  # a standby may be made a worker, and stopped, at any moment
            # The others' default actions now (one sent meanwhile lands); SIGINT waits, blocked,
            # for the worker's handler (``_run_worker``): a Ctrl-C is not for an idle standby.
            signal.pthread_sigmask(signal.SIG_SETMASK, {*mask, signal.SIGINT})
            _pdeathsig()  # towards the zygote: the chain dies with the agent
            _end_standby(theirs)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        theirs.close()
        self.standbys[pid] = ours

    def _activate(self, request: dict, fds: list[int]) -> tuple[int, socket.socket]:
        """Give ``request`` (and ``fds``, closed here) to a standby, forked now if none is ready."""
        try:
            while True:
                if not self.standbys:
                    self._fork_standby()
                pid, link = self.standbys.popitem()
                try:
                    socket.send_fds(link, [json.dumps(request).encode()], fds)
                    return pid, link
                except OSError:  # it died meanwhile (its exit is reaped as a standby's): the next one
                    link.close()
        finally:
            for fd in fds:
                os.close(fd)

    def _refill(self) -> float | None:
        """Fork one standby when the zygote has been idle long enough; the select timeout until the next."""
        if len(self.standbys) >= self.wanted:
            return None
        wait = self.refill_at - time.monotonic()
        if wait > 0:
            return wait
        self._fork_standby()
        return 0.0

    # -- requests ---------------------------------------------------------------------------------
    def _spawn(self, request: dict, fds: list[int]) -> dict:
        self.wanted = max(self.wanted, int(request["local_rank"]) + 1)
        pid, link = self._activate(request, fds)
        link.close()
        return {"spawned": request["local_rank"], "pid": pid}

    def _reap(self) -> None:
        os.read(self.wake_r, 4096)
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid in self.standbys:  # an unused standby died (e.g. swept): never a worker
                self.standbys.pop(pid).close()
            else:
                _send(self.sock, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})

    def serve(self) -> None:
        while True:
            events = self.selector.select(self._refill())
            for key, _ in events:
                if key.data == "child":
                    self._reap()
                    continue
                data, fds, _flags, _addr = socket.recv_fds(self.sock, 1 << 20, MAX_FDS)
                if not data:
                    self._end()
                    return  # the agent closed the socket: it is gone or done
                answer = self._spawn(json.loads(data), list(fds))
                _send(self.sock, answer)
                self.refill_at = time.monotonic() + REFILL_DELAY_S

    def _end(self) -> None:
        """Each standby told to exit (its link closed), all reaped."""
        for pid, link in list(self.standbys.items()):
            link.close()
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        self.standbys.clear()


def serve(sock: socket.socket) -> None:
    _Zygote(sock).serve()


def main() -> None:
    for sig in AGENT_SIGNALS:  # first, before the imports: a signal to the agent's group is not for us
        signal.signal(sig, signal.SIG_IGN)
    if sys.path and os.path.abspath(sys.path[0] or ".") == _HERE:
        del sys.path[0]  # run as a file: its directory is no import root (the workers inherit sys.path)
    _helpers["boot"] = _load("_fsm_agent_early_zygote", os.path.join(_HERE, "..", "..", "_early_zygote.py"))
    _pdeathsig()
    sock = socket.socket(fileno=int(sys.argv[2]))
    started = time.monotonic()
    for name in filter(None, sys.argv[1].split(",") if len(sys.argv) > 1 else []):
        try:
            importlib.import_module(name)
        except Exception as exc:  # told to the agent, which ends with one line naming the module
            _send(sock, {"ready": False, "module": name, "error": f"{type(exc).__name__}: {exc}"})
            return
    _helpers["containment"] = _load("_fsm_agent_containment", os.path.join(_HERE, "..", "containment.py"))
    _helpers["pg_generations"] = _load(
        "_fsm_agent_pg_generations", os.path.join(_HERE, "..", "..", "pg_generations.py")
    )
    _helpers["stack_dump"] = _load("_fsm_agent_stack_dump", os.path.join(_HERE, "..", "..", "stack_dump.py"))
    _send(sock, {"ready": True, "import_s": time.monotonic() - started})
    serve(sock)


if __name__ == "__main__":
    main()
