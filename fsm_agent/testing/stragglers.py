"""A straggler job for tests of any rendezvous backend: real agents, real workers, one of them slow.

Two agents with two workers each (``--nproc-per-node 2``); every worker calls
``fsm_agent.heartbeat(step=N)`` once a step, and the worker whose ``RANK`` is ``SLOW_RANK``, or
whose ``LOCAL_RANK`` is ``SLOW_LOCAL_RANK`` (set for one agent only), sleeps ``SLOW_FACTOR`` times
longer, in the 4-worker world only (a job that went on without its node runs even). Global rank 3 runs on group rank 1 as local rank 1 with every backend (ranks are
``group_rank * nproc + local_rank``), so it is never on the judge's node.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

#: The straggler plugin's settings the tests use: a short window, a clear factor.
WINDOW_S, FACTOR, WINDOWS = 0.5, 2.0, 3
#: Judge windows allowed beyond WINDOWS before the slow rank must be found: one for the slow
#: agent's first publication, one for a window where the judge reads its previous entry again,
#: one for a publication missed under load.
MARGIN_WINDOWS = 3
STEP_S, SLOW_FACTOR = 0.03, 10

WORKER = f"""
    import os, sys, time
    import fsm_agent
    slow = os.environ["WORLD_SIZE"] == "4" and (os.environ["RANK"] == os.environ.get("SLOW_RANK") or
                                                os.environ["LOCAL_RANK"] == os.environ.get("SLOW_LOCAL_RANK"))
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 10**9
    open(f"started.{{os.environ['WORLD_SIZE']}}.{{os.environ['RANK']}}", "w").close()
    for step in range(1, steps + 1):
        time.sleep({STEP_S * SLOW_FACTOR} if slow else {STEP_S})
        fsm_agent.heartbeat(step=step)
"""


#: A lockstep job (DDP's shape): every step computes, then all ranks meet in a gloo all_reduce, so
#: all advance together and only the compute time that ``fsm_agent.compute()`` reports differs.
LOCKSTEP_WORKER = f"""
    import os, sys, time
    import torch, torch.distributed as dist
    import fsm_agent
    dist.init_process_group("gloo")
    slow = os.environ["RANK"] == os.environ.get("SLOW_RANK")
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 10**9
    grad = torch.ones(4)
    for step in range(1, steps + 1):
        with fsm_agent.compute():  # forward/backward: the part before the collective
            time.sleep({STEP_S * SLOW_FACTOR} if slow else {STEP_S})
        dist.all_reduce(grad)  # every rank waits here for the slowest
        fsm_agent.heartbeat(step=step)
    dist.destroy_process_group()
"""


def write_worker(directory: Path, lockstep: bool = False) -> str:
    """Write the worker script (``LOCKSTEP_WORKER`` with ``lockstep``) into ``directory``; its path."""
    path = Path(directory) / ("lockstep_worker.py" if lockstep else "straggler_worker.py")
    path.write_text(textwrap.dedent(LOCKSTEP_WORKER if lockstep else WORKER))
    return str(path)


def straggler_flags(*extra: str) -> list[str]:
    """Two workers per agent and the straggler plugin on, with the settings above."""
    return [
        "--nproc-per-node",
        "2",
        "--straggler-window",
        str(WINDOW_S),
        "--straggler-factor",
        str(FACTOR),
        "--straggler-windows",
        str(WINDOWS),
        *extra,
    ]


def events(path: Path, kind: str) -> list[dict[str, Any]]:
    """The records of ``kind`` in the events file ``path`` (none while it does not exist). The
    agent may be writing it: only complete lines count (a record ends with its newline)."""
    path = Path(path)
    if not path.exists():
        return []
    complete = path.read_text().split("\n")[:-1]  # the last piece: empty, or a line being written
    return [e for e in map(json.loads, filter(str.strip, complete)) if e["kind"] == kind]


def check_found(*paths: Path, basis: str = "step") -> dict[str, Any]:
    """The one ``straggler`` record in the events files ``paths``, checked: global rank 3 (node
    rank 1, local rank 1), a factor above FACTOR, found by group rank 0 within WINDOWS +
    MARGIN_WINDOWS windows of its first step time, judged on ``basis``."""
    found = [e for path in paths for e in events(path, "straggler")]
    assert len(found) == 1, found  # once per episode, by the judge alone
    (record,) = found
    assert (record["global_rank"], record["local_rank"], record["node_rank"]) == (3, 1, 1), record
    assert record["host"] and record["factor"] > FACTOR and record["windows"] == WINDOWS, record
    assert record["window"] - record["since_window"] + 1 <= WINDOWS + MARGIN_WINDOWS, record
    assert record["group_rank"] == 0 and record["basis"] == basis, record
    return record
