"""What a rendezvous error means to the agent, and how it is told to the user.

``classify`` tells the agent which row of the table an exception from a rendezvous takes
(``rendezvous_not_needed``, ``rendezvous_failed``, or neither: an agent error); ``describe``
writes the one-line error a user reads, naming where the rendezvous was and the fix.
"""

from __future__ import annotations

import sys
from typing import Any

from fsm_agent.errors import FsmAgentError, RendezvousFailed, RendezvousNotNeeded


def classify(exc: BaseException) -> str | None:
    """``"not_needed"``, ``"failed"`` or None (not a rendezvous error).

    torch's error classes (``RendezvousGracefulExitError``, ``RendezvousError``) are only consulted
    when torch is already loaded, so a backend that does not use torch never makes the agent
    import it.
    """
    if isinstance(exc, RendezvousNotNeeded):
        return "not_needed"
    if isinstance(exc, RendezvousFailed):
        return "failed"
    torch_api = sys.modules.get("torch.distributed.elastic.rendezvous.api")
    if torch_api is not None:
        if isinstance(exc, torch_api.RendezvousGracefulExitError):
            return "not_needed"
        if isinstance(exc, torch_api.RendezvousError):
            return "failed"
    return None


def describe(exc: BaseException, rdzv: Any, timeout_key: str, timeout_s: float) -> str:
    """``rendezvous failed: <where>: <what>`` for ``exc``, where ``rdzv`` is the WorkerSpec's
    RendezvousSettings and ``timeout_key``/``timeout_s`` the round timeout the handler really
    waits (seconds)."""
    where = (
        f"backend={rdzv.backend} endpoint={rdzv.endpoint or '(default)'} run_id={rdzv.run_id} "
        f"{timeout_key}={timeout_s:g}s"
    )
    if "is_host" in (rdzv.conf_keys or ()):  # a backend that does not read is_host: it means nothing
        where += f" is_host={rdzv.config.get('is_host', 'inferred from the endpoint')}"
    detail = str(exc) or _empty_detail(exc, rdzv, timeout_key, timeout_s)
    own_prefix = f"{rdzv.backend} rendezvous failed: "
    if isinstance(exc, FsmAgentError) and detail.startswith(own_prefix) and "endpoint=" in detail:
        # The backend named where itself (fsm's handler): say it once, not twice.
        return f"rendezvous failed: {detail[len(own_prefix) :]}"
    return f"rendezvous failed: {where}: {type(exc).__name__}: {detail}"


def _empty_detail(exc: BaseException, rdzv: Any, key: str, seconds: float) -> str:
    """What torch's message-less RendezvousTimeoutError / RendezvousClosedError mean, with the fix."""
    name = type(exc).__name__
    if name == "RendezvousTimeoutError":
        return (
            f"the round did not complete within {key}={seconds:g}s: fewer than {rdzv.min_nodes} agents "
            f"(--nnodes {rdzv.min_nodes}:{rdzv.max_nodes}) joined run id {rdzv.run_id!r} at "
            f"{rdzv.endpoint or '(default)'}; start the other nodes, or give them longer with "
            f"--rdzv-conf {key}=SECONDS"
        )
    if name == "RendezvousClosedError":
        return (
            f"the rendezvous of run id {rdzv.run_id!r} at {rdzv.endpoint or '(default)'} is closed: a job "
            f"with this id already ended there; start the job with a new --rdzv-id"
        )
    return "(no message)"
