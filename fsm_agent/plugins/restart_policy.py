"""Built-in restart policy: torchrun's budget, a do-not-restart exit code, optional backoff.

- A worker exiting with ``DO_NOT_RESTART_EXIT_CODE`` (78, ``EX_CONFIG``: "restarting will not
  help") makes the group give up at once, whatever restarts are left.
- Otherwise restart while ``restart_count < max_restarts`` (torchrun's semantics).
- ``FSM_AGENT_RESTART_BACKOFF=S`` waits ``S * 2**restart_count`` seconds (capped by
  ``FSM_AGENT_RESTART_BACKOFF_MAX``, default 60), times a jitter factor in [0.5, 1.5), before
  restarting. Unset: restart at once, as torchrun.

Registered ``trylast``: a plugin that implements ``fsm_agent_restart_policy`` overrides it.
"""

from __future__ import annotations

import os
import random

from fsm_agent.plugins import hookimpl
from fsm_agent.worker import RestartDecision

DO_NOT_RESTART_EXIT_CODE = 78


def backoff_delay(restart_count: int, base: float, cap: float, rng: random.Random = random) -> float:
    """Exponential backoff with jitter, seconds: ``min(cap, base * 2**n) * U[0.5, 1.5)``."""
    if base <= 0:
        return 0.0
    return min(cap, base * 2 ** restart_count) * (0.5 + rng.random())


@hookimpl(trylast=True)
def fsm_agent_restart_policy(failures, worker_group, restart_count):
    max_restarts = worker_group.spec.max_restarts
    refusing = sorted(r for r, f in failures.items() if f.exitcode == DO_NOT_RESTART_EXIT_CODE)
    if refusing:
        return RestartDecision(False, reason=f"rank {refusing[0]} exited with {DO_NOT_RESTART_EXIT_CODE} "
                                             f"(do not restart)")
    if restart_count >= max_restarts:
        return RestartDecision(False, reason=f"no restarts left (max_restarts={max_restarts})")
    base = float(os.environ.get("FSM_AGENT_RESTART_BACKOFF", "0") or 0)
    cap = float(os.environ.get("FSM_AGENT_RESTART_BACKOFF_MAX", "60") or 60)
    delay = backoff_delay(restart_count, base, cap)
    return RestartDecision(True, delay_s=delay, reason=f"restart {restart_count + 1} of {max_restarts}"
                                                       + (f" after {delay:.2f}s backoff" if delay else ""))
