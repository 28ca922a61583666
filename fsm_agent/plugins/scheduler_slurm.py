"""Built-in scheduler plugin ``scheduler-slurm``: a Slurm job step's defaults (``--scheduler slurm``).

Inside ``srun`` (one task per node), ``fsm-agent run train.py`` forms one job with nothing else
given. What is read from where (docs/schedulers.md):

==========================  =====================================================================
key                         from
==========================  =====================================================================
``nnodes``                  ``SLURM_STEP_NUM_NODES`` (else ``SLURM_NNODES``, ``SLURM_JOB_NUM_NODES``)
``rendezvous.node_rank``    ``SLURM_NODEID``: the rank hint of the ``fsm`` backend (the rank of
                            ``static``), stable across restarts
``rendezvous.endpoint``     the first host of ``SLURM_STEP_NODELIST`` (else ``SLURM_JOB_NODELIST``),
                            expanded by python-hostlist, on port ``29400 + (16 * SLURM_JOB_ID +
                            SLURM_STEP_ID) % 1000`` (jobs sharing a node do not meet on one port)
``rendezvous.run_id``       ``slurm-<SLURM_JOB_ID>.<SLURM_STEP_ID>.<SLURM_RESTART_COUNT or 0>``: a
                            requeued job never meets its own closed rendezvous
``rendezvous.backend``      ``fsm``: its store runs in the first node's agent
``nproc_per_node``          the GPUs of the step on this node: ``SLURM_STEP_GPUS`` (else
                            ``SLURM_GPUS_ON_NODE``), when there are any
==========================  =====================================================================

It answers ``--scheduler auto`` only inside a job step (``SLURM_JOB_ID`` and ``SLURM_STEP_ID`` set):
not in a batch script's own shell nor in ``salloc``'s, where no step runs yet. Several tasks of
the step on one node (``SLURM_STEP_TASKS_PER_NODE``) are refused when discovery fills the node's
identity: run one task per node.
"""

from __future__ import annotations

from collections.abc import Mapping

from fsm_agent.errors import ConfigError
from fsm_agent.plugins import hookimpl
from fsm_agent.scheduler import AUTO, DiscoveredJob

PLUGIN_NAME = "scheduler-slurm"
SCHEDULER = "slurm"
FSM_AGENT_KINDS = ("scheduler",)
#: The rendezvous backend of a discovered job.
BACKEND = "fsm"
#: torchrun's c10d port; each job step gets one of the 1000 ports from here.
BASE_PORT = 29400
#: ``SLURM_STEP_ID`` of the batch script's and the allocation's own steps (never an srun step).
_NOT_A_TASK_STEP = frozenset({"4294967290", "4294967291", "4294967292", "4294967293", "4294967294"})


def _first(environ: Mapping[str, str], *names: str) -> tuple[str, str] | tuple[None, None]:
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            return name, value
    return None, None


def _number(name: str, value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(
            f"{name}={value!r}: not an integer, which Slurm always sets; fix the job's "
            f"environment or give --scheduler none"
        ) from None
    if number < 0:
        raise ConfigError(f"{name}={value!r}: negative; fix the job's environment or give --scheduler none")
    return number


def expand_hosts(name: str, expression: str) -> list[str]:
    """A Slurm hostlist expression (``gpu[01-04,07]``) -> host names, with python-hostlist.

    Raises:
        ConfigError: one line naming the variable, when the expression is malformed.
    """
    import hostlist  # python-hostlist: imported only inside a Slurm job step

    try:
        hosts = hostlist.expand_hostlist(expression)
    except hostlist.BadHostlist as exc:
        raise ConfigError(
            f"{name}={expression!r}: not a Slurm hostlist ({exc}); fix the job's environment "
            f"or give --rdzv-endpoint HOST:PORT"
        ) from None
    if not hosts:
        raise ConfigError(f"{name}={expression!r}: no hosts; give --rdzv-endpoint HOST:PORT")
    return hosts


def tasks_per_node(name: str, expression: str) -> list[int]:
    """``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``) -> one count per node, with python-hostlist."""
    import hostlist

    try:
        return hostlist.parse_slurm_tasks_per_node(expression)
    except (ValueError, hostlist.BadHostlist) as exc:
        raise ConfigError(
            f"{name}={expression!r}: not a Slurm task count list ({exc}); fix the job's "
            f"environment or give --scheduler none"
        ) from None


def _gpu_count(environ: Mapping[str, str]) -> tuple[str, int] | None:
    name, value = _first(environ, "SLURM_STEP_GPUS")
    if name is not None:
        ids = [g for g in value.split(",") if g.strip()]
        return (name, len(ids)) if ids else None
    name, value = _first(environ, "SLURM_GPUS_ON_NODE")
    if name is not None:
        count = _number(name, value)
        return (name, count) if count > 0 else None
    return None


def discover_slurm(environ: Mapping[str, str], scheduler: str = AUTO) -> DiscoveredJob | None:
    """The Slurm job step ``environ`` describes (see the module docstring), or None outside one.

    Args:
        environ: the environment (``os.environ`` of the task srun started).
        scheduler: ``auto`` or ``slurm`` (``--scheduler``); any other name: None.

    Raises:
        ConfigError: ``scheduler == "slurm"`` outside a job step, or a malformed Slurm variable.
    """
    if scheduler not in (AUTO, SCHEDULER):
        return None
    job_id, step_id = environ.get("SLURM_JOB_ID", "").strip(), environ.get("SLURM_STEP_ID", "").strip()
    if not job_id or not step_id or step_id in _NOT_A_TASK_STEP:
        if scheduler == AUTO:
            return None
        where = (
            "not inside a Slurm job (SLURM_JOB_ID is unset)"
            if not job_id
            else "in a batch script's or salloc's shell, not in a job step (SLURM_STEP_ID is unset)"
        )
        raise ConfigError(
            f"--scheduler slurm: {where}; start fsm-agent with srun (one task per node), or "
            f"give --scheduler none and the rendezvous flags"
        )
    job, step = _number("SLURM_JOB_ID", job_id), _number("SLURM_STEP_ID", step_id)
    restarts = _number("SLURM_RESTART_COUNT", environ.get("SLURM_RESTART_COUNT", "0").strip() or "0")
    values: dict[str, object] = {}
    origins: dict[str, str] = {}

    nodes_var, nodes = _first(environ, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    if nodes_var is not None:
        values["nnodes"], origins["nnodes"] = _number(nodes_var, nodes), nodes_var
    node_id = environ.get("SLURM_NODEID", "").strip()
    if node_id:
        values["rendezvous.node_rank"], origins["rendezvous.node_rank"] = (
            _number("SLURM_NODEID", node_id),
            "SLURM_NODEID",
        )
    hosts: list[str] = []
    list_var, expression = _first(environ, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    if list_var is not None:
        hosts = expand_hosts(list_var, expression)
        port = BASE_PORT + (16 * job + step) % 1000
        values["rendezvous.endpoint"] = f"{hosts[0]}:{port}"
        origins["rendezvous.endpoint"] = list_var
        values["rendezvous.backend"], origins["rendezvous.backend"] = BACKEND, "(its default backend)"
    values["rendezvous.run_id"] = f"slurm-{job}.{step}.{restarts}"
    origins["rendezvous.run_id"] = "SLURM_JOB_ID,SLURM_STEP_ID,SLURM_RESTART_COUNT"
    gpus = _gpu_count(environ)
    if gpus is not None:
        values["nproc_per_node"], origins["nproc_per_node"] = gpus[1], gpus[0]

    several = None
    counts_var, counts = _first(environ, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    if counts_var is not None:
        per_node = tasks_per_node(counts_var, counts)
        here = per_node[_number("SLURM_NODEID", node_id)] if node_id and int(node_id) < len(per_node) else max(per_node)
        if here > 1:
            several = (
                f"Slurm started {here} fsm-agent tasks on this node ({counts_var}={counts}): fsm-agent "
                f"starts the workers itself, so run one task per node (srun --ntasks-per-node=1, "
                f"and --nproc-per-node for the workers), or give --nnodes and --node-rank yourself "
                f"for one launcher per GPU"
            )
    return DiscoveredJob(
        scheduler=SCHEDULER, values=values, origins=origins, hosts=tuple(hosts), several_per_node=several
    )


@hookimpl
def fsm_agent_discover_job(environ: Mapping[str, str], scheduler: str) -> DiscoveredJob | None:
    return discover_slurm(environ, scheduler)
