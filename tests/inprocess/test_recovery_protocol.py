"""The in-process protocol's decisions on a real TCPStore (loopback), without worker processes:
the worker side's barrier (ranks as threads: it only talks to the store), the agent side's look at
a recovery, and the restart policy's answer about class ``inprocess``.

* a newer generation that begins as a barrier completes never splits the ranks: they all enter
  the completed one, or all leave it (one ``compare_set`` decides);
* the agent reports a recovery recovered, failed at its deadline, failed at once when abandoned
  (a step that could not replace a worker), and keeps waiting, not failing, while its store is
  unreachable before the deadline (the lost host's membership change decides that case);
* the restart policy refuses in process for the do-not-restart exit code, a class that takes the
  node out, and a spent ``inprocess`` budget.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from datetime import timedelta

import attrs
import pytest
from torch.distributed import PrefixStore, TCPStore

from fsm_agent import inprocess
from fsm_agent.inprocess import protocol
from fsm_agent.inprocess.recovery import InProcessRecovery
from fsm_agent.plugins.restart_policy import DO_NOT_RESTART_EXIT_CODE, RestartPolicy
from fsm_agent.states.facts import InProcessFailed, InProcessRecovered
from fsm_agent.worker import FailureClass, WorkerFailure

pytestmark = pytest.mark.unit

PREFIX = protocol.attempt_prefix("run", 0)


@pytest.fixture
def server():
    store = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)
    yield store
    del store


def client(server, prefix: str = PREFIX):
    return PrefixStore(prefix, TCPStore("127.0.0.1", server.port, None, False, timedelta(seconds=10)))


def job(server, rank: int, world_size: int):
    return inprocess._Job(
        store=client(server),
        address=("127.0.0.1", server.port),
        prefix=PREFIX,
        rank=rank,
        world_size=world_size,
        timeout_s=10.0,
        started_in=0,
    )


@pytest.mark.parametrize("delay_s", [0.0, 0.01, 0.03, 0.06])
def test_a_generation_begun_as_the_barrier_completes_never_splits_the_ranks(server, delay_s):
    agent, joined = client(server), {}
    agent.add(protocol.GENERATION, 1)

    def rank(r: int) -> None:
        joined[r] = inprocess._join(job(server, r, 3), 1, 10.0)

    waiting = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for thread in waiting:
        thread.start()
    time.sleep(0.2)  # ranks 0 and 1 wait at generation 1's barrier
    last = threading.Thread(target=rank, args=(2,))
    last.start()  # the replacement arrives last and completes it ...
    while not agent.check([protocol.state_key(1)]):
        time.sleep(0.001)
    time.sleep(delay_s)
    agent.add(protocol.GENERATION, 1)  # ... just as another node's agent begins generation 2
    agent.set(protocol.begun_key(2), b"1")
    for thread in (*waiting, last):
        thread.join(20)
    assert len(set(joined.values())) == 1, joined  # everyone in the same generation
    assert agent.get(protocol.state_key(1)) == protocol.READY


def test_a_rank_that_leaves_for_a_newer_generation_abandons_the_old_one(server):
    agent, joined = client(server), {}
    agent.add(protocol.GENERATION, 1)
    first = threading.Thread(target=lambda: joined.update({0: inprocess._join(job(server, 0, 2), 1, 10.0)}))
    first.start()
    time.sleep(0.2)
    agent.add(protocol.GENERATION, 1)  # generation 2 begins before rank 1 arrived at 1
    first.join(1)  # rank 0 is now waiting at 2, having abandoned 1
    assert agent.get(protocol.state_key(1)) == protocol.ABANDONED
    joined[1] = inprocess._join(job(server, 1, 2), 1, 10.0)  # a late arrival at 1 follows it to 2
    first.join(20)
    assert joined == {0: 2, 1: 2}


def recovery_on(server, timeout_s: float = 5.0) -> InProcessRecovery:
    recovery = InProcessRecovery()
    recovery.enable(timeout_s)
    recovery.new_round("127.0.0.1", server.port, is_host=False)
    recovery.new_attempt("run", 0, world_size=2)
    return recovery


def test_the_agent_reports_a_completed_barrier_as_recovered(server):
    recovery = recovery_on(server)
    begun = recovery.begin({1: 1}, fault_at=time.time())
    assert recovery.look() is None
    client(server).compare_set(protocol.state_key(begun.generation), "", protocol.READY)
    fact = recovery.look()
    assert isinstance(fact, InProcessRecovered) and fact.generation == 1 and fact.replaced == {1: 1}
    assert recovery.current is None and fact.phases["total_s"] >= 0


def test_past_its_deadline_a_recovery_failed(server):
    recovery = recovery_on(server, timeout_s=0.2)
    recovery.begin({0: 0}, fault_at=time.time())
    time.sleep(0.3)
    fact = recovery.look()
    assert isinstance(fact, InProcessFailed) and "--inprocess-timeout" in fact.reason


def test_an_abandoned_recovery_fails_at_the_next_look(server):
    recovery = recovery_on(server)
    recovery.abandon({1: 3}, time.time(), "replacing local ranks [1] failed: RuntimeError: no zygote")
    fact = recovery.look()
    assert isinstance(fact, InProcessFailed) and "no zygote" in fact.reason and fact.replaced == {1: 3}


def test_an_unreachable_store_waits_for_the_deadline_not_fails_at_once(server):
    recovery = InProcessRecovery()
    recovery.enable(4.0)
    recovery.new_round("127.0.0.1", 1, is_host=False)  # nothing listens on port 1
    recovery.new_attempt("run", 0, world_size=2)
    recovery.abandon({}, time.time(), "")  # a recovery to look at; then undo its failure
    recovery.current.failure, recovery.current.deadline = None, time.monotonic() + 4.0
    assert recovery.look() is None  # one connect attempt (CONNECT_TIMEOUT_S), then noted
    started = time.monotonic()
    assert recovery.look() is None and time.monotonic() - started < 0.5  # not asked again
    time.sleep(max(0.0, recovery.current.deadline - time.monotonic()) + 0.1)
    fact = recovery.look()
    assert isinstance(fact, InProcessFailed) and "unreachable" in fact.reason, fact


def failure(exitcode: int) -> dict[int, WorkerFailure]:
    kind = FailureClass.SIGNAL if exitcode < 0 else FailureClass.EXIT_CODE
    worker = WorkerFailure(local_rank=1, global_rank=1, role_rank=1, pid=1, exitcode=exitcode, timestamp=0.0)
    return {1: attrs.evolve(worker, failure_class=kind)}


@pytest.mark.parametrize(
    "policy, failures, in_process",
    [
        (RestartPolicy(), failure(1), True),
        (RestartPolicy(), failure(DO_NOT_RESTART_EXIT_CODE), False),
        (RestartPolicy(exclude_node_on=("signal",)), failure(-9), False),
        (RestartPolicy(budgets={"inprocess": 0}), failure(1), False),
    ],
    ids=["exit-1", "do-not-restart", "excluded-class", "budget-spent"],
)
def test_the_policy_answers_class_inprocess(policy, failures, in_process):
    decision = policy.fsm_agent_restart_policy(failures, None, 0, FailureClass.INPROCESS)
    assert decision.in_process is in_process and decision.restart is in_process, decision


def test_enabling_it_imports_torch_distributed_in_the_background_before_any_round():
    """A hot spare takes a lost node's seat with ``torch.distributed`` already imported: every
    agent of that round waits for the slowest one's ``new_round`` (the import took 1 s or more
    there). In a fresh interpreter: enabled, no round, and the import still happens."""
    code = (
        "import sys, time\n"
        "from fsm_agent.inprocess.recovery import InProcessRecovery\n"
        "assert 'torch.distributed' not in sys.modules\n"
        "recovery = InProcessRecovery()\n"
        "recovery.enable(10.0)\n"
        "deadline = time.monotonic() + 120\n"
        "while 'torch.distributed' not in sys.modules:  # begun, with no round\n"
        "    assert time.monotonic() < deadline, 'not imported'\n"
        "    time.sleep(0.05)\n"
        "recovery.close()  # waits for the import to end\n"
        "import torch.distributed\n"
        "assert callable(torch.distributed.init_process_group)\n"
        "print('imported')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0 and done.stdout.strip() == "imported", done.stderr[-2000:]
