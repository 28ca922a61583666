"""The agent's in-process restart steps and guard (the table's ``recovers_in_process`` rows).

A mixin of ``ElasticAgent``, on the agent's own data; the service it drives is
``fsm_agent.inprocess.recovery.InProcessRecovery`` (the store, the generations, the barrier).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any

from transitions import EventData

from fsm_agent.inprocess import protocol
from fsm_agent.inprocess.recovery import InProcessRecovery
from fsm_agent.plugins.protocols import LauncherAdapter
from fsm_agent.states.facts import InProcessFailed, InProcessRecovered, WorkersFailed, fact_of
from fsm_agent.states.worker_state import WorkerState
from fsm_agent.worker import FailureClass, RestartDecision, WorkerFailure, WorkerGroup, WorkerSpec

log = logging.getLogger(__name__)


class InProcessSteps:
    """In-process restart, on the agent's own data (see ``fsm_agent.inprocess``)."""

    spec: WorkerSpec
    state: WorkerState
    restart_count: int
    _worker_group: WorkerGroup
    _launcher_extras: LauncherAdapter
    _inprocess: InProcessRecovery
    _failures: dict[int, WorkerFailure]
    _decision: RestartDecision | None
    _worker_logs: dict[int, Any]
    _watch: Any
    _hang: Any

    def record_event(self, kind: str, **fields: Any) -> None:
        raise NotImplementedError  # PluginSurface's

    def _ask_restart_policy(self, failure_class: str, default: RestartDecision, what: str) -> None:
        raise NotImplementedError  # ElasticAgent's

    def _end_cycle(self, progress: Any, failure_class: str | None) -> None:
        raise NotImplementedError  # ElasticAgent's

    def _worker_envs(self, workers: list[Any], extra_env: dict[str, str] | None = None) -> dict[int, dict[str, str]]:
        raise NotImplementedError  # ElasticAgent's

    def restart_in_process(self, timeout_s: float) -> None:
        """Recover a failed worker by replacing its process alone while the others keep theirs
        (``--restart-mode inprocess``), each recovery within ``timeout_s`` seconds
        (``--inprocess-timeout``), else the whole group restarts. Called by the ``inprocess``
        plugin's ``fsm_agent_configure``. The workers must use ``fsm_agent.inprocess.run``."""
        self._inprocess.enable(timeout_s)

    # -- the guard and the decision ---------------------------------------------------------------
    def recovers_in_process(self, event: EventData | None = None) -> bool:
        """The decision is an in-process recovery (``RestartDecision.in_process``)."""
        return self._decision is not None and self._decision.in_process

    def _chooses_in_process(self, fact: WorkersFailed) -> bool:
        """Whether the failed workers of ``fact`` are recovered in process: every rank uses the
        API, no recovery runs, the launcher can replace one worker (``InProcessRecovery.why_not``),
        and the restart policy, asked about class ``inprocess``, says so. Replay: as recorded."""
        if self.state != WorkerState.HEALTHY or not fact.exits:
            return False
        if fact.in_process is None:
            ranks = [w.global_rank for w in self._worker_group.workers if w.local_rank in fact.exits]
            why_not = self._inprocess.why_not(ranks, self._launcher_extras.replaces_workers)
            if why_not is not None:
                if self._inprocess.enabled:
                    log.warning("[%s] no in-process recovery: %s; the whole group restarts", self.spec.role, why_not)
                return False
        elif not fact.in_process:
            return False
        self._ask_restart_policy(
            FailureClass.INPROCESS,
            RestartDecision(True, in_process=True, reason="in-process recovery"),
            f"workers failed (local ranks {sorted(fact.exits)}): recover in process",
        )
        return self.recovers_in_process()

    # -- the steps --------------------------------------------------------------------------------
    def _replace_failed_workers(self, event: EventData) -> None:
        """Begin the next generation (the survivors of every node are interrupted) and start a new
        process for each failed worker of this node (the launcher's ``replace_workers``); the
        other workers keep running. Records an ``inprocess_recovery_begun`` event. When either
        fails (the store gone, a launcher or plugin error), the recovery is abandoned: the next
        look reports ``inprocess_failed`` and the whole group restarts."""
        fact = fact_of(event, WorkersFailed)
        workers = [w for w in self._worker_group.workers if w.local_rank in fact.exits]
        replaced = {w.local_rank: w.global_rank for w in workers}
        fault_at = min(fact.exit_times.values(), default=time.time())
        try:
            recovery = self._inprocess.begin(replaced, fault_at)
            for local_rank in replaced:  # kept beside it: the new process writes its own, if it fails
                with contextlib.suppress(OSError):
                    error_file = self._worker_logs[local_rank].error_file
                    os.replace(error_file, f"{error_file}.generation{recovery.generation - 1}")
            envs = self._worker_envs(workers, {protocol.ENV_GENERATION: str(recovery.generation)})
            if self._launcher_extras.replaces_workers:  # else a replay, whose launcher has no processes
                pids = self._launcher_extras.replace_workers(self.spec, envs, {r: self._worker_logs[r] for r in envs})
                for worker in workers:
                    worker.id = pids[worker.local_rank]
        except Exception as exc:  # nothing to wait for: the whole group restarts
            why = f"replacing local ranks {sorted(replaced)} failed: {type(exc).__name__}: {exc}"
            log.error("[%s] in-process recovery: %s", self.spec.role, why)
            self._inprocess.abandon(replaced, fault_at, why)
            return
        recovery.spawned_at = time.time()
        self._watch.workers_replaced(set(replaced))
        self._hang.workers_replaced(set(replaced))
        self.record_event(
            "inprocess_recovery_begun",
            generation=recovery.generation,
            replaced={str(r): g for r, g in replaced.items()},
            exits={str(r): c for r, c in fact.exits.items()},
        )

    def _record_inprocess_recovery(self, event: EventData) -> None:
        """Record the ``inprocess_recovery`` event (outcome ``recovered``): the generation, the
        ranks replaced and each phase's seconds."""
        fact = fact_of(event, InProcessRecovered)
        self._record_recovery_end("recovered", fact)
        self._failures = {}  # recovered: a later success reports none (the events keep them)

    def _decide_on_inprocess_failure(self, event: EventData) -> None:
        """The recovery did not complete: record it (outcome ``failed``), end the attempt's cycle
        and ask the restart policy about class ``inprocess_failed`` (a counted restart)."""
        fact = fact_of(event, InProcessFailed)
        self._record_recovery_end("failed", fact)
        self._end_cycle(fact.progress, FailureClass.INPROCESS_FAILED)
        self._ask_restart_policy(
            FailureClass.INPROCESS_FAILED,
            RestartDecision(self.restart_count < self.spec.max_restarts),
            f"in-process recovery of generation {fact.generation} failed ({fact.reason}): restart the whole group",
        )

    def _record_recovery_end(self, outcome: str, fact: InProcessRecovered | InProcessFailed) -> None:
        self._inprocess.current = None  # ended (a replay fires the recorded end without looking)
        fields: dict[str, Any] = {
            "outcome": outcome,
            "generation": fact.generation,
            "replaced": {str(r): g for r, g in fact.replaced.items()},
            **fact.phases,
        }
        if isinstance(fact, InProcessFailed):
            fields["reason"] = fact.reason
        self.record_event("inprocess_recovery", **fields)
