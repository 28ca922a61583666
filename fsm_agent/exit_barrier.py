"""The exit barrier: a node whose workers are done waits for the others, as torch's ``_exit_barrier``.

Same keys as torch (``torchelastic/agent/terminal_state/num_members`` and ``.../last_member``), so
torchrun peers share it. A failing agent checks in too (``release``), so its peers stop waiting at
once instead of for the whole timeout (torch waits 300 s). A node in the barrier marks itself
finished in the round's store (``fsm_agent.finished_nodes``): its leaving is no loss to the others.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from fsm_agent.finished_nodes import mark_finished
from fsm_agent.worker import WorkerGroup

log = logging.getLogger(__name__)

EXIT_BARRIER_PREFIX = "torchelastic/agent/terminal_state"  # torch's key: torchrun peers share it
NUM_MEMBERS_KEY = f"{EXIT_BARRIER_PREFIX}/num_members"
LAST_MEMBER_KEY = f"{EXIT_BARRIER_PREFIX}/last_member"


def own_connection(store: Any) -> Any:
    """``store.clone()`` (torch's Store API: the same store on a new connection), or ``store``
    itself for a store that cannot be cloned (a Python store, whose calls do not queue)."""
    try:
        return store.clone()
    except (AttributeError, NotImplementedError, RuntimeError):
        return store


class ExitBarrier:
    """One agent's exit barrier, round after round.

    Args:
        hostname: this node's name, marked in the store when it finishes.
        timeout_s: seconds to wait for the others (``--exit-barrier-timeout``, torch's
            ``exit_barrier_timeout``).
    """

    def __init__(self, hostname: str, timeout_s: float) -> None:
        self._hostname = hostname
        self._timeout_s = timeout_s
        self._store: Any = None
        self.checked_in = False

    def new_round(self, store: Any, group_world_size: int) -> None:
        """Open the barrier's own connection now, while the round's store is surely there: a clone
        made at the barrier would retry a gone store host for the store's whole timeout."""
        self._store = own_connection(store) if group_world_size > 1 else None

    def wait(self, group: WorkerGroup, call: Callable[[str, Callable[[], Any]], Any]) -> None:
        """Wait (up to ``timeout_s``) until every agent of the round is done. ``call(name, fn)`` runs
        the blocking wait so that a stop signal cuts it short (``Interrupts.call``; ``SignalStop``
        passes through). A barrier that fails or times out is logged: the local result stands, as
        in torch."""
        if not group.group_world_size or group.group_world_size <= 1:
            return

        def barrier() -> None:
            # Its own connection: on one TCPStore connection a blocked wait holds every other call
            # (c10d's keep-alive among them, so the peers would take this finished node for lost).
            store = self._store or group.store
            mark_finished(store, group.group_rank or 0, self._hostname)
            store.wait([self.check_in(store, group.group_world_size or 0)], timedelta(seconds=self._timeout_s))

        try:
            call("exit-barrier", barrier)
        except Exception as exc:  # torch swallows barrier errors too: the local result stands
            network_error = getattr(sys.modules.get("torch.distributed"), "DistNetworkError", ())
            if isinstance(exc, network_error):  # the connection broke: no timeout passed
                log.warning(
                    "the store host left before the exit barrier completed (%s); this node's result stands", exc
                )
            else:
                log.warning("exit barrier did not complete within %ss: %s", self._timeout_s, exc)

    def release(
        self, group: WorkerGroup, bounded: Callable[[str, Callable[[], Any]], Any], abandoned: str | None
    ) -> None:
        """A failing agent checks in so its peers stop waiting for it. ``bounded(name, fn)`` runs the
        check-in with a short timeout: a store host that is gone without a reset would hold a stop
        for the store's timeout. ``abandoned``: a store call still holds the client (no check-in)."""
        if group.store is None or not group.group_world_size or group.group_world_size <= 1:
            return
        if self.checked_in:
            return  # stopped while waiting in the barrier: this node is counted already
        if abandoned is not None:
            log.warning(
                "not releasing the exit barrier: the store is still busy with the abandoned %s; "
                "the other nodes wait for the barrier's timeout",
                abandoned,
            )
            return
        world = group.group_world_size
        try:
            bounded("exit-barrier-release", lambda: self.check_in(group.store, world))
        except Exception as exc:  # the store may be gone with the failure; peers then time out
            log.warning("could not release the exit barrier: %s", exc)

    def check_in(self, store: Any, group_world_size: int) -> str:
        """Count this node in; the last one in sets the key everybody waits for. Returns that key."""
        self.checked_in = True
        if store.add(NUM_MEMBERS_KEY, 1) == group_world_size:
            store.set(LAST_MEMBER_KEY, "<val_ignored>")
        return LAST_MEMBER_KEY
