"""Log routing: torch's log-dir layout, redirects (-r), tee (-t) and the local-ranks filter.

Layout, as torch's ``DefaultLogsSpecs``::

    <log_dir>/<run_id>_<random>/attempt_<restart_count>/<local_rank>/{stdout.log, stderr.log, error.json}
                                                         filtered_stdout.log, filtered_stderr.log
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile

import attrs

from fsm_agent.errors import ConfigError

NONE, OUT, ERR, ALL = 0, 1, 2, 3
_MAPPING = re.compile(r"^(\d+:[0-3])(,\d+:[0-3])*$")


def parse_std(value: str, flag: str = "-r/--redirects") -> int | dict[int, int]:
    """``"3"`` -> 3 for every rank; ``"0:3,1:2"`` -> {0: 3, 1: 2} (any number of digits per rank).

    Raises:
        ConfigError: the value is neither form.
    """
    value = str(value).strip()
    if re.fullmatch(r"[0-3]", value):
        return int(value)
    if _MAPPING.match(value):
        return {int(r): int(s) for r, s in (pair.split(":") for pair in value.split(","))}
    raise ConfigError(f"{flag} {value!r}: use 0 (none), 1 (stdout), 2 (stderr), 3 (both) or a map like 0:3,1:2")


def std_for(value: int | dict[int, int], local_rank: int) -> int:
    return value.get(local_rank, NONE) if isinstance(value, dict) else value


@attrs.frozen
class WorkerLogs:
    """Where one worker's streams go for one attempt.

    Attributes:
        stdout / stderr: file path the stream is written to, or None (inherits the agent's).
        tee_stdout / tee_stderr: also copy the stream, line by line with a prefix, to the console.
        show: the rank passes ``--local-ranks-filter`` (its tee'd lines reach the console).
        error_file: the ``TORCHELASTIC_ERROR_FILE`` path ("" when logs go to /dev/null).
        prefix: the console prefix, e.g. ``[default0]:``.
    """

    stdout: str | None
    stderr: str | None
    tee_stdout: bool
    tee_stderr: bool
    show: bool
    error_file: str
    prefix: str


@attrs.define
class LogsLayout:
    """Creates ``<log_dir>/<run_id>_<random>/attempt_N`` directories and per-worker WorkerLogs."""

    log_dir: str | None
    run_id: str
    redirects: int | dict[int, int] = NONE
    tee: int | dict[int, int] = NONE
    local_ranks_filter: frozenset[int] | None = None
    prefix_template: str | None = None
    duplicate_stdout_filters: tuple[str, ...] = ()
    duplicate_stderr_filters: tuple[str, ...] = ()
    run_log_dir: str | None = None

    def __attrs_post_init__(self) -> None:
        if self.log_dir == os.devnull:
            return
        base = self.log_dir
        if base is None:
            base = tempfile.mkdtemp(prefix="fsm_agent_")
        elif os.path.isfile(base):
            raise ConfigError(f"--log-dir {base!r} is a file: pass a directory")
        os.makedirs(base, exist_ok=True)
        self.run_log_dir = tempfile.mkdtemp(prefix=f"{self.run_id}_", dir=base)

    @property
    def to_devnull(self) -> bool:
        return self.run_log_dir is None

    def attempt_dir(self, restart_count: int) -> str | None:
        if self.to_devnull:
            return None
        return os.path.join(self.run_log_dir, f"attempt_{restart_count}")

    def reify(self, restart_count: int, local_world_size: int, role: str, global_ranks: dict[int, int]) -> dict[int, WorkerLogs]:
        """Create this attempt's directories and return each local rank's WorkerLogs."""
        attempt = self.attempt_dir(restart_count)
        if attempt is not None:
            shutil.rmtree(attempt, ignore_errors=True)
            os.makedirs(attempt)
        result = {}
        for local_rank in range(local_world_size):
            redirect, tee = std_for(self.redirects, local_rank), std_for(self.tee, local_rank)
            to_file = redirect | tee
            show = self.local_ranks_filter is None or local_rank in self.local_ranks_filter
            rank_dir = None
            if attempt is not None:
                rank_dir = os.path.join(attempt, str(local_rank))
                os.makedirs(rank_dir)
            if not show:
                # torch sends an unshown rank's console streams to /dev/null; we keep them in files.
                to_file = ALL
            result[local_rank] = WorkerLogs(
                stdout=_path(rank_dir, "stdout.log") if to_file & OUT else None,
                stderr=_path(rank_dir, "stderr.log") if to_file & ERR else None,
                tee_stdout=bool(tee & OUT) and show,
                tee_stderr=bool(tee & ERR) and show,
                show=show,
                error_file=_path(rank_dir, "error.json") or "",
                prefix=self._prefix(role, local_rank, global_ranks.get(local_rank, local_rank)),
            )
        return result

    def filtered_paths(self, restart_count: int) -> tuple[str | None, str | None]:
        attempt = self.attempt_dir(restart_count)
        if attempt is None:
            return None, None
        return (os.path.join(attempt, "filtered_stdout.log") if self.duplicate_stdout_filters else None,
                os.path.join(attempt, "filtered_stderr.log") if self.duplicate_stderr_filters else None)

    def _prefix(self, role: str, local_rank: int, rank: int) -> str:
        if self.prefix_template:
            from string import Template

            return Template(self.prefix_template).safe_substitute(role_name=role, rank=rank, local_rank=local_rank)
        return f"[{role}{local_rank}]:"


def _path(directory: str | None, name: str) -> str | None:
    if directory is None:
        # /dev/null layout: no files; a redirected stream is discarded.
        return os.devnull if name.endswith(".log") else None
    return os.path.join(directory, name)
