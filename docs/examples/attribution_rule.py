"""A site's rule for the root-cause attribution (docs/plugins.md quotes this file; a test runs it).

This site's training wrapper exits 17 when it finds that a peer went away (its own watchdog saw
the peer's heartbeat stop): that rank failed because of a peer, whatever came first. Register it
as an entry point in the group ``fsm_agent`` (or ``--load-plugins``); it is asked before the
built-in ``attribution`` plugin.
"""

from fsm_agent.attribution import COLLATERAL, FailureReport
from fsm_agent.plugins import hookimpl

PEER_WENT_AWAY = 17  # our wrapper's exit code


@hookimpl
def fsm_agent_classify_failure(report: FailureReport) -> str | None:
    if report.exitcode == PEER_WENT_AWAY:
        return COLLATERAL
    return None  # no opinion: the next rule (in the end the built-in one) decides
