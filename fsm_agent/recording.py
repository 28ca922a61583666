"""How the agent tells its listeners: listener hooks called one by one, event records, metrics.

``Listeners.broadcast`` calls every implementation of a listener hook (``fsm_agent_record_event``,
``fsm_agent_put_metric``, ``fsm_agent_state_changed``, ...) so that one failing listener does not
stop the rest; ``event_record`` builds the common fields every record of docs/events.md carries;
``final_metrics`` are torch's ``_record_metrics`` names.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import attrs
import pluggy

from fsm_agent.interrupts import SignalStop
from fsm_agent.worker import RunResult, WorkerGroup

log = logging.getLogger(__name__)


@attrs.frozen
class TransitionRecord:
    """One state change of the worker group.

    Attributes:
        source / dest: WorkerState names.
        trigger: the table trigger that fired.
        ts: wall-clock time of the change, seconds since the epoch.
        restart_count: restarts used, after the change.
        duration_s: seconds spent in ``source``.
        error: the agent error that caused the change, if any.
    """

    source: str
    dest: str
    trigger: str
    ts: float
    restart_count: int
    duration_s: float
    error: str | None = None


class Listeners:
    """The listener side of the plugin manager.

    Args:
        plugin_manager: the agent's pluggy manager.
    """

    def __init__(self, plugin_manager: pluggy.PluginManager) -> None:
        self._plugin_manager = plugin_manager

    def broadcast(self, hook_name: str, **kwargs: Any) -> None:
        """Call every implementation of ``hook_name``; one failing listener does not stop the rest.

        pluggy aborts a hook call at the first exception, so listeners are called one by one. A
        stop signal (``SignalStop``) raised inside a listener still stops the agent.
        """
        for impl in reversed(getattr(self._plugin_manager.hook, hook_name).get_hookimpls()):
            try:
                impl.function(**{name: kwargs[name] for name in impl.argnames})
            except SignalStop:
                raise
            except Exception:
                log.exception("plugin %r failed in %s; continuing", impl.plugin_name, hook_name)


def event_record(
    kind: str,
    group: WorkerGroup,
    *,
    hostname: str,
    run_id: str,
    restart_count: int,
    current_state: str | None,
    **fields: Any,
) -> dict[str, Any]:
    """One record of ``kind`` with the fields every record carries (docs/events.md), then ``fields``
    (which may replace them: ``run_end`` says its terminal ``state`` itself)."""
    spec = group.spec
    return {
        "ts": time.time(),
        "kind": kind,
        "node": hostname,
        "pid": os.getpid(),
        "role": spec.role,
        "run_id": run_id,
        "restart_count": restart_count,
        "max_restarts": spec.max_restarts,
        "state": current_state,
        "group_rank": group.group_rank,
        "group_world_size": group.group_world_size,
        "local_world_size": spec.local_world_size,
        "rdzv_backend": spec.rendezvous.backend,
        "master_addr": group.master_addr,
        "master_port": group.master_port,
        "entrypoint": spec.get_entrypoint_name(),
        "workers": [
            {
                "local_rank": w.local_rank,
                "global_rank": w.global_rank,
                "role_rank": w.role_rank,
                "world_size": w.world_size,
                "role_world_size": w.role_world_size,
                "pid": w.id,
            }
            for w in group.workers
        ],
        **fields,
    }


def transition_event(
    record: TransitionRecord, decided_class: str | None, drain: Any, fact: dict[str, Any] | None
) -> dict[str, Any]:
    """The fields of a ``transition`` event (docs/events.md): the record's, what the restart policy
    decided about (``failure_class``), a drain's scope and source, and the trigger's fact."""
    fields: dict[str, Any] = dict(
        source=record.source,
        dest=record.dest,
        trigger=record.trigger,
        duration_s=round(record.duration_s, 6),
        error=record.error,
    )
    if decided_class:
        fields["failure_class"] = decided_class
    if record.trigger == "drain_requested" and drain is not None:  # a drain, not a failure
        fields.update(drain_scope=drain["scope"], drain_source=drain["source"])
    if fact is not None:
        fields["fact"] = fact
    return fields


def transition_metrics(
    role: str, source: str, dest: str, trigger: str, remaining_restarts: int, duration_s: float
) -> list[tuple[str, str, float]]:
    """``(group, name, value)`` of the metrics put after every transition: torch's
    ``workers.<role>.remaining_restarts`` and ``workers.<role>.<state>``, fsm-agent's seconds spent
    in the source state, and a drain's count (counted apart from failures and restarts)."""
    metrics: list[tuple[str, str, float]] = [
        ("torchelastic", f"workers.{role}.remaining_restarts", remaining_restarts),
        ("torchelastic", f"workers.{role}.{dest.lower()}", 1),
        ("fsm_agent", f"state.{source}.duration_s", duration_s),
    ]
    if trigger == "drain_requested":
        metrics.append(("fsm_agent", "drains", 1))
    return metrics


def final_metrics(result: RunResult, max_restarts: int, restart_count: int) -> dict[str, float]:
    """torch's ``_record_metrics`` names and values for a run that ended with ``result``:
    run_total, flakiness, run_{success,failed}_{with,no}_retries; run_drained for a drain."""
    drained, restarted = result.drain is not None, restart_count > 0
    failed = result.is_failed() and not drained  # a drain is counted apart (run_drained)
    remaining = max_restarts - restart_count
    flakiness = 100.0 if failed else 100.0 - 100.0 * (remaining + 1) / (max_restarts + 1)
    return {
        "run_total": 1,
        "flakiness": flakiness,
        "run_success_with_retries": int(not failed and restarted),
        "run_success_no_retries": int(not failed and not restarted),
        "run_failed_with_retries": int(failed and restarted),
        "run_failed_no_retries": int(failed and not restarted),
        **({"run_drained": 1} if drained else {}),  # only then: a run's metrics stay torch's otherwise
    }
