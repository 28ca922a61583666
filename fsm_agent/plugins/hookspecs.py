"""Every fsm-agent hook, grouped by plugin kind in lifecycle order.

Each docstring has Args, Returns and "Called from" (the transition or step that fires it);
``tests/plugins/test_hookspecs.py`` checks this, and ``docs/statechart.md`` quotes "Called from".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fsm_agent.plugins import hookspec

if TYPE_CHECKING:
    from fsm_agent.agent import ElasticAgent
    from fsm_agent.attribution import FailureReport
    from fsm_agent.config import LaunchConfig, OptionRegistry
    from fsm_agent.node_checks import CheckResult, CheckRound
    from fsm_agent.plugins.registry import BackendRegistry
    from fsm_agent.recording import TransitionRecord
    from fsm_agent.scheduler import DiscoveredJob
    from fsm_agent.worker import RestartDecision, RunResult, Worker, WorkerFailure, WorkerGroup

# --------------------------------------------------------------------------------------------
# setup: called once while the agent is built, before the machine leaves INIT
# --------------------------------------------------------------------------------------------


@hookspec
def fsm_agent_addoption(options: OptionRegistry) -> None:
    """Declare this plugin's configuration options: flags, environment variables and file keys.

    Args:
        options: call ``options.add(name, type=int, default=None, help="...")`` once per option
            (``fsm_agent.config.OptionRegistry.add``). Option ``name`` of plugin ``p`` becomes
            the flag ``--p-name`` (or the ``flag=`` given), the env var ``FSM_AGENT_P_NAME`` (or
            ``env=``) and the key ``name`` of the ``[plugins.p]`` table; values are checked
            strictly against ``type``, ``choices`` and ``check``.

    Returns:
        Nothing. The plugin reads its resolved values back with
        ``config.plugin_options("p")`` in ``fsm_agent_configure``. Declaring a name, flag or env
        var twice raises ``PluginError`` naming both plugins.

    Called from:
        The command line (``fsm-agent run``, ``fsm-agent config``), once per process before the
        flags are parsed, one plugin at a time; never by ``launch_agent`` (a config built in
        Python carries plugin values in ``LaunchConfig.plugins``).
    """


@hookspec
def fsm_agent_register_backends(registry: BackendRegistry) -> None:
    """Contribute named rendezvous backends and launchers (the selectable kinds).

    Args:
        registry: call ``registry.add_rendezvous(name, creator, conf_keys=KEYS)`` where ``creator`` takes
            a torch ``RendezvousParameters`` and returns a torch ``RendezvousHandler`` (the signature of
            torch's ``rendezvous_handler_registry.register``) and the optional ``conf_keys`` names the
            ``--rdzv-conf`` keys it reads (then a key no loaded backend reads is an error, one that
            only another backend reads a warning); the optional ``parameters(LaunchConfig)`` builds
            what ``creator`` receives instead of torch's ``RendezvousParameters`` (a torch-free
            backend, or defaults of its own); the optional ``node_rank`` says what the backend does
            with ``--node-rank`` (``"rank"``: this node's rank, as torch's static backend; ``"hint"``:
            a preferred rank; None: it assigns ranks itself) and ``host_port_endpoint=True`` that its
            endpoint is ``HOST[:PORT]`` read by torch's ``parse_rendezvous_endpoint`` (the CLI then
            checks the port before the launch); and/or
            ``registry.add_launcher(name, factory)`` where ``factory(agent)`` returns a launcher
            (see ``fsm_agent.plugins.launcher_subprocess.SubprocessLauncher`` for the interface).

    Returns:
        Nothing. Registering a name twice raises ``PluginError`` naming both plugins.

    Called from:
        Agent construction, before the statechart leaves INIT (once per process).
    """


@hookspec
def fsm_agent_configure(config: LaunchConfig, agent: ElasticAgent) -> None:
    """Let a plugin read the configuration and keep a reference to the agent.

    Args:
        config: the validated LaunchConfig.
        agent: the agent being built (its worker group is in INIT).

    Returns:
        Nothing.

    Called from:
        Agent construction, after backends are registered and before ``start`` (INIT -> HEALTHY).
    """


# --------------------------------------------------------------------------------------------
# scheduler kind: called once by the command line, while its configuration is merged
# --------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def fsm_agent_discover_job(environ: Mapping[str, str], scheduler: str) -> DiscoveredJob | None:
    """Discover the job step a batch scheduler started this process in (Slurm, LSF, PBS, ...).

    Args:
        environ: the environment to read (``os.environ`` of ``fsm-agent run``); read it, never
            ``os.environ`` itself, and never change it.
        scheduler: ``--scheduler``: ``auto`` (answer only inside one of your scheduler's job
            steps, recognised from its variables; not in a batch script's shell) or a scheduler's
            name (answer when it is yours, else None). Never ``none``: then nothing is asked.

    Returns:
        A ``fsm_agent.scheduler.DiscoveredJob`` (``scheduler`` name, ``values`` by file key such as
        ``nnodes``, ``nproc_per_node``, ``rendezvous.backend``, ``rendezvous.endpoint``,
        ``rendezvous.run_id``, ``rendezvous.node_rank``, the ``origins`` of each, the ``hosts``, and
        ``several_per_node``), or None when this is not one of your scheduler's job steps. The first
        answer wins. Its values only fill keys the user left unset: flags, ``FSM_AGENT_*``/``PET_*``
        variables and the configuration file win. Raise ``ConfigError`` (one line: the variable and
        the fix) when ``scheduler`` names yours but this is not one of its job steps, or a variable
        is malformed.

    Called from:
        The command line (``fsm-agent run``, ``fsm-agent config``), once per process, after flags,
        environment and configuration file are merged and before the LaunchConfig is built; never
        by ``launch_agent``.
    """


# --------------------------------------------------------------------------------------------
# rendezvous kind
# --------------------------------------------------------------------------------------------


@hookspec
def fsm_agent_rendezvous_completed(worker_group: WorkerGroup, duration_s: float) -> None:
    """Observe a completed rendezvous round and the ranks it assigned.

    Args:
        worker_group: group with ``group_rank``, ``group_world_size``, ``master_addr``,
            ``master_port`` and each worker's ``global_rank``/``role_rank`` set.
        duration_s: seconds spent in the rendezvous and rank assignment.

    Returns:
        Nothing.

    Called from:
        Transitions ``start`` (INIT -> HEALTHY) and ``restart`` (STOPPED -> HEALTHY), step
        ``_rendezvous``, before any worker is spawned.
    """


# --------------------------------------------------------------------------------------------
# launcher kind
# --------------------------------------------------------------------------------------------


@hookspec
def fsm_agent_worker_env(worker: Worker, worker_group: WorkerGroup) -> dict[str, str] | None:
    """Contribute extra environment variables for one worker process.

    Args:
        worker: the worker about to be spawned (ranks assigned).
        worker_group: the group being started.

    Returns:
        A mapping merged over the inherited environment, or None. The torchrun-standard
        variables (RANK, LOCAL_RANK, TORCHELASTIC_*, ...) cannot be overridden: trying
        raises ``PluginError``.

    Called from:
        Transitions ``start`` and ``restart``, step ``_start_workers``, once per worker,
        before the process is spawned; ``workers_failed`` recovered in process, step
        ``_replace_failed_workers``, once per worker replaced.
    """


@hookspec
def fsm_agent_workers_started(worker_group: WorkerGroup, pids: dict[int, int]) -> None:
    """Observe that every worker of the group has been spawned.

    Args:
        worker_group: the group that was started.
        pids: ``{local_rank: pid}``.

    Returns:
        Nothing.

    Called from:
        Transitions ``start`` and ``restart``, step ``_start_workers``, after the spawn.
    """


@hookspec
def fsm_agent_worker_exited(worker: Worker, worker_group: WorkerGroup, exitcode: int) -> None:
    """Observe one worker's exit as soon as the launcher sees it (event-driven, not polled).

    Args:
        worker: the worker that exited.
        worker_group: its group.
        exitcode: the exit code, or -N if signal N killed it.

    Returns:
        Nothing.

    Called from:
        The run loop while the group is HEALTHY or UNHEALTHY, before ``workers_succeeded`` or
        ``workers_failed`` is fired.
    """


@hookspec(firstresult=True)
def fsm_agent_restart_policy(
    failures: dict[int, WorkerFailure], worker_group: WorkerGroup, restart_count: int, failure_class: str
) -> RestartDecision | None:
    """Decide whether a failed attempt is restarted, after how long, given up, or this node leaves.

    Args:
        failures: ``{global_rank: WorkerFailure}`` of this attempt's failed workers on this node
            (each has ``failure_class`` and ``exitcode``); empty for a membership change.
        worker_group: the group (``spec.max_restarts`` is the budget).
        restart_count: restarts already used (membership changes do not count, as in torch).
        failure_class: a ``fsm_agent.worker.FailureClass`` value: the root cause's class
            (``exit_code``, ``signal``, ``hang``, ``health_check``), or ``node_lost`` /
            ``membership_change`` when the rendezvous membership changed.

    Returns:
        A RestartDecision (restart, ``delay_s`` backoff, give up, optionally with the agent's
        ``exit_code``, or ``exclude_node``); the first non-None answer wins. The built-in
        ``restart-policy`` plugin answers last (``trylast``): torchrun's budget, the do-not-restart
        exit code, per-class budgets, ``--exclude-node-on``, and exponential backoff with jitter
        when ``--restart-backoff`` (seconds) is set. The built-in ``progress`` plugin answers before
        it only to give up (exit code 79) after ``--max-no-progress-restarts`` cycles without
        progress; the cycles so far are ``ElasticAgent.cycles`` (the last is this attempt).

    Called from:
        The table's deciders (``DECIDERS``), once per event: ``_decide_on_failed_workers`` for
        ``workers_failed`` (from HEALTHY or UNHEALTHY, first about class ``inprocess`` when the
        failure could be recovered in process), ``_decide_on_inprocess_failure`` for
        ``inprocess_failed`` and ``_decide_on_membership_change`` for ``membership_changed``,
        before their rows' guards are read; its answer is what the guards ``has_restarts_left``,
        ``excludes_this_node`` and ``recovers_in_process`` read.
    """


@hookspec(firstresult=True)
def fsm_agent_classify_failure(report: FailureReport) -> str | None:
    """Class one failed rank for the root-cause attribution: its own fault, or a peer's seen from here.

    Args:
        report: a ``fsm_agent.attribution.FailureReport``: ``global_rank``, ``group_rank``,
            ``hostname``, ``exitcode`` (-N: signal N), ``failure_class``, ``time`` (seconds since the
            epoch), ``message`` (its error's first line), ``tail`` (its traceback's or stderr's last
            lines, or a hung rank's stacks).

    Returns:
        ``"collateral"`` (it failed because a peer did: a closed connection, a collective timeout),
        ``"own"`` (its own fault), or None (no opinion); the first non-None answer wins. The built-in
        ``attribution`` plugin answers last (``trylast``) with ``attribution.builtin_class``: gloo's
        and NCCL's peer-failure messages and a hung rank waiting inside a collective are
        collateral, everything else its own. ``attribution.attribute`` then names the first own
        failure the root cause (torch names the first failure it noticed: ``get_first_failure``).

    Called from:
        ``_decide_on_failed_workers`` (``workers_failed``), once per failed worker of this node, to
        name the root cause the restart policy decides on; ``_decide_job_verdict``, the step of the rows of
        ``workers_failed``, ``inprocess_failed`` and ``membership_changed`` that give the job up, once per failed rank of every node that
        reported; ``_name_the_lost_store_host`` (``rendezvous_failed`` while workers ran), once per
        failed rank of this node; and by the run loop (no step) before it fires ``workers_failed`` on a
        node of several, to learn whether its failures were all collateral.
        Must be deterministic: ``fsm-agent replay`` asks it again on the recorded reports.
    """


@hookspec
def fsm_agent_health_check(worker_group: WorkerGroup) -> str | None:
    """Check this node's health while its workers run (GPUs, disks, network, ...).

    Implement it only when a check is configured: while any plugin implements it, the run loop
    ticks every ``monitor_interval`` seconds to call it. A check that is slow or costly keeps
    its own cadence (the built-in ``health-check`` plugin runs a command every
    ``--health-check-interval`` seconds) and returns None between runs. It runs on the agent's
    loop: keep it short and bounded.

    Args:
        worker_group: the running group.

    Returns:
        None when healthy; else one line saying what is wrong. Any such answer marks the node
        unhealthy: every local worker is failed with ``failure_class`` ``health_check`` (or the
        class a ``fsm_agent.worker.NodeProblem`` answer names: ``straggler``) and the restart
        policy decides (restart, give up, or take this node out with ``exclude_node``).
        An exception is an agent error (the group lands in UNKNOWN).

    Called from:
        The run loop while the group is HEALTHY, every ``monitor_interval`` seconds; an answer
        fires ``health_check_failed``.
    """


@hookspec
def fsm_agent_node_check(check_round: CheckRound) -> CheckResult | None:
    """Check this node before the round's workers start (network, disks, shared memory, devices).

    Every implementation is called on every node of a new round, one after another, on a helper
    thread; all of them together must answer within ``check_round.timeout_s`` seconds
    (``--node-check-timeout``), else this node fails ("did not finish"). A check that measures
    between nodes exchanges its data through ``check_round.store`` under
    ``check_round.for_check(NAME).key_prefix`` and may name other nodes in ``CheckResult.blamed``.
    A check that is not switched on returns None (better: is not registered).

    Args:
        check_round: this node's place in the round, the round's store, the deadline
            (``fsm_agent.node_checks.CheckRound``).

    Returns:
        A ``fsm_agent.node_checks.CheckResult`` (``ok`` False: this node is excluded from the
        round, class ``node_check``; ``blamed``: other nodes excluded too), or None. Anything
        else, or an exception, is this node's failure of that check, named in one line.

    Called from:
        ``_check_nodes`` (``start``, ``restart``), once the rendezvous formed the round and
        before any worker starts; again in each round re-formed after an exclusion.
    """


# --------------------------------------------------------------------------------------------
# metrics kind
# --------------------------------------------------------------------------------------------


@hookspec
def fsm_agent_put_metric(metric_group: str, metric_name: str, metric_value: float) -> None:
    """Receive one metric; mirrors ``torch.distributed.elastic.metrics.put_metric``.

    Args:
        metric_group: ``"torchelastic"`` for torch's names, ``"fsm_agent"`` for fsm-agent's own.
        metric_name: torch's dotted names, e.g. ``workers.default.remaining_restarts``;
            fsm-agent adds ``state.<STATE>.duration_s`` and, from a launcher
            that reports them, ``launcher.<name>`` (e.g. ``launcher.preload_import_s``, seconds).
        metric_value: the value.

    Returns:
        Nothing. Exceptions are logged and do not stop other listeners or the agent.

    Called from:
        After every transition (``after_state_change``) and once at the end of ``run``; the
        launcher's own timings (``fsm_agent.launcher.*``, e.g. the preload import) from
        ``_start_workers`` (``start``, ``restart``), when the launcher reports them; the node
        checks' (``fsm_agent.node_check.seconds``, ``.excluded``) from ``_check_nodes``.
    """


# --------------------------------------------------------------------------------------------
# event-recording kind
# --------------------------------------------------------------------------------------------


@hookspec
def fsm_agent_record_event(event: dict[str, Any]) -> None:
    """Receive one event record (schema in docs/events.md); mirrors torch's ``events.record``.

    Args:
        event: a JSON-serialisable dict with at least ``ts`` (seconds since the epoch),
            ``kind`` (``transition`` | ``worker_exit`` | ``cycle`` | ``run_end``), ``node``, ``role``,
            ``run_id`` and ``restart_count``; transitions add ``source``, ``dest``, ``trigger``.

    Returns:
        Nothing. Exceptions are logged and do not stop other listeners or the agent.

    Called from:
        After every transition, after every worker exit, and at the end of ``run``; a ``cycle``
        record from the steps that end a restart cycle, before their transition:
        ``_decide_on_failed_workers`` (``workers_failed``), ``_decide_on_membership_change``
        (``membership_changed``) and ``_record_return_values`` (``workers_succeeded``); a ``drain``
        record from ``_drain_workers`` (``drain_requested``), once its workers are stopped; a
        ``launcher_timings`` record from ``_start_workers`` (``start``, ``restart``), when the launcher
        reports its timings; ``inprocess_recovery_begun`` from ``_replace_failed_workers``
        (``workers_failed`` recovered in process) and ``inprocess_recovery`` from
        ``_record_inprocess_recovery`` (``inprocess_recovered``) and ``_decide_on_inprocess_failure``
        (``inprocess_failed``, with its ``cycle``); a ``verdict`` record from ``_decide_job_verdict``
        (``workers_failed``, ``inprocess_failed``, ``membership_changed``: giving the job up), ``_adopt_job_verdict`` (``job_failed``) and
        ``_name_the_lost_store_host`` (``rendezvous_failed`` while workers ran, the store's host gone);
        a ``node_check`` record from ``_check_nodes`` (``start``, ``restart``).
    """


# --------------------------------------------------------------------------------------------
# lifecycle (any kind)
# --------------------------------------------------------------------------------------------


@hookspec
def fsm_agent_state_changed(transition: TransitionRecord) -> None:
    """Observe every state change of the worker group.

    Args:
        transition: the TransitionRecord (source, dest, trigger, timestamps, restart_count, error).

    Returns:
        Nothing. Exceptions are logged and do not stop other listeners or the agent.

    Called from:
        Every transition of the table, after the state has changed (``after_state_change``).
    """


@hookspec
def fsm_agent_unconfigure(result: RunResult) -> None:
    """Flush and release plugin resources; the last hook of a run.

    Args:
        result: the final RunResult.

    Returns:
        Nothing.

    Called from:
        The end of ``ElasticAgent.run``, after a terminal state was entered (always runs).
    """
