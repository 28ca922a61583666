"""Built-in ``statechart-coverage``: records every state change for ``pytest --statechart-coverage``.

Inactive (one environment lookup per transition) unless ``FSM_STATECHART_COVERAGE_DIR`` names a
directory. The fsm-agent pytest plugin sets it for the test session, so agents built in the test
process and agents started as subprocesses (``python -m fsm_agent run ...``, which inherit it)
are recorded alike. The name deliberately lacks the ``FSM_AGENT_`` prefix: test harnesses scrub
``FSM_AGENT_*`` variables from the agents they start, and this one changes no behaviour.

Each process appends one JSON line per transition to ``<dir>/transitions-<pid>.jsonl``:
``{"source", "trigger", "dest", "where"}``, where ``where`` is the pytest test that was running
(``PYTEST_CURRENT_TEST``) or, in a subprocess agent, its pid. ``fsm_agent.testing.coverage``
reads the files back and reports which edges of the table the run exercised.
"""

from __future__ import annotations

import json
import os
import sys

from fsm_agent.plugins import hookimpl

COVERAGE_DIR_ENV = "FSM_STATECHART_COVERAGE_DIR"  # also named in manager.TEST_TOOLING_PLUGINS

_files: dict[tuple[int, str], object] = {}  # (pid, directory) -> open file: reopened after a fork


def _file(directory: str):
    key = (os.getpid(), directory)
    handle = _files.get(key)
    if handle is None or handle.closed:
        os.makedirs(directory, exist_ok=True)
        handle = _files[key] = open(os.path.join(directory, f"transitions-{os.getpid()}.jsonl"), "a", encoding="utf-8")
    return handle


def record(source: str, trigger: str, dest: str) -> None:
    """Append one observed transition to the coverage directory (no-op when none is set)."""
    directory = os.environ.get(COVERAGE_DIR_ENV)
    if not directory:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    where = test or f"pid {os.getpid()} ({os.path.basename(sys.argv[0]) if sys.argv else '?'})"
    try:
        handle = _file(directory)
        handle.write(json.dumps({"source": source, "trigger": trigger, "dest": dest, "where": where}) + "\n")
        handle.flush()
    except OSError:  # the test session's directory went away: coverage is best effort, the run is not
        pass


@hookimpl
def fsm_agent_state_changed(transition):
    record(str(transition.source), str(transition.trigger), str(transition.dest))
