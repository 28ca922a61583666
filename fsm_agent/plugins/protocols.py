"""The written backend protocol: what the agent asks of a rendezvous handler and of a launcher.

A rendezvous handler is torch's ``RendezvousHandler`` (``next_rendezvous``, ``num_nodes_waiting``,
``shutdown``, ...); a launcher is ``fsm_agent.plugins.launcher_subprocess.SubprocessLauncher``'s
interface. Beyond those, a backend MAY have the optional members declared here
(``RENDEZVOUS_OPTIONAL`` and ``LAUNCHER_OPTIONAL``: each one's meaning, its default when absent and
the torch name it mirrors). The agent reads them only through ``RendezvousAdapter`` and
``LauncherAdapter``, never by probing the backend itself; the conformance suites
(``fsm_agent.testing.conformance``) check each optional member a backend has against its
declared kind; docs/plugins.md renders the tables from these declarations.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import attrs

log = logging.getLogger(__name__)


@attrs.frozen
class OptionalMember:
    """One optional member of a backend.

    Attributes:
        name: the attribute's name on the handler or launcher.
        kind: ``"method"`` (called with the arguments in ``signature``), ``"flag"`` (a bool
            attribute or property) or ``"callback"`` (an attribute the agent assigns a callable to).
        signature: how the agent calls or reads it, e.g. ``"num_nodes_lost() -> int"``.
        default: what the agent does or assumes when it is absent.
        meaning: what it is for.
        torch: the torch name it mirrors, or ``""`` (fsm-agent's own).
    """

    name: str
    kind: str
    signature: str
    default: str
    meaning: str
    torch: str = ""


RENDEZVOUS_OPTIONAL: tuple[OptionalMember, ...] = (
    OptionalMember(
        "use_agent_store",
        "flag",
        "use_agent_store: bool",
        "False: the workers' rank 0 hosts their store",
        "True when the handler itself hosts the workers' TCPStore at the round's MASTER_ADDR:MASTER_PORT "
        "(workers get TORCHELASTIC_USE_AGENT_STORE=True and are all clients). Every built-in says False: a store "
        "that outlives a process group hands a re-created one the earlier group's keys.",
        "RendezvousHandler.use_agent_store",
    ),
    OptionalMember(
        "num_nodes_lost",
        "method",
        "num_nodes_lost() -> int",
        "0: lost nodes are noticed only through the workers' failures",
        "Participants of this node's round that are gone (their keep-alive lapsed, or they left): the agent "
        "re-rendezvouses, class node_lost, not counted against max_restarts.",
    ),
    OptionalMember(
        "membership_fd",
        "method",
        "membership_fd() -> int | None",
        "None: the agent asks num_nodes_lost/num_nodes_waiting every --monitor-interval",
        "An fd that becomes readable when the membership changed, so the agent wakes at once instead of polling.",
    ),
    OptionalMember(
        "leave",
        "method",
        "leave() -> None",
        "shutdown() when this node ends with the job, nothing when it stops alone",
        "Leave this node's round without closing the rendezvous, for a node that stops alone (a signal, "
        "excluded, drained): the others see one node lost at their next check.",
        "the exit operation of DynamicRendezvousHandler",
    ),
    OptionalMember(
        "shutdown_closes_rendezvous",
        "flag",
        "shutdown_closes_rendezvous: bool",
        "True: shutdown() is skipped when this node stops alone",
        "False when shutdown() only takes this node out, so the agent may call it on every exit.",
        "RendezvousHandler.shutdown",
    ),
    OptionalMember(
        "interruptible",
        "flag",
        "interruptible: bool",
        "False: a blocking call runs on a helper thread the agent can abandon on a signal",
        "True when the handler's blocking calls are Python waits that a stop signal (SignalStop, raised from the "
        "agent's signal handler) cuts short, so the agent runs them on its own thread and shutdown() never races "
        "a join still running.",
    ),
    OptionalMember(
        "on_standby",
        "callback",
        "on_standby = callable(message: str)",
        "not set: a backend without hot spares",
        "Assigned by the agent: the handler calls it with one line when this node waits as a hot spare "
        "(the round is full); the agent logs it, records a standby event and shows it in /status.",
    ),
    OptionalMember(
        "hosts_store",
        "flag",
        "hosts_store: bool",
        "False: the round's store outlives every node (an etcd cluster), or its host is not known",
        "True on the node whose agent hosts the round's store, read after next_rendezvous(): when that store "
        "becomes unreachable, the survivors' job verdict names that node's ranks as lost with it.",
        "the is_host of torch's C10dRendezvousBackend",
    ),
    OptionalMember(
        "endpoint",
        "flag",
        "endpoint: str | None",
        "--rdzv-endpoint as configured",
        "The endpoint the handler really uses (the port it bound for host:0, as --standalone asks).",
    ),
)

LAUNCHER_OPTIONAL: tuple[OptionalMember, ...] = (
    OptionalMember(
        "take_timings",
        "method",
        "take_timings() -> dict[str, float]",
        "{}: nothing to report",
        "Seconds the launcher spent outside the agent's own steps since last asked (e.g. preload_import_s): "
        "metrics fsm_agent.launcher.<name> and one launcher_timings event.",
    ),
    OptionalMember(
        "replace_workers",
        "method",
        "replace_workers(spec, envs: dict[int, dict[str, str]], logs: dict[int, WorkerLogs]) -> dict[int, int]",
        "absent: no in-process restart (--restart-mode inprocess restarts the whole group)",
        "Start a new process for each exited local rank in envs while the other workers keep running; returns "
        "{local_rank: pid}. In-process restart (fsm_agent.inprocess) replaces a failed rank with it.",
    ),
    OptionalMember(
        "shutdown",
        "method",
        "shutdown() -> None",
        "nothing",
        "Release what outlives attempts (the preload launcher's zygote), once, after close().",
    ),
)


def optional_member_problems(backend: Any, members: tuple[OptionalMember, ...]) -> list[str]:
    """One line for each optional member ``backend`` has that does not fit its declared kind: a
    method that is not callable, a flag that is not a bool (``endpoint``: a str or None), a
    callback slot that holds neither None nor a callable. Absent members are fine."""
    problems = []
    owner = type(backend).__name__
    for member in members:
        if not hasattr(backend, member.name):
            continue
        value = getattr(backend, member.name)
        if member.kind == "method" and not callable(value):
            problems.append(f"{owner}.{member.name} must be a method ({member.signature}), got {value!r}")
        elif member.kind == "flag" and member.name == "endpoint":
            if value is not None and not isinstance(value, str):
                problems.append(f"{owner}.endpoint must be a str or None, got {value!r}")
        elif member.kind == "flag" and not isinstance(value, bool):
            problems.append(f"{owner}.{member.name} must be a bool, got {value!r}")
        elif member.kind == "callback" and value is not None and not callable(value):
            problems.append(f"{owner}.{member.name} must be None or a callable, got {value!r}")
    return problems


class RendezvousHandlerProtocol(Protocol):
    """What the agent calls on every rendezvous handler (torch's ``RendezvousHandler``)."""

    def next_rendezvous(self) -> Any: ...
    def get_backend(self) -> str: ...
    def get_run_id(self) -> str: ...
    def is_closed(self) -> bool: ...
    def set_closed(self) -> None: ...
    def num_nodes_waiting(self) -> int: ...
    def shutdown(self) -> bool: ...


class RendezvousAdapter:
    """The agent's one view of a rendezvous handler's optional members (``RENDEZVOUS_OPTIONAL``),
    each with its declared default when the handler does not have it."""

    def __init__(self, handler: RendezvousHandlerProtocol) -> None:
        self.handler = handler

    def _optional(self, name: str, default: Any) -> Any:
        return getattr(self.handler, name, default)

    @property
    def use_agent_store(self) -> bool:
        return bool(self._optional("use_agent_store", False))

    def num_nodes_lost(self) -> int:
        method = self._optional("num_nodes_lost", None)
        return int(method()) if method is not None else 0

    def membership_fd(self) -> int | None:
        method = self._optional("membership_fd", None)
        return method() if method is not None else None

    @property
    def leave(self) -> Callable[[], None] | None:
        """The handler's ``leave``, or None."""
        leave: Callable[[], None] | None = self._optional("leave", None)
        return leave

    def end(self, leaving_alone: bool, busy_with: str | None) -> None:
        """Tell the handler this node is done: torch's ``shutdown()``, unless this node leaves alone.

        torch's ``shutdown()`` closes the rendezvous for everyone, so a node leaving alone (a stop
        signal, as torch does; excluded; its own drain) skips it, unless the backend's shutdown only
        leaves (``shutdown_closes_rendezvous`` False). A backend with ``leave()`` (c10d, etcd-v3)
        leaves the round instead, so the others notice at once, not after a keep-alive; not while
        the store client is still ``busy_with`` an abandoned call. Logs, never raises.
        """
        leave = self.leave if leaving_alone else None
        if leave is not None and busy_with is not None:
            log.warning(
                "not leaving the rendezvous: its store is still busy with the abandoned %s; the other "
                "nodes notice this node after its keep-alive timeout",
                busy_with,
            )
        elif not leaving_alone or not self.shutdown_closes_rendezvous or leave:
            try:
                (leave or self.handler.shutdown)()
            except Exception as exc:
                log.warning("rendezvous %s failed: %s", "leave" if leave else "shutdown", exc)

    @property
    def shutdown_closes_rendezvous(self) -> bool:
        return bool(self._optional("shutdown_closes_rendezvous", True))

    @property
    def interruptible(self) -> bool:
        return bool(self._optional("interruptible", False))

    def set_on_standby(self, callback: Callable[[str], None]) -> None:
        """Assign ``on_standby`` where the handler declares it (a backend with hot spares)."""
        if hasattr(self.handler, "on_standby"):
            self.handler.on_standby = callback

    @property
    def hosts_store(self) -> bool:
        return bool(self._optional("hosts_store", False))

    @property
    def endpoint(self) -> str | None:
        endpoint = self._optional("endpoint", None)
        return str(endpoint) if endpoint else None

    def round_timeout(self, config: dict[str, Any]) -> tuple[str, float]:
        """(key, seconds) of the timeout a rendezvous round really waits, read from the handler.

        torch's StaticTCPRendezvous reads ``timeout`` (default 600), torch's DynamicRendezvousHandler
        ``settings.timeout.join``, fsm's handler ``settings.join_timeout``; another backend: the
        ``join_timeout`` it was given in ``config`` (``--rdzv-conf``), else torch's default 600.
        """
        settings = self._optional("settings", None)
        candidates: tuple[tuple[str, Any], ...] = (
            ("join_timeout", getattr(settings, "join_timeout", None)),
            ("join_timeout", getattr(getattr(settings, "timeout", None), "join", None)),
            ("timeout", self._optional("timeout", None)),
        )
        for key, value in candidates:
            seconds = value.total_seconds() if hasattr(value, "total_seconds") else value
            if isinstance(seconds, (int, float)):
                return key, float(seconds)
        try:
            return "join_timeout", float(config.get("join_timeout", 600))
        except (TypeError, ValueError):
            return "join_timeout", 600.0


class LauncherAdapter:
    """The agent's one view of a launcher's optional members (``LAUNCHER_OPTIONAL``)."""

    def __init__(self, launcher: Any) -> None:
        self.launcher = launcher

    def take_timings(self) -> dict[str, float]:
        method = getattr(self.launcher, "take_timings", None)
        return dict(method()) if method is not None else {}

    @property
    def replaces_workers(self) -> bool:
        """The launcher can replace one exited worker while the others run (``replace_workers``)."""
        return callable(getattr(self.launcher, "replace_workers", None))

    def replace_workers(self, spec: Any, envs: dict[int, dict[str, str]], logs: dict[int, Any]) -> dict[int, int]:
        """The launcher's ``replace_workers``.

        Raises:
            NotImplementedError: the launcher has none (check ``replaces_workers`` first).
        """
        method = getattr(self.launcher, "replace_workers", None)
        if method is None:
            raise NotImplementedError(f"{type(self.launcher).__name__} cannot replace one worker")
        return dict(method(spec, envs, logs))

    def shutdown(self) -> None:
        method = getattr(self.launcher, "shutdown", None)
        if method is not None:
            method()
