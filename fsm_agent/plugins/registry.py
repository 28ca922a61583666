"""BackendRegistry: named rendezvous backends and launchers, filled by ``fsm_agent_register_backends``."""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from fsm_agent.errors import ConfigError, PluginError
from fsm_agent.hosts import advertised_address

KINDS = ("rendezvous", "launcher")
#: torch's etcd backends: they need etcd's v2 API (off by default since etcd 3.4, gone in 3.6) and
#: python-etcd; fsm-agent serves etcd through the fsm-agent-etcd plugin's ``etcd-v3`` instead.
TORCH_ETCD_BACKENDS = ("etcd", "etcd-v2")
_FLAG = {"rendezvous": "--rdzv-backend", "launcher": "--launcher"}
#: What a rendezvous backend does with ``--node-rank``: ``rank`` it is this node's rank (checked within
#: ``--nnodes``, passed as the ``rank`` option: torch's static backend), ``hint`` a preferred rank
#: (the ``fsm`` backend, docs/schedulers.md). A backend that declares neither assigns ranks itself.
NODE_RANK_USES = ("rank", "hint")


@attrs.define
class BackendRegistry:
    """Factories by kind and name, with the plugin that registered each one.

    ``current_plugin`` is set by the plugin manager around each plugin's registration call so
    duplicate registrations can name both plugins.
    """

    _factories: dict[str, dict[str, Callable[..., Any]]] = attrs.Factory(lambda: {k: {} for k in KINDS})
    _owners: dict[tuple[str, str], str] = attrs.Factory(dict)
    _conf_keys: dict[str, frozenset[str]] = attrs.Factory(dict)
    _parameters: dict[str, Callable[[Any], Any]] = attrs.Factory(dict)
    _node_rank: dict[str, str] = attrs.Factory(dict)
    _host_port_endpoints: set[str] = attrs.Factory(set)
    current_plugin: str = "?"

    def _add(self, kind: str, name: str, factory: Callable[..., Any]) -> None:
        if not callable(factory):
            raise PluginError(f"plugin {self.current_plugin!r} registered {kind} {name!r} with a non-callable factory")
        if name in self._factories[kind] and self._factories[kind][name] is not factory:
            raise PluginError(
                f"{kind} backend {name!r} is registered twice: by plugin {self._owners[(kind, name)]!r} and by "
                f"{self.current_plugin!r}; disable one with --disable-plugin NAME"
            )
        self._factories[kind][name] = factory
        self._owners[(kind, name)] = self.current_plugin

    def add_rendezvous(
        self,
        name: str,
        creator: Callable[..., Any],
        conf_keys: Iterable[str] | None = None,
        parameters: Callable[[Any], Any] | None = None,
        *,
        node_rank: str | None = None,
        host_port_endpoint: bool = False,
    ) -> None:
        """Register ``creator(torch RendezvousParameters) -> torch RendezvousHandler`` under ``name``.

        Args:
            conf_keys: the ``--rdzv-conf`` keys the backend reads; given, ``fsm-agent run`` refuses
                a key that no loaded backend reads and warns about one another backend reads.
                None: not declared, nothing is checked for this backend.
            parameters: ``parameters(LaunchConfig) -> params`` builds what ``creator`` receives;
                None: torch's ``RendezvousParameters`` (``torch_parameters``). A backend that must
                not import torch, or that fills in defaults of its own, passes one.
            node_rank: what the backend does with ``--node-rank``, one of ``NODE_RANK_USES``; None:
                it assigns ranks itself (a ``--node-rank`` is warned about and ignored, a rank a
                batch scheduler discovered is dropped).
            host_port_endpoint: the endpoint is ``HOST[:PORT]`` read by torch's
                ``parse_rendezvous_endpoint``: the CLI checks the port before the launch.

        Raises:
            PluginError: a non-callable creator, a name registered twice, an unknown ``node_rank``.
        """
        if node_rank is not None and node_rank not in NODE_RANK_USES:
            raise PluginError(
                f"plugin {self.current_plugin!r} registered rendezvous {name!r} with node_rank="
                f"{node_rank!r}; use one of {', '.join(NODE_RANK_USES)} or None"
            )
        self._add("rendezvous", name, creator)
        if node_rank is not None:
            self._node_rank[name] = node_rank
        if host_port_endpoint:
            self._host_port_endpoints.add(name)
        if conf_keys is not None:
            self._conf_keys[name] = frozenset(conf_keys)
        if parameters is not None:
            self._parameters[name] = parameters

    def rendezvous_parameters(self, name: str, config: Any) -> Any:
        """What backend ``name``'s creator receives for ``config`` (a ``LaunchConfig``).

        Without ``--local-addr``, ``local_addr`` becomes the address of the interface that routes
        to the rendezvous endpoint (``fsm_agent.hosts.advertised_address``), for every backend:
        torch's default, ``socket.getfqdn()``, is a name the peers may not resolve (a pod's
        hostname), and MASTER_ADDR is built from it.
        """
        if getattr(config, "local_addr", None) is None:
            addr = advertised_address(getattr(config, "rdzv_endpoint", None))
            if addr is not None:
                config = (
                    attrs.evolve(config, local_addr=addr)
                    if attrs.has(type(config))
                    else dataclasses.replace(config, local_addr=addr)
                )
        return self._parameters.get(name, torch_parameters)(config)

    def node_rank_use(self, name: str) -> str | None:
        """What rendezvous backend ``name`` does with ``--node-rank`` (``NODE_RANK_USES``), or None."""
        return self._node_rank.get(name)

    def node_rank_backends(self) -> list[str]:
        """The rendezvous backends that read ``--node-rank``, sorted."""
        return sorted(self._node_rank)

    def host_port_endpoint(self, name: str) -> bool:
        """Whether rendezvous backend ``name`` reads its endpoint with torch's ``parse_rendezvous_endpoint``."""
        return name in self._host_port_endpoints

    def conf_keys(self, name: str) -> frozenset[str] | None:
        """The ``--rdzv-conf`` keys rendezvous backend ``name`` declared it reads, or None."""
        return self._conf_keys.get(name)

    def check_rdzv_conf(self, backend: str, keys: Iterable[str], where: Callable[[str], str]) -> list[str]:
        """Check rendezvous options against what the loaded backends read.

        Args:
            backend: the chosen rendezvous backend.
            keys: the option names given (``--rdzv-conf``, its env var, the config file).
            where: ``key -> text`` naming where the key was set, for the messages.

        Returns:
            One warning per key that ``backend`` does not read but another loaded backend does
            (job files often set ``PET_RDZV_CONF`` for several backends).

        Raises:
            ConfigError: a key that no loaded backend reads, with the closest known key.
        """
        reads = self.conf_keys(backend)
        if reads is None:  # the backend did not say: anything may be its
            return []
        known = set().union(*self._conf_keys.values())
        warnings, errors = [], []
        for key in keys:
            if key in reads:
                continue
            others = sorted(name for name, names in self._conf_keys.items() if key in names)
            if others:
                warnings.append(
                    f"{where(key)}: backend {backend} does not read {key!r} ({', '.join(others)} "
                    f"{'does' if len(others) == 1 else 'do'}); ignored"
                )
                continue
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"did you mean {close[0]}?" if close else f"backend {backend} reads {', '.join(sorted(reads))}"
            errors.append(f"{where(key)}: no loaded rendezvous backend reads {key!r}; {hint}")
        if errors:
            raise ConfigError("; ".join(errors))
        return warnings

    def add_launcher(self, name: str, factory: Callable[..., Any]) -> None:
        """Register ``factory(agent) -> launcher`` under ``name``."""
        self._add("launcher", name, factory)

    def names(self, kind: str) -> list[str]:
        return sorted(self._factories[kind])

    def owner(self, kind: str, name: str) -> str:
        return self._owners[(kind, name)]

    def get(self, kind: str, name: str) -> Callable[..., Any]:
        """The factory for ``name``; an unknown name raises ConfigError listing the known ones."""
        try:
            return self._factories[kind][name]
        except KeyError:
            known = ", ".join(self.names(kind)) or "(none)"
            if kind == "rendezvous" and name in TORCH_ETCD_BACKENDS:
                raise ConfigError(_etcd_hint(name, "etcd-v3" in self._factories[kind])) from None
            raise ConfigError(
                f"unknown {kind} backend {name!r}: known backends are {known}; "
                f"fix {_FLAG[kind]} or install a plugin that provides it"
            ) from None


def torch_parameters(config: Any, **defaults: Any) -> Any:
    """torch's ``RendezvousParameters`` for a ``LaunchConfig`` (as torch's ``launch_agent`` builds
    them); ``defaults`` fill in ``rdzv_configs`` keys the configuration does not set."""
    from fsm_agent._early_signals import undisturbed

    with undisturbed():  # the agent's first import of torch: a stop signal waits for its end
        from torch.distributed.elastic.rendezvous import RendezvousParameters

    return RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **{**defaults, **dict(config.rdzv_configs)},
    )


def _etcd_hint(name: str, installed: bool) -> str:
    how = (
        "use --rdzv-backend etcd-v3 (installed)"
        if installed
        else "use --rdzv-backend etcd-v3 after `pip install fsm-agent-etcd` (plugins/fsm-agent-etcd in "
        "fsm-agent's repository)"
    )
    return (
        f"--rdzv-backend {name}: torch's {name} backend needs etcd's v2 API and python-etcd, which fsm-agent "
        f"does not use; for etcd {how}, or use c10d"
    )


def positive_seconds(value: float) -> None:
    """The ``check`` of a plugin option in seconds (``options.add(..., check=positive_seconds)``).

    Raises:
        ValueError: ``expected seconds > 0, got VALUE`` (NaN and infinity included).
    """
    if not (math.isfinite(value) and value > 0):  # NaN compares false both ways
        raise ValueError(f"expected seconds > 0, got {value}")


def require_positive_seconds(config: dict[str, Any], defaults: dict[str, int]) -> None:
    """Check rendezvous options that torch reads as whole seconds and needs above 0.

    Args:
        config: the rendezvous options (``RendezvousParameters.config``), values as given.
        defaults: ``{option name: default seconds}`` of the options to check (the default is the
            example in the message); an option not in ``config`` is not checked.

    Raises:
        ConfigError: ``--rdzv-conf NAME=VALUE: must be a whole number of seconds > 0 (e.g. NAME=N)``,
            where torch would fail later with a store timeout of VALUE seconds or a raw ValueError.
    """
    for name, default in defaults.items():
        raw = config.get(name)
        if raw is None:
            continue
        try:  # as torch's ``int(value)``: "1.5" is not a whole number; a file's 600.0 is
            value = int(raw.strip()) if isinstance(raw, str) else int(raw) if float(raw).is_integer() else 0
        except (TypeError, ValueError, OverflowError):
            value = 0
        if value <= 0:
            raise ConfigError(
                f"--rdzv-conf {name}={raw}: must be a whole number of seconds > 0 (e.g. --rdzv-conf {name}={default})"
            )
