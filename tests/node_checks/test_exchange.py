"""The node checks' own machinery (``fsm_agent.node_checks``): every check run on its thread and
bounded by the deadline, bad answers turned into one-line failures, and the exchange of results
and the one decision through a real TCPStore by real threads, one per node."""

from __future__ import annotations

import datetime
import threading
import time

import pluggy
import pytest

from fsm_agent import node_checks
from fsm_agent.node_checks import CheckResult, CheckRound
from fsm_agent.plugins import PROJECT_NAME, hookimpl, hookspecs

pytestmark = pytest.mark.unit


def round_of(store=None, rank=0, world=1, timeout_s=2.0) -> CheckRound:
    return CheckRound(
        store=store,
        key_prefix=node_checks.KEY_PREFIX,
        group_rank=rank,
        group_world_size=world,
        node_addr="127.0.0.1",
        hostname=f"node{rank}",
        timeout_s=timeout_s,
        deadline=time.monotonic() + timeout_s,
    )


def hook_with(**plugins):
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    for name, plugin in plugins.items():
        pm.register(plugin, name)
    return pm.hook.fsm_agent_node_check


class Answers:
    def __init__(self, answer):
        self.answer = answer

    @hookimpl
    def fsm_agent_node_check(self, check_round):
        if isinstance(self.answer, BaseException):
            raise self.answer
        if self.answer == "hang":
            time.sleep(3)
        return self.answer


def test_every_bad_answer_is_this_nodes_failure_named_in_one_line():
    hook = hook_with(
        good=Answers(CheckResult("disk", ok=True)),
        silent=Answers(None),
        raises=Answers(OSError("no such device\nsecond line")),
        garbage=Answers({"ok": True}),
        hangs=Answers("hang"),
    )
    started = time.monotonic()
    results = {r.check: r for r in node_checks.run_checks(hook, round_of(timeout_s=1.0))}
    assert time.monotonic() - started < 5  # the hung check is not waited for past the deadline
    assert set(results) == {"disk", "raises", "garbage", "hangs"}  # None: nothing to say
    assert results["disk"].ok and results["disk"].seconds >= 0
    assert results["raises"].reason == "plugin 'raises' raised OSError: no such device"
    assert results["garbage"].reason == "plugin 'garbage' answered dict, not a CheckResult or None"
    assert results["hangs"].reason == "plugin 'hangs' did not finish within --node-check-timeout=1 s"
    assert not any(results[name].ok for name in ("raises", "garbage", "hangs"))


def test_the_decision_excludes_failed_blamed_and_silent_nodes_deterministically():
    reported = {
        0: ("n0", [CheckResult("network", ok=True, blamed={"2": "20 Mbit/s, median 9000 Mbit/s"})]),
        1: ("n1", [CheckResult("disk", ok=False, reason="/ckpt: 0.1 GiB free, below 1")]),
        2: ("n2", [CheckResult("network", ok=True)]),
    }
    decision = node_checks.decide(reported, 4, 30.0)
    assert decision.excluded == {
        1: "disk: /ckpt: 0.1 GiB free, below 1",
        2: "network (measured from group rank 0): 20 Mbit/s, median 9000 Mbit/s",
        3: "no node-check result within 30 s (its link or agent down?)",
    }
    assert node_checks.Decision.from_record(decision.record()) == decision
    assert node_checks.decide(dict(reversed(list(reported.items()))), 4, 30.0) == decision


@pytest.fixture
def store():
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30))


def client(server):
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=30))


def exchange_all(server, answers: dict[int, list[CheckResult]], world: int, timeout_s: float):
    """Every node of ``answers`` exchanges at once on its own thread; a rank not in it never comes."""
    decisions, errors = {}, []

    def node(rank):
        try:
            decisions[rank] = node_checks.exchange(round_of(client(server), rank, world, timeout_s), answers[rank])
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=node, args=(rank,)) for rank in answers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    return decisions


def test_every_node_reads_the_one_decision(store):
    answers = {
        0: [CheckResult("network", ok=True, blamed={2: "slow"})],
        1: [CheckResult("disk", ok=True)],
        2: [CheckResult("disk", ok=True)],
    }
    decisions = exchange_all(store, answers, 3, 5.0)
    assert {rank: d.excluded for rank, d in decisions.items()} == {
        r: {2: "network (measured from group rank 0): slow"} for r in range(3)
    }
    # the decider does not wait for the node its check blamed (the next test): node 2's host is
    # named when its report came before the decision, which a loaded machine can delay
    hosts = decisions[1].hosts
    assert (
        {0: "node0 (127.0.0.1)", 1: "node1 (127.0.0.1)"}.items()
        <= hosts.items()
        <= {
            **hosts,
            2: "node2 (127.0.0.1)",
        }.items()
    )


def test_a_node_that_never_reports_is_excluded_after_the_timeout_and_no_one_hangs(store):
    started = time.monotonic()
    decisions = exchange_all(store, {0: [CheckResult("disk", ok=True)], 1: [CheckResult("disk", ok=True)]}, 3, 1.0)
    waited = time.monotonic() - started
    assert set(decisions[0].excluded) == {2} and decisions[1] == decisions[0]
    assert waited < 1.0 + node_checks.EXCHANGE_MARGIN_S + 5, waited


def test_a_node_the_deciders_check_blamed_is_not_waited_for(store):
    started = time.monotonic()
    blames = [CheckResult("network", ok=True, blamed={2: "no answer: its link is down"})]
    decisions = exchange_all(store, {0: blames, 1: [CheckResult("network", ok=True)]}, 3, 20.0)
    assert set(decisions[1].excluded) == {2} and time.monotonic() - started < 10
