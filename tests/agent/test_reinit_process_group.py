"""A worker that destroys and re-creates its process group (#39.1), on two agents on loopback.

``init_process_group`` -> ``all_reduce`` -> ``destroy_process_group``, three times, as evaluation
loops and Megatron's re-initialization do (pytorch #114585, Megatron-LM #686). torch names the
default group "0" again after a destroy, so a store that outlives the group (an agent-hosted one,
torchrun's default) hands the second group the first one's gloo addresses: "Connection refused"
or a hang; a store re-created by rank 0 races with the old one when rank 0 destroys late (a
rank > 0 re-initializes against rank 0's previous server, which then closes). Here the workers'
rank 0 hosts the store and keeps it for every later group, each under a key prefix of its own
(fsm_agent/pg_generations.py), on every backend and both launchers; rank 0 destroys each group a
second late, which failed every time before. Across network namespaces: ``test_reinit_process_group_netns.py``.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import free_port, write_script

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TIMES = 3

REINIT = r"""
import datetime, json, os, sys, time
import torch
import torch.distributed as dist

sums = []
for _ in range(TIMES):
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=60))
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    sums.append(value.item())
    dist.barrier()
    if dist.get_rank() == 0:
        time.sleep(1.0)  # rank 0 destroys late: the others re-initialize while its store still runs
    dist.destroy_process_group()
with open(os.path.join(os.environ["FSM_E2E_OUT"], "reinit_%s.json" % os.environ["RANK"]), "w") as f:
    json.dump({"sums": sums, "store": os.environ["TORCHELASTIC_USE_AGENT_STORE"],
               "pythonpath": os.environ.get("PYTHONPATH"), "path": sys.path}, f)
""".replace("TIMES", str(TIMES))


def two_node_flags(backend: str, port: int, node: int) -> list[str]:
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--local-addr", "127.0.0.1", "--max-restarts", "0"]
    if backend == "static":
        return [*common, "--master-addr", "127.0.0.1", "--master-port", str(port), "--node-rank", str(node)]
    return [*common, "--rdzv-backend", backend, "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "reinit"]


@pytest.mark.parametrize("launcher_name", ["subprocess", "preload"])
@pytest.mark.parametrize("backend", ["c10d", "fsm", "static"])
def test_a_worker_re_creates_its_process_group(launcher, backend, launcher_name):
    script = write_script(launcher.dir, "reinit.py", REINIT)
    port = free_port()
    agents = [
        launcher.fsm(*two_node_flags(backend, port, node), "--launcher", launcher_name, script) for node in (0, 1)
    ]
    for agent in agents:
        agent.wait(180).check()
    records = [json.loads(p.read_text()) for p in sorted(launcher.out.glob("reinit_*.json"))]
    assert len(records) == 4, records
    # every group of every init is the whole world of 4: 1 + 2 + 3 + 4
    assert all(r["sums"] == [10.0] * TIMES for r in records), records
    assert {r["store"] for r in records} == {"False"}
    # the start-up hook of subprocess workers left neither PYTHONPATH nor sys.path changed
    assert not any("_worker_site" in str(r["pythonpath"]) + str(r["path"]) for r in records), records
