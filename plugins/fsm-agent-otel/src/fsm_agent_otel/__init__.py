"""fsm-agent-otel: OpenTelemetry traces of the agent — one span per state visit of the worker group.

A run is one trace: a root span ``fsm-agent run`` and, under it, one span per state the worker
group was in (``INIT``, ``HEALTHY``, ``STOPPED``, ``HEALTHY``, ..., ``SUCCEEDED``), each ended at
the next transition. Worker exits and completed rendezvous rounds are span events.

Where the spans go (``--otel-exporter``, ``FSM_AGENT_OTEL_EXPORTER`` or ``[plugins.otel] exporter``;
the options are declared in ``fsm_agent_addoption``):

* ``FSM_AGENT_OTEL_EXPORTER`` unset: the application's global TracerProvider
  (``opentelemetry.trace.set_tracer_provider``, ``opentelemetry-instrument``...). This is what an
  in-process ``fsm_agent.launch_agent`` caller uses; without a configured provider it costs nothing.
* ``FSM_AGENT_OTEL_EXPORTER=console,otlp,jsonl`` (any of them, comma-separated): the plugin builds
  its own SDK TracerProvider for the run and shuts it down (flushing every span) at the end.
"""

from __future__ import annotations

import os
from typing import Any

from fsm_agent.plugins import hookimpl

__all__ = ["EXPORTERS", "parse_exporters", "read_options", "run_options"]

PLUGIN_NAME = "otel"
TRACER_NAME = "fsm_agent_otel"
EXPORTERS = ("console", "otlp", "jsonl", "none")


def read_options(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """This plugin's options, from the environment (``FSM_AGENT_OTEL_<OPTION>``).

    * ``FSM_AGENT_OTEL_EXPORTER`` (default unset: the global TracerProvider): comma-separated
      ``console`` (stdout), ``otlp`` (OTLP/HTTP if ``opentelemetry-exporter-otlp-proto-http`` is
      installed, else OTLP/gRPC; endpoint and headers from the standard ``OTEL_EXPORTER_OTLP_*``
      variables), ``jsonl`` (one span per line to ``FSM_AGENT_OTEL_JSONL_FILE``), ``none`` (off).
    * ``FSM_AGENT_OTEL_JSONL_FILE`` (default ``spans.jsonl`` next to the events file): where
      ``jsonl`` writes.
    * ``FSM_AGENT_OTEL_SERVICE_NAME`` (default ``OTEL_SERVICE_NAME``, else ``fsm-agent``): the
      ``service.name`` resource attribute of the plugin's own TracerProvider.

    Raises:
        ValueError: an unknown exporter name (the message lists the known ones).
    """
    env = os.environ if environ is None else environ
    raw = env.get("FSM_AGENT_OTEL_EXPORTER", "").strip()
    try:
        exporters = parse_exporters(raw)
    except ValueError as exc:
        raise ValueError(f"FSM_AGENT_OTEL_EXPORTER={raw!r}: {exc}") from None
    return _options(
        exporters, env.get("FSM_AGENT_OTEL_JSONL_FILE", ""), env.get("FSM_AGENT_OTEL_SERVICE_NAME", ""), env
    )


def parse_exporters(raw: str) -> tuple[str, ...]:
    """``"Console, jsonl,console"`` -> ``("console", "jsonl")``; raises ValueError naming an unknown one."""
    exporters = tuple(dict.fromkeys(e.strip().lower() for e in raw.split(",") if e.strip()))
    unknown = [e for e in exporters if e not in EXPORTERS]
    if unknown:
        raise ValueError(
            f"unknown exporter {unknown[0]!r}; use a comma-separated list of {', '.join(EXPORTERS)} "
            f"(or unset it for the global provider)"
        )
    return exporters


def _options(
    exporters: tuple[str, ...], jsonl_file: str | None, service_name: str | None, environ: Any
) -> dict[str, Any]:
    return {
        "exporters": exporters,
        "jsonl_file": (jsonl_file or "").strip() or None,
        "service_name": (service_name or "").strip() or environ.get("OTEL_SERVICE_NAME", "").strip() or "fsm-agent",
    }


def run_options(config: Any) -> dict[str, Any]:
    """The options for a run: resolved by the CLI (``config.plugins``), else from the environment
    (a ``LaunchConfig`` built in Python carries only what its ``plugins`` holds).

    Raises:
        ValueError: a malformed option (named with the fix).
    """
    given = dict(config.plugin_options(PLUGIN_NAME)) if hasattr(config, "plugin_options") else {}
    if not {"exporter", "jsonl_file", "service_name"} <= set(given):
        return read_options()
    return _options(parse_exporters(given["exporter"] or ""), given["jsonl_file"], given["service_name"], os.environ)


def _check_exporters(value: str) -> None:
    parse_exporters(value)


@hookimpl
def fsm_agent_addoption(options):
    """``--otel-exporter`` / ``FSM_AGENT_OTEL_EXPORTER`` / ``[plugins.otel] exporter``, and so on."""
    options.add(
        "exporter",
        type=str,
        default="",
        check=_check_exporters,
        help=f"where spans go: a comma-separated list of {', '.join(EXPORTERS)}; "
        f"unset: the application's global TracerProvider",
    )
    options.add(
        "jsonl_file",
        type=str,
        default=None,
        help="the file the jsonl exporter writes; unset: spans.jsonl next to the events file",
    )
    options.add(
        "service_name",
        type=str,
        default=None,
        help="service.name of the plugin's own TracerProvider; unset: $OTEL_SERVICE_NAME, else fsm-agent",
    )


#: What `fsm-agent plugins` lists as this plugin's kind(s).
FSM_AGENT_KINDS = ("event recording",)


@hookimpl
def fsm_agent_configure(config, agent):
    """Register a StateSpans recorder for this run (INIT's span starts now).

    Raises:
        ConfigError: a malformed option, ``otlp`` without an OTLP exporter package, or a
            ``jsonl`` file that cannot be opened.
    """
    from fsm_agent.errors import ConfigError

    try:
        options = run_options(config)
    except ValueError as exc:
        raise ConfigError(f"plugin otel: {exc}") from None
    if options["exporters"] == ("none",):
        return
    from fsm_agent_otel.spans import StateSpans, build_provider

    provider = None
    if options["exporters"]:
        try:
            provider = build_provider(options, default_jsonl_dir=_default_jsonl_dir(agent))
        except ValueError as exc:
            raise ConfigError(f"plugin otel: {exc}") from None
        except OSError as exc:  # the jsonl file cannot be opened
            raise ConfigError(
                f"plugin otel: cannot write spans to {exc.filename or options['jsonl_file']}: "
                f"{exc.strerror or exc}; fix --otel-jsonl-file (FSM_AGENT_OTEL_JSONL_FILE)"
            ) from None
    agent.plugin_manager.register(StateSpans.for_agent(agent, config, provider), "otel-state-spans")


def _default_jsonl_dir(agent) -> str | None:
    events_path = agent.events_path
    if events_path and events_path != os.devnull:
        return os.path.dirname(os.path.abspath(events_path))
    return None
