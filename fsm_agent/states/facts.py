"""The facts that fire the table's triggers: one attrs class per trigger, each naming its trigger.

The run loop's watcher (``fsm_agent.watcher``) observes a fact and the agent fires its trigger with
it; every step of the row receives it as ``event.kwargs["fact"]``. ``fsm-agent replay`` builds
the same classes from the ``fact`` field of each ``transition`` record (docs/events.md, generated
from this module). A fact can only fire its own trigger (``Fact.trigger``), and
``fsm_agent.states.checks.check_facts`` fails when a trigger of the table has no fact class or a
fact class names a trigger the table lacks.

Mapping keys are ints in the facts (``local_rank`` or ``global_rank``); the events file writes
them as JSON strings, ``from_record`` turns them back.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

import attrs

from fsm_agent.worker import DRAIN_SCOPES

F = TypeVar("F", bound="Fact")


def _int_keys(value: Mapping[Any, Any] | None) -> dict[int, Any]:
    return {int(key): item for key, item in (value or {}).items()}


def _exit_codes(value: Mapping[Any, Any] | None) -> dict[int, int]:
    return {int(key): int(code) for key, code in (value or {}).items()}


def _seconds(value: Mapping[Any, Any] | None) -> dict[int, float]:
    return {int(key): float(ts) for key, ts in (value or {}).items()}


@attrs.frozen
class Progress:
    """How far an attempt got, when a replay says so instead of the workers' reports.

    Attributes:
        last_step: the highest step a worker reported (``fsm_agent.heartbeat(step=N)``), or None.
        checkpoint_step: the integer in ``--progress-file`` when the attempt ended, or None.
    """

    last_step: int | None = None
    checkpoint_step: int | None = None


def _progress(value: Progress | Mapping[str, Any] | None) -> Progress | None:
    if value is None or isinstance(value, Progress):
        return value
    return Progress(last_step=value.get("last_step"), checkpoint_step=value.get("checkpoint_step"))


@attrs.frozen(kw_only=True)
class Fact:
    """What happened, as the data of the table trigger ``trigger`` (a class attribute)."""

    trigger: ClassVar[str] = ""

    def record(self) -> dict[str, Any]:
        """The fields as the ``fact`` of a ``transition`` record (JSON-ready; None fields left out)."""
        return {key: value for key, value in attrs.asdict(self).items() if value is not None}

    @classmethod
    def from_record(cls: type[F], fields: Mapping[str, Any]) -> F:
        """The fact a ``transition`` record's ``fact`` field holds (``record()``'s inverse).

        Raises:
            TypeError: a field this fact does not have.
        """
        return cls(**fields)


@attrs.frozen(kw_only=True)
class Start(Fact):
    """The command that starts the first attempt (INIT: rendezvous, then spawn the workers)."""

    trigger: ClassVar[str] = "start"


@attrs.frozen(kw_only=True)
class Restart(Fact):
    """The command that starts the next attempt (STOPPED: backoff, rendezvous, spawn)."""

    trigger: ClassVar[str] = "restart"


@attrs.frozen(kw_only=True)
class WorkersHung(Fact):
    """Workers stopped reporting progress (``--hang-timeout``).

    Attributes:
        hung: ``{local_rank: why}`` of the hung workers.
    """

    trigger: ClassVar[str] = "workers_hung"
    hung: dict[int, str] = attrs.field(converter=_int_keys)


@attrs.frozen(kw_only=True)
class HealthCheckFailed(Fact):
    """A health-check plugin found the node unhealthy: its workers count as failed.

    Attributes:
        problem: what the plugins said.
        failure_class: the failed workers' class (``health_check``, or e.g. ``straggler``).
        global_rank: the worker the problem is about (the root cause), or None for the node.
    """

    trigger: ClassVar[str] = "health_check_failed"
    problem: str = attrs.field(converter=str)
    failure_class: str = "health_check"
    global_rank: int | None = None


@attrs.frozen(kw_only=True)
class WorkersSucceeded(Fact):
    """Every local worker exited 0.

    Attributes:
        return_values: ``{global_rank: value}`` (None for a program; callables return theirs).
        progress: how far the attempt got (replay), else None: the workers' reports are read.
    """

    trigger: ClassVar[str] = "workers_succeeded"
    return_values: dict[int, Any] = attrs.field(factory=dict, converter=_int_keys)
    progress: Progress | None = attrs.field(default=None, converter=_progress)

    def record(self) -> dict[str, Any]:
        # A callable's return value need not be JSON: the record keeps which ranks returned.
        fields = super().record()
        fields["return_values"] = {rank: None for rank in self.return_values}
        return fields


@attrs.frozen(kw_only=True)
class WorkersFailed(Fact):
    """Workers failed. From HEALTHY: the failed workers' exits; from UNHEALTHY (fired by the run
    loop itself) none: the workers that made the group unhealthy are the failures.

    Attributes:
        exits: ``{local_rank: exitcode}`` of the failed workers (negative: killed by that signal).
        exit_times: ``{local_rank: seconds since the epoch}`` when each exit was seen.
        progress: how far the attempt got (replay), else None: the workers' reports are read.
        job_verdict: the job's verdict when this node gave the job up (replay: the recorded
            ``verdict`` event), else None: decided with the other nodes through the store.
        in_process: whether the agent recovered in process (replay: the recorded next state), else
            None: decided live (``fsm_agent.inprocess``).
    """

    trigger: ClassVar[str] = "workers_failed"
    exits: dict[int, int] = attrs.field(factory=dict, converter=_exit_codes)
    exit_times: dict[int, float] = attrs.field(factory=dict, converter=_seconds)
    progress: Progress | None = attrs.field(default=None, converter=_progress)
    job_verdict: dict[str, Any] | None = None
    in_process: bool | None = None


@attrs.frozen(kw_only=True)
class InProcessRecovered(Fact):
    """Every rank arrived at the barrier of the generation this node's agent began when it replaced
    its failed workers (``fsm_agent.inprocess``): training goes on, no other process restarted.

    Attributes:
        generation: the generation that began.
        replaced: ``{local_rank: global_rank}`` of the workers whose processes were replaced.
        phases: seconds of each phase (``detect_s``, ``replace_s``, ``barrier_s``, ``total_s``).
    """

    trigger: ClassVar[str] = "inprocess_recovered"
    generation: int = 0
    replaced: dict[int, int] = attrs.field(factory=dict, converter=_int_keys)
    phases: dict[str, float] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class InProcessFailed(Fact):
    """An in-process recovery this node's agent began did not complete within
    ``--inprocess-timeout`` seconds (a rank that never reached the barrier), or its store went
    away: the whole group restarts, as for any failure (class ``inprocess_failed``).

    Attributes:
        reason: why, in one line.
        generation: the generation that did not complete.
        replaced: ``{local_rank: global_rank}`` of the workers replaced for it.
        phases: seconds of each phase until it was given up.
        progress: how far the attempt got (replay), else None: the workers' reports are read.
        job_verdict: the job's verdict when this node gave the job up (replay), else None.
    """

    trigger: ClassVar[str] = "inprocess_failed"
    reason: str = ""
    generation: int = 0
    replaced: dict[int, int] = attrs.field(factory=dict, converter=_int_keys)
    phases: dict[str, float] = attrs.field(factory=dict)
    progress: Progress | None = attrs.field(default=None, converter=_progress)
    job_verdict: dict[str, Any] | None = None


@attrs.frozen(kw_only=True)
class MembershipChanged(Fact):
    """A node was lost, or nodes wait to join: by default a restart that is not counted.

    Attributes:
        change: ``node_lost`` or ``membership_change``.
        progress: how far the attempt got (replay), else None: the workers' reports are read.
        job_verdict: the job's verdict when this node gave the job up (replay: the recorded
            ``verdict`` event), else None: decided with the other nodes through the store.
    """

    trigger: ClassVar[str] = "membership_changed"
    change: str = attrs.field(
        default="membership_change", validator=attrs.validators.in_(("node_lost", "membership_change"))
    )
    progress: Progress | None = attrs.field(default=None, converter=_progress)
    job_verdict: dict[str, Any] | None = None


@attrs.frozen(kw_only=True)
class RendezvousFailed(Fact):
    """The rendezvous or its store failed: while joining, or while checking membership.

    Attributes:
        error: what failed, with where (backend, endpoint, run id, timeout).
    """

    trigger: ClassVar[str] = "rendezvous_failed"
    error: str = attrs.field(converter=str)


@attrs.frozen(kw_only=True)
class RendezvousNotNeeded(Fact):
    """A node beyond max_nodes whose rendezvous closed: nothing to do, a clean exit."""

    trigger: ClassVar[str] = "rendezvous_not_needed"


@attrs.frozen(kw_only=True)
class StopRequested(Fact):
    """The agent received a stop signal (``--signals-to-handle``)."""

    trigger: ClassVar[str] = "stop_requested"


@attrs.frozen(kw_only=True)
class DrainRequested(Fact):
    """A drain (preemption notice): an orderly stop that is neither a failure nor a restart.

    Attributes:
        scope: ``node`` (this node alone leaves) or ``job`` (every node drains).
        source: what asked: ``signal``, ``file``, ``http``, ``peer``, ``api`` (``replay``).
        by: which one: the signal's name, the file's path, the client's address, the peer.
    """

    trigger: ClassVar[str] = "drain_requested"
    scope: str = attrs.field(validator=attrs.validators.in_(DRAIN_SCOPES))
    source: str = "api"
    by: str = ""


@attrs.frozen(kw_only=True)
class JobFailed(Fact):
    """Another node gave the job up and published the job's verdict (``fsm_agent.job_verdict``):
    this node ends with it, whatever its own restarts left. Read by the job-wide look, or found
    when this node's own failures were a peer's failure seen from here (collateral).

    Attributes:
        verdict: the job's verdict record (``root_causes``, ``classes``, ``reasons``, ``exit_code``,
            ``summary``, ``decided_by``, ``world_size``, ``reports``).
        exits: ``{local_rank: exitcode}`` of this node's workers that had failed already, if any.
    """

    trigger: ClassVar[str] = "job_failed"
    verdict: dict[str, Any] = attrs.field(factory=dict)
    exits: dict[int, int] = attrs.field(factory=dict, converter=_exit_codes)


@attrs.frozen(kw_only=True)
class NodeCheckFailed(Fact):
    """This node failed a node check before its workers started, or a peer's check blamed it
    (``fsm_agent.node_checks``): it leaves the job, class ``node_check``.

    Attributes:
        reason: what failed, in one line (check, measurement, threshold).
        decision: the round's decision record (``excluded``, ``hosts``, ``results``), or None (replay).
    """

    trigger: ClassVar[str] = "node_check_failed"
    reason: str = ""
    decision: dict[str, Any] | None = None


@attrs.frozen(kw_only=True)
class NodesExcluded(Fact):
    """Other nodes of the new round failed their node checks: they leave, and this node re-forms the
    round without them (a hot spare takes a seat, or the round re-forms within ``--nnodes MIN:MAX``).

    Attributes:
        excluded: ``{group_rank: "host: reason"}`` of the nodes excluded (keys as strings).
    """

    trigger: ClassVar[str] = "nodes_excluded"
    excluded: dict[str, str] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class AgentErrored(Fact):
    """An unexpected exception in the agent or a plugin: the agent can no longer vouch for its workers.

    Attributes:
        error: what raised.
    """

    trigger: ClassVar[str] = "agent_errored"
    error: str = attrs.field(converter=str)


def fact_of(event: Any, kind: type[F]) -> F:
    """The fact a transitions ``EventData`` carries (``event.kwargs["fact"]``), checked to be a ``kind``.

    Raises:
        TypeError: the event carries another fact, or none (a trigger fired without its fact).
    """
    fact = event.kwargs.get("fact")
    if not isinstance(fact, kind):
        raise TypeError(f"{event.event.name} carries {type(fact).__name__}, not the {kind.__name__} it needs")
    return fact


#: ``{trigger: its fact class}``: every trigger of the table, and nothing else (``check_facts``).
FACTS: dict[str, type[Fact]] = {
    cls.trigger: cls
    for cls in (
        Start,
        Restart,
        WorkersHung,
        HealthCheckFailed,
        WorkersSucceeded,
        WorkersFailed,
        InProcessRecovered,
        InProcessFailed,
        MembershipChanged,
        RendezvousFailed,
        RendezvousNotNeeded,
        StopRequested,
        DrainRequested,
        JobFailed,
        NodeCheckFailed,
        NodesExcluded,
        AgentErrored,
    )
}


def fact_for(trigger: str, **data: Any) -> Fact:
    """The fact of ``trigger`` built from its fields, as ``ElasticAgent.fire`` takes them.

    Raises:
        ValueError: an unknown trigger, a field the trigger's fact lacks, or a value it refuses.
    """
    cls = FACTS.get(trigger)
    if cls is None:
        raise ValueError(f"{trigger!r} is not a trigger of the table; known: {', '.join(FACTS)}")
    try:
        return cls(**data)
    except (TypeError, ValueError) as exc:  # attrs' validators give (message, attribute, ...) as args
        fields = ", ".join(f.name for f in attrs.fields(cls)) or "none"
        raise ValueError(f"{trigger} takes the fields of {cls.__name__} ({fields}): {exc.args[0]}") from None


def _field_doc(cls: type[Fact], name: str) -> str:
    """The ``name: meaning`` entry of the class's ``Attributes:`` docstring section (its
    continuation lines, indented deeper, joined), or ""."""
    lines = (inspect.getdoc(cls) or "").splitlines()
    for index, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith(f"{name}:"):
            indent = len(line) - len(line.lstrip())
            text = [stripped[len(name) + 1 :].strip()]
            for more in lines[index + 1 :]:
                if not more.strip() or len(more) - len(more.lstrip()) <= indent:
                    break
                text.append(more.strip())
            return " ".join(text)
    return ""


def _summary(cls: type[Fact]) -> str:
    return _markdown((inspect.getdoc(cls) or "").split("\n\n")[0].replace("\n", " "))


def _markdown(text: str) -> str:
    """Docstring text (reST literals) as a Markdown table cell."""
    return text.replace("``", "`").replace("|", "\\|").rstrip(".")


def markdown_table() -> str:
    """One Markdown table row per trigger: its fact class, what happened, the fields (docs)."""
    lines = ["| trigger | fact | what happened | fields |", "|---|---|---|---|"]
    for trigger, cls in FACTS.items():
        fields = "; ".join(
            f"`{field.name}`" + (f": {_markdown(doc)}" if (doc := _field_doc(cls, field.name)) else "")
            for field in attrs.fields(cls)
        )
        lines.append(f"| `{trigger}` | `{cls.__name__}` | {_summary(cls)} | {fields or 'none'} |")
    return "\n".join(lines) + "\n"
