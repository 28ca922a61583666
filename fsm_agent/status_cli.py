"""``fsm-agent status URL [--watch] [--interval S] [--json]``: a running agent's live status as tables.

Reads ``/status`` from the endpoint ``fsm-agent run --status-port PORT`` serves (plugin
``fsm_agent.plugins.status_http``). ``URL`` may be ``http://127.0.0.1:PORT``, ``127.0.0.1:PORT``,
``:PORT`` or just ``PORT``; ``/status`` is added when the URL has no path. ``--watch`` redraws
every ``--interval`` seconds until Ctrl-C (exit 130) or until the agent goes away (exit 0).

Output uses rich when it is installed, plain aligned text otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from fsm_agent.argparsing import OneLineParser
from fsm_agent.errors import ConfigError, FsmAgentError

#: Seconds to wait for one answer.
REQUEST_TIMEOUT_S = 5.0


class StatusUnavailable(FsmAgentError):
    """The status endpoint did not answer (agent not running, no --status-port, wrong port)."""

    exit_code = 1


def status_url(url: str) -> str:
    """Normalise a user-given endpoint to the full ``/status`` URL.

    Raises:
        ConfigError: not an http URL, host:port or port.
    """
    text = url.strip()
    if text.isdigit():
        text = f"127.0.0.1:{text}"
    elif text.startswith(":") and text[1:].isdigit():
        text = f"127.0.0.1{text}"
    if "://" not in text:
        text = f"http://{text}"
    parts = urlsplit(text)
    try:
        port_ok = parts.port is not None or parts.hostname is not None
    except ValueError:
        port_ok = False
    if parts.scheme != "http" or not parts.hostname or not port_ok:
        raise ConfigError(
            f"fsm-agent status {url!r}: expected the agent's status URL, e.g. "
            f"http://127.0.0.1:8600 or 127.0.0.1:8600 (see fsm-agent run --status-port)"
        )
    path = parts.path if parts.path not in ("", "/") else "/status"
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def fetch_status(url: str, timeout: float = REQUEST_TIMEOUT_S, token: str | None = None) -> dict[str, Any]:
    """GET the ``/status`` document (``timeout`` in seconds), sending ``Authorization: Bearer
    TOKEN`` when ``token`` is given (an agent off loopback answers only with it).

    Raises:
        StatusUnavailable: nothing answers, the agent refused the request (401/403), or the answer
            is not the status JSON.
    """
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read()
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            fix = "check the token file" if token else "give --status-token-file FILE (the agent's token)"
            raise StatusUnavailable(
                f"{url}: HTTP {exc.code} {exc.reason}: the agent refused the request; {fix}"
            ) from None
        raise StatusUnavailable(f"{url}: HTTP {exc.code} {exc.reason}; is this an fsm-agent status endpoint?") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise StatusUnavailable(f"cannot reach {url}: {reason}; is the agent running with --status-port?") from None
    try:
        doc = json.loads(body)
    except ValueError:
        raise StatusUnavailable(f"{url}: the answer is not JSON; is this an fsm-agent status endpoint?") from None
    if not isinstance(doc, dict) or "state" not in doc:
        raise StatusUnavailable(f"{url}: the answer has no 'state'; is this an fsm-agent status endpoint?")
    return doc


# ------------------------------------------------------------------------------------------------
# Rendering
# ------------------------------------------------------------------------------------------------


def _text(value: Any) -> str:
    return "-" if value is None else str(value)


def summary_rows(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) lines of the summary."""
    members = doc.get("membership", {})
    agent = doc.get("agent", {})
    drain = doc.get("drain")  # counted apart from the restarts: a drain is not a failure
    drains = (
        [
            (
                "drain",
                f"{drain.get('scope')} scope, requested by {drain.get('source')} {drain.get('by') or ''}".rstrip()
                + (
                    ""
                    if drain.get("checkpointed") is None
                    else f", {'checkpointed' if drain['checkpointed'] else 'not every worker checkpointed'}"
                ),
            )
        ]
        if isinstance(drain, dict)
        else []
    )
    standby = doc.get("standby")
    verdict = doc.get("verdict")  # the job failed: its root cause, the same on every node
    verdicts = (
        [
            (
                "verdict",
                f"{verdict.get('summary')} (exit code {verdict.get('exit_code')}, decided by {verdict.get('decided_by')})",
            )
        ]
        if isinstance(verdict, dict)
        else []
    )
    return [
        *verdicts,
        *checkpoint_rows(doc),
        ("state", f"{doc['state']} for {doc.get('time_in_state_s', 0):.1f}s" + (" (standby)" if standby else "")),
        *([("standby", standby)] if standby else []),
        (
            "restarts",
            f"{doc.get('restart_count')} used, {doc.get('remaining_restarts')} left (max {doc.get('max_restarts')})",
        ),
        *drains,
        ("rendezvous round", _text(doc.get("rendezvous_round"))),
        ("run id", _text(members.get("run_id"))),
        (
            "node",
            f"group rank {_text(members.get('group_rank'))} of {_text(members.get('group_world_size'))} "
            f"(nnodes {members.get('min_nodes')}:{members.get('max_nodes')}, "
            f"{_text(members.get('rdzv_backend'))} {_text(members.get('rdzv_endpoint'))})",
        ),
        ("master", f"{_text(members.get('master_addr'))}:{_text(members.get('master_port'))}"),
        (
            "agent",
            f"pid {_text(agent.get('pid'))} on {_text(agent.get('node'))}, "
            f"up {agent.get('uptime_s', 0):.1f}s, {_text(agent.get('entrypoint'))}",
        ),
    ]


def checkpoint_rows(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """The agent-held checkpoints' lines (``/status``'s ``checkpoints``; none when the plugin is off):
    the last restore (step, source per rank), what is on disk, a persistence error."""
    view = doc.get("checkpoints")
    if not isinstance(view, dict):
        return []
    restore = view.get("restore") or {}
    if restore.get("step") is None:
        restored = f"none ({restore.get('reason') or 'no round yet'})"
    else:
        sources = ", ".join(f"rank {r['global_rank']} from {r['source']}" for r in restore.get("ranks", []))
        restored = f"step {restore['step']}: {sources or 'no local rank'}"
    persisted = view.get("persisted") or {}
    rows = [("checkpoint restore", restored)]
    if view.get("dir"):
        on_disk = ", ".join(f"rank {g} step {s}" for g, s in persisted.items()) or "nothing yet"
        rows.append(("checkpoint disk", f"{view['dir']}: {on_disk}"))
    if view.get("persist_error"):
        rows.append(("checkpoint error", str(view["persist_error"])))
    return rows


WORKER_COLUMNS = ("local_rank", "global_rank", "role_rank", "pid", "state", "exit_code")
TRANSITION_COLUMNS = ("time", "source", "dest", "trigger", "in source", "restarts", "error")
CYCLE_COLUMNS = ("attempt", "start", "last step", "checkpoint", "failure", "progress", "no progress")
#: "ratio" is of the time judged: "compute/step" where workers report compute time, else "step time"
#: (in lockstep training the step time is the same on every rank; only compute time tells them apart).
STEP_TIME_COLUMNS = (
    "global_rank",
    "local_rank",
    "node_rank",
    "host",
    "step time",
    "compute/step",
    "ratio",
    "straggler",
)


def worker_rows(doc: dict[str, Any]) -> list[list[str]]:
    return [[_text(w.get(c)) for c in WORKER_COLUMNS] for w in doc.get("workers", [])]


def transition_rows(doc: dict[str, Any]) -> list[list[str]]:
    rows = []
    for t in doc.get("transitions", []):
        clock = time.strftime("%H:%M:%S", time.localtime(t["ts"])) if t.get("ts") else "-"
        rows.append(
            [
                clock,
                t.get("source", "-"),
                t.get("dest", "-"),
                t.get("trigger", "-"),
                f"{t.get('duration_s', 0):.2f}s",
                _text(t.get("restart_count")),
                t.get("error") or "",
            ]
        )
    return rows


def cycle_rows(doc: dict[str, Any]) -> list[list[str]]:
    """One row per restart cycle (``/status``'s ``cycles``; older agents have none)."""
    rows = []
    for c in doc.get("cycles", []):
        clock = time.strftime("%H:%M:%S", time.localtime(c["start"])) if c.get("start") else "-"
        rows.append(
            [
                _text(c.get("attempt")),
                clock,
                _text(c.get("last_step")),
                _text(c.get("checkpoint_step")),
                c.get("failure_class") or "succeeded",
                "yes" if c.get("progress") else "no",
                _text(c.get("no_progress_cycles")),
            ]
        )
    return rows


def step_time_rows(doc: dict[str, Any]) -> list[list[str]]:
    """One row per rank of ``/status``'s ``step_times`` (``--straggler-window``; else none)."""
    rows = []
    for r in (doc.get("step_times") or {}).get("ranks", []):
        rows.append(
            [
                _text(r.get("global_rank")),
                _text(r.get("local_rank")),
                _text(r.get("node_rank")),
                _text(r.get("host")),
                f"{r['step_time_s']:.4f}s" if r.get("step_time_s") is not None else "-",
                f"{r['compute_s']:.4f}s" if r.get("compute_s") is not None else "-",
                f"{r['ratio']:.2f}x" if r.get("ratio") is not None else "-",
                "yes" if r.get("straggler") else "",
            ]
        )
    return rows


def _step_time_title(doc: dict[str, Any]) -> str:
    times = doc.get("step_times") or {}
    median = times.get("median_s")
    judged = "compute time per step" if times.get("basis") == "compute" else "step time"
    return (
        f"step times (job median {judged} {median:.4f}s; ratio: each rank's {judged} to it; straggler "
        f"above {times.get('factor')}x for {times.get('windows')} windows)"
        if median is not None
        else "step times (no job median yet)"
    )


def _tables(doc: dict[str, Any]) -> list[tuple[str, tuple[str, ...], list[list[str]]]]:
    tables = [("workers", WORKER_COLUMNS, worker_rows(doc)), ("transitions", TRANSITION_COLUMNS, transition_rows(doc))]
    if doc.get("cycles"):
        tables.append(("cycles", CYCLE_COLUMNS, cycle_rows(doc)))
    if doc.get("step_times"):
        tables.append((_step_time_title(doc), STEP_TIME_COLUMNS, step_time_rows(doc)))
    return tables


def render_plain(doc: dict[str, Any], url: str) -> str:
    """The status as plain aligned text (no rich)."""
    lines = [f"fsm-agent status  {url}"]
    width = max(len(label) for label, _ in summary_rows(doc))
    lines += [f"  {label:<{width}}  {value}" for label, value in summary_rows(doc)]
    for title, columns, rows in _tables(doc):
        lines += ["", title]
        widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(columns)]
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip())
        lines += ["  " + "  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines) + "\n"


_STATE_STYLE = {
    "HEALTHY": "green",
    "SUCCEEDED": "bold green",
    "UNHEALTHY": "yellow",
    "STOPPED": "yellow",
    "INIT": "cyan",
    "FAILED": "bold red",
    "UNKNOWN": "bold red",
}
_WORKER_STYLE = {"running": "green", "succeeded": "green", "failed": "red", "stopped": "yellow", "pending": "cyan"}


def render_rich(doc: dict[str, Any], url: str) -> Any:
    """The status as a rich renderable (a summary grid, the workers and the transitions tables)."""
    from rich.console import Group
    from rich.table import Table

    summary = Table.grid(padding=(0, 2))
    summary.add_column(style="bold")
    summary.add_column()
    for label, value in summary_rows(doc):
        style = _STATE_STYLE.get(doc["state"], "") if label == "state" else ""
        summary.add_row(label, f"[{style}]{value}[/]" if style else value)

    workers = Table(title="workers", title_justify="left")
    for column in WORKER_COLUMNS:
        workers.add_column(column, justify="right" if column != "state" else "left")
    for row in worker_rows(doc):
        workers.add_row(*row, style=_WORKER_STYLE.get(row[4], ""))

    transitions = Table(title=f"last transitions ({doc.get('transitions_total', 0)} in all)", title_justify="left")
    for column in TRANSITION_COLUMNS:
        transitions.add_column(column)
    for row in transition_rows(doc):
        transitions.add_row(*row, style="red" if row[-1] else "")
    parts = [f"[bold]fsm-agent status[/]  {url}", summary, workers, transitions]
    if doc.get("cycles"):
        cycles = Table(title="restart cycles", title_justify="left")
        for column in CYCLE_COLUMNS:
            cycles.add_column(column)
        for row in cycle_rows(doc):
            cycles.add_row(*row, style="red" if row[5] == "no" else "")
        parts.append(cycles)
    if doc.get("step_times"):
        steps = Table(title=_step_time_title(doc), title_justify="left")
        for column in STEP_TIME_COLUMNS:
            steps.add_column(column)
        for row in step_time_rows(doc):
            steps.add_row(*row, style="red" if row[-1] else "")
        parts.append(steps)
    return Group(*parts)


def _have_rich() -> bool:
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


# ------------------------------------------------------------------------------------------------
# The command
# ------------------------------------------------------------------------------------------------


def _positive_seconds(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {raw!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {raw!r}")
    return value


def get_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="fsm-agent status",
        description="Show a running agent's live status, read from the endpoint that "
        "'fsm-agent run --status-port PORT' serves on 127.0.0.1.",
    )
    parser.add_argument("url", help="the endpoint: http://127.0.0.1:PORT, 127.0.0.1:PORT or PORT")
    parser.add_argument("--watch", action="store_true", help="redraw every --interval seconds until Ctrl-C")
    parser.add_argument(
        "--interval",
        type=_positive_seconds,
        default=1.0,
        metavar="SECONDS",
        help="seconds between redraws with --watch (default: 1)",
    )
    parser.add_argument("--json", action="store_true", help="print the raw /status JSON")
    parser.add_argument(
        "--status-token-file",
        metavar="PATH",
        default=None,
        help="file holding the agent's bearer token (its --status-token-file): needed off loopback",
    )
    return parser


def cli_main(argv: Sequence[str] | None = None) -> int:
    """``fsm-agent status URL [--watch] [--interval S] [--json] [--status-token-file PATH]``."""
    from fsm_agent.plugins.status_http import read_token

    args = get_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    url = status_url(args.url)
    token = read_token(args.status_token_file) if args.status_token_file else None
    if not args.watch:
        doc = fetch_status(url, token=token)
        _print(doc, url, as_json=args.json)
        return 0
    return _watch(url, args.interval, as_json=args.json, token=token)


def _print(doc: dict[str, Any], url: str, as_json: bool) -> None:
    if as_json:
        print(json.dumps(doc, indent=2))
    elif _have_rich():
        from rich.console import Console

        Console().print(render_rich(doc, url))
    else:
        sys.stdout.write(render_plain(doc, url))


def _gone(url: str, doc: dict[str, Any]) -> str:
    """The watch's last line once the agent stopped answering."""
    if doc["state"] in ("SUCCEEDED", "FAILED", "UNKNOWN"):
        return f"{url}: the run ended {doc['state']}"
    return (
        f"{url} stopped answering; the last state it reported was {doc['state']} (the agent ended or died "
        f"after that: its exit code and summary say how)"
    )


def _watch(url: str, interval: float, as_json: bool, token: str | None = None) -> int:
    """Redraw until the agent stops answering after it answered (exit 0); Ctrl-C raises
    KeyboardInterrupt (the CLI exits 130, as for every command).

    Into a pipe or file (stdout not a terminal) each redraw is printed and flushed in full: a live
    display (rich's) would only print once the watch ends.
    """
    doc = fetch_status(url, token=token)  # unreachable from the start: an error
    if as_json or not _have_rich() or not sys.stdout.isatty():
        while True:
            _print(doc, url, as_json)
            sys.stdout.flush()
            time.sleep(interval)
            try:
                doc = fetch_status(url, token=token)
            except StatusUnavailable:
                print(f"fsm-agent status: {_gone(url, doc)}")
                return 0
    from rich.live import Live

    with Live(render_rich(doc, url), auto_refresh=False) as live:
        while True:
            time.sleep(interval)
            try:
                doc = fetch_status(url, token=token)
            except StatusUnavailable:
                live.console.print(f"[yellow]{_gone(url, doc)}[/]")
                return 0
            live.update(render_rich(doc, url), refresh=True)
