"""fsm-agent-printmetrics: print every metric of the agent on stderr."""

import sys

from fsm_agent.plugins import hookimpl

NAME = "printmetrics"  # the entry-point name: --disable-plugin, option flags, [plugins.printmetrics]
FSM_AGENT_KINDS = ("metrics",)  # its sink is registered in configure, so say what it is


class Printer:
    """The metrics sink, registered for one run by fsm_agent_configure."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.exits: list[int] = []

    @hookimpl
    def fsm_agent_put_metric(self, metric_group, metric_name, metric_value):
        print(f"{self.prefix} {metric_group}.{metric_name}={metric_value}", file=sys.stderr)

    @hookimpl
    def fsm_agent_worker_exited(self, worker, exitcode):  # a hookimpl may take fewer arguments
        self.exits.append(exitcode)


@hookimpl
def fsm_agent_addoption(options):
    options.add("prefix", type=str, default="metric", help="text printed before each metric")


@hookimpl
def fsm_agent_configure(config, agent):
    options = config.plugin_options(NAME) if config is not None else {}
    agent.plugin_manager.register(Printer(options.get("prefix", "metric")), f"{NAME}-printer")
