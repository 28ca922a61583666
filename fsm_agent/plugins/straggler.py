"""Built-in plugin ``straggler``: step times in the rendezvous store, and the ranks slower than the job.

Off unless ``--straggler-window S`` (``FSM_AGENT_STRAGGLER_WINDOW``, ``[plugins.straggler]
window``) is above 0. Then every worker gets a heartbeat file (``fsm_agent.heartbeat(step=N)``
in the training loop reports its steps) and, every ``S`` seconds while the workers run, each
agent:

- estimates its workers' recent step times and, for workers that report it
  (``fsm_agent.heartbeat(compute_s=...)``, ``with fsm_agent.compute():``), their compute seconds
  per step (``fsm_agent.stragglers.StepClock``) and publishes them with one ``set`` to the rendezvous round's store (``WorkerGroup.store``: the same for the
  ``fsm``, ``c10d``, ``static`` and ``etcd-v3`` backends; no torch for ``fsm``);
- group rank 0 reads every agent's entry (one ``multi_get``), judges the window
  (``StragglerJudge``: the job's median compute time per step when every rank reports one, else
  its median step time: the ``basis``; each rank's ratio to it) and publishes the
  verdict with one ``set``; the other agents read it with one ``get``. So each agent makes 2 store
  calls a window (rank 0: 3), whatever the number of agents; the first windows add one
  ``check`` per key not seen yet (a missing key would block a ``get``);
- a rank above ``--straggler-factor F`` (default 1.5) times the median for ``--straggler-windows
  W`` (default 3) consecutive windows is a straggler: group rank 0 logs it and records one
  ``straggler`` event (host, node rank, local and global rank, factor), once per episode;
- with ``--exclude-node-on straggler`` (the ``restart-policy`` plugin's option), the straggler's
  own agent fails its health check with class ``straggler``: the restart policy takes the node
  out through the node-exclusion path and the others re-rendezvous without it (``--nnodes
  MIN:MAX`` permitting, a standby taking its place where there is one).

Each window also gives ``/status`` its ``step_times`` (``fsm-agent status``), the metrics
``fsm_agent`` ``step_time.median_s``, ``step_time.<global_rank>.seconds`` and
``step_time.<global_rank>.ratio`` (rank 0: every rank; others: their own) and ``stragglers``
(rank 0: ranks in an episode now), and one ``step_times`` event. A store call that fails is
logged and the window skipped: step times never fail a node.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import attrs

from fsm_agent.errors import ConfigError
from fsm_agent.plugins import hookimpl
from fsm_agent.stragglers import COMPUTE, STEP, STORE_PREFIX, RankTime, StepClock, StragglerJudge, ratio
from fsm_agent.worker import FailureClass, NodeProblem

log = logging.getLogger(__name__)
PLUGIN_NAME = "straggler"


def _non_negative(value: float) -> None:
    if value < 0:
        raise ValueError(f"expected seconds >= 0 (0: off), got {value}")


def _above_one(value: float) -> None:
    if not value > 1:
        raise ValueError(f"expected a factor > 1, got {value}")


def _at_least_one(value: int) -> None:
    if value < 1:
        raise ValueError(f"expected a count >= 1, got {value}")


#: How a basis reads in a log line or a failure message.
_WHAT = {COMPUTE: "compute time per step", STEP: "step time"}


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 6)


@hookimpl
def fsm_agent_addoption(options):
    options.add(
        "window",
        type=float,
        default=0.0,
        flag="--straggler-window",
        env="FSM_AGENT_STRAGGLER_WINDOW",
        check=_non_negative,
        help="seconds between step-time publications to the rendezvous store (fsm_agent.heartbeat(step=N)); 0: off",
    )
    options.add(
        "factor",
        type=float,
        default=1.5,
        flag="--straggler-factor",
        env="FSM_AGENT_STRAGGLER_FACTOR",
        check=_above_one,
        help="a rank slower than this many times the job's median step time is slow",
    )
    options.add(
        "windows",
        type=int,
        default=3,
        flag="--straggler-windows",
        env="FSM_AGENT_STRAGGLER_WINDOWS",
        check=_at_least_one,
        help="consecutive slow windows that make a rank a straggler",
    )


class StepTimes:
    """One agent's step-time publisher; group rank 0's also judges (see the module docstring).

    Args:
        agent: the ElasticAgent (``worker_steps``, ``record_event``, ``put_metric``, ``step_times``).
        window_s: seconds between publications.
        factor / windows: the StragglerJudge's settings.
        exclude: fail this node's health check (class ``straggler``) when a rank of it is a straggler.
    """

    def __init__(self, agent: Any, window_s: float, factor: float = 1.5, windows: int = 3, exclude: bool = False):
        self._agent, self.window_s, self.factor, self.windows, self.exclude = agent, window_s, factor, windows, exclude
        self._due: float | None = None

    @hookimpl
    def fsm_agent_workers_started(self, worker_group, pids):
        # Each attempt starts afresh: new workers, new step counters, a new round's store keys.
        self._due = time.monotonic() + self.window_s
        self._clock = StepClock()
        self._judge = StragglerJudge(self.factor, self.windows)
        self._known: set[str] = set()
        self._seen: dict[int, int] = {}
        self._seq = 0
        self._agent.report_step_times(None)

    @hookimpl
    def fsm_agent_health_check(self, worker_group):
        now = time.monotonic()
        if self._due is None or now < self._due:
            return None
        self._due = now + self.window_s
        if worker_group.store is None or worker_group.group_rank is None:
            return None
        try:
            return self.window(worker_group, now)
        except Exception as exc:  # the store is the rendezvous's: its loss is the backend's to report
            log.warning("step times: store call failed, window skipped: %s: %s", type(exc).__name__, exc)
            return None

    def window(self, group: Any, now: float) -> NodeProblem | None:
        """Publish this window's step times, judge (rank 0) or read the verdict (others); a
        NodeProblem when this node has a straggler and ``exclude`` is on."""
        agent, store = self._agent, group.store
        clock = self._clock
        times = clock.sample(agent.worker_steps(), now, agent.worker_compute())
        mine = [
            [w.global_rank, w.local_rank, round(times[w.local_rank], 6), _rounded(clock.compute.get(w.local_rank))]
            for w in group.workers
            if w.local_rank in times
        ]
        self._seq += 1
        prefix = f"{STORE_PREFIX}/{agent.restart_count}"
        store.set(
            f"{prefix}/node/{group.group_rank}",
            json.dumps({"host": agent.hostname, "node_rank": group.group_rank, "seq": self._seq, "ranks": mine}),
        )
        if group.group_rank == 0:
            ranks, verdict = self._judge_window(store, prefix, group.group_world_size or 1)
            store.set(f"{prefix}/job", json.dumps(verdict))
        else:
            verdict = self._read_verdict(store, f"{prefix}/job")
            ranks = [RankTime(agent.hostname, group.group_rank, lr, g, t, c) for g, lr, t, c in mine]
        self._show(ranks, verdict)
        flagged = [s for s in verdict.get("stragglers", []) if s["node_rank"] == group.group_rank]
        if not (flagged and self.exclude):
            return None
        s = flagged[0]
        return NodeProblem(
            f"rank {s['global_rank']} (local_rank {s['local_rank']}) is a straggler: {s['factor']}x "
            f"the job's median {_WHAT[s['basis']]} {s['median_s']:.4f}s for {s['windows']} windows",
            FailureClass.STRAGGLER,
            global_rank=s["global_rank"],
        )

    def _judge_window(self, store: Any, prefix: str, world: int) -> tuple[list[RankTime], dict[str, Any]]:
        keys = [f"{prefix}/node/{r}" for r in range(world)]
        for key in keys:  # a get of a missing key would block: check the ones not seen yet
            if key not in self._known and store.check([key]):
                self._known.add(key)
        present = [k for k in keys if k in self._known]
        ranks, fresh = [], set()
        for raw in store.multi_get(present) if present else []:
            node = json.loads(raw)
            new = self._seen.get(node["node_rank"]) != node["seq"]
            self._seen[node["node_rank"]] = node["seq"]
            for g, lr, t, c in node["ranks"]:
                ranks.append(RankTime(node["host"], node["node_rank"], lr, g, t, c))
                if new:
                    fresh.add(g)
        for s in self._judge.judge(ranks, fresh):
            log.warning(
                "straggler: rank %s (local_rank %s) on %s (node rank %s): %.2fx the job's median %s "
                "%.4fs for %s windows",
                s.global_rank,
                s.local_rank,
                s.host,
                s.node_rank,
                s.factor,
                _WHAT[s.basis],
                s.median_s,
                s.windows,
            )
            self._agent.record_event("straggler", **attrs.asdict(s))
        judge = self._judge
        verdict = {
            "window": judge.window,
            "median_s": judge.median_s,
            "basis": judge.basis,
            "ranks": len(ranks),
            "stragglers": [attrs.asdict(s) for s in judge.active.values()],
        }
        return ranks, verdict

    def _read_verdict(self, store: Any, key: str) -> dict[str, Any]:
        if key not in self._known:
            if not store.check([key]):
                return {}
            self._known.add(key)
        return json.loads(store.get(key))

    def _show(self, ranks: list[RankTime], verdict: dict[str, Any]) -> None:
        """``/status``'s ``step_times``, the metrics and the ``step_times`` event of one window."""
        median, basis = verdict.get("median_s"), verdict.get("basis", STEP)
        slow = {s["global_rank"] for s in verdict.get("stragglers", [])}
        rows = [
            {
                "global_rank": r.global_rank,
                "local_rank": r.local_rank,
                "node_rank": r.node_rank,
                "host": r.host,
                "step_time_s": r.step_time_s,
                "compute_s": r.compute_s,
                "ratio": ratio(r.time_s(basis), median),
                "straggler": r.global_rank in slow,
            }
            for r in sorted(ranks, key=lambda r: r.global_rank)
        ]
        view = {
            "window_s": self.window_s,
            "factor": self.factor,
            "windows": self.windows,
            "basis": basis,
            "median_s": median,
            "stragglers": verdict.get("stragglers", []),
            "ranks": rows,
        }
        self._agent.report_step_times(view)
        agent = self._agent
        if median is not None:
            agent.put_metric("fsm_agent", "step_time.median_s", median)
        for row in rows:
            agent.put_metric("fsm_agent", f"step_time.{row['global_rank']}.seconds", row["step_time_s"])
            if row["ratio"] is not None:
                agent.put_metric("fsm_agent", f"step_time.{row['global_rank']}.ratio", row["ratio"])
        if "window" in verdict and self._agent.get_worker_group().group_rank == 0:
            agent.put_metric("fsm_agent", "stragglers", len(slow))
        agent.record_event("step_times", **view)


@hookimpl
def fsm_agent_configure(config, agent):
    options = config.plugin_options(PLUGIN_NAME) if config is not None else {}
    window = float(options.get("window") or 0.0)
    excluded = (config.plugin_options("restart-policy").get("exclude_node_on") or "") if config is not None else ""
    exclude = FailureClass.STRAGGLER in (name.strip() for name in excluded.split(","))
    if window <= 0:
        if exclude:  # nothing would ever find a straggler to exclude
            raise ConfigError(
                "--exclude-node-on straggler needs --straggler-window S (seconds > 0, e.g. "
                "--straggler-window 30): without it no step times are judged"
            )
        return
    agent.track_steps()
    agent.plugin_manager.register(
        StepTimes(
            agent,
            window,
            factor=float(options.get("factor") or 1.5),
            windows=int(options.get("windows") or 3),
            exclude=exclude,
        ),
        f"{PLUGIN_NAME}-{id(agent)}",
    )
    log.info(
        "step times every %gs (straggler: above %gx the median for %s windows%s)",
        window,
        options.get("factor") or 1.5,
        options.get("windows") or 3,
        "; excluded" if exclude else "",
    )
