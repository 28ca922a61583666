"""The fault catalogue of the attribution suite (issue #35), each kind with its ground truth.

A ``Fault`` says how it is injected (the worker's environment for ``tests/fixtures/fault_worker.py``
and/or an ``Action`` the harness does to a process from outside), the job's shape (nodes, processes
per node), the agent flags it needs, and the ground truth: the global ranks that ARE the root cause.
The ground truths were written down here from the injection alone, before any launcher's output was
looked at. Where the harness takes a whole node (its agent killed, stopped or signalled), the truth
is that node's ranks: ``truth_node`` names the node (the harness's start order, 0 first), and the
harness reads which ranks its workers had from their own reports (torchrun's c10d rendezvous does
not follow ``--node-rank``); ``truth`` gives them as fsm-agent's ``--node-rank`` order assigns them.

Importable from the tests and from ``benchmarks/attribution.py``; nothing here starts a process.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: ``--hang-timeout`` for the kinds whose fault is a hang; below the process group's timeout, which
#: those kinds raise (``HANG_PG_TIMEOUT_S``) so that the hang detector, not gloo, ends the run.
HANG_TIMEOUT_S = 3
HANG_PG_TIMEOUT_S = 60


@dataclass(frozen=True)
class Action:
    """What the harness does from outside once the trigger is seen.

    what: ``kill_agent`` (SIGKILL the agent of ``node`` and every process under it at once: a
        machine lost; torchrun's workers would outlive their agent otherwise), ``stop_node`` (SIGSTOP
        the agent of ``node`` and every process under it: a machine frozen; SIGKILLed once the
        others ended), ``signal_agent`` (send ``signal`` to the agent of ``node``: the node
        preempted), ``signal_worker`` (send ``signal`` to the worker of global rank ``rank``).
    The trigger: every worker of the target node (or the target rank) has reached ``FAULT_STEP``.
    """

    what: str
    node: int | None = None
    rank: int | None = None
    signal: str = "SIGKILL"


@dataclass(frozen=True)
class Fault:
    name: str
    description: str
    truth: frozenset[int]
    nnodes: int = 2
    nproc: int = 1
    #: FAULT_KIND for the worker ("none": the worker trains normally, the harness injects)
    worker_kind: str = "none"
    action: Action | None = None
    #: the node whose ranks are the truth (harness actions on a node); None: ``truth`` as it is
    truth_node: int | None = None
    #: flags for ``fsm-agent run`` beyond the common ones (torchrun has none of these)
    agent_flags: tuple[str, ...] = ()
    #: flags for one node's ``fsm-agent run`` after ``agent_flags`` (``{node: flags}``; a later flag wins)
    node_agent_flags: dict[int, tuple[str, ...]] = field(default_factory=dict)
    #: extra worker environment (FAULT_PG_TIMEOUT_S, FAULT_STEP_S...)
    env: dict[str, str] = field(default_factory=dict)
    #: a real report or the issue the kind comes from
    source: str = "issue #35"

    @property
    def world(self) -> int:
        return self.nnodes * self.nproc

    @property
    def worker_ranks(self) -> tuple[int, ...]:
        """The ranks the worker faults itself (FAULT_RANKS): the truth, unless the harness injects."""
        return tuple(sorted(self.truth)) if self.worker_kind != "none" else ()


HANG = {"FAULT_PG_TIMEOUT_S": str(HANG_PG_TIMEOUT_S)}
HANG_FLAGS = (
    "--hang-timeout",
    str(HANG_TIMEOUT_S),
    "--redirects",
    "2",
)  # stderr in a file: the stacks dump lands there
#: a lost node ends the job (with a fixed --nnodes fsm-agent would wait for it to come back; torchrun
#: fails when its workers do)
NODE_FLAGS = ("--restart-budgets", "node_lost=0")
#: harness-injected kinds: steps of 0.2 s, so the job still trains when the harness strikes
SLOW_STEPS = {"FAULT_STEP_S": "0.2", "FAULT_STEP": "3"}

CATALOGUE: tuple[Fault, ...] = (
    Fault(
        "exception",
        "an uncaught RuntimeError on one rank at step 5; the others wait for it in the all_reduce",
        frozenset({2}),
        nproc=2,
        worker_kind="exception",
    ),
    Fault("exit_code", "sys.exit(3) on one rank", frozenset({1}), worker_kind="exit_code"),
    Fault(
        "sigsegv",
        "a real invalid memory read (ctypes.string_at(0)): SIGSEGV, no Python traceback",
        frozenset({3}),
        nproc=2,
        worker_kind="sigsegv",
        source="issue #35; segfaults in extension code",
    ),
    Fault(
        "sigabrt",
        "os.abort() on rank 0 (a C++ assertion, std::terminate): SIGABRT on the store host's node",
        frozenset({0}),
        worker_kind="sigabrt",
    ),
    Fault(
        "oom_sigkill",
        "SIGKILL of one worker by itself, as the kernel's OOM killer does (no traceback, no error file)",
        frozenset({1}),
        nnodes=3,
        worker_kind="sigkill",
        source="issue #35; OOM kills, the commonest real crash",
    ),
    Fault(
        "hang_in_collective",
        "one rank blocks in a torch.distributed call no peer answers (recv, as a rank stuck in NCCL on a "
        "bad link); the others wait in their all_reduce; found by --hang-timeout",
        frozenset({1}),
        nproc=2,
        worker_kind="hang_in_collective",
        agent_flags=HANG_FLAGS,
        env=HANG,
    ),
    Fault(
        "hang_busy",
        "one rank spins in a Python busy loop outside any collective (no heartbeat); the others wait in "
        "their all_reduce; found by --hang-timeout",
        frozenset({2}),
        nproc=2,
        worker_kind="hang_busy",
        agent_flags=HANG_FLAGS,
        env=HANG,
    ),
    Fault(
        "slow_rank",
        "one rank is slow (sleeps past the 5 s process-group timeout): its PEERS' all_reduce times out "
        "first and they fail; the slow rank fails later in the broken group",
        frozenset({1}),
        worker_kind="slow",
        source="issue #35; the classic misattribution: the first failure is a victim",
    ),
    Fault(
        "node_lost",
        "node 1 is lost while the job trains: its agent and workers SIGKILLed at once (a machine gone)",
        frozenset({2, 3}),
        nproc=2,
        action=Action("kill_agent", node=1),
        truth_node=1,
        agent_flags=NODE_FLAGS,
        env=SLOW_STEPS,
    ),
    Fault(
        "store_host_lost",
        "node 0, the rendezvous store's host, is lost while the job trains (agent and workers SIGKILLed)",
        frozenset({0}),
        nnodes=3,
        action=Action("kill_agent", node=0),
        truth_node=0,
        agent_flags=NODE_FLAGS,
        env=SLOW_STEPS,
    ),
    Fault(
        "node_frozen",
        "node 2 freezes (SIGSTOP of its agent and every process under it: a host hung in the kernel, "
        "a dead NIC); the others' all_reduce times out",
        frozenset({2}),
        nnodes=4,
        action=Action("stop_node", node=2),
        truth_node=2,
        agent_flags=NODE_FLAGS,
        env=SLOW_STEPS,
        source="issue #35; hosts that hang rather than die",
    ),
    Fault(
        "node_preempted",
        "the agent of node 1 gets SIGTERM (preemption, scancel of one node): it stops its workers; the "
        "other node's workers lose their peer",
        frozenset({1}),
        action=Action("signal_agent", node=1, signal="SIGTERM"),
        truth_node=1,
        agent_flags=NODE_FLAGS,
        env=SLOW_STEPS,
    ),
    Fault(
        "two_faults",
        "two ranks on different nodes raise 100 ms apart; both are root causes",
        frozenset({1, 2}),
        nproc=2,
        worker_kind="two_faults",
    ),
    Fault(
        "init_fault",
        "one rank raises while its peers are blocked in init_process_group (the process group's rendezvous)",
        frozenset({1}),
        worker_kind="init_fault",
    ),
    Fault(
        "import_error",
        "an ImportError (a missing module) on one rank before init_process_group",
        frozenset({3}),
        nproc=2,
        worker_kind="import_error",
        source="issue #35; a package missing on one node",
    ),
    Fault(
        "exit_barrier",
        "every rank finishes training; then one rank exits 5 while the others' agents wait in the exit barrier",
        frozenset({1}),
        worker_kind="exit_barrier",
    ),
    Fault(
        "disk_full",
        "ENOSPC while one rank writes its checkpoint (torch.save to /dev/full: every write fails, errno 28)",
        frozenset({0}),
        nproc=2,
        worker_kind="disk_full",
        source="issue #35; checkpoint writes on a full disk",
    ),
    Fault(
        "early_exit_0",
        "one rank exits 0 at step 5 (a wrong 'done' condition) while its peers wait for it in the all_reduce",
        frozenset({1}),
        worker_kind="early_exit_0",
        source="issue #35; the root cause 'succeeded'",
    ),
    Fault(
        "dataloader_error",
        "a ValueError in a DataLoader worker child (a corrupt sample), re-raised in the rank's main process",
        frozenset({2}),
        nproc=2,
        worker_kind="dataloader_error",
    ),
    Fault(
        "deadlock",
        "two ranks on different nodes each wait to receive from the other first; the rest wait in the "
        "all_reduce; found by --hang-timeout",
        frozenset({1, 2}),
        nproc=2,
        worker_kind="deadlock",
        agent_flags=HANG_FLAGS,
        env=HANG,
    ),
    Fault(
        "memory_error",
        "a Python MemoryError (a failed allocation) on one rank",
        frozenset({1}),
        worker_kind="memory_error",
    ),
    Fault(
        "sigterm_worker",
        "SIGTERM to one worker from outside (an admin's kill, a node daemon), not through its agent",
        frozenset({1}),
        nproc=2,
        action=Action("signal_worker", rank=1, signal="SIGTERM"),
        env=SLOW_STEPS,
    ),
    Fault(
        "thread_os_exit",
        "os._exit(1) from a background thread of one rank (a watchdog, a logger): no traceback",
        frozenset({2}),
        nproc=2,
        worker_kind="thread_os_exit",
    ),
    Fault(
        "exception_4_nodes",
        "an uncaught exception on the last rank of a 4-node job (the root cause is far from the store host)",
        frozenset({3}),
        nnodes=4,
        worker_kind="exception",
    ),
)

BY_NAME: dict[str, Fault] = {f.name: f for f in CATALOGUE}


def get(name: str) -> Fault:
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"no fault kind {name!r}; known: {', '.join(BY_NAME)}") from None
