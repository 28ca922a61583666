"""PrometheusExporter: one run's metrics in a CollectorRegistry, served over HTTP (``/metrics``).

Name mapping (``metric_for``), torch group ``torchelastic``:

=========================================  ====================================================  =======
torch name                                  Prometheus series                                    type
=========================================  ====================================================  =======
``workers.<role>.remaining_restarts``       ``torchelastic_workers_remaining_restarts{role}``    gauge
``workers.<role>.flakiness``                ``torchelastic_workers_flakiness{role}``             gauge
``workers.<role>.run_total``                ``torchelastic_workers_run_total{role}``             counter
``workers.<role>.run_<outcome>``            ``torchelastic_workers_run_<outcome>_total{role}``   counter
``workers.<role>.<state>`` (healthy, ...)   ``torchelastic_workers_state_total{role,state}``     counter
``workers.<role>.<other>``                  ``torchelastic_workers_<other>{role}``               gauge
``<other.dotted.name>``                     ``torchelastic_<other_dotted_name>{role}``           gauge
=========================================  ====================================================  =======

fsm-agent's group ``fsm_agent``: ``state.<STATE>.duration_s`` -> histogram
``fsm_agent_state_duration_seconds{role,state}`` (``_sum`` is the total time spent in the state,
``_count`` the number of visits); the ``straggler`` plugin's ``step_time.median_s`` -> gauge
``fsm_agent_step_time_median_seconds{role}``, ``step_time.<global_rank>.seconds`` and
``.ratio`` -> gauges ``fsm_agent_step_time_seconds{role,global_rank}`` and
``fsm_agent_step_time_ratio{role,global_rank}``; other names -> gauge ``fsm_agent_<name>{role}``
(``stragglers``: ``fsm_agent_stragglers{role}``, ranks in a straggler episode now).

From the lifecycle hooks: ``fsm_agent_worker_group_state{role,state}`` (1 for the current state,
0 for the others), ``fsm_agent_restart_count{role}``, ``fsm_agent_transitions_total{role,source,
dest,trigger}``, ``fsm_agent_worker_exits_total{role,exit_code}``,
``fsm_agent_rendezvous_duration_seconds{role}``, ``fsm_agent_group_world_size{role}`` and
``fsm_agent_info{role,run_id,node,rdzv_backend}`` = 1.
"""

from __future__ import annotations

import logging
import re
import socket
import sys
import threading
from collections.abc import Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from fsm_agent import WorkerState
from fsm_agent.plugins import hookimpl

log = logging.getLogger(__name__)

STATES = [s.value for s in WorkerState]
WORKER_STATE_NAMES = {s.lower() for s in STATES}
RUN_OUTCOMES = (
    "run_success_with_retries",
    "run_success_no_retries",
    "run_failed_with_retries",
    "run_failed_no_retries",
    "run_drained",
)
#: seconds; from a fast INIT to a multi-day HEALTHY
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600, 4 * 3600, 24 * 3600, float("inf"))


def _sanitize(name: str) -> str:
    return re.sub(r"[^a-z0-9_]", "_", name.lower()).strip("_")


def metric_for(group: str, name: str) -> tuple[str, str, dict[str, str]]:
    """``(kind, prometheus_name, extra_labels)`` for one ``put_metric(group, name)``.

    ``kind`` is ``gauge``, ``counter`` or ``histogram``; ``prometheus_name`` is the family name
    (counters are exposed with ``_total`` appended); the ``role`` label is added by the exporter.
    """
    parts = name.split(".")
    if group == "torchelastic" and len(parts) == 3 and parts[0] == "workers":
        metric = parts[2]
        if metric in WORKER_STATE_NAMES:
            return "counter", "torchelastic_workers_state", {"state": metric.upper()}
        if metric == "run_total":
            return "counter", "torchelastic_workers_run", {}
        if metric in RUN_OUTCOMES:
            return "counter", f"torchelastic_workers_{metric}", {}
        return "gauge", f"torchelastic_workers_{_sanitize(metric)}", {}
    if group == "fsm_agent" and name == "drains":  # one per drain_requested transition
        return "counter", "fsm_agent_drains", {}
    if group == "fsm_agent" and len(parts) == 3 and parts[0] == "state" and parts[2] == "duration_s":
        return "histogram", "fsm_agent_state_duration_seconds", {"state": parts[1]}
    if group == "fsm_agent" and parts[0] == "step_time":
        if parts[1:] == ["median_s"]:
            return "gauge", "fsm_agent_step_time_median_seconds", {}
        if len(parts) == 3 and parts[1].isdigit() and parts[2] in ("seconds", "ratio"):
            return "gauge", f"fsm_agent_step_time_{parts[2]}", {"global_rank": parts[1]}
    return "gauge", f"{_sanitize(group)}_{_sanitize(name)}", {}


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        pass


class _Body:
    """A WSGI response body that tells the exporter when the server has finished sending it."""

    def __init__(self, chunks: Iterable[bytes], on_sent):
        self._chunks, self._on_sent = chunks, on_sent

    def __iter__(self):
        return iter(self._chunks)

    def close(self):
        self._on_sent()


class PrometheusExporter:
    """Collects one agent's metrics and serves them.

    Args:
        role: the worker role (``--role``), the ``role`` label of every series.
        linger_s: after the run, serve until one scrape has read the final metrics, at most this long.
    """

    def __init__(self, role: str, linger_s: float = 0.0):
        self.role = role
        self.linger_s = linger_s
        self.registry = CollectorRegistry(auto_describe=True)
        self._dynamic: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._server = None
        self._thread: threading.Thread | None = None
        self._final = False
        self._final_scrape = threading.Event()
        r = self.registry
        self.state = Gauge(
            "fsm_agent_worker_group_state",
            "1 for the worker group's current state, 0 for the others",
            ["role", "state"],
            registry=r,
        )
        for state in STATES:
            self.state.labels(role, state).set(1 if state == "INIT" else 0)
        self.restart_count = Gauge(
            "fsm_agent_restart_count", "Restarts used so far (TORCHELASTIC_RESTART_COUNT)", ["role"], registry=r
        )
        self.restart_count.labels(role).set(0)
        self.transitions = Counter(
            "fsm_agent_transitions",
            "State changes of the worker group",
            ["role", "source", "dest", "trigger"],
            registry=r,
        )
        self.worker_exits = Counter(
            "fsm_agent_worker_exits",
            "Worker process exits, by exit code (-N: signal N)",
            ["role", "exit_code"],
            registry=r,
        )
        self.rendezvous_duration = Histogram(
            "fsm_agent_rendezvous_duration_seconds",
            "Seconds spent in each completed rendezvous round",
            ["role"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.group_world_size = Gauge(
            "fsm_agent_group_world_size", "Agents in the current rendezvous round", ["role"], registry=r
        )
        self.info = Gauge(
            "fsm_agent_info",
            "The run this agent belongs to (always 1)",
            ["role", "run_id", "node", "rdzv_backend"],
            registry=r,
        )

    # -- serving ----------------------------------------------------------------------------------
    @property
    def port(self) -> int | None:
        return self._server.server_port if self._server else None

    def serve(self, addr: str, port: int) -> None:
        """Serve ``/metrics`` on ``addr:port`` from a daemon thread (``OSError`` if the port is taken)."""
        metrics_app = make_wsgi_app(self.registry)

        def app(environ, start_response):
            final = self._final  # read before the metrics are: this scrape sees the final values
            body = metrics_app(environ, start_response)
            return _Body(body, self._final_scrape.set if final else (lambda: None))

        server_class = ThreadingWSGIServer
        if ":" in addr:
            server_class = type("IPv6ThreadingWSGIServer", (ThreadingWSGIServer,), {"address_family": socket.AF_INET6})
        self._server = make_server(addr, port, app, server_class, handler_class=_QuietHandler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="fsm-agent-prometheus", daemon=True)
        self._thread.start()
        host = f"[{addr}]" if ":" in addr else addr
        print(f"fsm-agent: prometheus metrics at http://{host}:{self.port}/metrics", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def set_info(self, agent, config) -> None:
        try:
            run_id = agent.run_id
        except Exception:  # the handler may not know it yet
            run_id = getattr(config, "run_id", "")
        node = agent.hostname
        backend = getattr(config, "rdzv_backend", "") or ""
        self.info.labels(self.role, str(run_id), node, backend).set(1)

    # -- hooks --------------------------------------------------------------------------------------
    @hookimpl
    def fsm_agent_put_metric(self, metric_group, metric_name, metric_value):
        kind, name, labels = metric_for(metric_group, metric_name)
        metric = self._metric(kind, name, ["role", *labels])
        if metric is None:
            return
        series = metric.labels(self.role, *labels.values())
        if kind == "gauge":
            series.set(metric_value)
        elif kind == "counter":
            series.inc(max(0.0, float(metric_value)))
        else:
            series.observe(metric_value)

    @hookimpl
    def fsm_agent_state_changed(self, transition):
        for state in STATES:
            self.state.labels(self.role, state).set(1 if state == transition.dest else 0)
        self.restart_count.labels(self.role).set(transition.restart_count)
        self.transitions.labels(self.role, transition.source, transition.dest, transition.trigger).inc()

    @hookimpl
    def fsm_agent_worker_exited(self, worker, worker_group, exitcode):
        self.worker_exits.labels(self.role, str(exitcode)).inc()

    @hookimpl
    def fsm_agent_rendezvous_completed(self, worker_group, duration_s):
        self.rendezvous_duration.labels(self.role).observe(duration_s)
        if worker_group.group_world_size is not None:
            self.group_world_size.labels(self.role).set(worker_group.group_world_size)

    @hookimpl
    def fsm_agent_unconfigure(self, result):
        self._final = True
        if self.linger_s > 0 and self._server is not None and not self._final_scrape.wait(self.linger_s):
            log.info("prometheus: no scrape within %ss after the run ended", self.linger_s)
        self.close()

    # -- helpers ------------------------------------------------------------------------------------
    def _metric(self, kind: str, name: str, labelnames: list[str]):
        with self._lock:
            metric = self._dynamic.get(name)
            if metric is None:
                doc = f"fsm-agent metric {name} (see fsm_agent_prometheus.exporter for the name mapping)"
                try:
                    if kind == "counter":
                        metric = Counter(name, doc, labelnames, registry=self.registry)
                    elif kind == "histogram":
                        metric = Histogram(name, doc, labelnames, buckets=DURATION_BUCKETS, registry=self.registry)
                    else:
                        metric = Gauge(name, doc, labelnames, registry=self.registry)
                except ValueError as exc:  # the name clashes with another series: keep the first
                    log.debug("prometheus: skipping %s: %s", name, exc)
                    self._dynamic[name] = False
                    return None
                self._dynamic[name] = metric
            return metric or None
