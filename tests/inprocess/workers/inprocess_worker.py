"""A worker of the in-process restart tests: a tiny deterministic model trained with ``inprocess.run``.

``python inprocess_worker.py OUT STEPS [FAULT RANK STEP]``. Each step all-reduces gradients that
depend only on (rank, step) and subtracts half their sum from four float64 parameters: every value
is exact, so any run that completes ``STEPS`` steps ends with :func:`reference_params`. The worker
appends ``<pid> <step>`` to ``OUT/steps-rank<R>.txt`` for each step it completed, a JSON line per
call of ``train_fn`` to ``OUT/generations-rank<R>.jsonl`` and, at the end, ``OUT/result-rank<R>-<pid>.json``.

FAULT (once per job: the marker file ``OUT/fault-done``), on rank RANK before step STEP:
``raise`` (a ``ValueError``, this rank's own fault), ``kill`` (SIGKILL to itself), ``again``
(``raise`` in every process of that rank that reaches the step: its replacement fails at once) or ``busy``
(``raise``, while every other rank, before that step of generation 0, loops in Python for
:data:`BUSY_S` seconds and no collective tells it of the fault: only the watcher's interrupt ends
the loop) or ``deferred`` (``raise``, while every other rank waits inside ``uninterrupted()``
until its watcher saw the next generation begin, then notes ``block-done`` in
``OUT/deferred-rank<R>.txt``; the interrupt comes as the block ends: ``after-block`` is never
written).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from fsm_agent import inprocess

#: Seconds of each step's "compute": a fault lands mid-run, not at the end.
STEP_S = 0.02
#: Seconds the other ranks loop in Python at a ``busy`` fault (far more than a test waits).
BUSY_S = 300.0


def grads(rank: int, step: int) -> torch.Tensor:
    return torch.tensor([rank + 1, step % 5, (rank * step) % 3, 1], dtype=torch.float64)


def reference_params(world_size: int, steps: int) -> list[float]:
    """The parameters of a fault-free run (sequential, exact)."""
    params = torch.zeros(4, dtype=torch.float64)
    for step in range(steps):
        params = params - 0.5 * sum(grads(rank, step) for rank in range(world_size))
    return params.tolist()


class State:
    """What survives a peer's fault in a surviving process's memory."""

    def __init__(self) -> None:
        self.params = torch.zeros(4, dtype=torch.float64)
        self.step = 0


def restore(state: State, replaced: tuple[int, ...]) -> None:
    """Everyone takes the state of the most advanced survivor (the lowest rank holding it)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    step = torch.tensor([-1 if rank in replaced else state.step])
    dist.all_reduce(step, op=dist.ReduceOp.MAX)
    source = torch.tensor([world if rank in replaced or state.step != int(step) else rank])
    dist.all_reduce(source, op=dist.ReduceOp.MIN)
    params = state.params.clone()
    dist.broadcast(params, int(source))
    with inprocess.uninterrupted():
        state.params, state.step = params, int(step)


def inject(fault: tuple[str, int, int], rank: int, step: int, generation: int, out: Path) -> None:
    kind, fault_rank, _ = fault
    if rank == fault_rank and kind == "again":
        raise ValueError(f"rank {rank}'s own fault at step {step}, in every process")
    if rank == fault_rank and not (out / "fault-done").exists():
        (out / "fault-done").touch()
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise ValueError(f"rank {rank}'s own fault at step {step}")
    if rank == fault_rank or generation > 0:
        return
    deadline = time.monotonic() + BUSY_S
    if kind == "busy":
        while time.monotonic() < deadline:  # Python runs between the sleeps: the interrupt lands
            time.sleep(0.01)
    if kind == "deferred":
        with inprocess.uninterrupted():
            while inprocess._WATCHER._begun < 1 and time.monotonic() < deadline:  # the watcher saw it
                time.sleep(0.01)
            note(out, rank, "block-done")
        note(out, rank, "after-block")


def note(out: Path, rank: int, what: str) -> None:
    with open(out / f"deferred-rank{rank}.txt", "a") as f:
        f.write(what + "\n")


def train(state: State, steps: int, out: Path, fault: tuple[str, int, int] | None) -> dict:
    rank = dist.get_rank()
    gen = inprocess.context()
    record = {"pid": os.getpid(), "generation": gen.generation, "replaced": list(gen.replaced)}
    record["attempt"] = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    record |= {"is_replacement": gen.is_replacement, "step": state.step, "entered_at": time.time()}
    with open(out / f"generations-rank{rank}.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    if gen.replaced:
        restore(state, gen.replaced)
    while state.step < steps:
        if fault is not None and fault[2] == state.step:
            inject(fault, rank, state.step, gen.generation, out)
        reduced = grads(rank, state.step)
        dist.all_reduce(reduced)
        time.sleep(STEP_S)
        with inprocess.uninterrupted():  # the update, the step and its record: all or nothing
            state.params, state.step = state.params - 0.5 * reduced, state.step + 1
            with open(out / f"steps-rank{rank}.txt", "a") as f:
                f.write(f"{os.getpid()} {state.step - 1}\n")
    return {"pid": os.getpid(), "params": state.params.tolist(), "step": state.step}


def main() -> None:
    out, steps = Path(sys.argv[1]), int(sys.argv[2])
    fault = (sys.argv[3], int(sys.argv[4]), int(sys.argv[5])) if len(sys.argv) > 3 else None
    result = inprocess.run(train, State(), steps, out, fault, backend="gloo")
    (out / f"result-rank{os.environ['RANK']}-{os.getpid()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
