"""Slurm discovery from a job step's real environment variables, as srun sets them (no cluster).

The variables are the ones Slurm 22.05 gives an ``srun`` task (checked on the cluster of
tests/schedulers/slurm/conftest.py); ``fsm-agent config`` is run as a process to show the sources.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fsm_agent import cli
from fsm_agent.errors import ConfigError
from fsm_agent.plugins.manager import get_plugin_manager, plugin_rows
from fsm_agent.plugins.scheduler_slurm import BASE_PORT, discover_slurm
from fsm_agent.scheduler import discover

pytestmark = pytest.mark.unit

#: What srun gives task 1 of ``srun -N4 --gres=gpu:4`` in job 1234's step 0.
STEP = {
    "SLURM_JOB_ID": "1234",
    "SLURM_STEP_ID": "0",
    "SLURM_NODEID": "1",
    "SLURM_PROCID": "1",
    "SLURM_STEP_NUM_NODES": "4",
    "SLURM_NNODES": "4",
    "SLURM_JOB_NUM_NODES": "5",
    "SLURM_STEP_NODELIST": "gpu[01-03,07]",
    "SLURM_JOB_NODELIST": "gpu[01-03,07,09]",
    "SLURM_STEP_TASKS_PER_NODE": "1(x4)",
    "SLURM_STEP_GPUS": "0,1,2,3",
    "SLURM_GPUS_ON_NODE": "4",
}
#: The batch script's own shell of the same job: no step variables.
BATCH = {k: v for k, v in STEP.items() if not k.startswith("SLURM_STEP")}
PORT = BASE_PORT + (16 * 1234 + 0) % 1000


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    """No SLURM_*, FSM_AGENT_*, PET_* from outside; an empty cwd (no pyproject.toml)."""
    for name in list(os.environ):
        if name.startswith(("SLURM_", "PET_", "FSM_AGENT_")):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)


def resolved(monkeypatch, env: dict[str, str], *flags: str):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    run = cli.resolve_run_args(list(flags), for_config=True, load_entry_points=False)
    config, _, _ = cli.config_from_args(run.args, set_omp_num_threads=False)
    return config, run.sources


def test_a_job_step_gives_nodes_rank_endpoint_run_id_and_gpus(monkeypatch):
    config, sources = resolved(monkeypatch, STEP)
    assert (config.min_nodes, config.max_nodes) == (4, 4)
    assert config.node_rank == 1
    assert config.rdzv_backend == "fsm"
    assert config.rdzv_endpoint == f"gpu01:{PORT}"
    assert config.run_id == "slurm-1234.0.0"
    assert config.nproc_per_node == 4
    assert str(sources["rendezvous.node_rank"]) == "slurm SLURM_NODEID"
    assert str(sources["nnodes"]) == "slurm SLURM_STEP_NUM_NODES"
    assert str(sources["rendezvous.endpoint"]) == "slurm SLURM_STEP_NODELIST"
    assert str(sources["nproc_per_node"]) == "slurm SLURM_STEP_GPUS"
    assert sources["max_restarts"].kind == "default"


def test_a_requeued_job_gets_a_new_run_id(monkeypatch):
    config, _ = resolved(monkeypatch, {**STEP, "SLURM_RESTART_COUNT": "2", "SLURM_STEP_ID": "3"})
    assert config.run_id == "slurm-1234.3.2"
    assert config.rdzv_endpoint == f"gpu01:{BASE_PORT + (16 * 1234 + 3) % 1000}"


def test_without_gpus_the_worker_count_stays_the_users(monkeypatch):
    env = {k: v for k, v in STEP.items() if "GPU" not in k}
    config, sources = resolved(monkeypatch, env)
    assert config.nproc_per_node == 1 and sources["nproc_per_node"].kind == "default"
    config, _ = resolved(monkeypatch, {**env, "SLURM_GPUS_ON_NODE": "2"})
    assert config.nproc_per_node == 2


@pytest.mark.parametrize("source", ["cli", "fsm_env", "pet_env", "file"])
def test_what_the_user_gives_wins_over_discovery(monkeypatch, tmp_path, source):
    flags: tuple[str, ...] = ()
    if source == "cli":
        flags = ("--nnodes", "1:4", "--rdzv-id", "mine", "--node-rank", "3", "--rdzv-endpoint", "h:1")
    elif source == "fsm_env":
        for name, value in {"NNODES": "1:4", "RDZV_ID": "mine", "NODE_RANK": "3", "RDZV_ENDPOINT": "h:1"}.items():
            monkeypatch.setenv(f"FSM_AGENT_{name}", value)
    elif source == "pet_env":
        for name, value in {"NNODES": "1:4", "RDZV_ID": "mine", "NODE_RANK": "3", "RDZV_ENDPOINT": "h:1"}.items():
            monkeypatch.setenv(f"PET_{name}", value)
    else:
        path = tmp_path / "fsm.toml"
        path.write_text('nnodes = "1:4"\n[rendezvous]\nrun_id = "mine"\nnode_rank = 3\nendpoint = "h:1"\n')
        flags = ("--config", str(path))
    config, sources = resolved(monkeypatch, STEP, *flags)
    assert (config.min_nodes, config.max_nodes, config.run_id, config.node_rank, config.rdzv_endpoint) == (
        1,
        4,
        "mine",
        3,
        "h:1",
    )
    assert sources["rendezvous.run_id"].kind == {"fsm_env": "env", "pet_env": "env"}.get(source, source)
    assert config.rdzv_backend == "fsm" and sources["rendezvous.backend"].kind == "slurm"  # still unset: filled


def test_the_batch_shell_is_not_a_job_step(monkeypatch):
    config, sources = resolved(monkeypatch, BATCH)
    assert sources["nnodes"].kind == "default" and config.run_id != "slurm-1234.0.0"
    with pytest.raises(ConfigError, match=r"^--scheduler slurm: in a batch script's or salloc's shell.*srun"):
        resolved(monkeypatch, BATCH, "--scheduler", "slurm")


def test_scheduler_none_and_an_unknown_name(monkeypatch):
    config, sources = resolved(monkeypatch, STEP, "--scheduler", "none")
    assert sources["nnodes"].kind == "default" and not config.run_id.startswith("slurm-")
    assert config.rdzv_endpoint == "127.0.0.1:0"  # torchrun's implicit single-node rendezvous
    monkeypatch.setenv("FSM_AGENT_SCHEDULER", "none")
    _, sources = resolved(monkeypatch, STEP)
    assert sources["rendezvous.node_rank"].kind == "default"
    with pytest.raises(ConfigError, match=r"^--scheduler 'lsf': no loaded plugin discovers jobs of that scheduler"):
        resolved(monkeypatch, STEP, "--scheduler", "lsf")


def test_several_tasks_per_node_is_one_line_unless_the_user_set_the_node_identity(monkeypatch):
    env = {**STEP, "SLURM_STEP_TASKS_PER_NODE": "8(x4)"}
    with pytest.raises(
        ConfigError,
        match=r"^Slurm started 8 fsm-agent tasks on this node "
        r"\(SLURM_STEP_TASKS_PER_NODE=8\(x4\)\).*one task per node",
    ) as info:
        resolved(monkeypatch, env)
    assert "\n" not in str(info.value)
    # one launcher per GPU, set up by the user: kept (the endpoint and run id are still discovered)
    config, _ = resolved(monkeypatch, env, "--nnodes", "32", "--node-rank", "9")
    assert (config.max_nodes, config.node_rank, config.run_id) == (32, 9, "slurm-1234.0.0")


def test_a_malformed_hostlist_is_one_line_naming_the_variable(monkeypatch):
    with pytest.raises(ConfigError, match=r"^SLURM_STEP_NODELIST='gpu\[01-': not a Slurm hostlist"):
        resolved(monkeypatch, {**STEP, "SLURM_STEP_NODELIST": "gpu[01-"})


@pytest.mark.parametrize(
    "expression, first",
    [("n1", "n1"), ("node[1-2]", "node1"), ("a[09-11],b7", "a09"), ("rack1-[3,5]-gpu[2-3]", "rack1-3-gpu2")],
)
def test_hostlist_expressions(expression, first):
    job = discover_slurm({**STEP, "SLURM_STEP_NODELIST": expression})
    assert job.values["rendezvous.endpoint"] == f"{first}:{PORT}"
    assert job.hosts[0] == first


def test_the_plugin_is_a_scheduler_plugin():
    pm = get_plugin_manager(load_entry_points=False)
    row = next(r for r in plugin_rows(pm) if r["name"] == "scheduler-slurm")
    assert row["kinds"] == ["scheduler"] and row["hooks"] == ["fsm_agent_discover_job"]
    assert discover(pm, "auto", {}) is None


def test_fsm_agent_config_shows_the_slurm_source(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PET_", "FSM_AGENT_"))}
    env.update(STEP)
    out = subprocess.run(
        [sys.executable, "-m", "fsm_agent", "config", "--json"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    values = json.loads(out.stdout)["values"]
    assert values["rendezvous.node_rank"] == {"value": 1, "source": "slurm SLURM_NODEID"}
    assert values["rendezvous.run_id"]["source"].startswith("slurm ")
    assert values["nnodes"] == {"value": "4:4", "source": "slurm SLURM_STEP_NUM_NODES"}


def test_a_backend_without_rank_hints_gets_no_discovered_node_rank(monkeypatch):
    config, sources = resolved(monkeypatch, STEP, "--rdzv-backend", "c10d")
    assert config.rdzv_backend == "c10d" and config.node_rank == 0
    assert sources["rendezvous.node_rank"].kind == "default"
    assert config.rdzv_endpoint == f"gpu01:{PORT}" and config.run_id == "slurm-1234.0.0"
    config, _ = resolved(monkeypatch, STEP, "--rdzv-backend", "static")
    assert config.node_rank == 1 and config.rdzv_configs["rank"] == 1
