"""Worker-side progress heartbeat: call ``fsm_agent.heartbeat()`` once per training step.

Under ``fsm-agent run --hang-timeout S`` each worker gets ``FSM_AGENT_HEARTBEAT_FILE``; a call
touches that file at most every ``min_interval`` seconds (one ``os.utime`` syscall; otherwise a
clock read), so calling it every step costs well under a microsecond on average. A worker that
has sent one heartbeat and then none for ``S`` seconds is reported hung: the agent records its
stacks and restarts the group. Outside fsm-agent (no variable set) the call does nothing.
This module imports nothing beyond the standard library.
"""

from __future__ import annotations

import os
import time

HEARTBEAT_FILE_ENV = "FSM_AGENT_HEARTBEAT_FILE"
_path = os.environ.get(HEARTBEAT_FILE_ENV) or None
_last = float("-inf")


def heartbeat(min_interval: float = 0.1) -> None:
    """Report progress to the agent (no-op when not launched by fsm-agent with a hang timeout).

    Args:
        min_interval: seconds; calls closer together than this are not written.
    """
    global _last
    if _path is None:
        return
    now = time.monotonic()
    if now - _last < min_interval:
        return
    _last = now
    try:
        os.utime(_path)
    except FileNotFoundError:
        open(_path, "a").close()
