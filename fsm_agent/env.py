"""The ONE place the worker environment is built: torchrun's variables, then plugin extras."""

from __future__ import annotations

import os

from fsm_agent.errors import PluginError
from fsm_agent.worker import Worker, WorkerGroup

#: Variables torchrun sets for every worker; plugins may not override them.
STANDARD_KEYS = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_NAME",
        "ROLE_WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_MAX_RESTARTS",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_USE_AGENT_STORE",
        "TORCHELASTIC_ERROR_FILE",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    }
)


def worker_env(
    worker: Worker,
    group: WorkerGroup,
    *,
    restart_count: int,
    run_id: str,
    error_file: str,
    use_agent_store: bool,
    extra: list[dict[str, str] | None] = (),
    base: dict[str, str] | None = None,
) -> dict[str, str]:
    """The full environment of one worker process.

    Mirrors ``LocalElasticAgent._start_workers``: the agent's environment plus RANK, LOCAL_RANK,
    ..., TORCHELASTIC_*; OMP_NUM_THREADS and CUDA_VISIBLE_DEVICES are inherited from the agent.

    Args:
        worker / group: ranks and sizes (after rank assignment).
        restart_count: restarts so far (``TORCHELASTIC_RESTART_COUNT``).
        run_id: ``TORCHELASTIC_RUN_ID``.
        error_file: path for the worker's ``@record`` error.json ("" disables it).
        use_agent_store: whether an agent hosts the workers' TCPStore at MASTER_ADDR:MASTER_PORT.
        extra: dicts returned by the ``fsm_agent_worker_env`` hook, merged in order.
        base: the inherited environment (default: ``os.environ``).

    Raises:
        PluginError: a plugin tried to override a standard variable.
    """
    spec = group.spec
    env = dict(os.environ if base is None else base)
    # torchrun leaks this into workers (torch issue noted in torchrun-contract §6.19); we do not.
    env.pop("TORCHELASTIC_SIGNALS_TO_HANDLE", None)
    env.update(
        {
            "LOCAL_RANK": "0" if spec.virtual_local_rank else str(worker.local_rank),
            "RANK": str(worker.global_rank),
            "GROUP_RANK": str(group.group_rank),
            "ROLE_RANK": str(worker.role_rank),
            "ROLE_NAME": spec.role,
            "LOCAL_WORLD_SIZE": str(spec.local_world_size),
            "WORLD_SIZE": str(worker.world_size),
            "GROUP_WORLD_SIZE": str(group.group_world_size),
            "ROLE_WORLD_SIZE": str(worker.role_world_size),
            "MASTER_ADDR": str(group.master_addr),
            "MASTER_PORT": str(group.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
            "TORCHELASTIC_RUN_ID": run_id,
            "TORCHELASTIC_USE_AGENT_STORE": str(use_agent_store),
            "TORCHELASTIC_ERROR_FILE": error_file,
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        }
    )
    if spec.virtual_local_rank:
        env["CUDA_VISIBLE_DEVICES"] = _visible_device(worker.local_rank)
    for contribution in extra:
        if not contribution:
            continue
        clash = STANDARD_KEYS & set(contribution)
        if clash:
            raise PluginError(f"fsm_agent_worker_env tried to override {sorted(clash)}; these are set by the agent")
        env.update({str(k): str(v) for k, v in contribution.items()})
    return env


def _visible_device(local_rank: int) -> str:
    """The local_rank-th entry of the agent's CUDA_VISIBLE_DEVICES, else local_rank (torch's rule)."""
    parent = os.environ.get("CUDA_VISIBLE_DEVICES")
    if parent:
        devices = [d.strip() for d in parent.split(",") if d.strip()]
        if local_rank < len(devices):
            return devices[local_rank]
    return str(local_rank)


def substitute_local_rank(args: tuple, local_rank: int) -> tuple:
    """Replace ``${local_rank}`` in str args, as torch's ``macros.substitute``."""
    return tuple(a.replace("${local_rank}", str(local_rank)) if isinstance(a, str) else a for a in args)
