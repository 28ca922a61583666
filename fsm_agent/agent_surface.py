"""PluginSurface: what plugins read of the agent and call on it, apart from the model.

``ElasticAgent`` (``fsm_agent.agent``) is the model of the statechart; this base class is its
documented surface for plugins: read-only properties (the agent alone changes what they show)
and the calls a plugin's ``fsm_agent_configure`` makes (``drain_on``, ``track_progress``, ...)
or its listeners make (``record_event``, ``put_metric``). ``tests/architecture`` checks that
plugins read these as attributes, never with ``getattr``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import pluggy

from fsm_agent.attribution import FailureReport
from fsm_agent.drain import NodeDrain
from fsm_agent.hang import HangDetector
from fsm_agent.logs import LogsLayout, TorchLogsSpecsLayout
from fsm_agent.plugins.protocols import RendezvousAdapter
from fsm_agent.progress import Cycle, CycleLog
from fsm_agent.recording import Listeners, event_record
from fsm_agent.worker import DrainSettings, WorkerGroup, WorkerSpec


class PluginSurface:
    """The agent as plugins see it (``ElasticAgent`` sets every attribute declared here)."""

    spec: WorkerSpec
    plugin_manager: pluggy.PluginManager
    restart_count: int
    _hostname: str
    _rdzv_handler: Any
    _rdzv: RendezvousAdapter
    _logs: LogsLayout | TorchLogsSpecsLayout
    _events_path: str | None
    _standby: str | None
    _cycles: CycleLog
    _step_times: dict[str, Any] | None
    _checkpoints: dict[str, Any] | None
    _job_verdict: dict[str, Any] | None
    _drains: NodeDrain
    _hang: HangDetector
    _listeners: Listeners
    _worker_group: WorkerGroup
    _signals: list[int]
    _forwarded: list[int]

    # -- public API (torch names) --------------------------------------------------------------
    def get_worker_group(self, role: str = "default") -> WorkerGroup:
        return self._worker_group

    @property
    def run_id(self) -> str:
        return str(self._rdzv_handler.get_run_id())

    @property
    def rdzv_endpoint(self) -> str:
        """Where the rendezvous is: the handler's ``endpoint`` if it has one (the port it bound for
        ``host:0``, as ``--standalone`` asks), else the configured ``--rdzv-endpoint``."""
        return self._rdzv.endpoint or self.spec.rendezvous.endpoint

    @property
    def run_log_dir(self) -> str | None:
        """The run's log directory (``--log-dir``'s ``<run_id>_<random>``, or a temporary one), or None."""
        return self._logs.run_log_dir

    @property
    def remaining_restarts(self) -> int:
        return self.spec.max_restarts - self.restart_count

    @property
    def hostname(self) -> str:
        """This node's name as its events, metrics and ``/status`` say it (``socket.getfqdn()``)."""
        return self._hostname

    @property
    def events_path(self) -> str | None:
        """The events file the built-in recorder writes (``--events-file``, else ``events.jsonl`` in
        the run's log directory), or None without a log directory."""
        return self._events_path

    @property
    def standby(self) -> str | None:
        """The rendezvous's message while this node waits as a hot spare (a node beyond
        ``max_nodes`` that the ``fsm`` backend keeps), or None: not a standby (any more)."""
        return self._standby

    @property
    def cycles(self) -> tuple[Cycle, ...]:
        """Every restart cycle so far, oldest first (``fsm_agent.progress.Cycle``): what the
        progress-aware restart policy decides on and ``/status`` shows."""
        return tuple(self._cycles.cycles)

    @property
    def step_times(self) -> Mapping[str, Any] | None:
        """The step-time view last reported with ``report_step_times`` (the ``straggler`` plugin's:
        window_s, factor, windows, basis, median_s, stragglers, ranks), for ``/status``; None while
        nobody reports one (no straggler detection, or no full window yet this attempt)."""
        return None if self._step_times is None else MappingProxyType(self._step_times)

    def report_step_times(self, view: Mapping[str, Any] | None) -> None:
        """Publish ``view`` as ``step_times`` (None clears it, as at each attempt's start)."""
        self._step_times = None if view is None else dict(view)

    @property
    def checkpoints(self) -> Mapping[str, Any] | None:
        """The agent-held checkpoints' view last reported with ``report_checkpoints`` (the
        ``checkpoint`` plugin's: dir, memory_bytes, restore (the last round's ``checkpoint_restore``
        record), persisted ({global_rank: step}), persist_error), for ``/status``; None while the
        plugin is off."""
        return None if self._checkpoints is None else MappingProxyType(self._checkpoints)

    def failure_classifier(self) -> Callable[[FailureReport], str | None]:
        """Hook ``fsm_agent_classify_failure`` as the attributor asks it (a site's rules first, the
        built-in ``attribution`` plugin last); ``fsm-agent replay`` asks it again on recorded reports."""
        hook = self.plugin_manager.hook.fsm_agent_classify_failure

        def classify(report: FailureReport) -> str | None:
            answer: str | None = hook(report=report)
            return answer

        return classify

    @property
    def job_verdict(self) -> Mapping[str, Any] | None:
        """The job's verdict once the job failed (``fsm_agent.job_verdict``: ``root_causes``,
        ``classes``, ``reasons``, ``exit_code``, ``summary``, ``decided_by``, ``reports``), the same
        on every node; None until then."""
        return None if self._job_verdict is None else MappingProxyType(self._job_verdict)

    def report_checkpoints(self, view: Mapping[str, Any] | None) -> None:
        """Publish ``view`` as ``checkpoints`` (a copy; None clears it)."""
        self._checkpoints = None if view is None else dict(view)

    def track_checkpoints(self, reader: Callable[[], int | None]) -> None:
        """Read each cycle's checkpoint step with ``reader`` (seconds-free: it returns the newest
        step every local worker holds a checkpoint of, or None) instead of ``--progress-file``.
        Called by the ``checkpoint`` plugin's ``fsm_agent_configure``."""
        self._cycles.checkpoint_step_reader = reader

    @property
    def drain(self) -> Mapping[str, Any] | None:
        """The drain that ended (or is ending) the run: scope, source, by, ts, and once the workers
        are stopped checkpoint_signal, timeout_s (seconds), exits, checkpointed, duration_s
        (seconds); None when no drain was taken. ``drain_request`` is one not taken yet."""
        return None if self._drains.taken is None else MappingProxyType(self._drains.taken)

    def drain_on(self, settings: DrainSettings) -> None:
        """Watch for drain requests as ``settings`` says (signals, the drain file) and drain that way.

        Called by the ``drain`` plugin's ``fsm_agent_configure``, before ``run()``.

        Raises:
            ConfigError: a drain signal is also a stop signal (``--signals-to-handle``) or forwarded
                (``--forward-signals``).
            ValueError: the scope is unknown.
        """
        self._drains.configure(settings, self._signals, self._forwarded)

    def request_drain(self, scope: str | None = None, source: str = "api", by: str = "") -> bool:
        """Ask for a drain; safe from any thread (the status endpoint's, a signal handler).

        Args:
            scope: ``"node"`` or ``"job"``; None: the configured ``--drain-scope``.
            source: what asked: ``signal``, ``file``, ``http``, ``peer`` or ``api``.
            by: which one (the signal's name, the file's path, the client's address).

        Returns:
            True if this request was taken; False when one is pending or the run is ending already.

        Raises:
            ValueError: ``scope`` is neither ``node`` nor ``job``.
        """
        return self._drains.ask(scope, source, by)

    @property
    def drain_request(self) -> dict[str, str] | None:
        """The drain request the run loop has not acted on yet (scope, source, by), or None."""
        return self._drains.request

    def track_progress(self, progress_file: str | None = None, max_no_progress_restarts: int = 0) -> None:
        """Read progress for the cycle records: every worker gets a heartbeat file (so
        ``fsm_agent.heartbeat(step=N)`` reports), ``progress_file`` is the iteration file the
        training writes at each checkpoint; ``max_no_progress_restarts`` (the restart limit a
        policy applies) goes into each ``cycle`` event, so ``fsm-agent replay`` applies it too.
        Called by the ``progress`` plugin's ``fsm_agent_configure``."""
        self.track_steps()
        self._cycles.progress_file = progress_file or None
        self._cycles.no_progress_limit = max_no_progress_restarts

    def declare_restart_policy(self, **options: str) -> None:
        """The restart policy's options as its plugin resolved them (``budgets``,
        ``exclude_node_on``; empty ones left out): each ``cycle`` event carries them, so
        ``fsm-agent replay`` gives the policy the same. Called by the ``restart-policy`` plugin's
        ``fsm_agent_configure``."""
        self._cycles.restart_policy = {name: value for name, value in options.items() if value}

    def track_steps(self) -> None:
        """Hand every worker a heartbeat file from the next attempt on, so ``worker_steps()`` reads
        what ``fsm_agent.heartbeat(step=N)`` reports. Called by plugins' ``fsm_agent_configure``."""
        self._hang.track_steps()

    def worker_steps(self) -> dict[int, int]:
        """{local_rank: the last step its worker reported this attempt}, for workers that did
        (``fsm_agent.heartbeat(step=N)``; empty unless ``track_steps()`` was called)."""
        return self._hang.steps(self.spec.local_world_size)

    def worker_compute(self) -> dict[int, float]:
        """{local_rank: its worker's total compute seconds this attempt}, for workers that
        reported compute time (``fsm_agent.heartbeat(compute_s=...)``/``fsm_agent.compute()``;
        empty unless ``track_steps()`` was called)."""
        return self._hang.compute(self.spec.local_world_size)

    def record_event(self, kind: str, **fields: Any) -> None:
        """Send one record of ``kind`` (docs/events.md) with the agent's common fields and ``fields``
        to every ``fsm_agent_record_event`` listener; for plugins' own records."""
        self._listeners.broadcast("fsm_agent_record_event", event=self._event(kind, **fields))

    def put_metric(self, group: str, name: str, value: float) -> None:
        """Send one metric to every ``fsm_agent_put_metric`` listener (torch's ``put_metric``)."""
        self._listeners.broadcast("fsm_agent_put_metric", metric_group=group, metric_name=name, metric_value=value)

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        try:
            run_id = self.run_id
        except Exception:
            run_id = self.spec.rendezvous.run_id
        return event_record(
            kind,
            self._worker_group,
            hostname=self.hostname,
            run_id=run_id,
            restart_count=self.restart_count,
            current_state=self._current_state(),
            **fields,
        )

    def _current_state(self) -> str | None:
        state = getattr(self, "state", None)  # set by the machine, after __init__ began
        return None if state is None else str(state.value)
