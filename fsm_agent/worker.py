"""The data model: WorkerSpec, Worker, WorkerGroup, WorkerFailure and RunResult (attrs).

Names and fields mirror ``torch.distributed.elastic.agent.server.api`` so that
torch.distributed.elastic users recognise them; times are in seconds.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

import attrs

from fsm_agent.states.worker_state import WorkerState


def _positive(instance: Any, attribute: attrs.Attribute[Any], value: float) -> None:
    if value <= 0:
        raise ValueError(f"{attribute.name} must be > 0, got {value!r}")


def _non_negative(instance: Any, attribute: attrs.Attribute[Any], value: float) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value!r}")


@attrs.frozen
class RendezvousSpec:
    """How this agent finds its peers (torch's ``RendezvousParameters`` inputs).

    Attributes:
        backend: registered rendezvous backend name (``c10d``, ``static``, ...).
        endpoint: ``host[:port]`` of the rendezvous store ("" lets the backend choose).
        run_id: job id shared by every agent of one job.
        min_nodes / max_nodes: elastic bounds on the number of agents (``--nnodes MIN:MAX``).
        config: backend-specific string options (``--rdzv-conf k=v,...``), e.g. ``join_timeout`` in seconds.
        local_addr: this node's address for identity and MASTER_ADDR (``--local-addr``); None: the address that routes to the endpoint (``fsm_agent.hosts``).
        node_rank: static backend only (``--node-rank``).
        conf_keys: the ``--rdzv-conf`` keys the backend declared in the registry (None: not declared);
            the rendezvous summary names ``is_host`` only for a backend that reads it.
    """

    backend: str = "c10d"
    endpoint: str = ""
    run_id: str = "none"
    min_nodes: int = attrs.field(default=1, validator=_positive)
    max_nodes: int = attrs.field(default=1, validator=_positive)
    config: dict[str, str] = attrs.field(factory=dict)
    local_addr: str | None = None
    node_rank: int = 0
    conf_keys: frozenset[str] | None = None

    @max_nodes.validator
    def _check_bounds(self, attribute: attrs.Attribute[int], value: int) -> None:
        if value < self.min_nodes:
            raise ValueError(f"max_nodes ({value}) must be >= min_nodes ({self.min_nodes})")


@attrs.frozen
class WorkerSpec:
    """What to run on this node and how often to retry; mirrors torch's ``WorkerSpec``.

    Attributes:
        role: worker role name (``--role``; ``ROLE_NAME`` and the ``[role0]:`` log prefix).
        local_world_size: number of workers on this node (``--nproc-per-node``), > 0.
        entrypoint: a program path (str; scripts are run as ``python -u script``) or a Python callable.
        args: arguments for the entrypoint; ``${local_rank}`` in str args is substituted per worker.
        rendezvous: the rendezvous parameters (see RendezvousSpec).
        max_restarts: restarts of the worker group allowed after failures (membership changes are free).
        monitor_interval: seconds between periodic checks (membership, metrics). Worker exits are
            noticed at once, independent of this interval.
        master_addr / master_port: override MASTER_ADDR/MASTER_PORT for workers (static backend).
        shutdown_timeout: seconds each worker gets between the stop signal and SIGKILL, on restarts too.
        exit_barrier_timeout: seconds to wait for the other agents after local success (torch: 300).
        start_method: multiprocessing start method for callable entrypoints (spawn, fork, forkserver).
        virtual_local_rank: every worker gets LOCAL_RANK=0 and its own CUDA_VISIBLE_DEVICES entry.
        numa_binding: None or one of node, socket, exclusive, core-complex (binaries wrapped with numactl).
        hang_timeout: seconds without progress (``fsm_agent.heartbeat()``) after which a worker is hung;
            None disables heartbeat hang detection (torch's FileTimer protocol works regardless).
    """

    role: str
    local_world_size: int = attrs.field(validator=_positive)
    entrypoint: str | Callable[..., Any]
    args: tuple[Any, ...] = ()
    rendezvous: RendezvousSpec = attrs.field(factory=RendezvousSpec)
    max_restarts: int = attrs.field(default=0, validator=_non_negative)
    monitor_interval: float = attrs.field(default=0.1, validator=_positive)
    master_addr: str | None = None
    master_port: int | None = None
    shutdown_timeout: float = attrs.field(default=30.0, validator=_non_negative)
    exit_barrier_timeout: float = attrs.field(default=300.0, validator=_non_negative)
    start_method: str = "spawn"
    virtual_local_rank: bool = False
    numa_binding: str | None = None
    hang_timeout: float | None = attrs.field(default=None, validator=attrs.validators.optional(_positive))
    #: ``--duplicate-std{out,err}-filters``: tee'd lines containing one of these go to filtered_*.log.
    duplicate_stdout_filters: tuple[str, ...] = ()
    duplicate_stderr_filters: tuple[str, ...] = ()

    @property
    def local_addr(self) -> str | None:
        return self.rendezvous.local_addr

    def get_entrypoint_name(self) -> str:
        """The entrypoint's name as torch reports it: the program path, or the function's name."""
        if isinstance(self.entrypoint, str):
            # `python -u script.py` reads better as the script, `python -u -m mod` as the module.
            args = [a for a in self.args if isinstance(a, str)]
            if args[:1] == ["-u"]:
                args = args[1:]
            if args[:1] == ["-m"] and len(args) > 1:
                return args[1]
            if args and args[0].endswith(".py"):
                return args[0]
            return self.entrypoint
        return getattr(self.entrypoint, "__qualname__", repr(self.entrypoint))


@attrs.define
class Worker:
    """One worker process; ranks are -1 until the rendezvous assigns them (torch's ``Worker``).

    Attributes:
        local_rank: index on this node, 0..local_world_size-1.
        global_rank: rank among all workers of the job (``RANK``).
        role_rank: rank among the workers of the same role (``ROLE_RANK``).
        world_size: all workers of the job (``WORLD_SIZE``).
        role_world_size: workers of this role (``ROLE_WORLD_SIZE``).
        id: the launcher's handle for the running worker (its pid), None when not running.
    """

    local_rank: int
    global_rank: int = -1
    role_rank: int = -1
    world_size: int = -1
    role_world_size: int = -1
    id: Any = None


@attrs.define
class WorkerGroup:
    """This agent's workers and what the rendezvous decided for them (torch's ``WorkerGroup``).

    Attributes:
        spec: the WorkerSpec.
        workers: the Worker objects, index == local_rank.
        store: the rendezvous round's store (torch ``Store``), None before the first rendezvous.
        group_rank: this agent's rank among the agents (``GROUP_RANK``).
        group_world_size: number of agents in this round (``GROUP_WORLD_SIZE``).
        state: the group's WorkerState (mirrors the statechart's current state).
        master_addr / master_port: where the workers' store for this attempt listens.
        store_host_ranks: the global ranks of the node whose agent hosts ``store`` (fsm-agent's own:
            when that store is unreachable, the job's verdict names them lost), or ``()``.
    """

    spec: WorkerSpec
    workers: list[Worker] = attrs.Factory(
        lambda self: [Worker(i) for i in range(self.spec.local_world_size)], takes_self=True
    )
    store: Any = None
    group_rank: int | None = None
    group_world_size: int | None = None
    state: WorkerState = WorkerState.INIT
    master_addr: str | None = None
    master_port: int | None = None
    store_host_ranks: tuple[int, ...] = ()


class FailureClass:
    """Why an attempt ended badly: the ``failure_class`` the restart policy decides on.

    Worker failures (one ``WorkerFailure`` per failed worker): ``EXIT_CODE``, ``SIGNAL``, ``HANG``
    (no heartbeat or FileTimer expiry), ``HEALTH_CHECK`` (a ``fsm_agent_health_check`` plugin
    reported the node unhealthy), ``STRAGGLER`` (the ``straggler`` plugin found a rank of this node
    slower than the job's median step time, with ``--exclude-node-on straggler``). Group-level causes (no worker failed): ``NODE_LOST`` (a peer
    stopped keeping its rendezvous alive or left), ``MEMBERSHIP_CHANGE`` (nodes wait to join:
    scale-up). ``AGENT_ERROR``: the agent or a plugin raised; the group lands in UNKNOWN
    without asking the policy (the agent can no longer vouch for its workers). In-process restart
    (``fsm_agent.inprocess``): ``INPROCESS`` (the policy is asked whether a worker failure may be
    recovered by replacing only the failed ranks; its budget counts those recoveries) and
    ``INPROCESS_FAILED`` (such a recovery did not complete: the whole group restarts).
    """

    EXIT_CODE = "exit_code"
    SIGNAL = "signal"
    HANG = "hang"
    HEALTH_CHECK = "health_check"
    STRAGGLER = "straggler"
    NODE_LOST = "node_lost"
    MEMBERSHIP_CHANGE = "membership_change"
    INPROCESS = "inprocess"
    INPROCESS_FAILED = "inprocess_failed"
    AGENT_ERROR = "agent_error"
    #: Every class, in documentation order.
    ALL = (
        EXIT_CODE,
        SIGNAL,
        HANG,
        HEALTH_CHECK,
        STRAGGLER,
        NODE_LOST,
        MEMBERSHIP_CHANGE,
        INPROCESS,
        INPROCESS_FAILED,
        AGENT_ERROR,
    )
    #: The classes the restart policy is asked about (an agent error never is).
    DECIDED = ALL[:-1]


class NodeProblem(str):
    """A health check's answer (``fsm_agent_health_check``) that names its failure class.

    A plain ``str`` answer fails the node's workers with class ``health_check``; a NodeProblem
    with ``failure_class`` ``straggler`` fails them with that class, so ``--exclude-node-on``
    can name it apart from a failed health-check command.

    Attributes:
        failure_class: one of ``FailureClass.HEALTH_CHECK``, ``FailureClass.STRAGGLER``.
        global_rank: the worker the problem is about (a straggler's rank), or None (the node):
            that worker's failure is the root cause (``first_failure``), the others follow it.
    """

    failure_class: str
    global_rank: int | None

    def __new__(
        cls, text: str, failure_class: str = FailureClass.HEALTH_CHECK, global_rank: int | None = None
    ) -> NodeProblem:
        problem = super().__new__(cls, text)
        problem.failure_class, problem.global_rank = failure_class, global_rank
        return problem


#: The exit code a worker counts as when it did not exit but was found hung (timeout(1)'s "timed out").
HANG_EXIT_CODE = 124
#: The exit code the workers of a node found unhealthy count as (sysexits' EX_UNAVAILABLE).
HEALTH_CHECK_EXIT_CODE = 69
#: The agent's exit code when it stopped restarting a job that makes no progress
#: (``--max-no-progress-restarts``): a requeue wrapper should not start it again. A worker's own
#: exit with this code is reported as 1, so the code always means the agent's verdict.
DO_NOT_REQUEUE_EXIT_CODE = 79
#: The agent's exit code after a drain (``--drain-signals``, ``--drain-file``, ``POST /drain``): an
#: orderly stop, the workers had their checkpoint chance, requeue it (sysexits' EX_TEMPFAIL, "try
#: again later"). A worker's own exit with this code is passed on as it is.
DRAIN_EXIT_CODE = 75
#: What a drain stops: this node alone (the others re-rendezvous) or the whole job.
DRAIN_SCOPES = ("node", "job")
DEFAULT_DRAIN_TIMEOUT_S = 60.0


@attrs.frozen
class DrainSettings:
    """How this agent drains (the ``drain`` plugin's options).

    Attributes:
        signals: signal numbers that request a drain (``--drain-signals``).
        file: a path whose appearance requests a drain (``--drain-file``), or None.
        timeout_s: seconds the workers get, after the checkpoint signal, to exit by themselves
            (``--drain-timeout``); then they are stopped as on a restart.
        scope: the scope of a signal's or file's drain: ``"node"`` or ``"job"`` (``--drain-scope``).
        checkpoint_signal: the signal number the workers get first (``--drain-checkpoint-signal``).
    """

    signals: tuple[int, ...] = ()
    file: str | None = None
    timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    scope: str = "node"
    checkpoint_signal: int = signal.SIGUSR1


def signal_name(exitcode: int) -> str:
    """``-9`` -> ``"SIGKILL"``; a non-negative code gives ``"<N/A>"`` (as torch's ProcessFailure)."""
    if exitcode < 0:
        try:
            return signal.Signals(-exitcode).name
        except ValueError:
            return f"signal {-exitcode}"
    return "<N/A>"


@attrs.frozen
class WorkerFailure:
    """A worker that ended badly; mirrors torch's ``ProcessFailure`` and adds what torch lacks.

    Attributes:
        local_rank / global_rank / role_rank: the worker's ranks.
        pid: its process id.
        exitcode: the exit code, or -N when killed by signal N (torch's convention).
        timestamp: when the agent observed the exit, seconds since the epoch (sub-second, unlike torch).
        error_file: path of the worker's error.json ("<N/A>" when it wrote none).
        message: the error message from error.json, else a description of the exit.
        traceback: ``py_callstack`` from error.json, else the last lines of the worker's stderr log, else "".
        hostname: the node the worker ran on.
        failure_class: why it failed, a ``FailureClass`` value: ``exit_code``, ``signal``, ``hang``
            or ``health_check``.
    """

    local_rank: int
    global_rank: int
    role_rank: int
    pid: int
    exitcode: int
    timestamp: float
    error_file: str = "<N/A>"
    message: str = ""
    traceback: str = ""
    hostname: str = ""
    failure_class: str = "exit_code"
    error_timestamp: float | None = None

    @property
    def signal_name(self) -> str:
        return signal_name(self.exitcode)

    @property
    def exitcode_text(self) -> str:
        """The exit code as the summary shows it: ``3``, or ``-9 (SIGKILL)`` for a death by signal."""
        return f"{self.exitcode} ({self.signal_name})" if self.exitcode < 0 else str(self.exitcode)

    @property
    def shell_exit_code(self) -> int:
        """The code a shell would report: the exit code, or 128+N for a death by signal N."""
        return 128 - self.exitcode if self.exitcode < 0 else self.exitcode


@attrs.frozen
class RestartDecision:
    """What the restart policy decided about a failed attempt (hook ``fsm_agent_restart_policy``).

    Attributes:
        restart: True to restart the worker group, False to give up (the group goes to FAILED).
        delay_s: seconds to wait before the next rendezvous (backoff); 0 for none.
        reason: one line for logs and the summary, e.g. ``"no restarts left (max_restarts=0)"``.
        exclude_node: with ``restart=False``: take only this node out of the job. The agent stops
            its workers and leaves the rendezvous without releasing the exit barrier, so the
            other nodes see a lost node and carry on (if at least ``min_nodes`` remain); this
            agent ends FAILED. False (the default) with ``restart=False``: the whole job gives up.
        exit_code: with ``restart=False``: the exit code the agent ends with (e.g.
            ``DO_NOT_REQUEUE_EXIT_CODE``); None (the default): the root-cause worker's code.
        in_process: with ``restart=True``, asked about class ``inprocess``: replace only the failed
            workers' processes (``fsm_agent.inprocess``) instead of restarting the group.

    Raises:
        ValueError: ``restart`` and ``exclude_node`` both True, or a negative ``delay_s``.
    """

    restart: bool
    delay_s: float = 0.0
    reason: str = ""
    exclude_node: bool = False
    exit_code: int | None = None
    in_process: bool = False

    def __attrs_post_init__(self) -> None:
        if self.in_process and not self.restart:
            raise ValueError("RestartDecision: in_process needs restart=True")
        if self.restart and self.exclude_node:
            raise ValueError("RestartDecision: restart and exclude_node cannot both be True")
        if self.restart and self.exit_code is not None:
            raise ValueError("RestartDecision: an exit_code needs restart=False")
        if self.delay_s < 0:
            raise ValueError(f"RestartDecision: delay_s must be >= 0 seconds, got {self.delay_s}")


def first_failure(failures: dict[int, WorkerFailure]) -> WorkerFailure | None:
    """The root cause among ``failures``: the earliest error (error.json time, else exit time),
    then the lowest global rank; None when empty. Mirrors torch's ``get_first_failure``."""
    if not failures:
        return None
    return min(failures.values(), key=lambda f: (f.error_timestamp or f.timestamp, f.timestamp, f.global_rank))


@attrs.frozen
class RunResult:
    """The outcome of ``agent.run()``; mirrors torch's ``RunResult``.

    Attributes:
        state: the terminal WorkerState (SUCCEEDED, FAILED or UNKNOWN).
        return_values: {global_rank: return value} for callable entrypoints of this node.
        failures: {global_rank: WorkerFailure} of this node's failed workers (workers the agent
            stopped itself are not failures).
        error: the agent-level error message (rendezvous failure, plugin exception), if any.
        signal: the signal number that stopped the agent, if one did.
        stopped_workers: the signal came while workers ran, and the agent stopped them (False: it
            came in a rendezvous, between attempts or in the exit barrier).
        restart_count: restarts used.
        verdict: the restart policy's reason when it gave up or took this node out of the job
            (``RestartDecision.reason``), else None.
        verdict_exit_code: the exit code the restart policy gave up with
            (``RestartDecision.exit_code``, e.g. ``DO_NOT_REQUEUE_EXIT_CODE``), else None.
        drain: the scope of the drain that ended the run (``"node"`` or ``"job"``), else None;
            such a run exits ``DRAIN_EXIT_CODE``.
        job_verdict: when the job failed, its verdict record (``fsm_agent.job_verdict``: the
            root-cause ranks, a class per failed rank, the exit code, a one-line summary, who
            decided), the same on every node; else None.
    """

    state: WorkerState
    return_values: dict[int, Any] = attrs.field(factory=dict)
    failures: dict[int, WorkerFailure] = attrs.field(factory=dict)
    error: str | None = None
    signal: int | None = None
    restart_count: int = 0
    verdict: str | None = None
    stopped_workers: bool = False
    verdict_exit_code: int | None = None
    drain: str | None = None
    job_verdict: dict[str, Any] | None = None

    def is_failed(self) -> bool:
        """True unless the group SUCCEEDED (torch checks only FAILED and so misses UNHEALTHY)."""
        return self.state != WorkerState.SUCCEEDED

    @property
    def root_cause(self) -> WorkerFailure | None:
        """The first observed failure (smallest timestamp), as torch's ``get_first_failure``."""
        return first_failure(self.failures)

    @property
    def exit_code(self) -> int:
        """0 on success; 128+N when a signal N stopped the agent; ``DRAIN_EXIT_CODE`` after a drain;
        the job verdict's code when the job failed (the root cause's, or the restart policy's); the restart policy's ``verdict_exit_code`` when it gave one; else the root-cause worker's code, except that a
        worker's ``DO_NOT_REQUEUE_EXIT_CODE`` is reported as 1 (only the agent says "do not requeue").
        docs/failure-handling.md "Exit codes" has the table."""
        if self.state == WorkerState.SUCCEEDED:
            return 0
        if self.signal is not None:
            return 128 + self.signal
        if self.drain is not None:
            return DRAIN_EXIT_CODE
        if self.job_verdict is not None:  # the job's, the same on every node
            return int(self.job_verdict.get("exit_code", 1))
        if self.verdict_exit_code is not None:
            return self.verdict_exit_code
        cause = self.root_cause
        if cause is not None and cause.shell_exit_code not in (0, DO_NOT_REQUEUE_EXIT_CODE):
            return cause.shell_exit_code
        return 1
