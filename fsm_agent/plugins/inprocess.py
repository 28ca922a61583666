"""Built-in plugin ``inprocess``: in-process restart (``fsm_agent.inprocess``).

- ``--restart-mode group|inprocess`` (``[plugins.inprocess] restart_mode``, default ``group``):
  ``inprocess`` recovers a failed worker by replacing its process alone; the other ranks, on every
  node, keep their processes and their memory and re-form their process group. The workers must
  run their training through ``fsm_agent.inprocess.run``; a job whose ranks do not, a fault during
  a recovery, a rank that fails again right after its replacement, a hang, or a lost node restart
  the whole group, as ``group`` does (torchrun's way).
- ``--inprocess-timeout S`` (default 30): seconds a recovery may take, from the fault to every
  rank at the new generation's barrier; past it the whole group restarts (class
  ``inprocess_failed``).

The restart policy counts in-process recoveries apart (class ``inprocess``, budget
``--restart-budgets inprocess=N``), never against ``--max-restarts``.
"""

from __future__ import annotations

from fsm_agent.plugins import hookimpl
from fsm_agent.plugins.registry import positive_seconds

PLUGIN_NAME = "inprocess"
RESTART_MODES = ("group", "inprocess")
DEFAULT_TIMEOUT_S = 30.0


@hookimpl
def fsm_agent_addoption(options):
    options.add(
        "restart_mode",
        type=str,
        default="group",
        choices=RESTART_MODES,
        flag="--restart-mode",
        env="FSM_AGENT_RESTART_MODE",
        help="group: a failure restarts every worker (torchrun's way); inprocess: only the failed ranks' "
        "processes are replaced, the others keep running (workers use fsm_agent.inprocess.run)",
    )
    options.add(
        "timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        check=positive_seconds,
        help="seconds an in-process recovery may take (fault to every rank back at the barrier); "
        "then the whole group restarts",
    )


@hookimpl
def fsm_agent_configure(config, agent):
    options = config.plugin_options(PLUGIN_NAME) if config is not None else {}
    if (options.get("restart_mode") or "group") == "inprocess":
        agent.restart_in_process(options.get("timeout") or DEFAULT_TIMEOUT_S)
