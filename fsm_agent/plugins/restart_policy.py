"""Built-in restart policy: torchrun's budget, a do-not-restart exit code, per-class budgets,
node exclusion, optional backoff.

Worker failures (the root cause's class: ``exit_code``, ``signal``, ``hang``, ``health_check``):

- A worker exiting with ``DO_NOT_RESTART_EXIT_CODE`` (78, ``EX_CONFIG``: "restarting will not
  help") makes the group give up at once, whatever restarts are left.
- ``--exclude-node-on health_check,hang`` (``[plugins.restart-policy] exclude_node_on``): a failure
  of one of those classes (``straggler``: the ``straggler`` plugin found a rank of this node slow) takes this node out of the job (``RestartDecision.exclude_node``): its
  agent ends FAILED while the other nodes re-rendezvous without it (``--nnodes MIN:MAX`` permitting).
- Otherwise restart while ``restart_count < max_restarts`` (torchrun's semantics).
- ``--restart-budgets hang=1,signal=2`` (``[plugins.restart-policy] budgets``): per failure class,
  at most that many restarts of that class; ``--max-restarts`` stays the overall budget.

Membership changes (``node_lost``, ``membership_change``): re-rendezvous without counting a
restart, as torch does, unless a budget for that class is spent (``--restart-budgets node_lost=2``).
In-process restart (``--restart-mode inprocess``): asked about class ``inprocess``, the policy
lets the failed ranks be replaced in process, not counted against ``--max-restarts``, unless
``--restart-budgets inprocess=N`` is spent (then the whole group restarts). A recovery that does
not complete is class ``inprocess_failed``: a counted whole-group restart (budget ``inprocess_failed=N``).
- ``--restart-backoff S`` (``FSM_AGENT_RESTART_BACKOFF``, ``[plugins.restart-policy] backoff``)
  waits ``S * 2**restart_count`` seconds, capped by ``--restart-backoff-max`` (default 60), times
  a jitter factor in [0.5, 1.5), before restarting. 0 (the default): restart at once, as torchrun.

The policy is registered ``trylast``: a plugin that implements ``fsm_agent_restart_policy``
overrides it.
"""

from __future__ import annotations

import random

from fsm_agent.plugins import hookimpl
from fsm_agent.worker import FailureClass, RestartDecision, first_failure

PLUGIN_NAME = "restart-policy"
DO_NOT_RESTART_EXIT_CODE = 78


def backoff_delay(restart_count: int, base: float, cap: float, rng: random.Random = random) -> float:
    """Exponential backoff with jitter, seconds: ``min(cap, base * 2**n) * U[0.5, 1.5)``."""
    if base <= 0:
        return 0.0
    return min(cap, base * 2**restart_count) * (0.5 + rng.random())


def _non_negative(value: float) -> None:
    if value < 0:
        raise ValueError(f"expected seconds >= 0, got {value}")


#: Classes a budget can name: every class the policy is asked about.
FAILURE_CLASSES = FailureClass.DECIDED
#: Classes that can take a node out: failures of this node's own workers.
EXCLUDABLE_CLASSES = (
    FailureClass.EXIT_CODE,
    FailureClass.SIGNAL,
    FailureClass.HANG,
    FailureClass.HEALTH_CHECK,
    FailureClass.STRAGGLER,
)
MEMBERSHIP_CLASSES = (FailureClass.NODE_LOST, FailureClass.MEMBERSHIP_CHANGE)


def parse_exclude_node_on(text: str) -> tuple[str, ...]:
    """``"health_check,hang"`` -> ("health_check", "hang").

    Raises:
        ValueError: a name that is not one of ``EXCLUDABLE_CLASSES``.
    """
    names = tuple(filter(None, (part.strip() for part in (text or "").split(","))))
    for name in names:
        if name not in EXCLUDABLE_CLASSES:
            raise ValueError(f"expected failure classes among {', '.join(EXCLUDABLE_CLASSES)}, got {name!r}")
    return names


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
    options.add(
        "budgets",
        type=str,
        default="",
        flag="--restart-budgets",
        env="FSM_AGENT_RESTART_BUDGETS",
        check=parse_budgets,
        help="per failure class restart budgets, e.g. hang=1,signal=2 (default: none)",
    )
    options.add(
        "backoff",
        type=float,
        default=0.0,
        flag="--restart-backoff",
        env="FSM_AGENT_RESTART_BACKOFF",
        check=_non_negative,
        help="seconds before the first restart, doubling each time (with jitter); 0: none",
    )
    options.add(
        "backoff_max",
        type=float,
        default=60.0,
        flag="--restart-backoff-max",
        env="FSM_AGENT_RESTART_BACKOFF_MAX",
        check=_non_negative,
        help="cap on the restart backoff, seconds",
    )
    options.add(
        "exclude_node_on",
        type=str,
        default="",
        flag="--exclude-node-on",
        env="FSM_AGENT_EXCLUDE_NODE_ON",
        check=parse_exclude_node_on,
        help="failure classes that take this node out of the job instead of restarting it, "
        "e.g. health_check,hang (default: none)",
    )


class RestartPolicy:
    """The default policy for one agent, with its backoff settings (seconds)."""

    def __init__(
        self,
        backoff: float = 0.0,
        backoff_max: float = 60.0,
        budgets: dict[str, int] | None = None,
        exclude_node_on: tuple[str, ...] = (),
    ):
        self.backoff, self.backoff_max = backoff, backoff_max
        self.budgets = dict(budgets or {})
        self.exclude_node_on = tuple(exclude_node_on)
        self.spent: dict[str, int] = {}

    def _spend(self, kind: str) -> RestartDecision | None:
        """Count one restart of class ``kind``; a give-up decision when its budget is spent."""
        if kind in self.budgets and self.spent.get(kind, 0) >= self.budgets[kind]:
            return RestartDecision(False, reason=f"no {kind} restarts left (budget {kind}={self.budgets[kind]})")
        self.spent[kind] = self.spent.get(kind, 0) + 1
        return None

    def _in_process(self, failures) -> RestartDecision:
        """In process unless the failure's own answer would refuse it (the do-not-restart exit code,
        a class that takes the node out) or the ``inprocess`` budget is spent."""
        cause = first_failure(failures)
        if any(f.exitcode == DO_NOT_RESTART_EXIT_CODE for f in failures.values()):
            return RestartDecision(False, reason=f"not in process: exit {DO_NOT_RESTART_EXIT_CODE} (do not restart)")
        if cause is not None and cause.failure_class in self.exclude_node_on:
            return RestartDecision(False, reason=f"not in process: {cause.failure_class} takes this node out")
        return self._spend(FailureClass.INPROCESS) or RestartDecision(
            True, in_process=True, reason="in-process recovery (not counted against max_restarts)"
        )

    @hookimpl(trylast=True)
    def fsm_agent_restart_policy(self, failures, worker_group, restart_count, failure_class):
        if failure_class == FailureClass.INPROCESS:  # may only the failed ranks be replaced?
            return self._in_process(failures)
        if failure_class in MEMBERSHIP_CLASSES:
            return self._spend(failure_class) or RestartDecision(
                True, reason="re-rendezvous (not counted against max_restarts)"
            )  # the agent names the class
        max_restarts = worker_group.spec.max_restarts
        refusing = sorted(r for r, f in failures.items() if f.exitcode == DO_NOT_RESTART_EXIT_CODE)
        if refusing:
            return RestartDecision(
                False, reason=f"rank {refusing[0]} exited with {DO_NOT_RESTART_EXIT_CODE} (do not restart)"
            )
        cause = first_failure(failures)
        # A failed in-process recovery is its own class (budget inprocess_failed=N), whatever the fault was.
        in_process_failed = failure_class == FailureClass.INPROCESS_FAILED or cause is None
        kind = failure_class if in_process_failed else cause.failure_class
        if kind in self.exclude_node_on:
            return RestartDecision(
                False,
                exclude_node=True,
                reason=f"{kind}{f' on rank {cause.global_rank}' if cause else ''}: this node leaves the job "
                f"(exclude_node_on={','.join(self.exclude_node_on)})",
            )
        if restart_count >= max_restarts:
            return RestartDecision(False, reason=f"no restarts left (max_restarts={max_restarts})")
        spent = self._spend(kind)
        if spent is not None:
            return spent
        delay = backoff_delay(restart_count, self.backoff, self.backoff_max)
        return RestartDecision(
            True,
            delay_s=delay,
            reason=f"restart {restart_count + 1} of {max_restarts}" + (f" after {delay:.2f}s backoff" if delay else ""),
        )


@hookimpl
def fsm_agent_configure(config, agent):
    options = config.plugin_options(PLUGIN_NAME) if config is not None else {}
    policy = RestartPolicy(
        backoff=options.get("backoff") or 0.0,
        backoff_max=options.get("backoff_max") or 60.0,
        budgets=parse_budgets(options.get("budgets") or ""),
        exclude_node_on=parse_exclude_node_on(options.get("exclude_node_on") or ""),
    )
    agent.plugin_manager.register(policy, f"{PLUGIN_NAME}-{id(agent)}")
    agent.declare_restart_policy(
        budgets=options.get("budgets") or "", exclude_node_on=options.get("exclude_node_on") or ""
    )
