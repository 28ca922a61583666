"""The ``@record`` error-file protocol (torch ``multiprocessing/errors``) and the final summary."""

from __future__ import annotations

import json
import os
import socket
import time
from collections import deque

from fsm_agent.attribution import rank_spans
from fsm_agent.worker import RunResult, WorkerFailure, signal_name


def read_error_file(path: str) -> tuple[str, str, float | None] | None:
    """(message, traceback, timestamp) from a worker's error.json, or None if it wrote none.

    Accepts torch's format ``{"message": {"message": ..., "extraInfo": {"py_callstack": ...,
    "timestamp": "<seconds>"}}}`` and the legacy one (string message, top-level timestamp).
    """
    if not path or not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    message = data.get("message", "")
    if isinstance(message, dict):
        extra = message.get("extraInfo", {}) or {}
        ts = extra.get("timestamp")
        return str(message.get("message", "")), str(extra.get("py_callstack", "")), _float(ts)
    return str(message), "", _float(data.get("timestamp"))


def _float(value) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def tail(path: str | None, lines: int = 20) -> str:
    """The last ``lines`` lines of a log file ("" if there is none)."""
    if not path or path == os.devnull or not os.path.isfile(path):
        return ""
    with open(path, errors="replace") as f:
        return "".join(deque(f, maxlen=lines)).rstrip()


def format_summary(name: str, result: RunResult) -> str:
    """The final report, root cause first; keeps torch's headings for log scrapers.

    torch's ``ChildFailedError.format_msg`` lists ``Failures:`` before ``Root Cause``; we put the
    root cause first, since that is where a reader looks.
    """
    width = 72
    if result.drain is not None and result.signal is None:  # an orderly stop, not a failure
        return "\n".join(
            [
                "=" * width,
                f"{name} DRAINED ({result.drain} scope)",
                "-" * width,
                f"Verdict: {result.verdict or 'drained'}",
                "=" * width,
            ]
        )
    lines = ["=" * width, f"{name} FAILED", "-" * width]
    if result.verdict:  # what the restart policy decided, e.g. "no restarts left (max_restarts=3)"
        lines += [f"Verdict: {result.verdict}", "-" * width]
    if result.job_verdict is not None and result.signal is None:
        return "\n".join(lines + _job_verdict_lines(result, width))
    cause = result.root_cause
    if cause is None or result.signal is not None:
        # A stop signal ends the job whatever failed before it (an attempt between its failure and
        # its restart): the signal is the cause; that failure is listed below it.
        lines += ["Root Cause (first observed failure):", f"  {result.error or 'agent stopped'}"]
        if result.signal is not None:
            what = (
                "and stopped its workers"
                if result.stopped_workers
                else "while no worker ran (in a rendezvous, between attempts or in the exit barrier)"
            )
            lines.append(f"  agent received signal {result.signal} ({signal_name(-result.signal)}) {what}")
        if not result.failures:
            lines.append("=" * width)
            return "\n".join(lines)
        return "\n".join(
            lines + _failures_section(sorted(result.failures.values(), key=lambda f: f.global_rank), width)
        )
    lines += ["Root Cause (first observed failure):"] + _entry(cause)
    others = [f for f in sorted(result.failures.values(), key=lambda f: f.global_rank) if f is not cause]
    return "\n".join(lines + _failures_section(others, width))


def _failures_section(others: list[WorkerFailure], width: int) -> list[str]:
    """torch's ``Failures:`` block: every other failure in full, or ``<NO_OTHER_FAILURES>``."""
    lines = ["-" * width, "Failures:"]
    for failure in others:
        lines += _entry(failure)
    if not others:
        lines.append("  <NO_OTHER_FAILURES>")
    return [*lines, "=" * width]


def _job_verdict_lines(result: RunResult, width: int) -> list[str]:
    """The job's verdict (``fsm_agent.job_verdict``), the same on every node: its root cause first
    (this node's entry when the rank ran here, else what its node reported), the collateral ranks
    as one line, then this node's other failures that were not collateral."""
    verdict = result.job_verdict or {}
    reports = {int(r["global_rank"]): r for r in verdict.get("reports", ())}
    classes = {int(rank): cls for rank, cls in dict(verdict.get("classes", {})).items()}
    reasons = {int(rank): why for rank, why in dict(verdict.get("reasons", {})).items()}
    roots = [int(rank) for rank in verdict.get("root_causes", ())]
    # torch's heading, which log scrapers look for; the root cause is the job's verdict's
    lines = [
        "Root Cause (first observed failure):",
        f"  (the job's verdict, decided by {verdict.get('decided_by', '?')}: the first failure of its own,"
        " not one a peer's failure caused)",
    ]
    if not roots:
        lines.append(f"  {verdict.get('summary') or 'unknown'}")
    for rank in roots:
        if rank in result.failures:
            lines += _entry(result.failures[rank])
        elif rank in reports:
            lines += _reported_entry(reports[rank])
        else:
            lines += [f"[{rank}]:", f"  rank      : {rank}", f"  reason    : {reasons.get(rank, '')}"]
    if result.error:  # what this agent saw (e.g. the store, unreachable, naming its endpoint)
        lines.append(f"  seen here : {result.error}")
    collateral = sorted(rank for rank, cls in classes.items() if cls == "collateral")
    if collateral:
        lines += [
            "-" * width,
            f"Collateral: rank{'s' if len(collateral) > 1 else ''} {rank_spans(collateral)} failed because the root cause did",
        ]
    others = [
        f
        for f in sorted(result.failures.values(), key=lambda f: f.global_rank)
        if f.global_rank not in roots and classes.get(f.global_rank) != "collateral"
    ]
    return lines + _failures_section(others, width)


def _reported_entry(report: dict) -> list[str]:
    """A root cause that ran on another node, from its node's report."""
    code = int(report.get("exitcode", 1))
    text = f"{code} ({signal_name(code)})" if code < 0 else str(code)
    when = time.strftime("%Y-%m-%d_%H:%M:%S", time.localtime(float(report.get("time", 0))))
    out = [
        f"[{report['global_rank']}]:",
        f"  rank      : {report['global_rank']} (local_rank: {report.get('local_rank')}, on another node)",
        f"  exitcode  : {text}",
    ]
    if report.get("message"):
        out.append(f"  message   : {report['message']}")
    if report.get("tail"):
        out += ["  traceback :"] + ["    " + line for line in str(report["tail"]).splitlines()]
    out += [
        f"  host      : {report.get('hostname', '')} (group_rank {report.get('group_rank')})",
        f"  time      : {when}",
        f"  class     : {report.get('failure_class', '')}",
    ]
    return out


def _entry(f: WorkerFailure) -> list[str]:
    """One failure: rank, exit code, message and traceback first; where and when after."""
    when = time.strftime("%Y-%m-%d_%H:%M:%S", time.localtime(f.timestamp))
    code = f.exitcode_text
    out = [
        f"[{f.global_rank}]:",
        f"  rank      : {f.global_rank} (local_rank: {f.local_rank}, role_rank: {f.role_rank})",
        f"  exitcode  : {code} (pid: {f.pid})",
    ]
    if f.message:
        out.append(f"  message   : {f.message.splitlines()[0]}")
    if f.traceback:
        out.append("  traceback :")
        out += ["    " + line for line in f.traceback.rstrip().splitlines()]
    elif f.exitcode < 0:  # @record cannot help: a process killed by a signal runs no more Python
        sender = " (the kernel's OOM killer sends it too: see dmesg)" if f.signal_name == "SIGKILL" else ""
        out.append(f"  traceback : none: killed by {f.signal_name}{sender}, the worker could not record one")
    else:
        out.append("  traceback : none recorded (decorate main with torch's @record, or redirect stderr with -r 2)")
    out += [
        f"  host      : {f.hostname}",
        f"  time      : {when}",
        f"  class     : {f.failure_class}",
        f"  error_file: {_error_file_text(f.error_file)}",
    ]
    return out


def _error_file_text(path: str) -> str:
    """The path, or what became of it: the summary is printed after a temporary log dir is removed."""
    if not path or path == "<N/A>" or os.path.exists(path):
        return path
    return (
        f"{path} (removed at exit with the temporary log directory; its message and traceback are above; "
        f"--log-dir DIR keeps it)"
    )


def propagate_to_parent(result: RunResult, name: str) -> None:
    """Copy the root cause into our own ``TORCHELASTIC_ERROR_FILE`` when an outer launcher set one.

    Mirrors torch's ``record`` handling of ``ChildFailedError``: the child's error.json is copied
    with ``errorCode`` set to the exit code; without one, a torch-format file is written.
    """
    parent_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not parent_file or not result.is_failed():
        return
    cause = result.root_cause
    data = None
    if cause is not None and cause.error_file and os.path.isfile(cause.error_file):
        try:
            with open(cause.error_file) as f:
                data = json.load(f)
            if isinstance(data.get("message"), dict):
                data["message"]["errorCode"] = cause.exitcode
        except (OSError, ValueError):
            data = None
    if data is None:
        text = cause.message if cause is not None else (result.error or "agent failed")
        data = {
            "message": {
                "message": f"{name} FAILED: {text}",
                "extraInfo": {
                    "py_callstack": cause.traceback if cause is not None else "",
                    "timestamp": str(int(time.time())),
                },
            }
        }
    os.makedirs(os.path.dirname(parent_file) or ".", exist_ok=True)
    with open(parent_file, "w") as f:
        json.dump(data, f)


def hostname() -> str:
    return socket.getfqdn()
