"""The ``@record`` error-file protocol (torch ``multiprocessing/errors``) and the final summary."""

from __future__ import annotations

import json
import os
import socket
import time
from collections import deque

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
    cause = result.root_cause
    if cause is None:
        lines += ["Root Cause (first observed failure):", f"  {result.error or 'agent stopped'}"]
        if result.signal is not None:
            what = (
                "and stopped its workers"
                if result.stopped_workers
                else "while no worker ran (in a rendezvous, between attempts or in the exit barrier)"
            )
            lines.append(f"  agent received signal {result.signal} ({signal_name(-result.signal)}) {what}")
        lines.append("=" * width)
        return "\n".join(lines)
    lines += ["Root Cause (first observed failure):"] + _entry(cause)
    others = [f for f in sorted(result.failures.values(), key=lambda f: f.global_rank) if f is not cause]
    lines += ["-" * width, "Failures:"]
    if others:
        for failure in others:
            lines += _entry(failure)
    else:
        lines.append("  <NO_OTHER_FAILURES>")
    lines.append("=" * width)
    return "\n".join(lines)


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
