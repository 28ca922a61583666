"""Built-in live status: an opt-in HTTP endpoint on 127.0.0.1 (``--status-port PORT``).

Off unless a port is configured (``--status-port``, ``FSM_AGENT_STATUS_PORT`` or
``[plugins.status-http] port`` in the config file; ``0`` picks a free port). The agent then
prints ``fsm-agent: status at http://127.0.0.1:PORT/status`` on stderr and serves, from a
daemon thread of the standard library's ``ThreadingHTTPServer``:

- ``GET /status``: JSON: the group's state and seconds in it, restart_count and remaining
  restarts, the rendezvous round, membership (group rank and world size, master address, the
  rendezvous endpoint as bound: a standalone agent's real port, not ``127.0.0.1:0``), one
  entry per worker (pid, ranks, state, exit code), the last transitions
  (``?transitions=N``, default 20, at most 100) and the last restart cycles (``cycles``: attempt,
  start, end, last step, checkpoint step, failure class, progress; ``fsm_agent.progress.Cycle``)
  and, with ``--straggler-window``, ``step_times`` (the job's median step time, each rank's step
  time and ratio to it, the stragglers; ``fsm_agent.plugins.straggler``), else null.
- ``GET /statechart``: the Mermaid statechart (``fsm_agent.states.statechart``) with the
  current state highlighted (``class <STATE> current``).
- ``GET /healthz``: ``ok``.
- ``POST /drain`` (``?scope=node`` or ``?scope=job``; default ``--drain-scope``): ask the agent to
  drain (the ``drain`` plugin; docs/failure-handling.md "Drain"); ``202`` with the request, ``409``
  when a drain is already under way.

Who may ask. On loopback (the default, ``127.0.0.0/8`` or ``::1``) every ``GET`` is open and a
loopback client may ``POST /drain``. ``--status-host ADDR`` serves on another interface (``0.0.0.0``
or ``::``: every one), e.g. for an orchestrator's preemption watcher; then every request, ``GET``
and ``POST`` alike and from a loopback client too, needs ``Authorization: Bearer <token>``, the
token read from ``--status-token-file``: without it or with a wrong one ``401`` (``WWW-Authenticate:
Bearer``, a one-line error, nothing of the status, not even which paths exist); ``403`` where no
token file is configured. ``--status-open-read true`` opens ``GET`` to whoever can reach the
address, deliberately; ``POST /drain`` still needs the token. Off loopback with neither a token file
nor ``--status-open-read`` the agent refuses to start (exit 2): such an endpoint would answer nobody.

The agent prints ``fsm-agent: status at URL`` with an address a client can use: for a wildcard bind
this host's name (``agent.hostname``, else ``socket.gethostname()``; their first non-loopback
address when both say ``localhost``), not ``0.0.0.0``; off loopback a second line says what is
listening and that the token is needed, and from which file.

State is tracked through hooks (``fsm_agent_rendezvous_completed``, ``fsm_agent_workers_started``,
``fsm_agent_worker_exited``, ``fsm_agent_state_changed``) by a ``LiveStatus`` object registered in
``fsm_agent_configure``; restart counts are read from the agent. The server is shut down in
``fsm_agent_unconfigure``. ``fsm-agent status URL [--watch]`` renders ``/status`` as tables.
"""

from __future__ import annotations

import collections
import hmac
import ipaddress
import json
import logging
import os
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import attrs

from fsm_agent.errors import ConfigError
from fsm_agent.plugins import hookimpl

log = logging.getLogger(__name__)

PLUGIN_NAME = "status-http"
HOST = "127.0.0.1"
#: Transitions kept, and shown by default.
TRANSITIONS_KEPT = 100
TRANSITIONS_SHOWN = 20
#: Restart cycles ``/status`` shows (the newest).
CYCLES_SHOWN = 20
_STOPPED_STATES = frozenset({"STOPPED", "FAILED", "UNKNOWN"})
TERMINAL_STATES = frozenset({"SUCCEEDED", "FAILED", "UNKNOWN"})
#: Seconds the server stays up after the run for a ``/status`` reader it saw lately (``fsm-agent
#: status --watch``, 1 s between polls by default) to read the end state; 0 when nobody polls.
FINAL_READ_WAIT_S = 2.0
#: A reader that polled within this many seconds is waited for.
_RECENT_READER_S = 5.0


def _check_port(port: int) -> None:
    if not 0 <= port <= 65535:
        raise ValueError("expected a port number 0-65535 (0: any free port)")


def _check_host(host: str) -> None:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"expected an IP address of this host, e.g. {HOST}, got {host!r}") from None


def read_token(path: str) -> str:
    """The bearer token in ``path`` (surrounding whitespace stripped): the agent's
    ``--status-token-file`` and the same flag of ``fsm-agent status``.

    Raises:
        ConfigError: the file cannot be read or is empty.
    """
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as exc:
        raise ConfigError(
            f"--status-token-file {path}: cannot read it: {exc.strerror or exc}; give a readable file holding the token"
        ) from None
    if not token:
        raise ConfigError(f"--status-token-file {path}: the file is empty; write the token into it")
    return token


@hookimpl
def fsm_agent_addoption(options):
    options.add(
        "port",
        type=int,
        default=None,
        flag="--status-port",
        env="FSM_AGENT_STATUS_PORT",
        check=_check_port,
        help="serve live status on http://127.0.0.1:PORT (/status, /statechart, /healthz, POST /drain); "
        "0 picks a free port; unset: off",
    )
    options.add(
        "host",
        type=str,
        default=HOST,
        flag="--status-host",
        env="FSM_AGENT_STATUS_HOST",
        check=_check_host,
        help="address the status endpoint listens on (0.0.0.0: every interface); off loopback every request "
        "needs the bearer token of --status-token-file (GET: unless --status-open-read)",
    )
    options.add(
        "token_file",
        type=str,
        default="",
        flag="--status-token-file",
        env="FSM_AGENT_STATUS_TOKEN_FILE",
        help="file holding the bearer token (Authorization: Bearer TOKEN) every request needs when "
        "--status-host is off loopback (default: none; then only --status-open-read serves there)",
    )
    options.add(
        "open_read",
        type=bool,
        default=False,
        flag="--status-open-read",
        env="FSM_AGENT_STATUS_OPEN_READ",
        help="off loopback, serve GET (/status, /statechart, /healthz) without the token to whoever can "
        "reach --status-host; POST /drain still needs it",
    )


@hookimpl
def fsm_agent_configure(config, agent):
    options = config.plugin_options(PLUGIN_NAME) if config is not None else {}
    port = options.get("port")
    if port is None:
        return
    token_file = options.get("token_file") or ""
    host = options.get("host") or HOST
    open_read = bool(options.get("open_read"))
    guarded = not _is_loopback(host)
    if guarded and not token_file and not open_read:
        raise ConfigError(
            f"--status-host {host}: off loopback every request needs a bearer token, and there is none: "
            f"give --status-token-file FILE (clients send Authorization: Bearer <its content>), or "
            f"--status-open-read true to serve GET to whoever can reach the port (POST /drain stays refused)"
        )
    status = LiveStatus(agent, token=read_token(token_file) if token_file else None, open_read=open_read)
    status.serve(port, host)
    agent.plugin_manager.register(status, f"{PLUGIN_NAME}-server")
    print(f"fsm-agent: status at {status.url}/status", file=sys.stderr, flush=True)
    if guarded:
        bearer = f"Authorization: Bearer <the token in {os.path.abspath(token_file)}>"
        listening = f"fsm-agent: status: listening on {_netloc(host, status.port)}, off loopback"
        if open_read:
            drain = f"POST /drain needs {bearer}" if token_file else "POST /drain is refused (no --status-token-file)"
            note = f"{listening}: GET is open to anyone who can reach it (--status-open-read); {drain}"
        else:
            note = f"{listening}: every request needs {bearer}"
        print(note, file=sys.stderr, flush=True)


class LiveStatus:
    """The agent's live state, kept up to date by hooks and served over HTTP.

    Hook calls come from the agent's thread, requests from the server's threads: everything
    shared is read and written under ``_lock``.

    Attributes:
        url: ``http://HOST:PORT`` once ``serve`` bound the port, HOST an address a client can use
            (``reachable_host``: this host's name for a wildcard bind).
        port: the bound port (None before ``serve``).
    """

    def __init__(self, agent: Any, token: str | None = None, open_read: bool = False):
        self._agent = agent
        self._token = token
        self._open_read = open_read
        self._guarded = False  # listening off loopback: the token for every request (set by serve)
        self._lock = threading.Lock()
        self._state = _state_name(agent.state)
        self._since = time.monotonic()
        self._since_wall = time.time()
        self._started = time.monotonic()
        self._transitions: collections.deque[dict[str, Any]] = collections.deque(maxlen=TRANSITIONS_KEPT)
        self._transition_count = 0
        self._round = 0
        self._membership: dict[str, Any] = {}
        self._workers: dict[int, dict[str, Any]] = {}
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._chart: str | None = None
        self._last_read: float | None = None  # monotonic time of the last /status request
        self._end_read = threading.Event()  # a /status reader got the terminal state
        self.url: str | None = None
        self.port: int | None = None

    # -- hooks ---------------------------------------------------------------------------------
    @hookimpl
    def fsm_agent_rendezvous_completed(self, worker_group, duration_s):
        with self._lock:
            self._round += 1
            self._membership = {
                "group_rank": worker_group.group_rank,
                "group_world_size": worker_group.group_world_size,
                "master_addr": worker_group.master_addr,
                "master_port": worker_group.master_port,
                "rendezvous_duration_s": round(duration_s, 6),
            }
            self._workers = {w.local_rank: _worker_row(w, state="pending") for w in worker_group.workers}

    @hookimpl
    def fsm_agent_workers_started(self, worker_group, pids):
        with self._lock:
            for worker in worker_group.workers:
                row = _worker_row(worker, state="running")
                row["pid"] = pids.get(worker.local_rank, worker.id)
                self._workers[worker.local_rank] = row

    @hookimpl
    def fsm_agent_worker_exited(self, worker, worker_group, exitcode):
        with self._lock:
            row = self._workers.setdefault(worker.local_rank, _worker_row(worker, state="running"))
            row["state"] = "succeeded" if exitcode == 0 else "failed"
            row["exit_code"] = exitcode

    @hookimpl
    def fsm_agent_state_changed(self, transition):
        with self._lock:
            self._state = _state_name(transition.dest)
            self._since, self._since_wall = time.monotonic(), transition.ts
            self._transition_count += 1
            self._transitions.append(
                {
                    "source": _state_name(transition.source),
                    "dest": _state_name(transition.dest),
                    "trigger": transition.trigger,
                    "ts": transition.ts,
                    "restart_count": transition.restart_count,
                    "duration_s": round(transition.duration_s, 6),
                    "error": transition.error,
                }
            )
            if self._state in _STOPPED_STATES:  # _stop_workers ended whatever was still running
                for row in self._workers.values():
                    if row["state"] == "running":
                        row["state"] = "stopped"

    @hookimpl
    def fsm_agent_unconfigure(self, result):
        last = self._last_read
        if last is not None and time.monotonic() - last < _RECENT_READER_S:  # a watcher: let it see the end
            self._end_read.wait(FINAL_READ_WAIT_S)
        self.close()

    # -- the server ----------------------------------------------------------------------------
    def serve(self, port: int, host: str = HOST) -> None:
        """Listen on ``host``:``port`` (0: a free port) from a daemon thread.

        Raises:
            ConfigError: the port cannot be bound (in use, no permission, not this host's address).
        """
        server_class = _ThreadingHTTPServerV6 if ":" in host else ThreadingHTTPServer
        try:
            server = server_class((host, port), _Handler)
        except OSError as exc:
            raise ConfigError(
                f"--status-port {port}: cannot listen on {host}:{port}: {exc.strerror or exc}; "
                f"choose another port (0 picks a free one) or another --status-host"
            ) from None
        server.daemon_threads = True
        server.status = self  # type: ignore[attr-defined]
        self._server = server
        self._guarded = not _is_loopback(host)
        self.port = server.server_address[1]
        self.url = f"http://{_netloc(reachable_host(host, self._agent.hostname), self.port)}"
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.1}, name="fsm-agent-status-http", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    # -- what is served ------------------------------------------------------------------------
    def refusal(self, method: str, client: str, authorization: str | None) -> tuple[int, dict[str, Any]] | None:
        """None when a ``method`` request from ``client`` (its IP address) with this ``Authorization``
        header may be answered, else (HTTP code, JSON error document): 401 for a missing or wrong
        bearer token, 403 when the agent has no token to check.

        The token is needed off loopback (``serve`` on a non-loopback address) for every request,
        ``GET`` excepted with ``--status-open-read``, and for a ``POST`` from a non-loopback client.
        """
        guarded = self._guarded and not (method == "GET" and self._open_read)
        if not guarded and not (method == "POST" and not _is_loopback(client)):
            return None
        what = "POST /drain" if method == "POST" else method
        if self._token is None:
            why = "the endpoint listens off loopback" if self._guarded else f"{client} is not a loopback client"
            return 403, {"error": f"{what} refused: {why} and the agent has no --status-token-file"}
        scheme, _, given = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self._token.encode()):
            return 401, {
                "error": f"{what} refused: missing or wrong bearer token "
                f"(Authorization: Bearer <token of --status-token-file>)"
            }
        return None

    def drain(self, scope: str | None, client: str, authorization: str | None) -> tuple[int, dict[str, Any]]:
        """Answer ``POST /drain`` from ``client`` (its IP address): (HTTP code, JSON document).

        On loopback a loopback client may always ask; off loopback, or from any other client, only
        with ``Authorization: Bearer <token>`` (``refusal``).
        """
        refused = self.refusal("POST", client, authorization)
        if refused is not None:
            return refused
        try:
            taken = self._agent.request_drain(scope=scope, source="http", by=client)
        except ValueError as exc:
            return 400, {"error": str(exc)}
        if not taken:
            return 409, {"error": "a drain is already under way, or the run is ending", "drain": self._drain_doc()}
        return 202, {"drain": self._drain_doc() or {"scope": scope, "source": "http", "by": client}}

    def _drain_doc(self) -> dict[str, Any] | None:
        agent = self._agent
        drain = agent.drain or agent.drain_request
        return dict(drain) if drain else None

    def snapshot(self, transitions: int = TRANSITIONS_SHOWN) -> dict[str, Any]:
        """The ``/status`` document."""
        agent = self._agent
        spec = agent.spec
        restart_count = agent.restart_count
        with self._lock:
            shown = list(self._transitions)[-transitions:] if transitions > 0 else []
            doc = {
                "state": self._state,
                "time_in_state_s": round(time.monotonic() - self._since, 3),
                "state_since": self._since_wall,
                "restart_count": restart_count,
                "max_restarts": spec.max_restarts,
                "remaining_restarts": max(0, spec.max_restarts - restart_count),
                "rendezvous_round": self._round,
                # a hot spare waiting for a seat (the rendezvous's message), else None
                "standby": agent.standby,
                "membership": {
                    "run_id": _run_id(agent),
                    "role": spec.role,
                    "rdzv_backend": spec.rendezvous.backend,
                    "rdzv_endpoint": _rdzv_endpoint(agent),
                    "min_nodes": spec.rendezvous.min_nodes,
                    "max_nodes": spec.rendezvous.max_nodes,
                    "local_world_size": spec.local_world_size,
                    **self._membership,
                },
                "workers": [dict(self._workers[r]) for r in sorted(self._workers)],
                "transitions": shown,
                "transitions_total": self._transition_count,
                "cycles": [attrs.asdict(cycle) for cycle in agent.cycles[-CYCLES_SHOWN:]],
                "step_times": None if agent.step_times is None else dict(agent.step_times),
                "checkpoints": None if agent.checkpoints is None else dict(agent.checkpoints),
                "verdict": _verdict_doc(agent.job_verdict),
                # A drain is not a failure: apart from restart_count, with its own count.
                "drain": self._drain_doc(),
                "drains": int(agent.drain is not None),
                "agent": {
                    "pid": os.getpid(),
                    "node": agent.hostname,
                    "entrypoint": spec.get_entrypoint_name(),
                    "uptime_s": round(time.monotonic() - self._started, 3),
                },
                "ts": time.time(),
            }
        return doc

    def statechart(self) -> str:
        """Mermaid text of the statechart with the current state highlighted."""
        if self._chart is None:
            self._chart = _mermaid()
        with self._lock:
            state = self._state
        return (
            self._chart.rstrip("\n")
            + "\n  classDef current fill:#ffd54f,stroke:#e65100,stroke-width:3px"
            + f"\n  class {state} current\n"
        )


class _ThreadingHTTPServerV6(ThreadingHTTPServer):
    address_family = socket.AF_INET6


def _is_loopback(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def _netloc(host: str, port: int | None) -> str:
    return f"{f'[{host}]' if ':' in host else host}:{port}"


def reachable_host(host: str, name: str | None = None) -> str:
    """An address a client can reach a server listening on ``host`` at: ``host`` itself, but for a
    wildcard (``0.0.0.0``, ``::``) this host's ``name`` (the agent's), else ``socket.gethostname()``,
    else, both being ``localhost``, this host's first non-loopback address (of ``host``'s family),
    else loopback."""
    ip = ipaddress.ip_address(host)
    if not ip.is_unspecified:
        return host
    for candidate in (name, socket.gethostname()):
        if candidate and candidate.split(".")[0].lower() != "localhost":
            return candidate
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, family, socket.SOCK_STREAM)
    except OSError:
        infos = []
    for info in infos:
        address = str(info[4][0])
        if not _is_loopback(address):
            return address
    return "::1" if ip.version == 6 else "127.0.0.1"


def _state_name(state: Any) -> str:
    return str(getattr(state, "value", state))


def _worker_row(worker: Any, state: str) -> dict[str, Any]:
    return {
        "local_rank": worker.local_rank,
        "global_rank": worker.global_rank,
        "role_rank": worker.role_rank,
        "world_size": worker.world_size,
        "pid": worker.id,
        "state": state,
        "exit_code": None,
    }


def _run_id(agent: Any) -> str | None:
    try:
        return agent.run_id
    except Exception:  # the handler may not answer (closed, not built): fall back to the spec
        return getattr(agent.spec.rendezvous, "run_id", None)


def _rdzv_endpoint(agent: Any) -> str:
    """The endpoint the rendezvous really uses (a standalone agent's bound port, not ``127.0.0.1:0``)."""
    try:
        return agent.rdzv_endpoint
    except Exception:  # the handler may not answer: fall back to the spec
        return agent.spec.rendezvous.endpoint


def _mermaid() -> str:
    """The statechart as Mermaid, rendered from the table (``fsm_agent.states.statechart``)."""
    from fsm_agent.states.statechart import render

    return render("mermaid")


class _Handler(BaseHTTPRequestHandler):
    server_version = "fsm-agent-status"

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        status: LiveStatus = self.server.status  # type: ignore[attr-defined]
        url = urlsplit(self.path)
        try:
            refused = status.refusal("GET", self.client_address[0], self.headers.get("Authorization"))
            if refused is not None:
                return self._refuse(*refused)
            if url.path in ("/status", "/status/"):
                query = parse_qs(url.query)
                try:
                    count = int(query.get("transitions", [TRANSITIONS_SHOWN])[0])
                except ValueError:
                    return self._send(
                        400, "application/json", json.dumps({"error": "transitions must be an integer"}) + "\n"
                    )
                doc = status.snapshot(max(0, min(count, TRANSITIONS_KEPT)))
                self._send(200, "application/json", json.dumps(doc, indent=2, default=str) + "\n")
                status._last_read = time.monotonic()
                if doc["state"] in TERMINAL_STATES:
                    status._end_read.set()
            elif url.path == "/statechart":
                self._send(200, "text/plain; charset=utf-8", status.statechart())
            elif url.path == "/healthz":
                self._send(200, "text/plain; charset=utf-8", "ok\n")
            else:
                self._send(
                    404,
                    "application/json",
                    json.dumps({"error": f"no such path {url.path!r}", "paths": ["/status", "/statechart", "/healthz"]})
                    + "\n",
                )
        except Exception as exc:  # never take the agent down from the status thread
            log.exception("status request %s failed", self.path)
            self._send(500, "application/json", json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        status: LiveStatus = self.server.status  # type: ignore[attr-defined]
        url = urlsplit(self.path)
        try:
            refused = status.refusal("POST", self.client_address[0], self.headers.get("Authorization"))
            if refused is not None:
                return self._refuse(*refused)
            if url.path not in ("/drain", "/drain/"):
                return self._send(
                    404,
                    "application/json",
                    json.dumps({"error": f"no such path {url.path!r} for POST", "paths": ["/drain"]}) + "\n",
                )
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(min(length, 65536))  # a body is allowed, and ignored
            scope = parse_qs(url.query).get("scope", [None])[0]
            code, doc = status.drain(scope, self.client_address[0], self.headers.get("Authorization"))
            self._send(code, "application/json", json.dumps(doc, default=str) + "\n")
        except Exception as exc:  # never take the agent down from the status thread
            log.exception("status request POST %s failed", self.path)
            self._send(500, "application/json", json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")

    def _refuse(self, code: int, doc: dict[str, Any]) -> None:
        self._send(
            code, "application/json", json.dumps(doc) + "\n", {"WWW-Authenticate": "Bearer"} if code == 401 else {}
        )

    def _send(self, code: int, content_type: str, body: str, headers: dict[str, str] | None = None) -> None:
        data = body.encode("utf-8")
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's signature)
        log.debug("status http: " + format, *args)


def _verdict_doc(verdict: Any) -> dict[str, Any] | None:
    """The job's verdict without the reports it was decided on (those are in the events file)."""
    if verdict is None:
        return None
    return {
        key: verdict[key] for key in ("summary", "root_causes", "classes", "exit_code", "decided_by") if key in verdict
    }
