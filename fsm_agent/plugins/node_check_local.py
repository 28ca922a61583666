"""Built-in plugin ``node-check-local``: node checks of this node's disks, shared memory and devices.

Three ``fsm_agent_node_check`` checks, each off by default and switched on by one option; they run
on every node before the workers of a new round start (``fsm_agent.node_checks``), and a node
that fails one is excluded from the round (class ``node_check``). Sizes are GiB (2**30 bytes),
times seconds.

``disk`` (``--node-check-disk true``): each directory the job writes to, ``--log-dir``,
``--checkpoint-dir`` and the comma-separated ``--node-check-disk-paths``, must take a small file
(created, written, fsynced and removed) and have at least ``--node-check-disk-min-free-gib`` GiB
free (default 1; what an unprivileged user may use, ``statvfs`` ``f_bavail``). A directory that does
not exist yet is checked at its nearest existing parent: the agent or the workers create it.
Without ``--log-dir`` the agent's own temporary log directory is not checked.

``shm`` (``--node-check-shm-min-gib G``, 0 or unset: off): ``/dev/shm`` (``--node-check-shm-path``)
must have at least ``G`` GiB free: NCCL, DataLoader workers and ``--checkpoint-memory`` live there,
and a container's default of 64 MiB fails them only once the job runs.

``device`` (``--node-check-device-command CMD``, empty: off): runs ``CMD`` with ``/bin/sh -c`` in a
session of its own, with ``LOCAL_WORLD_SIZE`` (``--nproc-per-node``) and ``GROUP_RANK`` in its
environment, stdout discarded. Exit 0 passes; another exit fails with the command's last stderr
line; a command still running after ``--node-check-device-timeout`` seconds (default 30, and never
past the round's ``--node-check-timeout``) fails. Either way its process group is killed when the
shell ends or times out, so nothing it started outlives the check (a command must not daemonize).
Typical site commands::

    test "$(nvidia-smi -L | grep -c '^GPU')" -ge "$LOCAL_WORLD_SIZE"   # every local rank has a GPU
    dcgmi diag -r 1                                                    # DCGM's quick diagnostic

Untested on GPUs: no GPU is lent to this project. The tests run a fake device script
(``tests/fixtures/fake_device_check.py``) that passes, lists fake GPUs for the count above, fails
with a stderr line or hangs; ``nvidia-smi`` and ``dcgmi`` themselves (their output format, their
exit codes on a sick device) are documented here, not run.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import select
import signal
import subprocess
import tempfile
import time
from typing import TYPE_CHECKING, Any

from fsm_agent.interrupts import STOP_LOOK_S, SignalStop, stop_taken
from fsm_agent.node_checks import CheckResult, CheckRound, failed
from fsm_agent.plugins import hookimpl
from fsm_agent.plugins.registry import positive_seconds

if TYPE_CHECKING:
    from fsm_agent.config import LaunchConfig, OptionRegistry

log = logging.getLogger(__name__)
PLUGIN_NAME = "node-check-local"
GIB = 2**30
#: Bytes the disk check writes into each directory (one page: enough to reach the device).
PROBE_BYTES = 4096
#: Characters of a command's stderr line kept in a reason.
STDERR_LINE_CHARS = 200


def _gib_at_least_zero(value: float) -> None:
    if not (math.isfinite(value) and value >= 0):  # NaN compares false both ways
        raise ValueError(f"expected GiB >= 0, got {value}")


#: (name, type, default, check, help); option ``name`` is flag ``--node-check-<name>`` and env
#: ``FSM_AGENT_NODE_CHECK_<NAME>`` (not the plugin's name: the three checks read as one family).
OPTIONS: tuple[tuple[str, type, Any, Any, str], ...] = (
    (
        "disk",
        bool,
        False,
        None,
        "true: check that --log-dir, --checkpoint-dir and --node-check-disk-paths are writable and have "
        "--node-check-disk-min-free-gib free",
    ),
    ("disk_min_free_gib", float, 1.0, _gib_at_least_zero, "GiB each checked directory must have free (disk check)"),
    ("disk_paths", str, "", None, "comma-separated extra directories the disk check covers"),
    ("shm_min_gib", float, 0.0, _gib_at_least_zero, "GiB that must be free in --node-check-shm-path (0: no shm check)"),
    ("shm_path", str, "/dev/shm", None, "the shared-memory mount the shm check measures"),
    ("device_command", str, "", None, "shell command that must exit 0 before the workers start (empty: none)"),
    ("device_timeout", float, 30.0, positive_seconds, "seconds the device command may take"),
)


@hookimpl
def fsm_agent_addoption(options: OptionRegistry) -> None:
    for name, kind, default, check, text in OPTIONS:
        flag = "--node-check-" + name.replace("_", "-")
        env = "FSM_AGENT_NODE_CHECK_" + name.upper()
        options.add(name, type=kind, default=default, flag=flag, env=env, check=check, help=text)


def _why(exc: OSError) -> str:
    """``exc``'s reason on one line (``Read-only file system``), without the path we name anyway."""
    return " ".join((exc.strerror or str(exc)).split())


def _free_gib(path: str) -> float:
    """GiB an unprivileged user may still write on the filesystem of ``path``."""
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize / GIB


def _existing_ancestor(path: str) -> str:
    """``path`` itself, or its nearest parent that exists (``/`` at worst)."""
    current = os.path.abspath(path)
    while not os.path.lexists(current) and os.path.dirname(current) != current:
        current = os.path.dirname(current)
    return current


class DiskCheck:
    """``disk``: each of ``paths`` writable, with at least ``min_free_gib`` GiB free."""

    name = "disk"

    def __init__(self, paths: list[str], min_free_gib: float = 1.0):
        self.paths = list(dict.fromkeys(paths))
        self.min_free_gib = min_free_gib

    @hookimpl
    def fsm_agent_node_check(self, check_round: CheckRound) -> CheckResult:
        problems, free, write_s = [], [], []
        for path in self.paths:
            problem, free_gib, seconds = self.check_path(path)
            if problem:
                problems.append(problem)
            if free_gib is not None:
                free.append(free_gib)
            write_s.append(seconds)
        measurements = {"paths": float(len(self.paths)), "write_ms": 1000 * max(write_s, default=0.0)}
        if free:
            measurements["free_gib"] = min(free)
        if problems:
            return CheckResult(check=self.name, ok=False, reason="; ".join(problems), measurements=measurements)
        return CheckResult(check=self.name, ok=True, measurements=measurements)

    def check_path(self, path: str) -> tuple[str, float | None, float]:
        """(one line naming what is wrong with ``path`` or "", its free GiB or None, seconds the write took)."""
        target = _existing_ancestor(path)
        shown = path if target == os.path.abspath(path) else f"{path} (not there yet: checked {target})"
        if not os.path.isdir(target):
            return f"{shown}: not a directory", None, 0.0
        started = time.monotonic()
        try:
            self._write_probe(target)
        except OSError as exc:
            return f"{shown}: not writable: {_why(exc)}", None, time.monotonic() - started
        seconds = time.monotonic() - started
        try:
            free_gib = _free_gib(target)
        except OSError as exc:
            return f"{shown}: cannot measure free space: {_why(exc)}", None, seconds
        if free_gib < self.min_free_gib:
            return (
                f"{shown}: {free_gib:.2f} GiB free, below --node-check-disk-min-free-gib {self.min_free_gib:g}",
                free_gib,
                seconds,
            )
        return "", free_gib, seconds

    @staticmethod
    def _write_probe(directory: str) -> None:
        # Through the filesystem to the device (fsync): a full or read-only disk, a stale NFS
        # mount or a quota shows here, not in the first checkpoint.
        fd, probe = tempfile.mkstemp(prefix=".fsm-agent-node-check-", dir=directory)
        try:
            os.write(fd, b"\0" * PROBE_BYTES)
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)


class ShmCheck:
    """``shm``: at least ``min_gib`` GiB free in the shared-memory mount ``path``."""

    name = "shm"

    def __init__(self, min_gib: float, path: str = "/dev/shm"):
        self.min_gib, self.path = min_gib, path

    @hookimpl
    def fsm_agent_node_check(self, check_round: CheckRound) -> CheckResult:
        try:
            stats = os.statvfs(self.path)
        except OSError as exc:
            return failed(self.name, f"{self.path}: cannot measure shared memory: {_why(exc)}")
        free_gib = stats.f_bavail * stats.f_frsize / GIB
        measurements = {"free_gib": free_gib, "total_gib": stats.f_blocks * stats.f_frsize / GIB}
        if free_gib < self.min_gib:
            return CheckResult(
                check=self.name,
                ok=False,
                reason=f"{self.path}: {free_gib:.2f} GiB free, below --node-check-shm-min-gib {self.min_gib:g}",
                measurements=measurements,
            )
        return CheckResult(check=self.name, ok=True, measurements=measurements)


class DeviceCheck:
    """``device``: ``command`` (``/bin/sh -c``) exits 0 within ``timeout`` seconds."""

    name = "device"

    def __init__(self, command: str, timeout: float = 30.0, local_world_size: int = 1):
        self.command, self.timeout, self.local_world_size = command, timeout, local_world_size

    @hookimpl
    def fsm_agent_node_check(self, check_round: CheckRound) -> CheckResult:
        left = check_round.seconds_left()
        timeout = min(self.timeout, left)
        env = {**os.environ, "LOCAL_WORLD_SIZE": str(self.local_world_size), "GROUP_RANK": str(check_round.group_rank)}
        started = time.monotonic()
        # stderr to a file, not a pipe: a background child that keeps it open cannot stall the check.
        with tempfile.TemporaryFile() as err:
            # A session of its own: the kill below reaches what the command started, not only the shell.
            proc = subprocess.Popen(
                ["/bin/sh", "-c", self.command],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                env=env,
                start_new_session=True,
            )
            try:
                exited = _wait_unreaped(proc.pid, timeout)
            finally:  # what it left running must not outlive the check, nor a stop signal
                _kill_group(proc.pid)
                proc.wait()
            measurements = {"command_s": time.monotonic() - started}
            if not exited:
                bound = "the node-check deadline" if left < self.timeout else "--node-check-device-timeout"
                reason = f"`{self.command}` did not finish within {timeout:.3g} s ({bound})"
                return CheckResult(check=self.name, ok=False, reason=reason, measurements=measurements)
            if proc.returncode == 0:
                return CheckResult(check=self.name, ok=True, measurements=measurements)
            last = _last_line(err)
        how = f"exited with {proc.returncode}" if proc.returncode > 0 else f"killed by signal {-proc.returncode}"
        reason = f"`{self.command}` {how}" + (f": {last}" if last else "")
        return CheckResult(check=self.name, ok=False, reason=reason, measurements=measurements)


def _wait_unreaped(pid: int, timeout: float) -> bool:
    """Whether child ``pid`` exited within ``timeout`` seconds. It is left unreaped, so its id, the
    id of its process group, cannot be reused before ``_kill_group`` ran.

    Raises:
        SignalStop: the agent took a stop signal meanwhile (as its interruptible calls do).
    """
    fd = os.pidfd_open(pid)
    deadline = time.monotonic() + timeout
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        while True:  # in slices: a stop signal to the agent must not wait for the command
            if poller.poll(max(0.0, min(STOP_LOOK_S, deadline - time.monotonic())) * 1000):
                return True
            if (stop := stop_taken()) is not None:
                raise SignalStop(stop)  # the step is cut short: the agent's next step stops it
            if time.monotonic() >= deadline:
                return False
    finally:
        os.close(fd)


def _last_line(file: Any) -> str:
    """The last non-blank line of the end of ``file``, cut to ``STDERR_LINE_CHARS``."""
    size = file.seek(0, os.SEEK_END)
    file.seek(max(0, size - 8192))
    lines = file.read().decode(errors="replace").strip().splitlines()
    return lines[-1].strip()[:STDERR_LINE_CHARS] if lines else ""


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError as exc:  # the group is gone already
        if exc.errno not in (errno.ESRCH, errno.EPERM):
            raise


def disk_paths(config: Any, options: Any) -> list[str]:
    """The directories the disk check covers: ``--log-dir``, ``--checkpoint-dir``, ``--node-check-disk-paths``."""
    paths = [getattr(config, "log_dir", None) or ""]
    paths.append(config.plugin_options("checkpoint").get("dir") or "")
    paths.extend((options.get("disk_paths") or "").split(","))
    return [path.strip() for path in paths if path.strip()]


def local_checks(config: Any) -> list[Any]:
    """The checks ``config`` switches on (none for a config without this plugin's options)."""
    if config is None:
        return []
    options = config.plugin_options(PLUGIN_NAME)
    checks: list[Any] = []
    if options.get("disk"):
        paths = disk_paths(config, options)
        if paths:
            checks.append(DiskCheck(paths, float(options.get("disk_min_free_gib", 1.0))))
        else:
            log.warning("--node-check-disk: no --log-dir, --checkpoint-dir or --node-check-disk-paths to check")
    if options.get("shm_min_gib"):
        checks.append(ShmCheck(float(options["shm_min_gib"]), options.get("shm_path") or "/dev/shm"))
    command = (options.get("device_command") or "").strip()
    if command:
        timeout = float(options.get("device_timeout") or 30.0)
        checks.append(DeviceCheck(command, timeout, int(getattr(config, "nproc_per_node", 1))))
    return checks


@hookimpl
def fsm_agent_configure(config: LaunchConfig | None, agent: Any) -> None:
    for check in local_checks(config):
        agent.plugin_manager.register(check, f"{PLUGIN_NAME}-{check.name}-{id(agent)}")
        log.info("node check %s switched on", check.name)
