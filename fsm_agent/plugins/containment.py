"""Worker containment with cgroup v2: nothing a worker starts outlives the agent, even a SIGKILLed one.

A launcher puts its workers in a child cgroup ``fsm-agent-<agent pid>-<random>`` of the agent's
own cgroup v2 directory: each worker is born in it (the launcher steps in while it spawns them,
``WorkerCgroup.born_inside``), so every process it starts later (a double-forked, ``setsid``
daemon included) is in it too. A *keeper* process, in its own
session and outside that cgroup, blocks reading a pipe whose only write end the agent holds;
when the pipe closes (the agent closed it on its way out, or died, SIGKILL included) the keeper
kills the cgroup (``cgroup.kill``), waits until it is empty, removes it and exits.

A keeper SIGKILLed together with its agent (a harness that kills the whole session) leaves the
empty cgroup behind; the next agent to create one removes the empty ``fsm-agent-<pid>-*``
cgroups of agents that no longer exist (``remove_leftovers``).

Without a writable cgroup v2 hierarchy (or with ``FSM_AGENT_WORKER_CGROUP=off``; the default is
``auto``) there is no cgroup and no keeper: workers still get the parent-death signal and the
agent's subreaper sweep (``fsm_agent.plugins.launcher_subprocess``).

The keeper runs this file as ``python -I -S containment.py --keep DIR``: module-level imports
must stay in the standard library, and light.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import select
import signal
import sys
import time
import weakref

log = logging.getLogger(__name__)

ENV_VAR = "FSM_AGENT_WORKER_CGROUP"
PREFIX = "fsm-agent-"
REMOVE_TIMEOUT = 10.0  # seconds for a killed cgroup to empty before it is removed
_NAME = re.compile(re.escape(PREFIX) + r"(\d+)-[0-9a-f]{8}")


def cgroup_dir(pid: int | str = "self") -> str | None:
    """The cgroup v2 directory of process ``pid`` (from ``/proc/PID/cgroup`` and our mountinfo), or None."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            path = next((line[3:].rstrip("\n") for line in f if line.startswith("0::")), None)
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return None
    if not path or not path.startswith("/"):
        return None
    for fields in mounts:  # ID PARENT DEV ROOT MOUNTPOINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER
        if "-" not in fields or fields[fields.index("-") + 1] != "cgroup2":
            continue
        relative = os.path.relpath(path, _unescape(fields[3]))
        if relative.split(os.sep)[0] == os.pardir:
            continue  # mounted from below our cgroup
        found = os.path.normpath(os.path.join(_unescape(fields[4]), relative))
        if os.path.isdir(found):
            return found
    return None


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes (``\\040``)."""
    import re

    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def cgroup_unavailable() -> str | None:
    """Why workers cannot be put in a cgroup of their own here; None when they can."""
    parent = cgroup_dir()
    if parent is None:
        return "no cgroup v2 hierarchy is mounted for this process"
    if not (os.access(parent, os.W_OK) and os.access(os.path.join(parent, "cgroup.procs"), os.W_OK)):
        return f"this process's cgroup {parent} is not writable"
    return None


def enter_cgroup(path: str) -> bool:
    """Move the calling process into the cgroup at ``path``; best effort (False if it failed).

    Called by a launcher around its spawns (``WorkerCgroup.born_inside``), or in a worker's forked
    child before it execs or forks anything, so that everything it starts is born inside. A
    failure leaves the worker uncontained rather than failing its start.
    """
    try:
        fd = os.open(os.path.join(path, "cgroup.procs"), os.O_WRONLY)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)
        return True
    except OSError:
        return False


class WorkerCgroup:
    """A cgroup v2 directory that holds one launcher's workers and all their descendants."""

    def __init__(self, path: str):
        self.path = path
        self._primer = None  # the thread of a pending prime_move()

    @classmethod
    def create(cls) -> WorkerCgroup | None:
        """A new child of this process's cgroup; None (logged at debug level) when that is not possible."""
        off = os.environ.get(ENV_VAR, "auto").strip().lower() == "off"
        reason = f"{ENV_VAR}=off" if off else cgroup_unavailable()
        if reason is None:
            parent = cgroup_dir()
            remove_leftovers(parent)
            path = os.path.join(parent, f"{PREFIX}{os.getpid()}-{os.urandom(4).hex()}")
            try:
                os.mkdir(path)
                return cls(path)
            except OSError as exc:
                reason = f"cannot create {path}: {exc}"
        log.debug("workers are not put in a cgroup: %s", reason)
        return None

    @contextlib.contextmanager
    def born_inside(self):
        """Context manager: while in it, every process this one starts is born in the cgroup.

        Yields True, or False when this process could not enter (start children the slow way
        then: each one enters between fork and exec). The calling process moves itself in and,
        on the way out, back to the cgroup it came from, so its children can be spawned with
        ``vfork`` (``subprocess`` without ``preexec_fn``): no copy of the agent's page tables and no
        Python code to schedule in each child before its exec, and no moment in which a child is
        outside the cgroup. Raises RuntimeError if this process cannot move back out: it must
        not stay where ``kill()`` would reach it.
        """
        self.wait_primed()  # its write must not move us back home after we entered
        home = cgroup_dir()
        if home is None or not enter_cgroup(self.path):
            yield False
            return
        try:
            yield True
        finally:
            if not enter_cgroup(home):
                raise RuntimeError(f"could not move back from the worker cgroup {self.path} to {home}")

    def prime_move(self) -> None:
        """Start, in a thread, the wait the kernel makes the next move between cgroups do; return at once.

        Moving a process between cgroups first waits for an RCU grace period when no move
        happened lately (cgroup_threadgroup_rwsem: 5-15 ms on a 2-core machine), and
        ``born_inside`` is on every restart's path. A launcher calls this when it starts
        stopping workers: a no-op move (into our own cgroup) pays that wait while the workers
        stop and the next rendezvous runs, and the real move soon after is quick.
        """
        import threading

        if self._primer is not None or (home := cgroup_dir()) is None:
            return
        self._primer = threading.Thread(target=enter_cgroup, args=(home,), name="fsm-cgroup-prime", daemon=True)
        self._primer.start()

    def wait_primed(self) -> None:
        """Wait for a pending ``prime_move`` (it takes at most a grace period)."""
        if self._primer is not None:
            self._primer.join()
            self._primer = None

    def pids(self) -> list[int]:
        """The processes in the cgroup now (none once it is removed)."""
        try:
            with open(os.path.join(self.path, "cgroup.procs")) as f:
                return [int(pid) for pid in f.read().split()]
        except FileNotFoundError:
            return []

    def kill(self) -> None:
        """SIGKILL every process in the cgroup (``cgroup.kill``; pid by pid on kernels before 5.14)."""
        try:
            with open(os.path.join(self.path, "cgroup.kill"), "w") as f:
                f.write("1")
        except FileNotFoundError:
            self._kill_each()

    def _kill_each(self, rounds: int = 100) -> None:
        # Without cgroup.kill a process may fork between our read and our kill: repeat until empty.
        for _ in range(rounds):
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.wait_empty(0.1)

    def wait_empty(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s until no live process is left in the cgroup; True if none is."""
        deadline = time.monotonic() + timeout
        try:
            fd = os.open(os.path.join(self.path, "cgroup.events"), os.O_RDONLY)
        except FileNotFoundError:
            return True
        try:
            poller = select.poll()
            poller.register(fd, select.POLLPRI)  # the kernel signals each change of cgroup.events
            while b"populated 1" in os.pread(fd, 4096, 0):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                poller.poll(min(remaining, 0.1) * 1000)  # 0.1 s: never rely on the notification alone
            return True
        except OSError as exc:  # ENODEV: removed meanwhile (by the agent's keeper): empty for good
            if exc.errno != errno.ENODEV:
                raise
            return True
        finally:
            os.close(fd)

    def remove(self, timeout: float = REMOVE_TIMEOUT) -> bool:
        """Wait (bounded) until the cgroup is empty, then remove it and any cgroups under it; True if gone."""
        if not self.wait_empty(timeout):
            log.warning("the worker cgroup %s still has processes after %.0fs: not removed", self.path, timeout)
            return False
        for root, dirs, _files in os.walk(self.path, topdown=False):  # e.g. a nested agent's cgroup
            for name in dirs:
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.join(root, name))
        try:
            os.rmdir(self.path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("could not remove the worker cgroup %s: %s", self.path, exc)
            return False
        return True


def remove_leftovers(parent: str) -> list[str]:
    """Remove the empty ``fsm-agent-<pid>-*`` cgroups under ``parent`` whose agent pid no longer exists.

    What a keeper killed together with its agent could not remove. A cgroup with processes in it,
    or of a pid that is alive, is left alone. Returns the paths removed.
    """
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        match = _NAME.fullmatch(name)
        if match is None or _alive(int(match.group(1))):
            continue
        cgroup = WorkerCgroup(os.path.join(parent, name))
        if cgroup.wait_empty(0) and cgroup.remove(0):
            log.debug("removed the empty cgroup %s of an agent that is gone", cgroup.path)
            removed.append(cgroup.path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


_keepers: weakref.WeakSet[Keeper] = weakref.WeakSet()
#: What the agent writes to its keeper before closing the pipe on its own way out: its temporary
#: directories (``fsm_agent.tempdirs``) are then its own to remove or keep; EOF alone: it died.
_CLEAN_EXIT = b"clean-exit\n"


class Keeper:
    """The process that kills and removes a cgroup once the agent is gone, however it went.

    Its stdin is a pipe whose write end only this process holds (``close_fds`` for everything we
    exec; ``_drop_pipes_in_child`` for forks that do not exec), so its EOF means we closed it.
    """

    def __init__(self, cgroup: WorkerCgroup):
        import subprocess

        from fsm_agent.tempdirs import registered  # not at module level: the keeper's script runs with -I -S

        read_end, write_end = os.pipe()  # both close-on-exec
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-I", "-S", os.path.abspath(__file__), "--keep", cgroup.path, *registered()],
                stdin=read_end,
                stdout=subprocess.DEVNULL,
                close_fds=True,
                start_new_session=True,
            )
        except BaseException:
            os.close(write_end)
            raise
        finally:
            os.close(read_end)
        self._pipe = open(write_end, "wb", buffering=0)  # closed when dropped: the keeper then cleans up
        _keepers.add(self)

    @property
    def pid(self) -> int:
        return self.process.pid

    def close(self, timeout: float = REMOVE_TIMEOUT + 5.0) -> bool:
        """Close the pipe and reap the keeper (it empties and removes the cgroup); True if it did."""
        import subprocess

        _keepers.discard(self)
        with contextlib.suppress(OSError):  # a keeper already gone: nothing to tell
            self._pipe.write(_CLEAN_EXIT)
        self._pipe.close()
        try:
            return self.process.wait(timeout) == 0
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            return False


def keeper_pids() -> set[int]:
    """The keepers this process started and has not closed (the orphan sweep spares them)."""
    return {keeper.pid for keeper in _keepers}


def _drop_pipes_in_child() -> None:
    # A fork that does not exec (multiprocessing's fork start method, a plugin's os.fork) would
    # hold the write ends: a daemon started from it would keep the keepers waiting forever.
    for keeper in list(_keepers):
        keeper._pipe.close()
    _keepers.clear()


os.register_at_fork(after_in_child=_drop_pipes_in_child)


def _keep(path: str, agent_dirs: list[str]) -> int:
    """The keeper: wait for EOF on stdin, then kill, empty and remove the cgroup at ``path``; when
    the agent died (EOF without ``_CLEAN_EXIT``), remove its temporary ``agent_dirs`` too."""
    received = b""
    while True:
        try:
            data = os.read(0, 4096)
        except OSError:
            break
        if not data:
            break
        received += data
    cgroup = WorkerCgroup(path)
    cgroup.kill()
    removed = cgroup.remove()  # a failure is logged to stderr (logging's last resort)
    if _CLEAN_EXIT not in received:
        import shutil

        for directory in agent_dirs:
            shutil.rmtree(directory, ignore_errors=True)
    return 0 if removed else 1


if __name__ == "__main__":
    if sys.argv[1:2] != ["--keep"] or len(sys.argv) < 3:
        sys.exit("usage: containment.py --keep CGROUP_DIR [AGENT_TEMP_DIR ...]")
    sys.exit(_keep(sys.argv[2], sys.argv[3:]))
