"""The job's verdict across nodes: failure reports in, one verdict out, the same on every node.

Every agent whose workers fail writes its ``FailureReport``s to the round's rendezvous store, with
what its restart policy decided (``restart`` or ``give_up``). An agent that gives the job up
decides the verdict: it waits briefly for the reports of nodes failing at the same moment
(``GATHER_S``), runs ``attribution.attribute`` on all of them, and publishes the result once (the
first to claim ``CLAIM_KEY`` publishes; later deciders adopt its verdict). It then marks the job
failed under the drain's job-wide key (``drain.JOB_DRAIN_KEY``, value ``JOB_FAILED_MARK ...``), so
the peers' existing look (one request per look, flat in the number of nodes) finds it; each
peer that reads it counts itself under ``SEEN_KEY``, stops its workers and ends FAILED with that
verdict. The decider waits (at most ``SEEN_WAIT_S``) until every peer saw it or checked in at the
exit barrier: leaving first would take the store (c10d's, static's, fsm's: in an agent) along.

A node whose failures are all collateral (a peer's failure seen from here) first waits, at most
``GATHER_S``, for a peer's report: the job's verdict (it ends with it, trigger ``job_failed``) or a
root-cause node's ``restart`` (then its own restart policy decides as usual). torch has none of
this: each torchrun node prints its own first failure.
"""

from __future__ import annotations

import json
import logging
import select
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fsm_agent.attribution import COLLATERAL, FailureReport, Verdict, attribute, builtin_class, report_order
from fsm_agent.exit_barrier import NUM_MEMBERS_KEY
from fsm_agent.interrupts import empty_pipe
from fsm_agent.worker import DO_NOT_REQUEUE_EXIT_CODE, WorkerFailure, WorkerGroup, first_failure

log = logging.getLogger(__name__)

REPORTS_KEY = "fsm_agent/verdict/reports"  # a counter: report n is at REPORT_KEY.format(n)
REPORT_KEY = "fsm_agent/verdict/report/{}"
CLAIM_KEY = "fsm_agent/verdict/claim"
VERDICT_KEY = "fsm_agent/verdict/job"
SEEN_KEY = "fsm_agent/verdict/seen"
#: The value prefix of ``drain.JOB_DRAIN_KEY`` that says "the job failed" (not a drain).
JOB_FAILED_MARK = "job failed: "
#: At most this long (seconds) a decider waits for the reports of other nodes failing with it, and
#: a node with only collateral failures for a peer's decision.
GATHER_S = 5.0
#: The decider waits at least this long (seconds) unless every other node reported, and then until
#: no new report came for ``SETTLE_S``: a peer's workers that fail because of the root cause take
#: a moment (measured: 1.1 s on a loaded 2-core machine) to notice it, exit and be reported, as the
#: root cause's own process first has to end and close its connections.
GATHER_MIN_S = 2.0
SETTLE_S = 1.0
#: At most this long (seconds) the decider waits for every peer to see the verdict before it leaves.
SEEN_WAIT_S = 30.0  # as drain.JOB_DRAIN_SEEN_WAIT_S: every look comes well within it, at any scale
POLL_S = 0.05
#: Why a lost node's ranks are named in a verdict (``lost_reason``): its agent's keep-alive lapsed.
NODE_LOST = "its node was lost"
#: ... or its agent hosted the round's store, which this node can no longer reach.
STORE_HOST_LOST = "its node hosted the rendezvous store, which became unreachable: the node was lost"


class PeerVerdict(Exception):
    """Raised by a step that found the job's verdict (the exit barrier, released by a node that gave
    the job up): the transition does not happen, and the run loop fires ``job_failed`` instead."""


def report_of(failure: WorkerFailure, group_rank: int, tail_lines: int = 30) -> FailureReport:
    """A WorkerFailure as the attributor reads it: its error time, message and traceback tail."""
    tail = "\n".join(failure.traceback.rstrip().splitlines()[-tail_lines:]) if failure.traceback else ""
    return FailureReport(
        global_rank=failure.global_rank,
        local_rank=failure.local_rank,
        group_rank=group_rank,
        hostname=failure.hostname,
        exitcode=failure.exitcode,
        failure_class=failure.failure_class,
        time=round(failure.error_timestamp or failure.timestamp, 6),
        message=(failure.message.splitlines()[0] if failure.message else "")[:500],
        tail=tail,
    )


def verdict_line(record: Mapping[str, Any]) -> str:
    """One line for logs and the summary's ``Verdict:``: the job failed, why, who decided."""
    return f"the job failed: {record.get('summary')} (decided by {record.get('decided_by')})"


def shared(group: WorkerGroup) -> bool:
    """Whether the round has a store and other nodes."""
    return group.store is not None and (group.group_world_size or 0) > 1


def all_collateral(reports: Sequence[FailureReport], classify: Callable[[FailureReport], str | None]) -> bool:
    """Whether every report looks like a peer's failure seen from here (site rules first)."""
    return bool(reports) and all((classify(r) or builtin_class(r)) == COLLATERAL for r in reports)


def publish_reports(
    store: Any, reports: Sequence[FailureReport], decision: str, who: str, ranks: Sequence[int] = ()
) -> None:
    """Add this node's reports (its restart policy's ``decision``, and the global ``ranks`` of its
    workers: a node that reports is not the lost one) to the round's store."""
    n = store.add(REPORTS_KEY, 1)
    entry = {"decision": decision, "by": who, "ranks": list(ranks), "reports": [r.record() for r in reports]}
    store.set(REPORT_KEY.format(n), json.dumps(entry))


def read_reports(store: Any, after: int = 0) -> tuple[int, list[dict[str, Any]]]:
    """The reports published after the ``after``-th: ``(count, [{"decision", "by", "reports"}])``;
    one still being written (counted, not yet set) is left for the next read."""
    count = int(store.add(REPORTS_KEY, 0))
    found: list[dict[str, Any]] = []
    for n in range(after + 1, count + 1):
        key = REPORT_KEY.format(n)
        if not store.check([key]):
            return n - 1, found
        raw = store.get(key)
        found.append(json.loads(raw.decode() if isinstance(raw, bytes) else raw))
    return count, found


def published_verdict(store: Any) -> dict[str, Any] | None:
    """The job's verdict if one was published in this round (its record), else None."""
    if not store.check([VERDICT_KEY]):
        return None
    raw = store.get(VERDICT_KEY)
    return dict(json.loads(raw.decode() if isinstance(raw, bytes) else raw))


def wait_for_peer_decision(store: Any, wake_r: int, stopped: Callable[[], bool]) -> dict[str, Any] | None:
    """A node with only collateral failures: wait (at most ``GATHER_S`` s) for the job's verdict
    (returned) or a peer's report that decided a restart (None: decide as usual)."""
    deadline, seen = time.monotonic() + GATHER_S, 0
    while not stopped():
        verdict = published_verdict(store)
        if verdict is not None:
            return verdict
        seen, found = read_reports(store, seen)
        if any(report["decision"] == "restart" for report in found):
            return None
        if any(report["decision"] == "give_up" for report in found):  # it decides once its workers stopped
            deadline = max(deadline, time.monotonic() + SEEN_WAIT_S)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        select.select([wake_r], [], [], min(POLL_S * 2, remaining))
        empty_pipe(wake_r)
    return None


def decide(
    store: Any,
    own: Sequence[FailureReport],
    world_size: int,
    who: str,
    classify: Callable[[FailureReport], str | None],
    exit_code: int | None,
    nodes: int = 0,
    lost: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Gather the reports of this round's ``nodes`` (until each reported, else at least
    ``GATHER_MIN_S`` s and ``SETTLE_S`` s without a new one, at most ``GATHER_S`` s), attribute, and
    publish the verdict unless another node did first; returns the job's verdict record (``Verdict``
    fields plus ``decided_by``, ``world_size`` and the ``reports`` it was decided on).
    ``exit_code``: the restart policy's own exit code (e.g. 79), which the verdict carries."""
    started = time.monotonic()
    count, found = read_reports(store, 0)
    quiet_since = started

    def gathering() -> bool:
        now = time.monotonic()
        if now - started >= GATHER_S:
            return False
        reporters = {r["group_rank"] for entry in found for r in entry["reports"]} | {r.group_rank for r in own}
        if len(reporters) >= nodes:  # every node reported: nothing more to wait for
            return False
        return now - started < GATHER_MIN_S or now - quiet_since < SETTLE_S

    while gathering():
        existing = published_verdict(store)
        if existing is not None:
            return existing
        time.sleep(POLL_S)
        count, more = read_reports(store, count)
        if more:
            found += more
            quiet_since = time.monotonic()
    reports = list(own) + [FailureReport.from_record(r) for entry in found for r in entry["reports"]]
    gone: list[int] = []
    if lost is not None:  # a node was lost: its ranks are those no node of the round reported as its own
        seen = {*lost, *(rank for entry in found for rank in entry.get("ranks", ())), *(r.global_rank for r in reports)}
        gone = [rank for rank in range(world_size) if rank not in seen]
    record = verdict_record(reports, world_size, who, classify, exit_code, gone)
    record["decided_at"] = round(time.time(), 6)  # wall clock: the peers' end is measured from it
    if store.add(CLAIM_KEY, 1) == 1:
        store.set(VERDICT_KEY, json.dumps(record))
        return record
    winner = published_verdict(store)
    deadline = time.monotonic() + GATHER_S
    while winner is None and time.monotonic() < deadline:  # claimed, not yet written
        time.sleep(POLL_S)
        winner = published_verdict(store)
    return winner if winner is not None else record


def verdict_record(
    reports: Sequence[FailureReport],
    world_size: int,
    who: str,
    classify: Callable[[FailureReport], str | None],
    exit_code: int | None,
    lost_ranks: Sequence[int] = (),
    lost_reason: str = NODE_LOST,
) -> dict[str, Any]:
    """The verdict on ``reports`` (and the ranks of lost nodes, each for ``lost_reason``) as the
    record every node keeps (and ``replay`` recomputes)."""
    verdict = attribute(reports, world_size, classify, dict.fromkeys(lost_ranks, lost_reason))
    record = verdict.record()
    if exit_code is not None:
        record["exit_code"] = exit_code
    elif record["exit_code"] == DO_NOT_REQUEUE_EXIT_CODE:  # only the agent says "do not requeue" (RunResult.exit_code)
        record["exit_code"] = 1
    unique: dict[int, FailureReport] = {}
    for report in sorted(reports, key=report_order):  # each rank's earliest, as attribute() keeps
        unique.setdefault(report.global_rank, report)
    record.update(
        decided_by=who,
        world_size=world_size,
        lost_ranks=list(lost_ranks),
        lost_reason=lost_reason,
        reports=[unique[rank].record() for rank in sorted(unique)],
    )
    return record


def recompute(record: dict[str, Any], classify: Callable[[FailureReport], str | None] | None = None) -> Verdict:
    """The verdict ``attribute`` gives today on a verdict record's own reports (``fsm-agent replay``)."""
    reports = [FailureReport.from_record(r) for r in record.get("reports", ())]
    reason = str(record.get("lost_reason", NODE_LOST))
    lost = {int(rank): reason for rank in record.get("lost_ranks", ())}
    return attribute(reports, int(record.get("world_size", 0)), classify, lost)


def announce(store: Any, record: dict[str, Any], job_end_key: str) -> None:
    """Mark the job failed where the peers' job-wide look finds it, unless a job-wide drain was
    announced there first (the first to end the job wins: the peers then drain, with the requeue
    code, and this node ends with the verdict)."""
    set_unless_set(store, job_end_key, JOB_FAILED_MARK + str(record.get("summary", "")))


def set_unless_set(store: Any, key: str, value: str) -> None:
    """Set ``key`` unless it is set already (compare-and-set: the first writer wins); a store
    without compare-and-set just sets it."""
    try:
        store.compare_set(key, "", value)  # creates the key when it is missing
    except (AttributeError, NotImplementedError):
        store.set(key, value)


def wait_until_seen(
    group: WorkerGroup, wake_r: int, stopped: Callable[[], bool], role: str, lost_ranks: Sequence[int] = ()
) -> None:
    """The decider waits (at most ``SEEN_WAIT_S`` s) until every other node saw the verdict or
    checked in at the exit barrier (it ended, or its workers finished); a lost node (``lost_ranks``:
    its ranks, the verdict's) never will, and is not waited for."""
    per_node = max(1, group.spec.local_world_size)
    others = (group.group_world_size or 1) - 1 - -(-len(lost_ranks) // per_node)
    deadline = time.monotonic() + SEEN_WAIT_S
    while not stopped() and time.monotonic() < deadline:
        try:
            # a peer that saw it also checks in at the exit barrier as it ends: max, not the sum
            if max(store_count(group.store, SEEN_KEY), store_count(group.store, NUM_MEMBERS_KEY)) >= others:
                return
        except Exception as exc:  # the store is gone: nobody left to tell
            log.debug("could not read who saw the job's verdict: %s", exc)
            return
        select.select([wake_r], [], [], 0.1)
        empty_pipe(wake_r)
    log.warning("[%s] not every node saw the job's verdict within %gs", role, SEEN_WAIT_S)


def store_unreachable(exc: BaseException) -> bool:
    """Whether a store call's error says the store is gone (refused, reset, closed: its host's
    process or node is), not merely slow (a timeout)."""
    if isinstance(exc, TimeoutError):
        return False
    if isinstance(exc, ConnectionError):
        return True
    text = f"{type(exc).__name__}: {exc}".lower()  # torch's DistNetworkError, the fsm store's own words
    return any(word in text for word in ("refused", "reset", "closed", "broken pipe", "gone", "networkerror"))


def store_count(store: Any, key: str) -> int:
    return int(store.add(key, 0))


Classify = Callable[[FailureReport], "str | None"]


class NodeVerdicts:
    """One agent's part in the job's verdict; the agent's steps call it (``ElasticAgent``:
    ``_peer_verdict_first``, ``_decide_on_failed_workers``, ``_decide_job_verdict``, ``_exit_barrier``).

    Args:
        group: the agent's WorkerGroup (its store, group rank and size change round by round).
        hostname / role: for the verdict's ``decided_by`` and log lines.
        interrupts: the agent's ``Interrupts`` (wake-up pipe, stop signal, an abandoned store call).
        bounded: ``call(name, fn)`` bounded and uninterruptible (``ElasticAgent._bounded_call``).
    """

    def __init__(self, group: WorkerGroup, hostname: str, role: str, interrupts: Any, bounded: Any) -> None:
        self._group, self._hostname, self._role = group, hostname, role
        self._interrupts, self._bounded = interrupts, bounded

    @property
    def who(self) -> str:
        return f"{self._hostname} (group_rank {self._group.group_rank})"

    @property
    def world_size(self) -> int:
        workers = self._group.workers
        return workers[0].world_size if workers else self._group.spec.local_world_size

    def _usable(self) -> bool:
        return shared(self._group) and self._interrupts.abandoned_call is None

    def reports(self, failures: dict[int, WorkerFailure]) -> list[FailureReport]:
        return [report_of(f, self._group.group_rank or 0) for f in failures.values()]

    def local_root_cause(self, failures: dict[int, WorkerFailure], classify: Classify) -> WorkerFailure:
        """The root cause among this node's ``failures``: its first failure of its own (not one a
        peer's failure caused), else its first failure."""
        verdict = attribute(self.reports(failures), self.world_size, classify)
        local = [rank for rank in verdict.root_causes if rank in failures]
        cause = failures[local[0]] if local else first_failure(failures)
        assert cause is not None  # the agent's failures are never empty here
        return cause

    def before_deciding(
        self, failures: Callable[[], dict[int, WorkerFailure]], classify: Classify
    ) -> dict[str, Any] | None:
        """Before this node decides on failed workers: the job's verdict when a peer published one, or,
        when every failure here is collateral, the one a peer decides within ``GATHER_S`` s (this
        node's reports published first, so that they are counted in it); None: decide as usual."""
        group = self._group
        if not self._usable():
            return None
        try:
            verdict = published_verdict(group.store)
            if verdict is None:
                reports = self.reports(failures())
                if all_collateral(reports, classify):
                    publish_reports(group.store, reports, "collateral", self.who)
                    verdict = wait_for_peer_decision(group.store, self._interrupts.wake_r, self._interrupts.signalled)
        except Exception as exc:  # the store is gone: decide alone, as before
            log.debug("could not look for the job's verdict: %s", exc)
            return None
        return verdict

    def publish(self, failures: dict[int, WorkerFailure], decision: Any) -> None:
        """Tell the round's other nodes what failed here and what the restart policy decided."""
        if not self._usable() or decision is None:
            return
        what = "restart" if decision.restart else ("exclude_node" if decision.exclude_node else "give_up")
        reports, store = self.reports(failures), self._group.store
        try:
            self._bounded("publish-failures", lambda: publish_reports(store, reports, what, self.who))
        except Exception as exc:  # the store is gone: every node decides alone
            log.debug("could not publish this node's failures: %s", exc)

    def decide_and_share(
        self, failures: dict[int, WorkerFailure], exit_code: int | None, classify: Classify, lost: bool = False
    ) -> dict[str, Any]:
        """The job is given up here: decide its verdict with the other nodes' reports (``decide``),
        or adopt the one a peer decided first; mark it for the peers' look and wait until they saw
        it; alone (one node, or the store gone): this node's own verdict."""
        group, reports = self._group, self.reports(failures)
        mine = [w.global_rank for w in group.workers]
        unreachable = False
        if self._usable():
            try:
                if lost:  # alive: the lost node's ranks are those no node reports
                    publish_reports(group.store, reports, "node_lost", self.who, mine)
                record = decide(
                    group.store,
                    reports,
                    self.world_size,
                    self.who,
                    classify,
                    exit_code,
                    group.group_world_size or 0,
                    lost=mine if lost else None,
                )
                announce(group.store, record, _job_end_key())
                if record.get("decided_by") != self.who:
                    group.store.add(SEEN_KEY, 1)
                else:
                    wake, signalled = self._interrupts.wake_r, self._interrupts.signalled
                    wait_until_seen(group, wake, signalled, self._role, record.get("lost_ranks", ()))
                return record
            except Exception as exc:  # the store is gone: this node's own verdict
                log.warning("[%s] could not share the job's verdict: %s", self._role, exc)
                unreachable = store_unreachable(exc)
        # The store is unreachable (not merely slow): its host's node is gone (or cut off), and with
        # it the others' reports.
        gone = self._store_host_elsewhere() if unreachable else []
        record = verdict_record(reports, self.world_size, self.who, classify, exit_code, gone, STORE_HOST_LOST)
        if lost and not reports and not gone:  # which node it was is not known here
            record["summary"] = "a node was lost, and the rendezvous store with it: which one is not known here"
        return record

    def _store_host_elsewhere(self) -> list[int]:
        """The global ranks of the node hosting the round's store, unless it is this node (or not known)."""
        mine = {w.global_rank for w in self._group.workers}
        hosts = self._group.store_host_ranks
        return [] if mine & set(hosts) else list(hosts)

    def store_host_lost(self, failures: dict[int, WorkerFailure], classify: Classify) -> dict[str, Any] | None:
        """The round's store became unreachable while workers ran: the verdict, decided here alone
        (there is no store to share it through), that names its host's ranks lost (every survivor
        names the same ones); None when this node hosted the store or its host is not known."""
        gone = self._store_host_elsewhere()
        if not gone or not shared(self._group):
            return None
        return verdict_record(self.reports(failures), self.world_size, self.who, classify, None, gone, STORE_HOST_LOST)

    def after_barrier(self, drains: Any) -> None:
        """A node that gave the job up releases the exit barrier after publishing the verdict: a node
        whose workers all succeeded ends with that verdict too, not with exit 0.

        Raises:
            PeerVerdict: the job failed (``drains.peer_verdict`` is set); the run loop fires ``job_failed``.
        """
        group = self._group
        if not shared(group) or self._interrupts.signal is not None:
            return
        try:
            verdict = self._bounded("look-for-verdict", lambda: published_verdict(group.store))
        except Exception as exc:  # the store left with the last node: the local result stands
            log.debug("could not look for the job's verdict after the exit barrier: %s", exc)
            return
        if verdict is not None:
            drains.peer_verdict = verdict
            raise PeerVerdict(verdict.get("summary"))


def _job_end_key() -> str:
    from fsm_agent.drain import JOB_DRAIN_KEY  # drain imports this module

    return JOB_DRAIN_KEY
