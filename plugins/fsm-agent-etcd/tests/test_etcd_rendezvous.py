"""Real agents (``fsm-agent run --rdzv-backend etcd-v3``) meeting through a real etcd."""

from __future__ import annotations

import pickle
import textwrap
import time
import uuid

import pytest

pytestmark = pytest.mark.slow

ALL_REDUCE = """
    import os, time
    world = int(os.environ["WORLD_SIZE"])
    wanted = int(os.environ["WANTED_WORLD_SIZE"])
    tag = f"{os.environ['GROUP_RANK']}_{os.environ['LOCAL_RANK']}_{world}_{os.getpid()}"
    open(f"started_{tag}", "w").close()
    if world < wanted:
        time.sleep(120)  # the agent restarts us when the bigger group forms
        raise SystemExit(3)
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.tensor([float(os.environ["RANK"]) + 1])
    dist.all_reduce(t)
    with open(f"sum_{os.environ['RANK']}", "w") as f:
        f.write(repr(t.item()))
    dist.destroy_process_group()
"""


def write_script(tmp_path) -> str:
    path = tmp_path / "all_reduce.py"
    path.write_text(textwrap.dedent(ALL_REDUCE))
    return str(path)


def agent_args(etcd_server, run_id: str, nnodes: str, events) -> list[str]:
    return [
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "etcd-v3",
        "--rdzv-endpoint",
        etcd_server.endpoint,
        "--rdzv-id",
        run_id,
        "--local-addr",
        "127.0.0.1",
        "--monitor-interval",
        "0.2",
        "--rdzv-conf",
        "last_call_timeout=1,join_timeout=120",
        "--events-file",
        str(events),
    ]


def sums(tmp_path, world: int) -> list[float]:
    return [float((tmp_path / f"sum_{rank}").read_text()) for rank in range(world)]


def test_two_agents_form_one_job_through_etcd(tmp_path, agents, etcd_server):
    run_id = f"pair-{uuid.uuid4().hex[:8]}"
    script = write_script(tmp_path)
    env = {"WANTED_WORLD_SIZE": "4"}
    a = agents.start(*agent_args(etcd_server, run_id, "2", tmp_path / "a.jsonl"), script, env=env)
    b = agents.start(*agent_args(etcd_server, run_id, "2", tmp_path / "b.jsonl"), script, env=env)
    out_a, err_a = a.communicate(timeout=180)
    out_b, err_b = b.communicate(timeout=180)
    assert (a.returncode, b.returncode) == (0, 0), err_a[-3000:] + err_b[-3000:]
    assert sums(tmp_path, 4) == [10.0] * 4  # 1+2+3+4: one gloo group of four workers over two agents

    for name in ("a.jsonl", "b.jsonl"):
        assert agents.transitions(tmp_path / name) == [
            ("INIT", "HEALTHY", "start"),
            ("HEALTHY", "SUCCEEDED", "workers_succeeded"),
        ]
        assert {e["rdzv_backend"] for e in agents.read_events(tmp_path / name)} == {"etcd-v3"}
    ranks = sorted(e["group_rank"] for e in (agents.read_events(tmp_path / n)[-1] for n in ("a.jsonl", "b.jsonl")))
    assert ranks == [0, 1]

    # The rendezvous, as etcd holds it: torch's state (closed by the agents' shutdown) and the round's store.
    client = etcd_server.client()
    state = pickle.loads(client.get(f"/torch/elastic/rendezvous/{run_id}")[0])
    assert state.complete and state.closed and len(state.participants) == 2
    store_prefix = f"/torch/elastic/store/{run_id}/torch.rendezvous.{run_id}.{state.round}/"
    keys = {meta["key"].decode()[len(store_prefix) :]: value for value, meta in client.get_prefix(store_prefix)}
    assert keys["MASTER_ADDR"] == b"127.0.0.1"
    assert {
        "torchelastic/role_info/0",
        "torchelastic/role_info/1",
        "torchelastic/assigned_ranks/0",
        "torchelastic/assigned_ranks/1",
    } <= set(keys)
    assert keys["torchelastic/agent/terminal_state/num_members"] == b"2"  # both passed the exit barrier


def test_a_third_agent_joining_triggers_a_rerendezvous(tmp_path, agents, etcd_server):
    run_id = f"grow-{uuid.uuid4().hex[:8]}"
    script = write_script(tmp_path)
    env = {"WANTED_WORLD_SIZE": "6"}
    a = agents.start(*agent_args(etcd_server, run_id, "2:3", tmp_path / "a.jsonl"), script, env=env)
    b = agents.start(*agent_args(etcd_server, run_id, "2:3", tmp_path / "b.jsonl"), script, env=env)
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("started_*_4_*"))) < 4 and time.monotonic() < deadline:
        assert a.poll() is None and b.poll() is None, "an agent ended before the two-node job started"
        time.sleep(0.2)
    assert len(list(tmp_path.glob("started_*_4_*"))) == 4, "the two-node job never started its four workers"

    c = agents.start(*agent_args(etcd_server, run_id, "2:3", tmp_path / "c.jsonl"), script, env=env)
    results = [(p.communicate(timeout=180), p.returncode) for p in (a, b, c)]
    assert [code for _, code in results] == [0, 0, 0], "\n".join(err[-3000:] for (_, err), _ in results)
    assert sums(tmp_path, 6) == [21.0] * 6  # 1+...+6: the three agents' workers in one group

    for name in ("a.jsonl", "b.jsonl"):
        assert agents.transitions(tmp_path / name) == [
            ("INIT", "HEALTHY", "start"),
            ("HEALTHY", "STOPPED", "membership_changed"),
            ("STOPPED", "HEALTHY", "restart"),
            ("HEALTHY", "SUCCEEDED", "workers_succeeded"),
        ]
        assert all(e["restart_count"] == 0 for e in agents.read_events(tmp_path / name))  # not counted
    assert agents.transitions(tmp_path / "c.jsonl") == [
        ("INIT", "HEALTHY", "start"),
        ("HEALTHY", "SUCCEEDED", "workers_succeeded"),
    ]
    state = pickle.loads(etcd_server.client().get(f"/torch/elastic/rendezvous/{run_id}")[0])
    assert len(state.participants) == 3 and state.round >= 1
