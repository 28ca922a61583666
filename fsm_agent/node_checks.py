"""Node checks before the workers start: every agent of a new round runs the ``fsm_agent_node_check``
plugins, the agents exchange their results through the round's store, and one decision, taken by
group rank 0 and read by every node, names the nodes excluded from the round (a failed check, a
node another node's check blamed, or no result within ``--node-check-timeout``). An excluded node
leaves the job (``node_check_failed``: INIT or STOPPED -> FAILED, class ``node_check``); the others
re-form the round without it (a hot spare takes its seat, or the round re-forms within
``--nnodes MIN:MAX``), and check the new round again.

What a check gets is a ``CheckRound``; what it answers is a ``CheckResult`` (or None: nothing to
say). A check that raises, returns something else or does not finish within the timeout is that
node's failure, named in one line (``run_checks``). Store keys live under ``KEY_PREFIX`` in the
round's store (a fresh prefix each round on every built-in backend).
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

import attrs

from fsm_agent.interrupts import STOP_LOOK_S, SignalStop, stop_taken

log = logging.getLogger(__name__)

#: The store keys of the exchange, under the round's store.
KEY_PREFIX = "fsm_agent/node_check/"
RESULT_KEY = KEY_PREFIX + "result/{}"  # one per group rank: its CheckResults, as JSON
DECISION_KEY = KEY_PREFIX + "decision"  # group rank 0's decision, as JSON
#: The failure class of a node a check excluded (``WorkerFailure.failure_class``, the restart
#: policy's and the events' name).
NODE_CHECK = "node_check"
#: Seconds beyond ``--node-check-timeout`` the decider waits for a node's result, and a node for
#: the decision: the store's own round trips, never a check's work.
EXCHANGE_MARGIN_S = 5.0


@attrs.frozen
class CheckRound:
    """What a node check gets: this node's place in the new round, and the round's store.

    Attributes:
        store: the round's store (torch ``Store``: ``set``, ``get``, ``add``, ``multi_get``,
            ``wait``, ``check``). A check that exchanges data with its peers keeps its keys under
            ``key_prefix``.
        key_prefix: ``fsm_agent/node_check/<check name>/``: the keys a check may use.
        group_rank / group_world_size: this node's rank among the agents and their number
            (torch's ``GROUP_RANK``/``GROUP_WORLD_SIZE``).
        node_addr: the address other nodes reach this node at (``--local-addr``, else the one that
            routes to the rendezvous endpoint).
        hostname: this node's host name, for messages.
        timeout_s: seconds the check may take in all (``--node-check-timeout``); past
            ``deadline`` its answer is not waited for.
        deadline: ``time.monotonic()`` value by which every check of this node must have answered.
        check_round: how many check rounds this node ran before this one since its last workers
            started (0: the first; a round re-formed after an exclusion is 1, ...).
    """

    store: Any
    key_prefix: str
    group_rank: int
    group_world_size: int
    node_addr: str
    hostname: str
    timeout_s: float
    deadline: float
    check_round: int = 0

    def for_check(self, name: str) -> CheckRound:
        """This round with ``key_prefix`` of check ``name``."""
        return attrs.evolve(self, key_prefix=f"{KEY_PREFIX}{name}/")

    def seconds_left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())


def _rank_map(value: Mapping[Any, Any]) -> dict[int, str]:
    """``{group_rank: text}`` with int keys (a JSON record has them as strings)."""
    return {int(rank): str(text) for rank, text in value.items()}


@attrs.frozen
class CheckResult:
    """One check's answer on one node.

    Attributes:
        check: the check's name (``network``, ``disk``, ``shm``, ``device``, a site's own).
        ok: False when this node failed the check: it is excluded from the round.
        reason: one line saying what failed (and the threshold), "" when ok.
        blamed: ``{group_rank: one line}``: other nodes this check found bad (a check that
            measures between nodes, such as ``network``, answers for the round on group rank 0).
            They are excluded too.
        measurements: what the check measured, for the events file (``{name: number}``: say the
            unit in the name, e.g. ``free_gib``, ``bandwidth_mbps``, ``rtt_ms``).
        seconds: how long the check took (filled in by ``run_checks``).
    """

    check: str
    ok: bool
    reason: str = ""
    blamed: Mapping[int, str] = attrs.field(factory=dict, converter=_rank_map)
    measurements: Mapping[str, float] = attrs.field(factory=dict)
    seconds: float = 0.0

    def record(self) -> dict[str, Any]:
        """JSON-ready (``blamed`` keys as strings)."""
        record = attrs.asdict(self)
        record["blamed"] = {str(rank): why for rank, why in self.blamed.items()}
        return record

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> CheckResult:
        names = {field.name for field in attrs.fields(cls)}
        return cls(**{key: value for key, value in record.items() if key in names})


def failed(check: str, reason: str) -> CheckResult:
    """A failed ``CheckResult`` of ``check`` with ``reason``."""
    return CheckResult(check=check, ok=False, reason=reason)


@attrs.frozen
class Decision:
    """The round's decision: the nodes excluded from it, by group rank, each with its reasons.

    Attributes:
        excluded: ``{group_rank: "host: reason; reason"}``; empty: every node passed.
        hosts: ``{group_rank: "hostname (address)"}`` of every node that reported.
        results: ``{group_rank: [CheckResult record, ...]}`` of every node that reported.
        store_host: the group rank whose agent hosts the round's store (it said so), or None.
    """

    excluded: Mapping[int, str] = attrs.field(factory=dict)
    hosts: Mapping[int, str] = attrs.field(factory=dict)
    results: Mapping[int, list[dict[str, Any]]] = attrs.field(factory=dict)
    store_host: int | None = None

    def record(self) -> dict[str, Any]:
        return {
            "excluded": {str(rank): why for rank, why in sorted(self.excluded.items())},
            "hosts": {str(rank): host for rank, host in sorted(self.hosts.items())},
            "results": {str(rank): results for rank, results in sorted(self.results.items())},
            "store_host": self.store_host,
        }

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Decision:
        host = record.get("store_host")
        return cls(
            excluded={int(rank): why for rank, why in record.get("excluded", {}).items()},
            hosts={int(rank): host for rank, host in record.get("hosts", {}).items()},
            results={int(rank): list(results) for rank, results in record.get("results", {}).items()},
            store_host=None if host is None else int(host),
        )


#: Seconds between the decider's looks at the arrivals.
POLL_S = 0.05


def run_checks(hook: Any, check_round: CheckRound) -> list[CheckResult]:
    """Every ``fsm_agent_node_check`` implementation of ``hook`` (a pluggy hook caller), each on a
    thread of its own, all waited for until ``check_round.deadline``: one CheckResult per check
    that answered (None: no answer, no result). An implementation that raises, answers something
    that is not a CheckResult, or has not answered by the deadline gives a failed result naming
    its plugin, in one line. Each result's ``seconds`` is filled in.

    Raises:
        SignalStop: the agent took a stop signal while the checks ran (a check that waits on a
            command looks for it too: ``fsm_agent.interrupts.stop_taken``).
    """
    impls = hook.get_hookimpls()
    answers: dict[str, Any] = {}
    started = time.monotonic()

    def call(impl: Any) -> None:
        began = time.monotonic()
        try:
            value = impl.function(**{name: check_round for name in impl.argnames})
        except SignalStop:  # the agent took a stop signal: no answer (run_checks is cut short too)
            return
        except Exception as exc:  # a check's own bug is this node's failure, in one line
            line = (str(exc).strip().splitlines() or [""])[0][:200]
            value = failed(impl.plugin_name, f"plugin {impl.plugin_name!r} raised {type(exc).__name__}: {line}")
        if value is not None and not isinstance(value, CheckResult):
            value = failed(
                impl.plugin_name,
                f"plugin {impl.plugin_name!r} answered {type(value).__name__}, not a CheckResult or None",
            )
        answers[impl.plugin_name] = None if value is None else attrs.evolve(value, seconds=time.monotonic() - began)

    threads = {impl.plugin_name: threading.Thread(target=call, args=(impl,), daemon=True) for impl in impls}
    for thread in threads.values():
        thread.start()
    for thread in threads.values():  # a hung check is left behind (daemon): its answer no longer counts
        while thread.is_alive() and (left := check_round.deadline - time.monotonic()) > 0:
            thread.join(min(STOP_LOOK_S, left))
            if (stop := stop_taken()) is not None:  # the step is cut short, as the agent's interruptible calls
                raise SignalStop(stop)
    results = []
    for name in threads:
        if name not in answers:
            results.append(
                attrs.evolve(
                    failed(
                        name, f"plugin {name!r} did not finish within --node-check-timeout={check_round.timeout_s:g} s"
                    ),
                    seconds=time.monotonic() - started,
                )
            )
        elif answers[name] is not None:
            results.append(answers[name])
    return results


def decide(reported: Mapping[int, tuple[str, list[CheckResult]]], world_size: int, timeout_s: float) -> Decision:
    """The round's decision from every node's ``(hostname, results)`` by group rank: a node is
    excluded when one of its checks failed, when a check of any node blamed it, or when it did not
    report (its link or its agent is down; not said of a blamed node, which is not waited for).
    Deterministic."""
    excluded: dict[int, list[str]] = {}
    blamed_by_any = {r for _, results in reported.values() for result in results for r in result.blamed}
    for rank in range(world_size):
        if rank not in reported and rank not in blamed_by_any:  # a blamed node, not waited for, says why below
            excluded.setdefault(rank, []).append(
                f"no node-check result within {timeout_s:g} s (its link or agent down?)"
            )
    for rank, (_, results) in sorted(reported.items()):
        for result in results:
            if not result.ok:
                excluded.setdefault(rank, []).append(f"{result.check}: {result.reason}")
            for blamed, why in sorted(result.blamed.items()):
                if 0 <= blamed < world_size:
                    excluded.setdefault(blamed, []).append(f"{result.check} (measured from group rank {rank}): {why}")
    hosts = {rank: host for rank, (host, _) in reported.items()}
    return Decision(
        excluded={rank: "; ".join(reasons) for rank, reasons in sorted(excluded.items())},
        hosts=hosts,
        results={rank: [r.record() for r in results] for rank, (_, results) in sorted(reported.items())},
    )


def exchange(check_round: CheckRound, results: list[CheckResult], hosts_store: bool = False) -> Decision:
    """Publish this node's ``results``; group rank 0 gathers every node's (until each reported
    that its own checks did not blame, or ``deadline + EXCHANGE_MARGIN_S``), decides (``decide``) and publishes the decision, which
    every other node waits for (one blocking ``wait``, then one ``get``).

    Store requests per node: 3 (set, wait, get); group rank 0: a look at the results every
    ``POLL_S`` s while it waits (one ``check`` of every awaited key), then one ``check`` per node
    its checks blamed (per node only when some did not report), one ``multi_get`` and one ``set``.

    ``hosts_store``: this node's agent hosts the round's store (the decision says which node
    does: the round cannot re-form without it).

    Raises:
        whatever the store raises (unreachable, or no decision by its timeout): the caller treats
        it as the rendezvous failing.
    """
    store, rank, world = check_round.store, check_round.group_rank, check_round.group_world_size
    # by name and address: several agents may share a host name (containers, namespaces)
    where = f"{check_round.hostname} ({check_round.node_addr})"
    store.set(RESULT_KEY.format(rank), json.dumps([where, [r.record() for r in results], hosts_store]))
    if rank != 0:
        wait_s = check_round.seconds_left() + 2 * EXCHANGE_MARGIN_S
        store.wait([DECISION_KEY], datetime.timedelta(seconds=wait_s))
        return Decision.from_record(json.loads(bytes(store.get(DECISION_KEY)).decode()))
    until = check_round.deadline + EXCHANGE_MARGIN_S
    keys = [RESULT_KEY.format(r) for r in range(world)]
    # a node this node's own checks blamed (a link found down) is not waited for
    blamed = {r for result in results for r in result.blamed if 0 < r < world}
    awaited = [keys[r] for r in range(world) if r not in blamed]
    complete = store.check(awaited)
    while not complete and time.monotonic() < until:
        time.sleep(POLL_S)
        complete = store.check(awaited)
    if complete:  # every awaited node reported; of the blamed ones, look which did
        present = sorted({r for r in range(world) if r not in blamed} | {r for r in blamed if store.check([keys[r]])})
    else:  # some did not: one look per node finds which
        present = [r for r in range(world) if store.check([keys[r]])]
    values = store.multi_get([keys[r] for r in present]) if present else []
    reported, store_host = {}, None
    for r, raw in zip(present, values, strict=True):
        host, records, *hosting = json.loads(bytes(raw).decode())
        reported[r] = (str(host), [CheckResult.from_record(record) for record in records])
        store_host = r if hosting and hosting[0] else store_host
    decision = attrs.evolve(decide(reported, world, check_round.timeout_s), store_host=store_host)
    store.set(DECISION_KEY, json.dumps(decision.record()))
    return decision
