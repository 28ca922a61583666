"""Spans from real runs: the SDK's InMemorySpanExporter in-process, the JSON-lines and console exporters
from the CLI, and OTLP/HTTP to a local FakeOtlpCollector."""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.trace import SpanKind, StatusCode

from fsm_agent import LaunchConfig, run_agent

pytestmark = pytest.mark.slow

STATE_TRACE = ["INIT", "HEALTHY", "STOPPED", "HEALTHY", "SUCCEEDED"]


def test_one_span_per_state_visit_with_a_crash_and_a_restart(tmp_path, memory_spans, worker_script):
    config = LaunchConfig(
        nproc_per_node=2,
        max_restarts=1,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        run_id="otel-crash",
        role="trainer",
        log_dir=str(tmp_path / "logs"),
    )
    result = run_agent(config, sys.executable, (worker_script,))
    assert result.exit_code == 0 and result.restart_count == 1

    spans = memory_spans.get_finished_spans()
    run = [s for s in spans if s.name == "fsm-agent run"]
    assert len(run) == 1
    run = run[0]
    states = sorted((s for s in spans if s is not run), key=lambda s: s.start_time)
    assert [s.name for s in states] == STATE_TRACE

    # One trace; every state span is a child of the run span; the visits tile the run without gaps.
    assert {s.context.trace_id for s in spans} == {run.context.trace_id}
    assert all(s.parent.span_id == run.context.span_id for s in states)
    assert all(a.end_time == b.start_time for a, b in zip(states[:-1], states[1:], strict=True))
    assert run.start_time == states[0].start_time and run.end_time == states[-1].end_time
    assert all(s.kind == SpanKind.INTERNAL for s in spans)

    attrs = [dict(s.attributes) for s in states]
    assert {a["fsm_agent.role"] for a in attrs} == {"trainer"}
    assert {a["fsm_agent.run_id"] for a in attrs} == {"otel-crash"}
    assert [a.get("fsm_agent.trigger") for a in attrs] == [
        None,
        "start",
        "workers_failed",
        "restart",
        "workers_succeeded",
    ]
    assert [a["fsm_agent.restart_count"] for a in attrs] == [0, 0, 1, 1, 1]
    assert [a.get("fsm_agent.exit_trigger") for a in attrs[:-1]] == [
        "start",
        "workers_failed",
        "restart",
        "workers_succeeded",
    ]
    assert attrs[-1]["fsm_agent.exit_code"] == 0 and attrs[-1]["fsm_agent.final_state"] == "SUCCEEDED"
    assert [a.get("fsm_agent.group_world_size") for a in attrs] == [None, 1, 1, 1, 1]
    assert attrs[1]["fsm_agent.group_rank"] == 0

    crash = [e for e in states[1].events if e.name == "worker_exit"]
    assert [(e.attributes["local_rank"], e.attributes["exit_code"]) for e in crash] == [(1, 7)]
    assert [e.name for e in states[3].events].count("worker_exit") == 2  # both ranks of attempt 1 exit 0
    assert [[e.name for e in s.events].count("rendezvous_completed") for s in states] == [1, 0, 1, 0, 0]
    assert run.status.status_code == StatusCode.UNSET and run.attributes["fsm_agent.restart_count"] == 1


def test_a_failed_run_marks_the_run_span_as_an_error(tmp_path, memory_spans, worker_script):
    config = LaunchConfig(
        nproc_per_node=2,
        max_restarts=0,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        run_id="otel-fail",
        log_dir=str(tmp_path / "logs"),
    )
    result = run_agent(config, sys.executable, (worker_script,))
    assert result.exit_code == 7
    spans = {s.name: s for s in memory_spans.get_finished_spans()}
    assert set(spans) == {"fsm-agent run", "INIT", "HEALTHY", "FAILED"}
    assert spans["fsm-agent run"].status.status_code == StatusCode.ERROR
    assert spans["FAILED"].attributes["fsm_agent.exit_code"] == 7


def test_jsonl_exporter_from_the_cli(tmp_path, agents, worker_script):
    out_file = tmp_path / "spans" / "run.jsonl"
    proc = agents.start(
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        worker_script,
        env={
            "FSM_AGENT_OTEL_EXPORTER": "jsonl",
            "FSM_AGENT_OTEL_JSONL_FILE": str(out_file),
            "FSM_AGENT_OTEL_SERVICE_NAME": "trainer-42",
        },
    )
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    spans = [json.loads(line) for line in out_file.read_text().splitlines()]
    states = sorted((s for s in spans if s["name"] != "fsm-agent run"), key=lambda s: s["start_time"])
    assert [s["name"] for s in states] == STATE_TRACE
    assert len({s["context"]["trace_id"] for s in spans}) == 1
    assert {s["resource"]["attributes"]["service.name"] for s in spans} == {"trainer-42"}
    assert [s["attributes"]["fsm_agent.restart_count"] for s in states] == [0, 0, 1, 1, 1]


def test_jsonl_exporter_defaults_to_the_events_file_directory(tmp_path, agents, worker_script):
    events = tmp_path / "out" / "events.jsonl"
    proc = agents.start(
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--events-file",
        str(events),
        worker_script,
        env={"FSM_AGENT_OTEL_EXPORTER": "jsonl"},
    )
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    names = [json.loads(line)["name"] for line in (tmp_path / "out" / "spans.jsonl").read_text().splitlines()]
    assert sorted(names) == sorted(STATE_TRACE + ["fsm-agent run"])


def test_console_exporter_prints_the_spans(tmp_path, agents):
    script = tmp_path / "ok.py"
    script.write_text("print('ok')\n")
    proc = agents.start(
        "--standalone", "--nproc-per-node", "1", str(script), env={"FSM_AGENT_OTEL_EXPORTER": "console"}
    )
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    for name in ("INIT", "HEALTHY", "SUCCEEDED", "fsm-agent run"):
        assert f'"name": "{name}"' in out


class FakeOtlpCollector:
    """An OTLP/HTTP trace receiver on 127.0.0.1: decodes each POST /v1/traces (protobuf) it gets."""

    def __init__(self):
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        self.requests: list = []
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                collector.requests.append((self.path, request))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def span_names(self) -> list[str]:
        return [
            span.name
            for _, request in self.requests
            for rs in request.resource_spans
            for ss in rs.scope_spans
            for span in ss.spans
        ]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_otlp_exporter_sends_to_a_collector(tmp_path, agents, worker_script):
    pytest.importorskip(
        "opentelemetry.exporter.otlp.proto.http.trace_exporter",
        reason="install fsm-agent-otel[otlp] (.ci/install-plugins.sh does)",
    )
    collector = FakeOtlpCollector()
    try:
        proc = agents.start(
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            worker_script,
            env={"FSM_AGENT_OTEL_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": collector.url},
        )
        out, err = proc.communicate(timeout=120)
    finally:
        collector.close()
    assert proc.returncode == 0, err
    assert {path for path, _ in collector.requests} == {"/v1/traces"}
    assert sorted(collector.span_names()) == sorted(STATE_TRACE + ["fsm-agent run"])


@pytest.mark.parametrize(
    "env, message",
    [
        (
            {"FSM_AGENT_OTEL_EXPORTER": "zipkin"},
            "FSM_AGENT_OTEL_EXPORTER='zipkin': unknown exporter 'zipkin'; use a comma-separated list of "
            'console, otlp, jsonl, none (or unset it for the global provider), got "zipkin"',
        ),
        (
            {"FSM_AGENT_OTEL_EXPORTER": "jsonl", "FSM_AGENT_OTEL_JSONL_FILE": "/proc/no-such-dir/spans.jsonl"},
            "plugin otel: cannot write spans to /proc/no-such-dir: No such file or directory; "
            "fix --otel-jsonl-file (FSM_AGENT_OTEL_JSONL_FILE)",
        ),
    ],
)
def test_bad_options_are_a_one_line_error(tmp_path, agents, env, message):
    script = tmp_path / "ok.py"
    script.write_text("print('ok')\n")
    proc = agents.start("--standalone", str(script), env=env)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert err.strip().splitlines()[-1] == f"fsm-agent: error: {message}"
