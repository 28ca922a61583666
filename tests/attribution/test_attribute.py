"""The attributor (``fsm_agent.attribution``) on reports as agents make them: the root cause is the
first failure of a rank's own; a peer's failure seen from elsewhere is collateral; when every
failure is collateral, the ranks that had not failed are blamed; site rules come first; the verdict
does not depend on the order the reports arrive in."""

from __future__ import annotations

import signal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsm_agent.attribution import (
    COLLATERAL,
    OWN,
    ROOT_CAUSE,
    UNKNOWN,
    FailureReport,
    Verdict,
    attribute,
    builtin_class,
    rank_spans,
    waits_in_collective,
)

pytestmark = pytest.mark.unit

CLOSED = (
    "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
    "by peer [127.0.0.1]:23987. This is typically caused by a remote worker crashing."
)
TIMEOUT = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Timed out waiting 5000ms for recv operation to complete"
NCCL = "torch.distributed.DistBackendError: [Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9)"
STACK_IN_ALL_REDUCE = """Thread 0x00007f (most recent call first):
  File "/usr/lib/python3/site-packages/torch/distributed/distributed_c10d.py", line 3252 in all_reduce
  File "/job/train.py", line 40 in step
  File "/job/train.py", line 60 in main"""
STACK_IN_LOOP = """Thread 0x00007f (most recent call first):
  File "/job/train.py", line 31 in compute
  File "/job/train.py", line 40 in step
  File "/job/train.py", line 60 in main"""


def report(rank, t, message="", exitcode=1, **fields):
    return FailureReport(global_rank=rank, time=t, message=message, exitcode=exitcode, **fields)


def test_the_rank_that_raised_is_the_root_cause_and_its_peers_collateral():
    verdict = attribute(
        [report(0, 10.2, CLOSED), report(1, 10.0, "RuntimeError: injected fault"), report(2, 10.3, CLOSED)], 4
    )
    assert verdict.root_causes == (1,)
    assert verdict.classes == {0: COLLATERAL, 1: ROOT_CAUSE, 2: COLLATERAL}
    assert verdict.exit_code == 1
    assert verdict.summary == ("rank 1: RuntimeError: injected fault; collateral: ranks 0, 2 failed because of it")


def test_the_root_cause_is_named_even_when_a_collateral_failure_was_seen_first():
    # the exit a node notices first is often a peer's "Connection closed": torch would name it
    verdict = attribute([report(0, 9.0, CLOSED), report(1, 10.0, "ValueError: loss is nan")], 2)
    assert verdict.root_causes == (1,)
    assert verdict.classes[0] == COLLATERAL


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGSEGV, 139), (signal.SIGABRT, 134), (signal.SIGKILL, 137)])
def test_a_death_by_signal_is_the_ranks_own_and_sets_the_exit_code(sig, code):
    verdict = attribute([report(2, 5.0, exitcode=-sig), report(0, 5.1, TIMEOUT)], 4)
    assert verdict.root_causes == (2,)
    assert verdict.exit_code == code
    assert f"killed by {sig.name}" in verdict.summary


def test_two_independent_faults_are_both_root_causes_the_first_first():
    verdict = attribute(
        [report(3, 7.1, "OSError: [Errno 28] No space left"), report(1, 7.0, "exited with code 3", 3)], 4
    )
    assert verdict.root_causes == (1, 3)
    assert verdict.classes == {1: ROOT_CAUSE, 3: OWN}
    assert verdict.exit_code == 3


@pytest.mark.parametrize("message", [CLOSED, TIMEOUT, NCCL])
def test_peer_failure_signatures_are_collateral(message):
    assert builtin_class(report(0, 1.0, message)) == COLLATERAL


def test_when_every_failure_is_collateral_the_rank_that_had_not_failed_is_blamed():
    # rank 3 was slow (or hung outside a collective, or exited early): its peers timed out waiting
    verdict = attribute([report(0, 1.0, TIMEOUT), report(1, 1.0, TIMEOUT), report(2, 1.1, TIMEOUT)], 4)
    assert verdict.root_causes == (3,)
    assert verdict.classes == {0: COLLATERAL, 1: COLLATERAL, 2: COLLATERAL, 3: ROOT_CAUSE}
    assert verdict.exit_code == 1


def test_nothing_to_blame_is_unknown_not_a_guess():
    # half the ranks timed out, half still run: no one rank stands out
    verdict = attribute([report(0, 1.0, TIMEOUT)], 4)
    assert verdict.root_causes == ()
    assert verdict.classes == {0: UNKNOWN}
    assert verdict.summary.startswith("root cause unknown")


def test_a_lost_node_is_blamed_before_the_ranks_still_running():
    verdict = attribute([report(0, 1.0, CLOSED)], 4, unfailed_known={2: "its node was lost", 3: "its node was lost"})
    assert verdict.root_causes == (2, 3)
    assert verdict.reasons[2] == "its node was lost"


def test_a_hung_rank_waiting_in_a_collective_is_collateral_one_hung_elsewhere_is_the_cause():
    hung = dict(failure_class="hang", exitcode=124)
    waiting = report(0, 3.0, "hang: no heartbeat for 5s", tail=STACK_IN_ALL_REDUCE, **hung)
    looping = report(1, 3.0, "hang: no heartbeat for 5s", tail=STACK_IN_LOOP, **hung)
    assert waits_in_collective(STACK_IN_ALL_REDUCE) and not waits_in_collective(STACK_IN_LOOP)
    verdict = attribute([waiting, looping], 2)
    assert verdict.root_causes == (1,)
    assert verdict.classes[0] == COLLATERAL


def test_a_site_rule_comes_first_and_changes_the_verdict():
    reports = [
        report(0, 1.0, "RuntimeError: CUDA error: an illegal memory access"),
        report(1, 1.5, "exited with code 2", 2),
    ]
    assert attribute(reports, 2).root_causes == (0, 1)

    def site_rule(r):  # this site knows the illegal access follows a peer's ECC error: collateral
        return COLLATERAL if "illegal memory access" in r.message else None

    verdict = attribute(reports, 2, site_rule)
    assert verdict.root_causes == (1,)
    assert verdict.classes[0] == COLLATERAL


def test_a_rule_that_answers_garbage_is_named():
    with pytest.raises(ValueError, match="a failure rule answered 'maybe' for rank 0"):
        attribute([report(0, 1.0)], 1, lambda r: "maybe")


def test_a_rank_reported_twice_keeps_its_earliest_failure():
    verdict = attribute([report(1, 5.0, CLOSED), report(1, 4.0, "RuntimeError: first")], 2)
    assert verdict.root_causes == (1,)


def test_records_round_trip_and_tolerate_newer_fields():
    verdict = attribute([report(1, 1.0, "RuntimeError: x"), report(0, 1.1, CLOSED)], 2)
    assert Verdict.from_record(verdict.record()) == verdict
    r = report(1, 1.0, "x", hostname="n1", group_rank=1)
    assert FailureReport.from_record({**r.record(), "added_later": 1}) == r


def test_rank_spans_keep_a_thousand_ranks_one_short_line():
    assert rank_spans([5, 0, 1, 2, 7, 8]) == "0-2, 5, 7-8"
    assert rank_spans(range(1000)) == "0-999"


_messages = st.sampled_from([CLOSED, TIMEOUT, NCCL, "RuntimeError: boom", "exited with code 3", ""])
_reports = st.lists(
    st.builds(
        report,
        rank=st.integers(0, 7),
        t=st.floats(0, 100, allow_nan=False),
        message=_messages,
        exitcode=st.sampled_from([1, 3, -9, -11]),
    ),
    max_size=8,
    unique_by=lambda r: r.global_rank,
)


@pytest.mark.property
@settings(max_examples=200, deadline=None)
@given(reports=_reports, order=st.randoms())
def test_the_verdict_does_not_depend_on_the_order_reports_arrive(reports, order):
    shuffled = list(reports)
    order.shuffle(shuffled)
    first, second = attribute(reports, 8), attribute(shuffled, 8)
    assert first == second
    # every failed rank is classed; a root cause is a failed rank or one that had not failed
    assert {r.global_rank for r in reports} <= set(first.classes)
    assert set(first.root_causes) <= set(first.classes)
    if any(builtin_class(r) == OWN for r in reports):
        assert first.root_causes and first.classes[first.root_causes[0]] == ROOT_CAUSE


def _dump(*frames: tuple[str, str]) -> str:
    """A faulthandler dump of the main thread, innermost frame first."""
    lines = [f'  File "{path}", line 1 in {func}' for path, func in frames]
    return "Fatal Python error: Aborted\n\nCurrent thread 0x00007f (most recent call first):\n" + "\n".join(lines)


C10D = "/venv/site-packages/torch/distributed/distributed_c10d.py"
IN_ALL_REDUCE = _dump(
    (C10D, "all_reduce"), ("/venv/site-packages/torch/distributed/c10d_logger.py", "wrapper"), ("/job/train.py", "main")
)
IN_RECV = _dump((C10D, "recv"), ("/job/train.py", "main"))
IN_ERROR_HANDLER = _dump(
    ("/usr/lib/python3.11/traceback.py", "format_exc"),
    ("/venv/site-packages/torch/distributed/elastic/multiprocessing/errors/error_handler.py", "record_exception"),
    ("/job/train.py", "<module>"),
)


def hung(rank, stacks):
    return report(rank, 3.0, "hang: no heartbeat for 3s", exitcode=124, failure_class="hang", tail=stacks)


def test_the_rank_hung_in_another_op_than_its_peers_is_the_root_cause():
    # rank 1 waits in a recv nobody sends; ranks 0, 2, 3 wait for it in all_reduce
    verdict = attribute([hung(0, IN_ALL_REDUCE), hung(1, IN_RECV), hung(2, IN_ALL_REDUCE), hung(3, IN_ALL_REDUCE)], 4)
    assert verdict.root_causes == (1,)
    assert verdict.reasons[1] == "hung in recv while its peers waited in another op for it"


def test_a_tie_blames_the_point_to_point_ops():
    # a deadlock: ranks 1 and 2 each receive first, ranks 0 and 3 wait in all_reduce
    verdict = attribute([hung(0, IN_ALL_REDUCE), hung(1, IN_RECV), hung(2, IN_RECV), hung(3, IN_ALL_REDUCE)], 4)
    assert verdict.root_causes == (1, 2)


def test_a_hung_rank_caught_reporting_an_error_was_failing_because_of_a_peer():
    assert builtin_class(hung(3, IN_ERROR_HANDLER)) == COLLATERAL
    assert builtin_class(hung(2, STACK_IN_LOOP)) == OWN


def test_a_slow_rank_that_failed_after_its_peers_gave_up_is_the_root_cause():
    verdict = attribute([report(0, 10.0, TIMEOUT), report(2, 10.1, TIMEOUT), report(1, 14.0, CLOSED)], 3)
    assert verdict.root_causes == (1,)
    assert verdict.classes == {0: COLLATERAL, 1: ROOT_CAUSE, 2: COLLATERAL}


def test_a_users_own_network_error_is_its_own_fault_not_a_peers():
    # a Redis client in the training script: nothing of torch.distributed in the traceback
    redis = report(
        3, 1.0, "ConnectionRefusedError: [Errno 111] Connection refused", tail='File "/job/cache.py", line 9'
    )
    assert builtin_class(redis) == OWN
    store = report(1, 1.0, "RuntimeError: Connection refused", tail='File "/venv/torch/distributed/rendezvous.py"')
    assert builtin_class(store) == COLLATERAL


def test_an_nccl_watchdog_abort_is_a_peers_failure_seen_from_here():
    # NCCL's watchdog SIGABRTs the rank whose collective timed out waiting for a hung peer
    aborted = report(0, 1.0, "Signal 6 (SIGABRT) received", exitcode=-signal.SIGABRT, tail=NCCL)
    assert builtin_class(aborted) == COLLATERAL
    assert builtin_class(report(0, 1.0, "Signal 6 (SIGABRT) received", exitcode=-signal.SIGABRT)) == OWN
