"""Built-in restart policy: torchrun's budget, a do-not-restart exit code, optional backoff.

- A worker exiting with ``DO_NOT_RESTART_EXIT_CODE`` (78, ``EX_CONFIG``: "restarting will not
  help") makes the group give up at once, whatever restarts are left.
- Otherwise restart while ``restart_count < max_restarts`` (torchrun's semantics).
- ``--restart-backoff S`` (``FSM_AGENT_RESTART_BACKOFF``, ``[plugins.restart-policy] backoff``)
  waits ``S * 2**restart_count`` seconds, capped by ``--restart-backoff-max`` (default 60), times
  a jitter factor in [0.5, 1.5), before restarting. 0 (the default): restart at once, as torchrun.

The policy is registered ``trylast``: a plugin that implements ``fsm_agent_restart_policy``
overrides it.
"""

from __future__ import annotations

import random

from fsm_agent.plugins import hookimpl
from fsm_agent.worker import RestartDecision

PLUGIN_NAME = "restart-policy"
DO_NOT_RESTART_EXIT_CODE = 78


def backoff_delay(restart_count: int, base: float, cap: float, rng: random.Random = random) -> float:
    """Exponential backoff with jitter, seconds: ``min(cap, base * 2**n) * U[0.5, 1.5)``."""
    if base <= 0:
        return 0.0
    return min(cap, base * 2 ** restart_count) * (0.5 + rng.random())


def _non_negative(value: float) -> None:
    if value < 0:
        raise ValueError(f"expected seconds >= 0, got {value}")


@hookimpl
def fsm_agent_addoption(options):
    options.add("backoff", type=float, default=0.0, flag="--restart-backoff", env="FSM_AGENT_RESTART_BACKOFF",
                check=_non_negative, help="seconds before the first restart, doubling each time (with jitter); 0: none")
    options.add("backoff_max", type=float, default=60.0, flag="--restart-backoff-max",
                env="FSM_AGENT_RESTART_BACKOFF_MAX", check=_non_negative, help="cap on the restart backoff, seconds")


class RestartPolicy:
    """The default policy for one agent, with its backoff settings (seconds)."""

    def __init__(self, backoff: float = 0.0, backoff_max: float = 60.0):
        self.backoff, self.backoff_max = backoff, backoff_max

    @hookimpl(trylast=True)
    def fsm_agent_restart_policy(self, failures, worker_group, restart_count):
        max_restarts = worker_group.spec.max_restarts
        refusing = sorted(r for r, f in failures.items() if f.exitcode == DO_NOT_RESTART_EXIT_CODE)
        if refusing:
            return RestartDecision(False, reason=f"rank {refusing[0]} exited with {DO_NOT_RESTART_EXIT_CODE} "
                                                 f"(do not restart)")
        if restart_count >= max_restarts:
            return RestartDecision(False, reason=f"no restarts left (max_restarts={max_restarts})")
        delay = backoff_delay(restart_count, self.backoff, self.backoff_max)
        return RestartDecision(True, delay_s=delay, reason=f"restart {restart_count + 1} of {max_restarts}"
                                                           + (f" after {delay:.2f}s backoff" if delay else ""))


@hookimpl
def fsm_agent_configure(config, agent):
    options = config.plugin_options(PLUGIN_NAME) if config is not None else {}
    policy = RestartPolicy(backoff=options.get("backoff") or 0.0, backoff_max=options.get("backoff_max") or 60.0)
    agent.plugin_manager.register(policy, f"{PLUGIN_NAME}-{id(agent)}")
