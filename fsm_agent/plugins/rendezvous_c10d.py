"""Built-in rendezvous ``c10d``: torch's DynamicRendezvousHandler over a TCPStore (torch-compatible).

It is torch's own handler, so an fsm-agent node and a torchrun node can join the same rendezvous.
One change: MASTER_ADDR/MASTER_PORT (a free port on group rank 0's node) are published afresh
each round (torch's ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` path), and the workers' rank 0 hosts
their TCPStore there (``TORCHELASTIC_USE_AGENT_STORE=False``), a new one for each
``init_process_group``. torch 2.13 shares one agent-hosted store across attempts and process groups,
so a restarted group, or a worker that destroys and re-creates its process group, finds the earlier
group's keys and connects to addresses that are gone (pytorch/pytorch#135712, #114585).

Lost and departed nodes (``num_nodes_lost``, fsm-agent's optional backend API): torch tells the
survivors nothing when a participant dies; its handler only drops a node whose keep-alive is
older than ``keep_alive_interval * keep_alive_max_attempt`` (15 s by default) when it next reads
the shared state. The wrapper remembers the participants of the round this node joined and,
every ``--monitor-interval``, asks torch's own state holder (the read ``num_nodes_waiting``
makes, served from torch's 1 s cache) whether one of them is gone; a suspect is confirmed by one
fresh read (a node that re-joins leaves the round and enters the wait list in two writes). A node
that stops on a signal or is excluded leaves the round (``leave``: torch's own exit operation)
instead of closing the rendezvous, so the others see it at their next check, not after the
keep-alive timeout. These read torch's private layout (``_state_holder``, ``_RendezvousState``):
``check_torch_layout`` names what is missing in one line, and the supported torch range is
``TORCH_LAYOUT_TESTED``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from datetime import timedelta

from fsm_agent.errors import RendezvousFailed
from fsm_agent.hosts import is_this_host
from fsm_agent.plugins import hookimpl
from fsm_agent.plugins.registry import require_positive_seconds

log = logging.getLogger(__name__)

#: The ``--rdzv-conf`` keys torch's DynamicRendezvousHandler reads (``dynamic_rendezvous.create_handler``);
#: public for backends built on it (the etcd-v3 plugin).
DYNAMIC_HANDLER_CONF_KEYS = (
    "join_timeout",
    "last_call_timeout",
    "close_timeout",
    "heartbeat_timeout",
    "keep_alive_interval",
    "keep_alive_max_attempt",
)
#: ... and those torch's c10d backend adds (``c10d_rendezvous_backend.create_backend``).
C10D_CONF_KEYS = (*DYNAMIC_HANDLER_CONF_KEYS, "is_host", "read_timeout", "store_type")

#: The c10d options torch reads as whole seconds > 0, with torch's defaults (``RendezvousTimeout``,
#: ``create_backend``).
C10D_TIMEOUTS = {
    "join_timeout": 600,
    "last_call_timeout": 30,
    "close_timeout": 30,
    "heartbeat_timeout": 5,
    "read_timeout": 60,
}

#: torch reads this switch from the environment at the end of ``next_rendezvous``, after a
#: blocking join. Handlers running at once in one process (tests, several agents) share one
#: setting: the first to enter sets it, the last to leave restores it.
_SHARE_SWITCH = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
_switch_lock = threading.Lock()
_switch_users = 0
_switch_previous: str | None = None


@contextlib.contextmanager
def _fresh_store_per_round():
    global _switch_users, _switch_previous
    with _switch_lock:
        if _switch_users == 0:
            _switch_previous = os.environ.get(_SHARE_SWITCH)
            os.environ[_SHARE_SWITCH] = "1"
        _switch_users += 1
    try:
        yield
    finally:
        with _switch_lock:
            _switch_users -= 1
            if _switch_users == 0:
                if _switch_previous is None:
                    os.environ.pop(_SHARE_SWITCH, None)
                else:
                    os.environ[_SHARE_SWITCH] = _switch_previous


#: torch versions whose handler layout ``check_torch_layout`` was tested against (pyproject's range).
TORCH_LAYOUT_TESTED = ">=2.4,<3"
#: Seconds between a suspect loss and the fresh read that confirms it (a re-join takes two writes).
CONFIRM_PAUSE_S = 0.05


def check_torch_layout(handler) -> None:
    """Check that ``handler`` (torch's ``DynamicRendezvousHandler``) has what ``num_nodes_lost`` reads.

    Raises:
        RendezvousFailed: one line naming the missing private torch name and the torch range tested.
    """
    import torch
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    needed = [
        (handler, "_state_holder"),
        (handler, "_heartbeat_lock"),
        (handler, "_this_node"),
        (handler, "_op_executor"),
        (handler, "_stop_heartbeats"),
        (handler, "settings"),
        (dr, "_BackendRendezvousStateHolder"),
        (dr, "_RendezvousExitOp"),
    ]
    for owner, name in needed:
        if not hasattr(owner, name):
            _layout_error(torch.__version__, f"{type(owner).__name__}.{name}")
    state = handler._state_holder.state
    for name in ("round", "complete", "participants", "wait_list", "last_heartbeats"):
        if not hasattr(state, name):
            _layout_error(torch.__version__, f"{type(state).__name__}.{name}")


def _layout_error(version: str, missing: str):
    raise RendezvousFailed(
        f"torch {version}'s dynamic rendezvous has no {missing}, which fsm-agent reads to notice lost nodes "
        f"(tested with torch {TORCH_LAYOUT_TESTED}): install a torch in that range or use --rdzv-backend fsm"
    )


class FreshStoreHandler:
    """Wraps a torch ``DynamicRendezvousHandler``: a new MASTER_PORT every round, lost nodes noticed.

    Public for third-party backends built on torch's ``DynamicRendezvousHandler`` (the
    ``fsm-agent-etcd`` package wraps its handler with it): with ``use_agent_store`` false the
    workers' rank 0 hosts a new TCPStore for every process group they create;
    ``num_nodes_lost``, ``leave`` and ``num_nodes_waiting`` (see the module docstring and
    each method) work on any backend of that handler. All other calls go to the wrapped handler
    unchanged.

    Args:
        handler: torch's ``DynamicRendezvousHandler``.
        backend: its ``RendezvousBackend`` (for the confirming read); default: the handler's own.

    Raises:
        RendezvousFailed: torch's handler lacks the layout ``num_nodes_lost`` reads
            (``check_torch_layout``).
    """

    #: torch's ``RendezvousHandler.use_agent_store``: no agent hosts the workers' store; their rank 0
    #: does, at the MASTER_PORT published for the round.
    use_agent_store = False

    def __init__(self, handler, backend=None, hosts_store: bool = False):
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _BackendRendezvousStateHolder

        check_torch_layout(handler)
        self._handler = handler
        #: this agent hosts the c10d TCPStore (torch's ``is_host``, as it was finally decided)
        self.hosts_store = hosts_store
        backend = backend if backend is not None else getattr(handler._state_holder, "_backend", None)
        # torch's own state holder, never written through, without the 1 s cache: confirms a suspect.
        self._fresh = (
            _BackendRendezvousStateHolder(backend, handler.settings, cache_duration=0) if backend is not None else None
        )
        self._joined: tuple[int, frozenset] | None = None  # (round, participants) this node joined

    def next_rendezvous(self):
        with _fresh_store_per_round():
            info = self._handler.next_rendezvous()
        state = self._handler._state_holder.state
        self._joined = (state.round, frozenset(state.participants))
        return info

    def num_nodes_lost(self) -> int:
        """Participants of this node's round that are gone: their keep-alive expired (torch drops
        them when it reads the state) or they left (``leave``). This node counts itself when it is
        no longer a participant (its own keep-alive lapsed). 0 before the first round.

        Detection: within ``keep_alive_interval * keep_alive_max_attempt`` seconds of a node's last
        keep-alive (torch's rendezvous conf, 5 x 3 s by default), plus the caller's polling
        interval or torch's 1 s state cache, whichever is longer.

        Raises:
            torch ``RendezvousConnectionError``: the backend holding the state is unreachable.
        """
        if self._joined is None:
            return 0
        handler = self._handler
        with handler._heartbeat_lock:
            handler._state_holder.sync()
            gone = self._gone(handler._state_holder.state)
            if gone and self._fresh is not None:  # a node re-joining is briefly in no list: read again
                time.sleep(CONFIRM_PAUSE_S)
                self._fresh.sync()
                gone &= self._gone(self._fresh.state)
        return len(gone)

    def num_nodes_waiting(self) -> int:
        """torch's ``num_nodes_waiting``, except 0 while this node's round is complete with
        ``max_nodes`` participants: a new round could not take more nodes. torch would answer the
        wait list, and a node left on it (it joined the wait list just before the round refilled)
        then makes every participant re-rendezvous again and again while it keeps missing the
        seat (it polls every second, the participants re-join in milliseconds). Such a node
        stays a standby: it joins the round after a participant is lost."""
        waiting = self._handler.num_nodes_waiting()
        state = self._handler._state_holder.state
        full = (
            self._joined is not None
            and state.round == self._joined[0]
            and state.complete
            and len(state.participants) >= self._handler.settings.max_nodes
        )
        return 0 if full else waiting

    def _gone(self, state) -> set:
        """Members of the joined round in none of ``state``'s lists. A new round never holds this
        node (only its own ``next_rendezvous`` adds it), so a round that moved on counts it."""
        members = self._joined[1]
        present = set(state.participants) | set(state.wait_list) | set(getattr(state, "redundancy_list", ()))
        return set(members) - present

    def leave(self) -> None:
        """Leave this node's round without closing the rendezvous (torch's exit operation, the one
        ``next_rendezvous`` starts with): the others see one node lost at their next check. For an
        agent that stops on a signal or was excluded; torch's ``shutdown`` would close the
        rendezvous for every node. Errors are logged by the caller."""
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousExitOp

        handler = self._handler
        handler._stop_heartbeats()
        with handler._heartbeat_lock:
            deadline = time.monotonic() + handler.settings.timeout.close.total_seconds()
            handler._op_executor.run(_RendezvousExitOp(), deadline)
        self._joined = None

    def __getattr__(self, name):
        return getattr(self._handler, name)


def create_c10d_handler(params):
    """``RendezvousParameters -> RendezvousHandler`` for backend ``c10d`` (torch's creator, wrapped).

    Raises:
        ConfigError: a timeout option (``C10D_TIMEOUTS``) is not a whole number of seconds > 0.
        RendezvousFailed: the endpoint is held by something that does not answer as a TCPStore
            (within PROBE_TIMEOUT seconds); on a node that does not host the store (``is_host``
            false), nothing listened there within ``join_timeout`` (``_wait_for_store_host``); on
            the store's host, or for a name that does not resolve, no store within ``read_timeout``.
    """
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    require_positive_seconds(params.config, C10D_TIMEOUTS)
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
    inferred = params.get("is_host") is None
    if inferred:
        # Found by address: torch's own inference resolves this machine's hostname unguarded, and
        # a pod's or container's hostname that does not resolve raises gaierror (fsm_agent.hosts).
        params.config["is_host"] = "1" if is_this_host(host) else "0"
    read_timeout = float(params.get("read_timeout", 60))
    if port and not _hosts_store(params):
        _wait_for_store_host(params, host, port)
    # Something already listens: a real TCPStore answers in milliseconds, so a silent peer is an
    # unrelated program (torch would block in its client handshake, then retry until join_timeout).
    # Nothing listens yet (a name that does not resolve, or this node hosts the store): wait as
    # torch does, read_timeout.
    deadline = min(PROBE_TIMEOUT, read_timeout) if port and _listening(host, port) else read_timeout + 5
    outcome: dict = {}

    def connect():
        try:
            try:
                backend, store = create_backend(params)
            except RendezvousConnectionError:
                if not (inferred and params.config["is_host"] == "1"):
                    raise
                params.config["is_host"] = "0"  # as torch: another agent on this machine hosts it already
                backend, store = create_backend(params)
            _probe(store, read_timeout)
            outcome["value"] = (backend, store)
        except BaseException as exc:  # reported in the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=connect, name="c10d-connect", daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(deadline)
    if "value" in outcome:
        backend, store = outcome["value"]
        return FreshStoreHandler(create_handler(store, backend, params), backend, _hosts_store(params))
    waited = time.monotonic() - started
    try:  # torch retries a name that does not resolve as if the store were not up yet
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:  # UnicodeError: not a valid host name at all
        raise RendezvousFailed(
            f"rendezvous endpoint {params.endpoint} (backend c10d): the host {host!r} does not "
            f"resolve ({getattr(exc, 'strerror', None) or exc}; tried for {waited:.0f}s): check "
            f"the host name in --rdzv-endpoint"
        ) from None
    error = outcome.get("error") or TimeoutError(f"no answer within {deadline:.0f}s")
    raise RendezvousFailed(_unreachable(params, error, waited))


#: Seconds a store that accepts connections gets to answer before the endpoint is declared wrong.
PROBE_TIMEOUT = 10.0
#: Seconds between the progress lines of a node waiting for a store host that has not started.
WAIT_PROGRESS_S = 30.0
#: Seconds between two looks for the store host's port while nothing listens there.
WAIT_POLL_S = 0.5


def _hosts_store(params) -> bool:
    """``is_host`` as torch reads it; a value torch cannot read counts as hosting (torch names it)."""
    try:
        return bool(params.get_as_bool("is_host", False))
    except ValueError:
        return True


def _wait_for_store_host(params, host: str, port: int) -> None:
    """A node that does not host the store (``is_host`` false) waits up to ``join_timeout`` seconds
    for something to listen at the endpoint: pods, VMs and Slurm steps start in any order, and the
    store's host may come minutes after the others. torch gives up after ``read_timeout`` (its
    TCPStore client's connect timeout). A log line every ``WAIT_PROGRESS_S`` seconds says what it
    waits for. Returns at once when the name does not resolve (the caller names that).

    Raises:
        RendezvousFailed: nothing listened within ``join_timeout``.
    """
    join_timeout = float(params.get("join_timeout", C10D_TIMEOUTS["join_timeout"]))
    started = time.monotonic()
    next_line = started + WAIT_PROGRESS_S
    while not _listening(host, port):
        try:
            socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError):
            return
        now = time.monotonic()
        if now - started >= join_timeout:
            raise RendezvousFailed(
                f"rendezvous endpoint {params.endpoint} (backend c10d): nothing listened there within "
                f"join_timeout={join_timeout:g}s (is_host={params.get('is_host')}): start the node that hosts "
                f"the store (is_host=1, or the host named in --rdzv-endpoint), check --rdzv-endpoint, or give "
                f"a longer --rdzv-conf join_timeout"
            )
        if now >= next_line:
            next_line = now + WAIT_PROGRESS_S
            log.warning(
                "c10d rendezvous: waiting for the store host at %s:%s to start (nothing listens there yet; "
                "is_host=%s): %.0fs of join_timeout=%gs",
                host,
                port,
                params.get("is_host"),
                now - started,
                join_timeout,
            )
        time.sleep(WAIT_POLL_S)


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def _probe(store, read_timeout: float) -> None:
    """One round trip through the store."""
    previous = store.timeout
    store.set_timeout(timedelta(seconds=min(PROBE_TIMEOUT, read_timeout)))
    try:
        store.add("fsm_agent/probe", 0)
    finally:
        store.set_timeout(previous)


def _unreachable(params, exc: BaseException, waited: float) -> str:
    is_host = params.get("is_host", "inferred from the endpoint")
    detail = str(exc).splitlines()[0] if str(exc) else ""
    return (
        f"rendezvous endpoint {params.endpoint or '(default)'} (backend c10d) did not answer as a TCPStore "
        f"(gave up after {waited:.0f}s; is_host={is_host}): {type(exc).__name__}: {detail}. If another program "
        f"holds that port, pick a free port for --rdzv-endpoint"
    )


@hookimpl
def fsm_agent_register_backends(registry):
    registry.add_rendezvous("c10d", create_c10d_handler, conf_keys=C10D_CONF_KEYS, host_port_endpoint=True)
