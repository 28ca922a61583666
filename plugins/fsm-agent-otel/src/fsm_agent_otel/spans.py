"""StateSpans: the hooks that turn state changes into spans; build_provider: the plugin's own SDK pipeline.

Span attributes (on every state span; the run span has the same, minus the per-visit ones):

=============================  ==========================================================
``fsm_agent.role``             ``--role``
``fsm_agent.run_id``           the rendezvous run id (``TORCHELASTIC_RUN_ID``)
``fsm_agent.node``             this host's FQDN
``fsm_agent.state``            the state this span covers
``fsm_agent.restart_count``    restarts used when the state was entered
``fsm_agent.trigger``          the statechart trigger that entered the state (``start`` for INIT's successor...)
``fsm_agent.source``           the state it came from (absent for INIT)
``fsm_agent.exit_trigger``     the trigger that left it, and ``fsm_agent.next_state`` where it went
``fsm_agent.group_rank``       and ``fsm_agent.group_world_size``: the membership of the last rendezvous
=============================  ==========================================================

Events: ``worker_exit`` (``local_rank``, ``global_rank``, ``pid``, ``exit_code``) on the span of the
state the worker exited in, and ``rendezvous_completed`` (``group_rank``, ``group_world_size``,
``duration_s``) on the INIT or STOPPED span whose transition ran the rendezvous. A state entered with
an agent error (FAILED, UNKNOWN) and a failed run's spans carry status ERROR with the message.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import Status, StatusCode

from fsm_agent.plugins import hookimpl

RUN_SPAN_NAME = "fsm-agent run"


def _ns(ts: float) -> int:
    return int(ts * 1e9)


class StateSpans:
    """One run's spans. Call order: ``start`` (from configure), the hooks, ``fsm_agent_unconfigure``.

    Args:
        tracer: an OpenTelemetry Tracer.
        attributes: attributes put on every span (role, run id, node).
        provider: the plugin's own TracerProvider to shut down at the end, or None (global provider).
    """

    def __init__(self, tracer: trace.Tracer, attributes: dict[str, Any], provider=None):
        self._tracer = tracer
        self._attributes = dict(attributes)
        self._provider = provider
        self._run_span: trace.Span | None = None
        self._span: trace.Span | None = None
        self._state: str | None = None
        self._membership: dict[str, int] = {}

    @classmethod
    def for_agent(cls, agent, config, provider=None) -> StateSpans:
        tracer_provider = provider if provider is not None else trace.get_tracer_provider()
        from fsm_agent_otel import TRACER_NAME

        tracer = tracer_provider.get_tracer(TRACER_NAME, _version())
        try:
            run_id = str(agent.run_id)
        except Exception:  # the handler may not know it yet
            run_id = str(getattr(config, "run_id", ""))
        attributes = {
            "fsm_agent.role": getattr(config, "role", None) or agent.spec.role,
            "fsm_agent.run_id": run_id,
            "fsm_agent.node": agent.hostname,
            "fsm_agent.max_restarts": int(agent.spec.max_restarts),
            "fsm_agent.rdzv_backend": str(getattr(config, "rdzv_backend", "") or ""),
        }
        spans = cls(tracer, attributes, provider)
        spans.start(state=str(getattr(agent.state, "value", agent.state)), restart_count=agent.restart_count)
        return spans

    def start(self, state: str = "INIT", restart_count: int = 0, ts: float | None = None) -> None:
        start_ns = _ns(ts if ts is not None else time.time())
        self._run_span = self._tracer.start_span(RUN_SPAN_NAME, attributes=self._attributes, start_time=start_ns)
        self._open(state, start_ns, {"fsm_agent.restart_count": restart_count})

    # -- hooks ----------------------------------------------------------------------------------
    @hookimpl
    def fsm_agent_state_changed(self, transition):
        ts = _ns(transition.ts)
        if self._span is not None:
            self._span.set_attribute("fsm_agent.exit_trigger", transition.trigger)
            self._span.set_attribute("fsm_agent.next_state", transition.dest)
            self._span.set_attribute("fsm_agent.duration_s", float(transition.duration_s))
            self._span.end(end_time=ts)
        self._open(
            transition.dest,
            ts,
            {
                "fsm_agent.restart_count": transition.restart_count,
                "fsm_agent.trigger": transition.trigger,
                "fsm_agent.source": transition.source,
            },
        )
        if transition.error:
            self._span.set_status(Status(StatusCode.ERROR, transition.error))

    @hookimpl
    def fsm_agent_rendezvous_completed(self, worker_group, duration_s):
        if self._span is None:
            return
        attributes = {
            "group_rank": worker_group.group_rank,
            "group_world_size": worker_group.group_world_size,
            "duration_s": float(duration_s),
        }
        # The rendezvous runs inside the transition out of INIT/STOPPED: the event goes on that span,
        # the membership it produced on the spans of the states that follow.
        self._span.add_event("rendezvous_completed", {k: v for k, v in attributes.items() if v is not None})
        self._membership = {
            f"fsm_agent.{key}": int(attributes[key])
            for key in ("group_rank", "group_world_size")
            if attributes[key] is not None
        }

    @hookimpl
    def fsm_agent_worker_exited(self, worker, worker_group, exitcode):
        if self._span is None:
            return
        attributes = {"local_rank": worker.local_rank, "global_rank": worker.global_rank, "exit_code": int(exitcode)}
        if worker.id is not None:
            attributes["pid"] = int(worker.id)
        self._span.add_event("worker_exit", {k: v for k, v in attributes.items() if v is not None})

    @hookimpl
    def fsm_agent_unconfigure(self, result):
        now = time.time_ns()
        failed = result.is_failed()
        outcome = {
            "fsm_agent.final_state": result.state.value,
            "fsm_agent.exit_code": int(result.exit_code),
            "fsm_agent.restart_count": int(result.restart_count),
        }
        if self._span is not None:
            self._span.set_attributes(outcome)
            self._span.end(end_time=now)
            self._span = None
        if self._run_span is not None:
            self._run_span.set_attributes(outcome)
            if failed:
                self._run_span.set_status(Status(StatusCode.ERROR, result.error or f"exit code {result.exit_code}"))
            self._run_span.end(end_time=now)
            self._run_span = None
        if self._provider is not None:
            self._provider.shutdown()  # flushes the batch processors
        else:
            flush = getattr(trace.get_tracer_provider(), "force_flush", None)
            if flush is not None:
                flush()

    # -- helpers --------------------------------------------------------------------------------
    def _open(self, state: str, start_ns: int, attributes: dict[str, Any]) -> None:
        context = trace.set_span_in_context(self._run_span) if self._run_span is not None else None
        self._state = state
        self._span = self._tracer.start_span(
            state,
            context=context,
            start_time=start_ns,
            attributes={**self._attributes, "fsm_agent.state": state, **self._membership, **attributes},
        )


class JsonlSpanExporter(SpanExporter):
    """Appends each finished span as one JSON object per line (``ReadableSpan.to_json``), flushed at once.

    Args:
        path: the file (its directory is created).
    """

    def __init__(self, path: str):
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")
        self._lock = threading.Lock()

    def export(self, spans: Sequence) -> SpanExportResult:
        with self._lock:
            if self._file.closed:
                return SpanExportResult.FAILURE
            for span in spans:
                self._file.write(json.dumps(json.loads(span.to_json(indent=None)), sort_keys=True) + "\n")
            self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        with self._lock:
            if not self._file.closed:
                self._file.flush()
        return True


def build_provider(options: dict[str, Any], default_jsonl_dir: str | None = None):
    """An SDK TracerProvider with one processor per exporter named in ``options["exporters"]``.

    Raises:
        ValueError: ``otlp`` without an OTLP exporter package, or ``jsonl`` with no file to write.
    """
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

    resource = Resource.create(
        {"service.name": options["service_name"], "host.name": socket.getfqdn(), "process.pid": os.getpid()}
    )
    provider = TracerProvider(resource=resource)
    for name in options["exporters"]:
        if name == "console":
            provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
        elif name == "jsonl":
            path = options.get("jsonl_file") or (
                os.path.join(default_jsonl_dir, "spans.jsonl") if default_jsonl_dir else None
            )
            if not path:
                raise ValueError(
                    "FSM_AGENT_OTEL_EXPORTER=jsonl needs FSM_AGENT_OTEL_JSONL_FILE=PATH "
                    "(there is no events file to put spans.jsonl beside)"
                )
            provider.add_span_processor(SimpleSpanProcessor(JsonlSpanExporter(path)))
        elif name == "otlp":
            provider.add_span_processor(BatchSpanProcessor(_otlp_exporter()))
    return provider


def _otlp_exporter():
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise ValueError(
                "FSM_AGENT_OTEL_EXPORTER=otlp needs an OTLP exporter: "
                "pip install 'fsm-agent-otel[otlp]' (opentelemetry-exporter-otlp-proto-http)"
            ) from None
    return OTLPSpanExporter()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fsm-agent-otel")
    except PackageNotFoundError:
        return "0+unknown"
