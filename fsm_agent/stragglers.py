"""Stragglers: each worker's recent step time, the job's median, and the ranks slower than it.

A slow GPU, a throttled node or a bad link makes a rank take longer per step. The agent reads
the step each worker reports with ``fsm_agent.heartbeat(step=N)`` once per window (``StepClock``:
no worker change beyond that call), every agent publishes its workers' step times to the
rendezvous store, and the agent of group rank 0 judges them (``StragglerJudge``): a rank whose
step time is above ``factor`` times the job's median for ``windows`` consecutive windows is a
straggler, reported once per episode (an episode ends when the rank is back within the factor for
``windows`` windows in a row, or with the attempt).

The step time is what the agent sees of a worker's progress: it finds a rank that is slower on
its own (independent ranks, data loading, a rank ahead of a collective). In a job whose every
step ends in a collective all ranks advance together and the step time is the same everywhere,
so workers there report their own compute time (``fsm_agent.heartbeat(step=N, compute_s=...)``
or ``with fsm_agent.compute():``): when every rank reports it, the judge compares compute time
per step (``basis`` "compute"), else step time (``basis`` "step").
This module is data and arithmetic only (no store, no torch); the ``straggler`` plugin
(``fsm_agent.plugins.straggler``) does the publishing.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping

import attrs

#: Keys of the rendezvous round's store: ``<prefix>/<restart_count>/node/<group_rank>`` (one
#: agent's workers) and ``<prefix>/<restart_count>/job`` (group rank 0's verdict).
STORE_PREFIX = "fsm_agent/step_times"
#: What the judge compares: each rank's compute time per step (every rank reports it), or its step time.
COMPUTE, STEP = "compute", "step"


class StepClock:
    """Estimates each local worker's recent step time, seconds, from steps sampled once a window.

    A worker whose step advanced by ``d`` since the sample where it last changed, ``T`` seconds
    ago, takes ``T / d`` s a step; one whose step did not advance takes at least ``T`` (so a rank
    slower than a window still shows). The first sample of a worker gives no estimate.
    """

    def __init__(self) -> None:
        # local_rank -> (step, when it was first seen, the compute total then or None)
        self._last: dict[int, tuple[int, float, float | None]] = {}
        self._estimate: dict[int, float] = {}
        #: {local_rank: compute seconds per step} over the same steps, for workers that report it.
        self.compute: dict[int, float] = {}

    def sample(
        self, steps: Mapping[int, int], now: float, compute: Mapping[int, float] | None = None
    ) -> dict[int, float]:
        """{local_rank: step time in seconds} after one sample of ``steps`` ({local_rank: step})
        taken at ``now`` (monotonic seconds); ``compute`` ({local_rank: total compute seconds})
        updates ``self.compute`` over the same steps."""
        compute = compute or {}
        for rank, step in steps.items():
            last, total = self._last.get(rank), compute.get(rank)
            if last is None or step < last[0]:  # first sample, or a counter that went back
                self._last[rank] = (step, now, total)
                self._estimate.pop(rank, None)
                self.compute.pop(rank, None)
            elif step > last[0]:
                self._estimate[rank] = (now - last[1]) / (step - last[0])
                if total is not None and last[2] is not None:
                    self.compute[rank] = max(total - last[2], 0.0) / (step - last[0])
                self._last[rank] = (step, now, total)
            elif rank in self._estimate:
                self._estimate[rank] = max(self._estimate[rank], now - last[1])
        return dict(self._estimate)


@attrs.frozen
class RankTime:
    """One rank's step time as its agent published it.

    Attributes:
        host: the agent's host name.
        node_rank: the agent's group rank (``GROUP_RANK``).
        local_rank / global_rank: the worker's ranks (``LOCAL_RANK``, ``RANK``).
        step_time_s: seconds per step, recent.
        compute_s: the worker's own compute seconds per step over the same steps, or None when
            it does not report compute time.
    """

    host: str
    node_rank: int
    local_rank: int
    global_rank: int
    step_time_s: float
    compute_s: float | None = None

    def time_s(self, basis: str) -> float:
        """The time judged: ``compute_s`` with basis "compute", else ``step_time_s``."""
        return self.compute_s if basis == COMPUTE and self.compute_s is not None else self.step_time_s


@attrs.frozen
class Straggler:
    """A rank found slower than ``factor`` times the job's median step time.

    Attributes:
        host / node_rank / local_rank / global_rank: where it runs (see ``RankTime``).
        factor: its time over the job's median when it was found.
        step_time_s / median_s: its step time and the job's median of the judged time, seconds.
        basis: the judged time: "compute" (compute seconds per step, every rank reported it) or
            "step" (step time).
        compute_s: its compute seconds per step, or None (basis "step").
        windows: consecutive windows it was above the factor (the ``windows`` setting).
        window: the judge's window count (since the attempt started) when it was found.
        since_window: the judge's first window that had a step time of this rank.
    """

    host: str
    node_rank: int
    local_rank: int
    global_rank: int
    factor: float
    step_time_s: float
    median_s: float
    windows: int
    window: int
    since_window: int
    basis: str = STEP
    compute_s: float | None = None


class StragglerJudge:
    """Counts, per global rank, the consecutive windows above ``factor`` times the median.

    Args:
        factor: a rank slower than this many times the median step time is slow (> 1).
        windows: consecutive slow windows that make a straggler (>= 1).
    """

    def __init__(self, factor: float, windows: int):
        self.factor, self.windows = factor, windows
        self.window = 0
        self.median_s: float | None = None
        #: The last window's basis: COMPUTE when every rank reported compute time, else STEP.
        self.basis = STEP
        #: Ranks in an episode now: {global_rank: the Straggler report}.
        self.active: dict[int, Straggler] = {}
        self._slow: dict[int, int] = {}
        self._fast: dict[int, int] = {}  # consecutive windows within the factor, per global rank
        self._first: dict[int, int] = {}

    def judge(self, ranks: Iterable[RankTime], fresh: Iterable[int]) -> list[Straggler]:
        """Judge one window: ``ranks`` are every rank's latest step time, ``fresh`` the global
        ranks whose agents published since the last window (only they count a window). Returns
        the stragglers found in this window (each once per episode)."""
        self.window += 1
        ranks, fresh = list(ranks), set(fresh)
        if not ranks:
            return []
        # Switching basis mid-episode would compare different times: only all-or-nothing counts.
        self.basis = basis = COMPUTE if all(r.compute_s is not None for r in ranks) else STEP
        self.median_s = median = statistics.median(r.time_s(basis) for r in ranks)
        found = []
        for r in ranks:
            g = r.global_rank
            self._first.setdefault(g, self.window)
            if g not in fresh:
                continue
            ratio = r.time_s(basis) / median if median > 0 else 1.0
            if ratio <= self.factor:
                self._slow[g] = 0
                # One fast window (a noisy one, a busy machine) does not end an episode: as many
                # windows within the factor as it took to find it do, so a rank is reported once.
                self._fast[g] = self._fast.get(g, 0) + 1
                if self._fast[g] >= self.windows:
                    self.active.pop(g, None)  # the episode is over
                continue
            self._fast[g] = 0
            self._slow[g] = self._slow.get(g, 0) + 1
            if self._slow[g] >= self.windows and g not in self.active:
                self.active[g] = Straggler(
                    host=r.host,
                    node_rank=r.node_rank,
                    local_rank=r.local_rank,
                    global_rank=g,
                    factor=round(ratio, 3),
                    step_time_s=r.step_time_s,
                    median_s=median,
                    windows=self._slow[g],
                    window=self.window,
                    since_window=self._first[g],
                    basis=basis,
                    compute_s=r.compute_s,
                )
                found.append(self.active[g])
        return found


def ratio(step_time_s: float, median_s: float | None) -> float | None:
    """``step_time_s / median_s``, rounded to 3 places; None without a median."""
    return round(step_time_s / median_s, 3) if median_s else None
