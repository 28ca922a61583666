"""Scheduler discovery: defaults a batch scheduler's environment gives a job step (Slurm, ...).

A scheduler plugin implements ``fsm_agent_discover_job(environ, scheduler)`` and answers a
``DiscoveredJob``: file keys (``docs/configuration.md``) with the values it read and the variable
each came from. ``apply_discovery`` is the precedence step that ``fsm-agent run``/``config`` take
after flags, environment and file are merged: a discovered value fills a key only where the user
gave none, so flags, ``FSM_AGENT_*``/``PET_*`` and the configuration file always win. Each filled key
is shown by ``fsm-agent config`` with the scheduler's name as its source (``slurm SLURM_NODEID``).

``--scheduler auto`` (default) asks every scheduler plugin to recognise its own job step; ``none``
asks none; ``NAME`` asks for that scheduler, and its plugin raises ``ConfigError`` when this is not
one of its job steps. See docs/schedulers.md.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import attrs

from fsm_agent.errors import ConfigError, PluginError

AUTO = "auto"
NONE = "none"
#: Keys that tell this node apart in the job: filled in for several launchers on one node, they
#: would make each believe it is the node (the ``--ntasks-per-node`` mistake).
PER_NODE_KEYS = ("nnodes", "rendezvous.node_rank")
#: Sources the user set a value with; a discovered value never replaces one of these.
USER_SOURCES = ("cli", "env", "file")


@attrs.frozen
class DiscoveredJob:
    """What a scheduler plugin found out about the job step this process runs in.

    Attributes:
        scheduler: the scheduler's name (``slurm``): ``--scheduler NAME`` and the source that
            ``fsm-agent config`` shows.
        values: ``{file key: value}`` with TOML-typed values, checked like the file's: e.g.
            ``{"nnodes": 2, "rendezvous.node_rank": 1, "rendezvous.endpoint": "node1:29400"}``.
        origins: ``{file key: the variable(s) it was read from}``, e.g. ``SLURM_NODEID``.
        hosts: the step's hosts, in node-rank order.
        several_per_node: None, or one line saying that several launchers run on this node and how
            to run one per node; ``apply_discovery`` raises it as a ``ConfigError`` when it fills
            a ``PER_NODE_KEYS`` key (a user who set those keys keeps one launcher per GPU).
    """

    scheduler: str
    values: Mapping[str, Any] = attrs.field(factory=dict)
    origins: Mapping[str, str] = attrs.field(factory=dict)
    hosts: tuple[str, ...] = ()
    several_per_node: str | None = None


def discover(pm: Any, scheduler: str, environ: Mapping[str, str]) -> DiscoveredJob | None:
    """Ask the scheduler plugins (``fsm_agent_discover_job``) about this process's job step.

    Args:
        pm: the plugin manager.
        scheduler: ``auto``, ``none`` or a scheduler's name (``--scheduler``).
        environ: the environment to read (``os.environ``).

    Returns:
        The first plugin's answer, or None (``none``; or ``auto`` outside any known job step).

    Raises:
        ConfigError: ``--scheduler NAME`` that no loaded plugin answers, or its plugin's own error
            (not inside one of its job steps, a malformed variable).
        PluginError: a plugin answered something that is not a DiscoveredJob.
    """
    if scheduler == NONE:
        return None
    job = pm.hook.fsm_agent_discover_job(environ=environ, scheduler=scheduler)
    if job is None and scheduler != AUTO:
        raise ConfigError(
            f"--scheduler {scheduler!r}: no loaded plugin discovers jobs of that scheduler; "
            f"use --scheduler auto or none, or install the scheduler's plugin"
        )
    if job is not None and not isinstance(job, DiscoveredJob):
        raise PluginError(
            f"fsm_agent_discover_job returned {type(job).__name__}, not a fsm_agent.scheduler.DiscoveredJob"
        )
    return job


def apply_discovery(
    job: DiscoveredJob | None,
    args: Any,
    sources: dict[str, Any],
    keys: Mapping[str, Any],
    make_source: Any,
    node_rank_backends: Collection[str] = (),
) -> list[str]:
    """Fill the keys the user left at their defaults with the discovered values (in place).

    Args:
        job: ``discover``'s answer (None: nothing to do).
        args: the ``fsm-agent run`` namespace (each key's flag dest is set).
        sources: ``{file key: Source}``; a filled key's becomes ``make_source(job.scheduler, origin)``.
        keys: ``{file key: fsm_agent.settings.Setting}``.
        make_source: ``Source`` (``fsm_agent.resolve``), passed in to keep this module free of the CLI.
        node_rank_backends: the rendezvous backends that read ``--node-rank`` (the registry's
            ``node_rank_backends()``); for the others a discovered node rank is dropped.

    Returns:
        The keys that were filled.

    Raises:
        ConfigError: ``job.several_per_node`` when a ``PER_NODE_KEYS`` key would be filled.
        PluginError: a discovered key that does not exist, or a value its kind rejects.
    """
    if job is None:
        return []
    standalone = (
        sources.get("standalone") is not None
        and sources["standalone"].kind in USER_SOURCES
        and bool(getattr(args, "standalone", False))
    )
    filled = []
    for name, value in job.values.items():
        key = keys.get(name)
        if key is None or key.dest is None:
            raise PluginError(
                f"scheduler {job.scheduler!r} discovered {name!r}, which is not a configuration key "
                f"(docs/configuration.md)"
            )
        if sources.get(name) is not None and sources[name].kind in USER_SOURCES:
            continue
        if standalone and (name.startswith("rendezvous.") or name == "nnodes"):
            continue  # --standalone given: a single-node job on its own rendezvous
        try:
            setattr(args, key.dest, key.kind.structure(value))
        except ValueError as exc:
            origin = job.origins.get(name, "its environment")
            raise ConfigError(
                f"{job.scheduler} ({origin}): {name}: {exc}; fix the job's environment, set "
                f"{name} yourself, or give --scheduler none"
            ) from None
        sources[name] = make_source(job.scheduler, job.origins.get(name, ""))
        filled.append(name)
    if job.several_per_node and any(name in filled for name in PER_NODE_KEYS):
        raise ConfigError(job.several_per_node)
    if "rendezvous.node_rank" in filled and getattr(args, "rdzv_backend", None) not in node_rank_backends:
        # the user's backend assigns ranks itself: a discovered rank would only be warned about
        args.node_rank = keys["rendezvous.node_rank"].kind.structure(0)
        sources["rendezvous.node_rank"] = make_source("default")
        filled.remove("rendezvous.node_rank")
    return filled
