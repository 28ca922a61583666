"""LaunchConfig: everything one agent needs to launch a job, validated once (attrs, frozen).

Mirrors ``torch.distributed.launcher.api.LaunchConfig`` field by field where torch has
the field, with torchrun's CLI defaults; fsm-agent's additions are marked "fsm-agent:".
The CLI (``cli.py``) and the Python API (``fsm_agent.launch``) both build one of these.
"""

from __future__ import annotations

from typing import Any

import attrs

from fsm_agent.errors import ConfigError


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


@attrs.frozen
class LaunchConfig:
    """One agent's configuration. Times are seconds.

    Attributes:
        min_nodes / max_nodes: ``--nnodes MIN:MAX``; 0 < min <= max.
        nproc_per_node: workers on this node (``--nproc-per-node``, already resolved to an int).
        run_id: ``--rdzv-id``; agents with the same id and endpoint form one job.
        role: ``--role``.
        rdzv_endpoint / rdzv_backend / rdzv_configs: ``--rdzv-endpoint``, ``--rdzv-backend``, ``--rdzv-conf``.
        max_restarts: ``--max-restarts``.
        monitor_interval: ``--monitor-interval`` seconds (periodic checks only; exits are event-driven).
        start_method: ``--start-method`` for callable entrypoints.
        log_dir: ``--log-dir``; None makes a temporary directory (kept, and printed, as torch does).
        redirects / tee: ``-r`` / ``-t`` values as torch's ``Std`` strings ("0".."3" or "0:3,1:2").
        local_ranks_filter: ``--local-ranks-filter`` as a set of local ranks, or None for all.
        log_line_prefix_template: ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``.
        logs_specs: name of a ``torchrun.logs_specs`` entry point, or None for the built-in layout.
        local_addr: ``--local-addr``.
        node_rank / master_addr / master_port: static-rendezvous flags.
        event_log_handler: ``--event-log-handler`` (torch's event destination name).
        numa_binding: ``--numa-binding``.
        signals_to_handle: ``--signals-to-handle`` (comma-separated signal names).
        duplicate_stdout_filters / duplicate_stderr_filters: substrings copied to filtered_*.log.
        virtual_local_rank: ``--virtual-local-rank``.
        shutdown_timeout: ``--shutdown-timeout`` / ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` (30).
        exit_barrier_timeout: fsm-agent: ``--exit-barrier-timeout`` (torch hard-codes 300).
        hang_timeout: fsm-agent: ``--hang-timeout`` seconds without ``fsm_agent.heartbeat()`` (None: off).
        forward_signals: fsm-agent: ``--forward-signals`` names of signals relayed to the workers.
        events_file: fsm-agent: ``--events-file``; None writes ``events.jsonl`` in the log directory.
        launcher: fsm-agent: ``--launcher`` name of the launcher backend (``subprocess``).
        disabled_plugins: fsm-agent: plugin names to block.
        standalone: ``--standalone`` was given (informational; the rdzv fields already reflect it).
    """

    min_nodes: int = 1
    max_nodes: int = 1
    nproc_per_node: int = 1
    run_id: str = "none"
    role: str = "default"
    rdzv_endpoint: str = ""
    rdzv_backend: str = "static"
    rdzv_configs: dict[str, str] = attrs.field(factory=dict)
    max_restarts: int = 0
    monitor_interval: float = 0.1
    start_method: str = "spawn"
    log_dir: str | None = None
    redirects: str = "0"
    tee: str = "0"
    local_ranks_filter: frozenset[int] | None = None
    log_line_prefix_template: str | None = None
    logs_specs: str | None = None
    local_addr: str | None = None
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    event_log_handler: str = "null"
    numa_binding: str | None = None
    signals_to_handle: str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    duplicate_stdout_filters: tuple[str, ...] = ()
    duplicate_stderr_filters: tuple[str, ...] = ()
    virtual_local_rank: bool = False
    shutdown_timeout: float = 30.0
    exit_barrier_timeout: float = 300.0
    hang_timeout: float | None = None
    forward_signals: str = ""
    events_file: str | None = None
    launcher: str = "subprocess"
    disabled_plugins: tuple[str, ...] = ()
    standalone: bool = False

    def __attrs_post_init__(self) -> None:
        _check(0 < self.min_nodes <= self.max_nodes,
               f"--nnodes {self.min_nodes}:{self.max_nodes}: need 0 < MIN <= MAX (e.g. --nnodes 1:2)")
        _check(self.nproc_per_node > 0,
               f"--nproc-per-node {self.nproc_per_node}: must be > 0 (e.g. --nproc-per-node 2)")
        _check(self.max_restarts >= 0, f"--max-restarts {self.max_restarts}: must be >= 0")
        _check(self.monitor_interval > 0, f"--monitor-interval {self.monitor_interval}: must be > 0 seconds")
        _check(self.shutdown_timeout >= 0, f"--shutdown-timeout {self.shutdown_timeout}: must be >= 0 seconds")
        _check(self.exit_barrier_timeout >= 0,
               f"--exit-barrier-timeout {self.exit_barrier_timeout}: must be >= 0 seconds")
        _check(self.hang_timeout is None or self.hang_timeout > 0,
               f"--hang-timeout {self.hang_timeout}: must be > 0 seconds")
        _check(self.start_method in ("spawn", "fork", "forkserver"),
               f"--start-method {self.start_method!r}: use spawn, fork or forkserver")

    def evolve(self, **changes: Any) -> "LaunchConfig":
        return attrs.evolve(self, **changes)
