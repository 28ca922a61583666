"""The agent's own cost of one failure -> restart cycle, in process, without worker processes.

On the test kit's fakes (``fsm_agent.testing``: FakeRendezvous, FakeLauncher, which spawn nothing),
fire ``workers_failed`` (HEALTHY -> STOPPED: the failures built, the restart policy asked, the
transition recorded) then ``restart`` (STOPPED -> HEALTHY: rendezvous, ranks, the workers'
environment, start), N times; prints microseconds per cycle, best of 5. What a real restart costs
beyond this is the workers' processes (``benchmarks/run.py`` scenario b).

    python benchmarks/agent_cycle_cost.py 200
    PYTHONPATH=<a worktree of another commit> python benchmarks/agent_cycle_cost.py 200   # compare
"""

import logging
import sys
import time

from fsm_agent.testing.fakes import FakeLauncher, FakeRendezvous, Round
from fsm_agent.testing.scenario import build_agent


def main() -> None:
    logging.disable(logging.CRITICAL)
    cycles = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    per_cycle_us = []
    for _ in range(5):
        rendezvous = FakeRendezvous(rounds=[Round(rank=0, world_size=1)] * (cycles + 1))
        agent = build_agent(rendezvous, FakeLauncher(), max_restarts=cycles + 1, local_world_size=4)
        agent.fire("start")
        started = time.perf_counter()
        for _ in range(cycles):
            agent.fire("workers_failed", exits={1: 1})
            agent.fire("restart")
        per_cycle_us.append((time.perf_counter() - started) / cycles * 1e6)
        assert agent.restart_count == cycles, agent.restart_count
        agent.close()
    runs = ", ".join(f"{us:.0f}" for us in per_cycle_us)
    print(f"{min(per_cycle_us):.0f} us per workers_failed + restart cycle (best of 5; all: {runs})")


if __name__ == "__main__":
    main()
