"""End to end: several agents on loopback form ONE job (c10d and static rendezvous, with and without torchrun).

Every worker checks in through a real gloo process group (``init_process_group("env://")``, so it
relies on MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE and TORCHELASTIC_USE_AGENT_STORE being right)
and does an all_reduce of ``rank + 1``; the sum over a world of 4 must be 10.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import free_port, write_script

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ALL_REDUCE = r"""
import datetime, json, os, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=90))
value = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(value)
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "LOCAL_WORLD_SIZE", "ROLE_RANK",
        "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"]
record = {k: os.environ[k] for k in keys}
record.update(agent=sys.argv[1], sum=value.item(), pg_rank=dist.get_rank(), pg_world=dist.get_world_size())
dist.barrier()
dist.destroy_process_group()
path = os.path.join(os.environ["FSM_E2E_OUT"], "allreduce_%s.json" % record["RANK"])
with open(path, "w") as f:
    json.dump(record, f)
"""


def check_one_job(launcher, agents: dict[str, int], nproc: int = 2) -> list[dict]:
    """The records of every worker; asserts they form one job of len(agents) * nproc ranks."""
    records = [json.loads(p.read_text()) for p in launcher.out.glob("allreduce_*.json")]
    world = len(agents) * nproc
    assert len(records) == world, records
    assert sorted(int(r["RANK"]) for r in records) == list(range(world))
    assert sorted(r["pg_rank"] for r in records) == list(range(world))
    for r in records:
        assert int(r["WORLD_SIZE"]) == r["pg_world"] == world
        assert r["GROUP_WORLD_SIZE"] == str(len(agents)) and r["LOCAL_WORLD_SIZE"] == str(nproc)
        assert r["ROLE_WORLD_SIZE"] == str(world) and r["ROLE_RANK"] == r["RANK"]
        assert r["sum"] == world * (world + 1) / 2
    assert len({(r["MASTER_ADDR"], r["MASTER_PORT"]) for r in records}) == 1
    assert len({r["TORCHELASTIC_RUN_ID"] for r in records}) == 1
    for agent in agents:
        mine = [r for r in records if r["agent"] == agent]
        assert sorted(r["LOCAL_RANK"] for r in mine) == [str(lr) for lr in range(nproc)]
        assert len({r["GROUP_RANK"] for r in mine}) == 1, f"{agent}'s workers disagree on GROUP_RANK"
        group_rank = int(mine[0]["GROUP_RANK"])
        assert sorted(int(r["RANK"]) for r in mine) == [group_rank * nproc + lr for lr in range(nproc)]
    assert sorted(int(r["GROUP_RANK"]) for r in records) == sorted(g for g in range(len(agents)) for _ in range(nproc))
    return records


def rdzv_flags(port: int, run_id: str, backend: str = "c10d") -> list[str]:
    return [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        backend,
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        run_id,
        "--local-addr",
        "127.0.0.1",
    ]


@pytest.mark.parametrize("backend", ["c10d", "fsm"])
def test_two_fsm_agents(launcher, backend):
    """torch's c10d rendezvous, and fsm-agent's own torch-free ``fsm`` backend."""
    script = write_script(launcher.dir, "all_reduce.py", ALL_REDUCE)
    flags = rdzv_flags(free_port(), "e2e-two-fsm", backend)
    a = launcher.fsm(*flags, script, "a")
    b = launcher.fsm(*flags, script, "b")
    a.wait().check()
    b.wait().check()
    records = check_one_job(launcher, {"a": 0, "b": 1})
    assert {r["TORCHELASTIC_RUN_ID"] for r in records} == {"e2e-two-fsm"}


def test_standalone_single_node_process_group(launcher):
    """--standalone: one agent, a real gloo group over its workers (whoever hosts their store)."""
    script = write_script(launcher.dir, "all_reduce.py", ALL_REDUCE)
    launcher.fsm("--standalone", "--nproc-per-node", "2", script, "solo").wait().check()
    records = [json.loads(p.read_text()) for p in launcher.out.glob("allreduce_*.json")]
    assert sorted(r["pg_rank"] for r in records) == [0, 1]
    assert all(r["sum"] == 3 and r["pg_world"] == 2 for r in records)


@pytest.mark.parametrize("first", ["fsm-agent", "torchrun"])
def test_fsm_agent_and_torchrun_form_one_job(launcher, first):
    """A mixed job: one fsm-agent and one real torchrun agent on the same c10d endpoint.

    The agent started first usually gets group rank 0 (torch orders nodes by address, then pid),
    so both orders run: fsm-agent hosting the workers' store for torchrun's workers, and the reverse.
    """
    script = write_script(launcher.dir, "all_reduce.py", ALL_REDUCE)
    flags = rdzv_flags(free_port(), "e2e-mixed")
    starters = {"fsm-agent": launcher.fsm, "torchrun": launcher.torchrun}
    second = "torchrun" if first == "fsm-agent" else "fsm-agent"
    procs = {name: starters[name](*flags, script, name) for name in (first, second)}
    for proc in procs.values():
        proc.wait().check()
    check_one_job(launcher, procs)


def test_two_fsm_agents_static(launcher):
    """Static rendezvous: --node-rank decides GROUP_RANK; the agents meet at --master-addr:--master-port."""
    script = write_script(launcher.dir, "all_reduce.py", ALL_REDUCE)
    port = free_port()
    common = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        "--local-addr",
        "127.0.0.1",
    ]
    # node 1 starts first, so the group ranks cannot come from the start order
    one = launcher.fsm(*common, "--node-rank", "1", script, "node1")
    zero = launcher.fsm(*common, "--node-rank", "0", script, "node0")
    zero.wait().check()
    one.wait().check()
    records = check_one_job(launcher, {"node0": 0, "node1": 1})
    for r in records:
        assert r["GROUP_RANK"] == r["agent"][-1]
