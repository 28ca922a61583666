"""Built-in plugin ``attribution``: fsm-agent's own rules for the root-cause attribution.

It answers ``fsm_agent_classify_failure`` last (``trylast``) with
``fsm_agent.attribution.builtin_class``: a rank whose error is a peer's failure seen from here
(gloo's "Connection closed by peer", a collective timeout, NCCL's aborted communicator) or that hung
waiting inside a collective is ``collateral``; any other failure (an exception, an exit code, a
signal) is its ``own``. A site adds rules by answering the same hook from its own plugin (it is
asked first); docs/plugins.md has an example. Disabling this plugin leaves the rules in place
(``attribute`` falls back on them): it exists so that the built-in rules are a plugin like a site's.
"""

from __future__ import annotations

from fsm_agent.attribution import FailureReport, builtin_class
from fsm_agent.plugins import hookimpl

PLUGIN_NAME = "attribution"


@hookimpl(trylast=True)
def fsm_agent_classify_failure(report: FailureReport) -> str | None:
    return builtin_class(report)
