"""Restart cycles and the progress each made: what progress-aware restarts decide on.

A cycle is one attempt of the worker group, from its start to the fact that ended it (workers
failed, a membership change, success). At its end the agent records a ``Cycle``: the last step
the workers reported (``fsm_agent.heartbeat(step=N)``), the last checkpoint step (the integer in
``--progress-file``, the iteration file the training writes at each checkpoint), the failure
class, and whether the cycle made progress.

Progress: a cycle made progress when its checkpoint step is beyond every earlier cycle's; while
no cycle has reported a checkpoint step (no ``--progress-file``, or not written yet), when its
last step is beyond every earlier cycle's. ``no_progress_cycles`` counts the cycles in a row,
up to this one, that ended in a worker failure without progress (a membership change without
progress neither counts nor resets it; progress resets it to 0).
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from collections.abc import Callable, Sequence

import attrs

from fsm_agent.worker import FailureClass

#: Classes that are not the workers' doing: such a cycle never counts as one without progress.
MEMBERSHIP_CLASSES = (FailureClass.NODE_LOST, FailureClass.MEMBERSHIP_CHANGE)


@attrs.frozen
class Cycle:
    """One restart cycle (attempt) of the worker group.

    Attributes:
        attempt: the restart count the attempt ran with (``TORCHELASTIC_RESTART_COUNT``).
        start / end: wall-clock times, seconds since the epoch.
        last_step: the highest step a local worker reported with ``heartbeat(step=N)``, or None.
        checkpoint_step: the step in ``--progress-file`` at the cycle's end, or None.
        failure_class: what ended it (``exit_code``, ``signal``, ``hang``, ``health_check``,
            ``node_lost``, ``membership_change``), None on success.
        progress: whether it got beyond every earlier cycle (see the module docstring).
        no_progress_cycles: cycles in a row, up to this one, that failed without progress.
    """

    attempt: int
    start: float
    end: float
    last_step: int | None
    checkpoint_step: int | None
    failure_class: str | None
    progress: bool
    no_progress_cycles: int


def next_cycle(
    previous: Sequence[Cycle],
    *,
    attempt: int,
    start: float,
    end: float,
    last_step: int | None,
    checkpoint_step: int | None,
    failure_class: str | None,
) -> Cycle:
    """The Cycle that follows ``previous``, with its progress judged against them."""
    checkpoints = [c.checkpoint_step for c in previous if c.checkpoint_step is not None]
    steps = [c.last_step for c in previous if c.last_step is not None]
    if checkpoint_step is not None:
        progress = not checkpoints or checkpoint_step > max(checkpoints)
    elif not checkpoints and last_step is not None:
        progress = not steps or last_step > max(steps)
    else:
        progress = False
    before = previous[-1].no_progress_cycles if previous else 0
    if progress:
        count = 0
    elif failure_class is None or failure_class in MEMBERSHIP_CLASSES:
        count = before
    else:
        count = before + 1
    return Cycle(
        attempt=attempt,
        start=start,
        end=end,
        last_step=last_step,
        checkpoint_step=checkpoint_step,
        failure_class=failure_class,
        progress=progress,
        no_progress_cycles=count,
    )


class CycleLog:
    """The node's restart cycles so far, and where their progress is read from.

    ``attempt_started()`` at each start of the workers; ``end(...)`` when a fact ends the attempt.
    ``progress_file`` (``--progress-file``) gives the checkpoint step; ``no_progress_limit``
    (``--max-no-progress-restarts``) goes into each ``cycle`` record, so replay applies it too.
    """

    def __init__(self) -> None:
        self.cycles: list[Cycle] = []
        self.progress_file: str | None = None
        #: Reads the newest checkpoint step when set (the ``checkpoint`` plugin's agent-held
        #: checkpoints); else ``progress_file`` is read.
        self.checkpoint_step_reader: Callable[[], int | None] | None = None
        self.no_progress_limit = 0
        #: The restart policy's own options (``--restart-budgets``, ``--exclude-node-on``), in each
        #: ``cycle`` record as ``restart_policy`` so replay decides with them too.
        self.restart_policy: dict[str, str] = {}
        self._start: float | None = None

    def checkpoint_step(self) -> int | None:
        """The newest checkpoint step now: the reader's when one is set, else ``progress_file``'s."""
        if self.checkpoint_step_reader is not None:
            return self.checkpoint_step_reader()
        return read_progress_file(self.progress_file)

    def attempt_started(self) -> None:
        self._start = time.time()

    def end(
        self, attempt: int, failure_class: str | None, last_step: int | None, checkpoint_step: int | None
    ) -> dict[str, object]:
        """Append the Cycle of the attempt that ended now; its ``cycle`` record's fields."""
        now = time.time()
        cycle = next_cycle(
            self.cycles,
            attempt=attempt,
            start=self._start if self._start is not None else now,
            end=now,
            last_step=last_step,
            checkpoint_step=checkpoint_step,
            failure_class=failure_class,
        )
        self.cycles.append(cycle)
        limit = {"max_no_progress_restarts": self.no_progress_limit} if self.no_progress_limit else {}
        policy = {"restart_policy": dict(self.restart_policy)} if self.restart_policy else {}
        return {**attrs.asdict(cycle), **limit, **policy}


_STEP = re.compile(r"\s*(-?\d+)\s*")


def read_progress_file(path: str | None) -> int | None:
    """The checkpoint step the iteration file ``path`` holds (one integer, as Megatron's
    ``latest_checkpointed_iteration.txt``), or None when there is no such file or no integer."""
    if not path:
        return None
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read(4096)
    except OSError:
        return None
    match = _STEP.fullmatch(text)
    return int(match.group(1)) if match else None


def write_finished_file(path: str, run_id: str) -> bool:
    """Create ``path`` once, atomically, saying the job finished; False when it already exists.

    The content is one line: ``finished run_id=<id> ts=<seconds since the epoch>``.

    Raises:
        OSError: the directory cannot be written.
    """
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".fsm_agent_finished_", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(f"finished run_id={run_id} ts={time.time():.6f}\n")
        try:
            os.link(tmp, path)  # never replaces: the first agent to finish writes it, once
        except FileExistsError:
            return False
        return True
    finally:
        os.unlink(tmp)
