"""scheduler-kubernetes: what each operator's pod environment discovers (no agents; the agents
in namespaces with these environments: tests/schedulers/kubernetes/test_kubernetes_pods.py)."""

from __future__ import annotations

import pytest

from fsm_agent.errors import ConfigError
from fsm_agent.plugins.scheduler_kubernetes import discover_kubernetes

pytestmark = pytest.mark.unit

POD = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}


def jobset_pod(job: int, pod: int, replicas: int = 2, nnodes: int = 4, **extra: str) -> dict[str, str]:
    """A pod of examples/kubernetes/jobset.yaml (JobSet v0.9.1's annotations through the downward API)."""
    return {
        **POD,
        "JOB_COMPLETION_INDEX": str(pod),
        "JOBSET_NAME": "digits",
        "JOBSET_JOB_GLOBAL_INDEX": str(job),
        "JOBSET_GLOBAL_REPLICAS": str(replicas),
        "JOBSET_COORDINATOR": "digits-workers-0-0.digits",
        "JOBSET_RESTART_ATTEMPT": "0",
        "PET_NNODES": str(nnodes),
        **extra,
    }


def test_outside_a_pod_auto_discovers_nothing_and_the_name_is_one_line():
    assert discover_kubernetes({"JOB_COMPLETION_INDEX": "1"}, "auto") is None
    with pytest.raises(ConfigError, match="not in a Kubernetes pod"):
        discover_kubernetes({}, "kubernetes")
    assert discover_kubernetes(POD, "slurm") is None


def test_trainer_and_pytorchjob_pods_add_nothing_to_their_pet_variables():
    trainer = {
        **POD,
        "PET_NNODES": "2",
        "PET_NPROC_PER_NODE": "auto",
        "PET_NODE_RANK": "1",
        "JOB_COMPLETION_INDEX": "1",
        "PET_MASTER_ADDR": "digits-node-0-0.digits",
        "PET_MASTER_PORT": "29500",
    }
    job = discover_kubernetes(trainer, "auto")
    assert job.values == {"rendezvous.node_rank": 1}  # the completion index, equal to PET_NODE_RANK (which wins)
    elastic = {
        **POD,
        "PET_RDZV_BACKEND": "c10d",
        "PET_RDZV_ENDPOINT": "digits-elastic-worker-0:23456",
        "PET_NNODES": "1:3",
        "PET_MAX_RESTARTS": "3",
        "PET_NPROC_PER_NODE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    assert discover_kubernetes(elastic, "auto").values == {}


@pytest.mark.parametrize("job, pod, rank", [(0, 0, 0), (0, 1, 1), (1, 0, 2), (1, 1, 3)])
def test_jobset_node_rank_is_job_index_times_pods_per_job_plus_completion_index(job, pod, rank):
    found = discover_kubernetes(jobset_pod(job, pod), "auto")
    assert found.values == {
        "rendezvous.node_rank": rank,
        "rendezvous.run_id": "jobset-digits-0",
        "rendezvous.endpoint": "digits-workers-0-0.digits:29400",
        "rendezvous.backend": "fsm",
    }


def test_a_restarted_jobset_gets_a_new_run_id():
    assert (
        discover_kubernetes(jobset_pod(0, 0, JOBSET_RESTART_ATTEMPT="2"), "auto").values["rendezvous.run_id"]
        == "jobset-digits-2"
    )


def test_one_job_needs_no_node_count():
    pod = jobset_pod(0, 3, replicas=1)
    del pod["PET_NNODES"]
    assert discover_kubernetes(pod, "auto").values["rendezvous.node_rank"] == 3


@pytest.mark.parametrize(
    "change, message",
    [
        ({"PET_NNODES": "1:4"}, "set PET_NNODES to the total node count"),
        ({"PET_NNODES": "5"}, "a multiple of 2"),
        ({"JOB_COMPLETION_INDEX": "2"}, "lie outside"),
        ({"JOBSET_JOB_GLOBAL_INDEX": "x"}, "jobset.sigs.k8s.io/job-global-index"),
    ],
)
def test_a_jobset_pod_that_cannot_give_a_node_rank_is_one_line(change, message):
    with pytest.raises(ConfigError, match=message):
        discover_kubernetes({**jobset_pod(1, 0), **change}, "auto")
