"""What failed workers are, as ``WorkerFailure`` records: built from exits, hangs and health checks.

The agent's deciding step (``ElasticAgent._decide_on_failed_workers``) asks these for the failures
it hands the restart policy; each reads what the node has (``@record`` error files, stderr tails,
py-spy or faulthandler stacks) and never changes the group.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import time
from collections.abc import Mapping
from typing import Any

from fsm_agent import errorfile
from fsm_agent.hang import announce_stack_dump, dump_stacks
from fsm_agent.logs import WorkerLogs
from fsm_agent.stack_dump import DUMP_SIGNAL, catches, running, signal_main_thread
from fsm_agent.states.facts import HealthCheckFailed
from fsm_agent.worker import HANG_EXIT_CODE, HEALTH_CHECK_EXIT_CODE, FailureClass, WorkerFailure, WorkerGroup

log = logging.getLogger(__name__)
STACK_DUMP_WAIT_S = 5.0  # at most this long for a hung worker to write its stacks (and, aborted, exit)
DUMP_POLL_S = 0.02
#: With more than one node, a hung worker dumped without dying is killed only this long (seconds,
#: at least two monitor intervals) after its dump was asked for: the other nodes' agents see the
#: same hang within a monitor interval or so, and dump their ranks meanwhile.
HANG_KILL_HOLD_S = 1.0


def exit_failures(
    group: WorkerGroup,
    worker_logs: Mapping[int, WorkerLogs],
    hostname: str,
    failed: Mapping[int, int],
    times: Mapping[int, float],
) -> dict[int, WorkerFailure]:
    """The failed workers (``{local_rank: exitcode}``, exit ``times`` in seconds since the epoch)
    as ``{global_rank: WorkerFailure}``, with what their ``@record`` error files say (torch's
    ``ProcessFailure``)."""
    failures = {}
    for local_rank, code in failed.items():
        worker = group.workers[local_rank]
        wlogs = worker_logs.get(local_rank)
        error_file = wlogs.error_file if wlogs else ""
        parsed = errorfile.read_error_file(error_file)
        if parsed is not None:
            message, trace, error_ts = parsed
        else:
            message = (
                f"Signal {-code} ({signal.Signals(-code).name}) received by PID {worker.id}"
                if code < 0
                else f"exited with code {code}"
            )
            trace, error_ts = errorfile.tail(wlogs.stderr if wlogs else None), None
        failures[worker.global_rank] = WorkerFailure(
            local_rank=local_rank,
            global_rank=worker.global_rank,
            role_rank=worker.role_rank,
            pid=worker.id,
            exitcode=code,
            timestamp=times.get(local_rank, time.time()),
            error_file=error_file if parsed is not None else "<N/A>",
            message=message,
            traceback=trace,
            hostname=hostname,
            failure_class=FailureClass.SIGNAL if code < 0 else FailureClass.EXIT_CODE,
            error_timestamp=error_ts,
        )
    return failures


def failures_of(
    group: WorkerGroup,
    worker_logs: Mapping[int, WorkerLogs],
    hostname: str,
    exits: Mapping[int, int],
    exit_times: Mapping[int, float],
    unhealthy: tuple[HealthCheckFailed | None, Mapping[int, str], Mapping[int, str]] | None = None,
) -> dict[int, WorkerFailure]:
    """The failed workers a ``workers_failed`` fact is about: its non-zero ``exits`` (error files read
    now), or, when the group is UNHEALTHY (``unhealthy``: the health check's problem, else the hung
    workers and their stacks), every worker of the unhealthy node, or the hung ones.

    Raises:
        ValueError: no ``unhealthy`` and no failed exit (``workers_failed`` from HEALTHY needs them).
    """
    if unhealthy is not None:
        problem, hung, stacks = unhealthy
        if problem is not None:
            return health_failures(group, hostname, problem)
        return hang_failures(group, worker_logs, hostname, hung, stacks)
    failed = {r: c for r, c in exits.items() if c != 0}
    if not failed:
        raise ValueError("workers_failed needs the failed workers' exits={local_rank: exitcode}")
    return exit_failures(group, worker_logs, hostname, failed, exit_times)


def health_failures(group: WorkerGroup, hostname: str, problem: HealthCheckFailed) -> dict[int, WorkerFailure]:
    """A node found unhealthy fails every local worker (class ``health_check``, or the class the
    health check names, e.g. ``straggler``)."""
    kind = problem.failure_class
    what = "health check" if kind == FailureClass.HEALTH_CHECK else kind
    cause, now = problem.global_rank, time.time()
    # The named worker (a straggler) failed first: the others fail because of it, so the
    # verdict (first_failure: earliest, then lowest rank) names it, not the lowest local rank.
    return {
        worker.global_rank: WorkerFailure(
            local_rank=worker.local_rank,
            global_rank=worker.global_rank,
            role_rank=worker.role_rank,
            pid=worker.id,
            exitcode=HEALTH_CHECK_EXIT_CODE,
            timestamp=now if cause in (None, worker.global_rank) else now + 1e-3,
            message=f"{what}: {problem.problem}",
            hostname=hostname,
            failure_class=kind,
        )
        for worker in group.workers
    }


def hang_failures(
    group: WorkerGroup,
    worker_logs: Mapping[int, WorkerLogs],
    hostname: str,
    hung: Mapping[int, str],
    stacks: Mapping[int, str],
) -> dict[int, WorkerFailure]:
    """Each hung worker (``{local_rank: why}``) fails (class ``hang``), with the ``stacks``
    ``dump_hung_stacks`` found."""
    failures = {}
    for local_rank, why in hung.items():
        worker = group.workers[local_rank]
        wlogs = worker_logs.get(local_rank)
        # py-spy's stacks, else the faulthandler dump at the end of its stderr file (where it is
        # stuck is what the attribution reads: inside torch.distributed, it waits for a peer)
        dumped = errorfile.tail(wlogs.stderr, 60) if wlogs and wlogs.stderr else ""
        trace = stacks.get(local_rank) or (
            dumped if "most recent call first" in dumped else "(faulthandler stack dump on the worker's stderr)"
        )
        failures[worker.global_rank] = WorkerFailure(
            local_rank=local_rank,
            global_rank=worker.global_rank,
            role_rank=worker.role_rank,
            pid=worker.id,
            exitcode=HANG_EXIT_CODE,
            timestamp=time.time(),
            message=f"hang: {why}",
            traceback=trace,
            hostname=hostname,
            failure_class=FailureClass.HANG,
        )
    return failures


def dump_hung_stacks(
    launcher: Any, worker_logs: Mapping[int, WorkerLogs], hung: Mapping[int, str], role: str, hold_s: float = 0.0
) -> dict[int, str]:
    """Record where each hung worker is stuck: py-spy if installed, else faulthandler; returns
    ``{local_rank: stacks}`` of those whose stacks were read (also written to ``stacks.txt``
    beside the worker's logs).

    Without py-spy, a worker that registered ``stack_dump.DUMP_SIGNAL`` and writes its stderr to
    a file prints its stacks there on that signal and lives on; it is killed (SIGKILL) once its
    dump is complete and ``hold_s`` seconds have passed since the signals: the agents of the
    other nodes, which see the same hang about as soon, dump their ranks before a death here
    wakes them (``fsm_agent.stack_dump``). Any other worker gets SIGABRT, and
    ``PYTHONFAULTHANDLER=1`` makes Python dump (to its stderr, not ``stacks.txt``) before it dies.
    Only the process the launcher started dumps, as with py-spy: a wrapper shows its own stacks,
    not those of a trainer it runs as a child. At most ``STACK_DUMP_WAIT_S`` s, plus the hold.
    """
    found, pids, aborted, dumping = {}, launcher.pids(), [], {}
    for local_rank, why in hung.items():
        pid = pids[local_rank]
        log.warning("[%s] local_rank %s (pid %s) is hung: %s", role, local_rank, pid, why)
        stacks = dump_stacks(pid)
        wlogs = worker_logs.get(local_rank)
        stderr = wlogs.stderr if wlogs and wlogs.stderr and os.path.isfile(wlogs.stderr) else None
        if stacks:
            found[local_rank] = stacks
            log.warning("stacks of local_rank %s:\n%s", local_rank, stacks)
        elif stderr and DUMP_SIGNAL is not None and catches(pid, DUMP_SIGNAL):
            announce_stack_dump(stderr, local_rank, pid, fatal=False)
            dumping[local_rank] = (pid, stderr, os.path.getsize(stderr))
        else:
            announce_stack_dump(stderr, local_rank, pid)
            aborted.append(local_rank)
    deadline = time.monotonic() + STACK_DUMP_WAIT_S
    held_until = time.monotonic() + hold_s
    try:
        # Every hung worker dumps at the same instant: one after the other, a worker would die of
        # the dump before the next dumped, and the next be caught failing because of it.
        for pid, _, _ in dumping.values():
            with contextlib.suppress(ProcessLookupError):
                signal_main_thread(pid, DUMP_SIGNAL)  # type: ignore[arg-type]  # not None: checked above
        for local_rank in aborted:
            launcher.signal_worker(local_rank, signal.SIGABRT)
        _await_dumps(dumping, deadline)
        if dumping or found:
            time.sleep(max(0.0, held_until - time.monotonic()))
        for local_rank, (_, path, offset) in dumping.items():  # read last: the longest it will be
            text = _read_from(path, offset)
            if "most recent call first" in text:
                found[local_rank] = text
    finally:
        for local_rank in dumping:
            launcher.signal_worker(local_rank, signal.SIGKILL)
    for local_rank, stacks in found.items():
        wlogs = worker_logs.get(local_rank)
        if wlogs is not None and wlogs.error_file:
            with open(os.path.join(os.path.dirname(wlogs.error_file), "stacks.txt"), "w") as f:
                f.write(stacks)
    # Let faulthandler finish writing before the group's SIGTERM can cut the dump short.
    for local_rank in aborted:
        exit_fds = [fd for fd, rank in launcher.wait_fds().items() if rank == local_rank]
        if exit_fds:
            select.select(exit_fds, [], [], max(0.0, deadline - time.monotonic()))
    return found


def _await_dumps(dumping: Mapping[int, tuple[int, str, int]], deadline: float) -> None:
    """Wait until each worker in ``dumping`` (``{local_rank: (pid, stderr path, offset)}``) has
    written its whole dump after ``offset`` (the signalled main thread's block, ``Current
    thread``, comes last) and the file stopped growing, or its process died without one, or
    ``deadline`` (``time.monotonic()``) passed."""
    sizes: dict[int, int] = {}
    waiting = set(dumping)
    while waiting and time.monotonic() < deadline:
        time.sleep(DUMP_POLL_S)
        for local_rank in sorted(waiting):
            pid, path, offset = dumping[local_rank]
            size = os.stat(path).st_size if os.path.isfile(path) else -1
            # done: stable since the last poll, and complete, or it died before the signal came
            if size == sizes.get(local_rank) and ("Current thread" in _read_from(path, offset) or not running(pid)):
                waiting.discard(local_rank)
            sizes[local_rank] = size


def _read_from(path: str, offset: int) -> str:
    try:
        with open(path, errors="replace") as f:
            f.seek(offset)
            return f.read()
    except OSError:
        return ""
