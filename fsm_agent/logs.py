"""Log routing: torch's log-dir layout, redirects (-r), tee (-t) and the local-ranks filter.

Layout, as torch's ``DefaultLogsSpecs``::

    <log_dir>/<run_id>_<random>/attempt_<restart_count>/<local_rank>/{stdout.log, stderr.log, error.json}
                                                         filtered_stdout.log, filtered_stderr.log
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile

import attrs

from fsm_agent.errors import ConfigError
from fsm_agent.tempdirs import forget, remove_if_the_agent_dies

log = logging.getLogger(__name__)
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
    temporary_dir: str | None = None

    def __attrs_post_init__(self) -> None:
        if self.log_dir == os.devnull:
            return
        base = self.log_dir
        if base is None:
            base = self.temporary_dir = tempfile.mkdtemp(prefix="fsm_agent_")
            if not self.holds_only_copy_of_output:  # that one is kept, however the agent ends
                remove_if_the_agent_dies(base)
        elif os.path.isfile(base):
            raise ConfigError(f"--log-dir {base!r} is a file: pass a directory")
        try:
            os.makedirs(base, exist_ok=True)
            self.run_log_dir = tempfile.mkdtemp(prefix=f"{self.run_id}_", dir=base)
        except OSError as exc:
            raise ConfigError(
                f"--log-dir {base!r}: cannot create the run's log directory there "
                f"({exc.strerror or exc}); pass a writable directory"
            ) from None

    def cleanup(self) -> None:
        """Remove the temporary log directory made when no ``--log-dir`` was given (torch keeps it),
        unless worker output went there and nowhere else (``--redirects``, ranks hidden by
        ``--local-ranks-filter``): that is kept, and its path logged, so no output is lost."""
        if self.temporary_dir is None:
            return
        if self.holds_only_copy_of_output:
            log.warning("worker output that was not shown is kept in %s (no --log-dir was given)", self.run_log_dir)
        else:
            shutil.rmtree(self.temporary_dir, ignore_errors=True)
            forget(self.temporary_dir)
        self.temporary_dir = None

    @property
    def holds_only_copy_of_output(self) -> bool:
        """Some worker stream goes to a file and not to the console (redirected and not teed, or hidden)."""
        if self.local_ranks_filter is not None:
            return True
        ranks = {-1} | {r for value in (self.redirects, self.tee) if isinstance(value, dict) for r in value}
        return any(std_for(self.redirects, r) & ~std_for(self.tee, r) for r in ranks)  # -1: ranks not named

    @property
    def to_devnull(self) -> bool:
        return self.run_log_dir is None

    def attempt_dir(self, restart_count: int) -> str | None:
        if self.to_devnull:
            return None
        return os.path.join(self.run_log_dir, f"attempt_{restart_count}")

    def reify(
        self, restart_count: int, local_world_size: int, role: str, global_ranks: dict[int, int]
    ) -> dict[int, WorkerLogs]:
        """Create this attempt's directories and return each local rank's WorkerLogs."""
        attempt = self.attempt_dir(restart_count)
        if attempt is not None:
            _keep_superseded(attempt)
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
        return (
            os.path.join(attempt, "filtered_stdout.log") if self.duplicate_stdout_filters else None,
            os.path.join(attempt, "filtered_stderr.log") if self.duplicate_stderr_filters else None,
        )

    def _prefix(self, role: str, local_rank: int, rank: int) -> str:
        if self.prefix_template:
            from string import Template

            return Template(self.prefix_template).safe_substitute(role_name=role, rank=rank, local_rank=local_rank)
        return f"[{role}{local_rank}]:"


def _keep_superseded(attempt: str) -> None:
    """Move an existing ``attempt_N`` aside as ``attempt_N.1``, ``attempt_N.2``, ...

    A re-rendezvous after a membership change is not a counted restart, so the next round
    reuses ``attempt_N``. torch deletes the directory (and the round's logs with it); we keep
    it under the next free suffix, so ``attempt_N`` is always the latest round of restart N.
    """
    if not os.path.exists(attempt):
        return
    suffix = 1
    while os.path.exists(f"{attempt}.{suffix}"):
        suffix += 1
    os.rename(attempt, f"{attempt}.{suffix}")


def _path(directory: str | None, name: str) -> str | None:
    if directory is None:
        # /dev/null layout: no files; a redirected stream is discarded.
        return os.devnull if name.endswith(".log") else None
    return os.path.join(directory, name)


class TorchLogsSpecsLayout:
    """Adapter for a torch ``LogsSpecs`` (``--logs-specs NAME`` from the ``torchrun.logs_specs`` group).

    torch builds the class with ``(log_dir, redirects, tee, local_ranks_filter)`` and calls
    ``reify(envs)`` on every start (``torch/distributed/run.py:_get_logs_specs_class``); the
    returned ``LogsDest`` is turned into our WorkerLogs.
    """

    def __init__(self, specs, run_id: str, prefix_template: str | None = None):
        self._specs, self._run_id, self._prefix_template = specs, run_id, prefix_template
        self._last = None

    @property
    def run_log_dir(self) -> str | None:
        return getattr(self._specs, "root_log_dir", None)

    to_devnull = False

    def reify(
        self, restart_count: int, local_world_size: int, role: str, global_ranks: dict[int, int]
    ) -> dict[int, WorkerLogs]:
        envs = {
            r: {"TORCHELASTIC_RUN_ID": self._run_id, "TORCHELASTIC_RESTART_COUNT": str(restart_count)}
            for r in range(local_world_size)
        }
        dest = self._last = self._specs.reify(envs)
        naming = LogsLayout(log_dir=os.devnull, run_id=self._run_id, prefix_template=self._prefix_template)
        return {
            r: WorkerLogs(
                stdout=dest.stdouts.get(r) or None,
                stderr=dest.stderrs.get(r) or None,
                tee_stdout=bool(dest.tee_stdouts.get(r)),
                tee_stderr=bool(dest.tee_stderrs.get(r)),
                show=True,
                error_file=dest.error_files.get(r, ""),
                prefix=naming._prefix(role, r, global_ranks.get(r, r)),
            )
            for r in range(local_world_size)
        }

    def filtered_paths(self, restart_count: int) -> tuple[str | None, str | None]:
        dest = self._last
        return (getattr(dest, "filtered_stdout", "") or None, getattr(dest, "filtered_stderr", "") or None)

    def cleanup(self) -> None:
        """Nothing to remove: a torch ``LogsSpecs`` keeps its directories, as under torchrun."""


def load_logs_specs(
    name: str, log_dir: str | None, redirects: str, tee: str, local_ranks_filter: frozenset[int] | None
):
    """Instantiate the ``torchrun.logs_specs`` entry point ``name`` as torch's run.py does.

    Raises:
        ConfigError: no such entry point, or it is not a LogsSpecs subclass.
    """
    from importlib.metadata import entry_points

    eps = {ep.name: ep for ep in entry_points(group="torchrun.logs_specs")}
    if name not in eps:
        known = ", ".join(sorted(eps)) or "(none installed)"
        raise ConfigError(f"--logs-specs {name!r}: no torchrun.logs_specs entry point of that name; known: {known}")
    from torch.distributed.elastic.multiprocessing import LogsSpecs, Std

    ep = eps[name]
    where = f"torchrun.logs_specs entry point {name!r} from " + (
        f"{ep.dist.name} {ep.dist.version}" if ep.dist else "an unknown distribution"
    )
    try:
        cls = ep.load()
    except Exception as exc:  # any import-time failure of a third-party module
        raise ConfigError(
            f"--logs-specs {name!r}: {where} failed to load: {type(exc).__name__}: {exc}; "
            f"fix or uninstall it, or pick another --logs-specs"
        ) from None
    if not (isinstance(cls, type) and issubclass(cls, LogsSpecs)):
        raise ConfigError(f"--logs-specs {name!r}: {cls!r} is not a torch LogsSpecs subclass")
    try:
        return cls(
            log_dir=log_dir,
            redirects=Std.from_str(redirects),
            tee=Std.from_str(tee),
            local_ranks_filter=set(local_ranks_filter) if local_ranks_filter else None,
        )
    except Exception as exc:
        raise ConfigError(f"--logs-specs {name!r}: {where} failed to start: {type(exc).__name__}: {exc}") from None
