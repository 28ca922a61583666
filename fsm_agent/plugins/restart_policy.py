"""Built-in restart policy: torchrun's budget, a do-not-restart exit code, optional backoff.

- A worker exiting with ``DO_NOT_RESTART_EXIT_CODE`` (78, ``EX_CONFIG``: "restarting will not
  help") makes the group give up at once, whatever restarts are left.
- Otherwise restart while ``restart_count < max_restarts`` (torchrun's semantics).
- ``--restart-budgets hang=1,signal=2`` (``[plugins.restart-policy] budgets``): per failure class
  (``exit_code``, ``signal``, ``hang``; the root cause's class counts), at most that many restarts
  of that class; ``--max-restarts`` stays the overall budget.
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


FAILURE_CLASSES = ("exit_code", "signal", "hang")


def parse_budgets(text: str) -> dict[str, int]:
    """``"hang=1,signal=2"`` -> {"hang": 1, "signal": 2}.

    Raises:
        ValueError: an unknown class or a count that is not an integer >= 0.
    """
    budgets = {}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        name, sep, count = item.partition("=")
        if not sep or name.strip() not in FAILURE_CLASSES or not count.strip().isdigit():
            raise ValueError(f"expected CLASS=N with CLASS one of {', '.join(FAILURE_CLASSES)}, got {item!r}")
        budgets[name.strip()] = int(count)
    return budgets


@hookimpl
def fsm_agent_addoption(options):
    options.add("budgets", type=str, default="", flag="--restart-budgets", env="FSM_AGENT_RESTART_BUDGETS",
                check=parse_budgets, help="per failure class restart budgets, e.g. hang=1,signal=2 (default: none)")
    options.add("backoff", type=float, default=0.0, flag="--restart-backoff", env="FSM_AGENT_RESTART_BACKOFF",
                check=_non_negative, help="seconds before the first restart, doubling each time (with jitter); 0: none")
    options.add("backoff_max", type=float, default=60.0, flag="--restart-backoff-max",
                env="FSM_AGENT_RESTART_BACKOFF_MAX", check=_non_negative, help="cap on the restart backoff, seconds")


class RestartPolicy:
    """The default policy for one agent, with its backoff settings (seconds)."""

    def __init__(self, backoff: float = 0.0, backoff_max: float = 60.0, budgets: dict[str, int] | None = None):
        self.backoff, self.backoff_max = backoff, backoff_max
        self.budgets = dict(budgets or {})
        self.spent: dict[str, int] = {}

    @hookimpl(trylast=True)
    def fsm_agent_restart_policy(self, failures, worker_group, restart_count):
        max_restarts = worker_group.spec.max_restarts
        refusing = sorted(r for r, f in failures.items() if f.exitcode == DO_NOT_RESTART_EXIT_CODE)
        if refusing:
            return RestartDecision(False, reason=f"rank {refusing[0]} exited with {DO_NOT_RESTART_EXIT_CODE} "
                                                 f"(do not restart)")
        if restart_count >= max_restarts:
            return RestartDecision(False, reason=f"no restarts left (max_restarts={max_restarts})")
        cause = min(failures.values(), key=lambda f: (f.error_timestamp or f.timestamp, f.global_rank))
        kind = cause.failure_class
        if kind in self.budgets and self.spent.get(kind, 0) >= self.budgets[kind]:
            return RestartDecision(False, reason=f"no {kind} restarts left (budget {kind}={self.budgets[kind]})")
        self.spent[kind] = self.spent.get(kind, 0) + 1
        delay = backoff_delay(restart_count, self.backoff, self.backoff_max)
        return RestartDecision(True, delay_s=delay, reason=f"restart {restart_count + 1} of {max_restarts}"
                                                           + (f" after {delay:.2f}s backoff" if delay else ""))


@hookimpl
def fsm_agent_configure(config, agent):
    options = config.plugin_options(PLUGIN_NAME) if config is not None else {}
    policy = RestartPolicy(backoff=options.get("backoff") or 0.0, backoff_max=options.get("backoff_max") or 60.0,
                           budgets=parse_budgets(options.get("budgets") or ""))
    agent.plugin_manager.register(policy, f"{PLUGIN_NAME}-{id(agent)}")
