"""Built-in metrics sink: every metric to the ``fsm_agent.metrics`` logger (torch's ConsoleMetricHandler)."""

from __future__ import annotations

import logging

from fsm_agent.plugins import hookimpl

log = logging.getLogger("fsm_agent.metrics")


@hookimpl
def fsm_agent_put_metric(metric_group, metric_name, metric_value):
    log.info("[metric][%s]: %s=%s", metric_group, metric_name, metric_value)
