"""fsm-agent-prometheus: the agent's metrics and state durations, served in Prometheus format over HTTP.

Off unless a port is set: ``--prometheus-port``, ``FSM_AGENT_PROMETHEUS_PORT`` or
``[plugins.prometheus] port`` in the config file (see ``fsm_agent_addoption``). Each agent then
serves ``http://127.0.0.1:<port>/metrics`` from its own ``CollectorRegistry`` while it runs.
Torch's dotted metric names become Prometheus names by the rules in ``metric_for`` (and the
README): ``workers.<role>.remaining_restarts`` -> ``torchelastic_workers_remaining_restarts{role}``,
``state.<STATE>.duration_s`` -> ``fsm_agent_state_duration_seconds{role,state}`` (a histogram), and
so on.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from fsm_agent.plugins import hookimpl

log = logging.getLogger(__name__)

__all__ = ["PrometheusExporter", "metric_for", "read_options"]

PLUGIN_NAME = "prometheus"
EXPORTER_NAME = "prometheus-exporter"


def read_options(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """This plugin's options, from the environment (``FSM_AGENT_PROMETHEUS_<OPTION>``).

    * ``FSM_AGENT_PROMETHEUS_PORT`` (default unset = 0 = off): the TCP port to serve on.
    * ``FSM_AGENT_PROMETHEUS_ADDR`` (default ``127.0.0.1``): the address to bind; ``0.0.0.0``
      exposes it to the network.
    * ``FSM_AGENT_PROMETHEUS_LINGER_S`` (default 0): after the run ends, keep serving until one
      more scrape has read the final metrics (``run_success_*``, the terminal state), at most this
      many seconds. 0 stops the server as soon as the run ends.

    Raises:
        ValueError: a value is malformed (named with the fix).
    """
    env = os.environ if environ is None else environ

    def number(name: str, default: str, kind=int):
        raw = env.get(f"FSM_AGENT_PROMETHEUS_{name}", "").strip() or default
        try:
            return kind(raw)
        except ValueError:
            raise ValueError(
                f"FSM_AGENT_PROMETHEUS_{name}={raw!r}: expected a number "
                f"(e.g. FSM_AGENT_PROMETHEUS_{name}={default or 0})"
            ) from None

    options = {
        "port": number("PORT", "0"),
        "addr": env.get("FSM_AGENT_PROMETHEUS_ADDR", "").strip() or "127.0.0.1",
        "linger_s": number("LINGER_S", "0", float),
    }
    if not 0 <= options["port"] <= 65535:
        raise ValueError(f"FSM_AGENT_PROMETHEUS_PORT={options['port']}: must be 0 (off) or a TCP port 1..65535")
    if options["linger_s"] < 0:
        raise ValueError(f"FSM_AGENT_PROMETHEUS_LINGER_S={options['linger_s']}: must be >= 0 seconds")
    return options


def __getattr__(name):  # prometheus_client is imported only when the exporter is switched on
    if name in ("PrometheusExporter", "metric_for"):
        from fsm_agent_prometheus import exporter

        return getattr(exporter, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: What `fsm-agent plugins` lists as this plugin's kind(s).
FSM_AGENT_KINDS = ("metrics",)


def _check_port(port: int) -> None:
    if not 0 <= port <= 65535:
        raise ValueError("expected 0 (off) or a TCP port 1..65535")


def _check_seconds(seconds: float) -> None:
    if seconds < 0:
        raise ValueError("expected seconds >= 0")


@hookimpl
def fsm_agent_addoption(options):
    """``--prometheus-port`` / ``FSM_AGENT_PROMETHEUS_PORT`` / ``[plugins.prometheus] port``, and so on."""
    options.add(
        "port",
        type=int,
        default=0,
        check=_check_port,
        help="serve the agent's metrics on http://ADDR:PORT/metrics while it runs; 0: off",
    )
    options.add(
        "addr",
        type=str,
        default="127.0.0.1",
        help="the address the metrics server binds; 0.0.0.0 exposes it to the network",
    )
    options.add(
        "linger_s",
        type=float,
        default=0.0,
        check=_check_seconds,
        help="after the run, serve until one more scrape read the final metrics, at most this many "
        "seconds; 0: stop at once",
    )


def run_options(config: Any) -> dict[str, Any]:
    """The options for a run: resolved by the CLI (``config.plugins``), else from the environment
    (a ``LaunchConfig`` built in Python carries only what its ``plugins`` holds).

    Raises:
        ValueError: a malformed environment variable (named with the fix).
    """
    given = dict(config.plugin_options(PLUGIN_NAME)) if hasattr(config, "plugin_options") else {}
    return given if {"port", "addr", "linger_s"} <= set(given) else {**read_options(), **given}


@hookimpl
def fsm_agent_configure(config, agent):
    """Start the exporter for this run when a port is set.

    Raises:
        ConfigError: a malformed option (the CLI prints it on one line and exits 2).
    """
    from fsm_agent.errors import ConfigError

    try:
        options = run_options(config)
    except ValueError as exc:
        raise ConfigError(f"plugin prometheus: {exc}") from None
    if not options["port"]:
        return
    from fsm_agent_prometheus.exporter import PrometheusExporter

    role = getattr(config, "role", None) or agent.spec.role
    exporter = PrometheusExporter(role=role, linger_s=options["linger_s"])
    exporter.set_info(agent=agent, config=config)
    try:
        exporter.serve(options["addr"], options["port"])
    except OSError as exc:  # a busy port must not stop the training job
        log.warning(
            "prometheus: cannot serve on %s:%s (%s); metrics are not exported for this run",
            options["addr"],
            options["port"],
            exc,
        )
        return
    agent.plugin_manager.register(exporter, EXPORTER_NAME)
