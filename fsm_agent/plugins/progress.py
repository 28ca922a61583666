"""Built-in progress plugin: progress-aware restarts and a finished flag for requeue wrappers.

- ``--progress-file PATH`` (``[plugins.progress] progress_file``): the iteration file the training
  writes at each checkpoint (one integer: the checkpoint's step, as Megatron's
  ``latest_checkpointed_iteration.txt``). The agent reads it when each cycle ends.
- ``fsm_agent.heartbeat(step=N)`` in the training loop reports the last step reached; with this
  plugin on (any of its options set) every worker gets a heartbeat file, ``--hang-timeout`` or not.
- ``--max-no-progress-restarts K``: after K cycles in a row that ended in a worker failure
  without progress past the last checkpoint (``fsm_agent.progress``: the checkpoint step, or the
  last step while no checkpoint is reported), the agent stops restarting and exits with
  ``DO_NOT_REQUEUE_EXIT_CODE`` (79), whatever restarts are left. 0 (the default): off.
- ``--finished-file PATH``: written once, atomically, when the job succeeds (never replaced), so
  a requeue wrapper knows not to start it again.

Each cycle (attempt, start, last step, last checkpoint step, failure class) is a ``cycle`` record
of the events file (docs/events.md) and a row of ``fsm-agent status``.
"""

from __future__ import annotations

import logging
import os
import tempfile

from fsm_agent.errors import ConfigError
from fsm_agent.plugins import hookimpl
from fsm_agent.progress import MEMBERSHIP_CLASSES, write_finished_file
from fsm_agent.states import WorkerState
from fsm_agent.worker import DO_NOT_REQUEUE_EXIT_CODE, RestartDecision

log = logging.getLogger(__name__)
PLUGIN_NAME = "progress"


def _count(value: int) -> None:
    if value < 0:
        raise ValueError(f"expected a count >= 0, got {value}")


#: (option, type, default, check, help); each is flag ``--<option>`` and env ``FSM_AGENT_<OPTION>``.
OPTIONS = (
    (
        "progress_file",
        str,
        "",
        None,
        "iteration file the training writes at each checkpoint (one integer, the "
        "step); read at the end of each restart cycle",
    ),
    (
        "max_no_progress_restarts",
        int,
        0,
        _count,
        f"stop restarting after this many failed cycles in a row without "
        f"progress and exit {DO_NOT_REQUEUE_EXIT_CODE} (do not requeue); 0: off",
    ),
    ("finished_file", str, "", None, "file written once when the job succeeds, for requeue wrappers (default: none)"),
)


@hookimpl
def fsm_agent_addoption(options):
    for name, kind, default, check, text in OPTIONS:
        options.add(
            name,
            type=kind,
            default=default,
            flag="--" + name.replace("_", "-"),
            env=f"FSM_AGENT_{name.upper()}",
            check=check,
            help=text,
        )


class NoProgressPolicy:
    """Gives up with ``DO_NOT_REQUEUE_EXIT_CODE`` once the agent's last ``limit`` cycles in a
    row failed without progress; otherwise no answer (the next policy decides)."""

    def __init__(self, agent, limit: int):
        self._agent, self.limit = agent, limit

    @hookimpl
    def fsm_agent_restart_policy(self, failure_class):
        cycles = self._agent.cycles
        if not cycles or failure_class in MEMBERSHIP_CLASSES or cycles[-1].no_progress_cycles < self.limit:
            return None
        last = cycles[-1]
        where = (
            f"checkpoint step {last.checkpoint_step}"
            if last.checkpoint_step is not None
            else f"step {last.last_step}"
            if last.last_step is not None
            else "no step reported"
        )
        return RestartDecision(
            False,
            exit_code=DO_NOT_REQUEUE_EXIT_CODE,
            reason=f"no progress in {last.no_progress_cycles} cycles in a row ({where}; "
            f"max_no_progress_restarts={self.limit}): do not requeue "
            f"(exit code {DO_NOT_REQUEUE_EXIT_CODE})",
        )


class FinishedFile:
    """Writes ``path`` once when the run ends SUCCEEDED."""

    def __init__(self, agent, path: str):
        self._agent, self.path = agent, path

    @hookimpl
    def fsm_agent_unconfigure(self, result):
        if result.state != WorkerState.SUCCEEDED:
            return
        try:
            written = write_finished_file(self.path, self._agent.run_id)
        except OSError as exc:
            log.error("--finished-file %s: cannot write it: %s", self.path, exc)
            return
        if not written:
            log.info("--finished-file %s exists already: left as it is", self.path)


@hookimpl
def fsm_agent_configure(config, agent):
    options = config.plugin_options(PLUGIN_NAME) if config is not None else {}
    progress_file = options.get("progress_file") or ""
    limit = int(options.get("max_no_progress_restarts") or 0)
    finished_file = options.get("finished_file") or ""
    if progress_file or limit:
        agent.track_progress(progress_file=progress_file or None, max_no_progress_restarts=limit)
    if limit:
        agent.plugin_manager.register(NoProgressPolicy(agent, limit), f"{PLUGIN_NAME}-policy-{id(agent)}")
    if finished_file:
        _check_writable(finished_file)
        agent.plugin_manager.register(FinishedFile(agent, finished_file), f"{PLUGIN_NAME}-finished-{id(agent)}")


def _check_writable(path: str) -> None:
    """A file can be created beside ``path`` now, as ``write_finished_file`` will at the end.

    Raises:
        ConfigError: it cannot: a job that succeeded with no finished file would be requeued
            and run again by its wrapper.
    """
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd, probe = tempfile.mkstemp(prefix=".fsm_agent_finished_probe_", dir=directory)
    except OSError as exc:
        raise ConfigError(
            f"--finished-file {path}: cannot write there ({exc.strerror or exc}): give a path in a "
            f"folder that exists and this agent can write"
        ) from None
    os.close(fd)
    os.unlink(probe)
