"""Kubernetes contract tests: agents in namespaced hosts with exactly the environment each
operator gives its pods, and nothing else (no fsm-agent flags but the observation ones the
fixture adds: ``--events-file``, ``--log-dir``; no ``--local-addr``, no ``GLOO_SOCKET_IFNAME``).

No cluster is reachable from CI; these follow the operators' sources:

* Kubeflow Trainer v2.3.0, ``pkg/runtime/framework/plugins/torch/torch.go`` (TrainJob, torch runtime);
* kubeflow/training-operator v1.9.0, ``pkg/controller.v1/pytorch/envvar.go`` and ``elastic.go``
  (PyTorchJob with an ``elasticPolicy``);
* kubernetes-sigs/jobset v0.9.1, ``pkg/controllers/jobset_controller.go`` (``labelAndAnnotateObject``,
  ``coordinatorEndpoint``), mapped to variables as examples/kubernetes/jobset.yaml does.

Each pod gets its own hostname (``unshare --uts``: the pod's name, as the kubelet sets it) and the
``/etc/hosts`` the kubelet writes (its own IP -> FQDN and hostname); what cluster DNS would answer
for the headless Service names (the master, the rendezvous endpoint, the coordinator) is in the
same file, since no DNS server runs here.
"""

from __future__ import annotations

import pytest

from tests.agent.test_netns import JOB_TIMEOUT_S, check_world
from tests.netns import NetnsHosts

pytestmark = [pytest.mark.multihost, pytest.mark.slow]

POD_ENV = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443", "PYTHONUNBUFFERED": "1"}


def pods(hosts: NetnsHosts, hostnames: list[str], subdomain: str, dns: dict[str, int]) -> None:
    """The kubelet's /etc/hosts for each pod, plus ``dns``: {Service name: host it points to}."""
    for i, hostname in enumerate(hostnames):
        lines = ["127.0.0.1 localhost", f"{hosts.addrs[i]} {hostname}.{subdomain}.default.svc.cluster.local {hostname}"]
        lines += [f"{hosts.addrs[host]} {name}" for name, host in dns.items()]
        hosts.set_etc(i, "\n".join(lines) + "\n")


def run_pods(
    hosts: NetnsHosts,
    hostnames: list[str],
    envs: list[dict[str, str]],
    final_world: int,
    exit_code: int = 0,
    last_first: bool = False,
) -> list:
    """Start one agent per pod (the last pod first with ``last_first``); each must exit ``exit_code``."""
    order = list(range(len(envs)))[::-1] if last_first else list(range(len(envs)))
    agents = {
        i: hosts.start_agent(
            i,
            final_world=final_world,
            local_addr=False,
            hostname=hostnames[i],
            env={**POD_ENV, **envs[i]},
            gloo_ifname=False,
        )
        for i in order
    }
    for i in sorted(agents):
        assert agents[i].wait(JOB_TIMEOUT_S) == exit_code, hosts.diagnostics()
    return [agents[i] for i in sorted(agents)]


def group_rank_of(records: list[dict]) -> dict[str, int]:
    return {r["host"]: int(r["env"]["GROUP_RANK"]) for r in records}


def test_trainer_v2_trainjob_pods_form_the_static_job_of_their_pet_variables(netns_hosts):
    """TrainJob ``digits``, numNodes 2, numProcPerNode 1: Trainer's PET_* and the Job's completion index."""
    hosts = netns_hosts
    hostnames = [f"digits-node-0-{i}" for i in range(2)]
    pods(hosts, hostnames, "digits", dns={"digits-node-0-0.digits": 0})
    envs = [
        {
            "PET_NNODES": "2",
            "PET_NPROC_PER_NODE": "1",
            "PET_NODE_RANK": str(i),
            "JOB_COMPLETION_INDEX": str(i),
            "PET_MASTER_ADDR": "digits-node-0-0.digits",
            "PET_MASTER_PORT": "29500",
        }
        for i in range(2)
    ]
    agents = run_pods(hosts, hostnames, envs, final_world=2)
    records = check_world(hosts, 2, ["h0", "h1"], master_addr="digits-node-0-0.digits")
    assert group_rank_of(records) == {"h0": 0, "h1": 1}  # PET_NODE_RANK, on torch's static rendezvous
    # the agents meet at PET_MASTER_PORT; the workers' own store is on a port node rank 0 published (#39.1)
    ports = {r["env"]["MASTER_PORT"] for r in records}
    assert len(ports) == 1 and ports != {"29500"}, records
    for agent in agents:
        assert agent.transitions() == [("INIT", "HEALTHY", "start"), ("HEALTHY", "SUCCEEDED", "workers_succeeded")]


def test_elastic_pytorchjob_pods_form_a_c10d_job_hosted_by_worker_0(netns_hosts):
    """PyTorchJob ``digits-elastic`` (examples/kubernetes/pytorchjob.yaml with 2 workers): the operator's
    PET_RDZV_* variables; the store host is found by address (worker 0's Service name is its own IP)."""
    hosts = netns_hosts
    hostnames = [f"digits-elastic-worker-{i}" for i in range(2)]
    pods(hosts, hostnames, "digits-elastic", dns={"digits-elastic-worker-0": 0})
    env = {
        "PET_RDZV_ENDPOINT": "digits-elastic-worker-0:23456",
        "PET_RDZV_BACKEND": "c10d",
        "PET_NNODES": "1:2",
        "PET_MAX_RESTARTS": "3",
        "PET_NPROC_PER_NODE": "1",
        "PET_RDZV_CONF": "join_timeout=120,last_call_timeout=60",
    }
    agents = run_pods(hosts, hostnames, [env, env], final_world=2)
    reduced = hosts.records("reduced")
    master = {r["env"]["MASTER_ADDR"] for r in reduced}
    assert len(master) == 1 and master <= set(hosts.addrs), f"MASTER_ADDR {master}: not a pod address"
    records = check_world(hosts, 2, ["h0", "h1"], master_addr=master.pop())
    rank0 = next(r for r in records if r["env"]["GROUP_RANK"] == "0")
    assert rank0["env"]["MASTER_ADDR"] == hosts.addrs[int(rank0["host"][1:])]
    for agent in agents:
        assert agent.transitions() == [("INIT", "HEALTHY", "start"), ("HEALTHY", "SUCCEEDED", "workers_succeeded")]


def jobset_pods(hosts: NetnsHosts, **extra: str) -> tuple[list[str], list[dict[str, str]]]:
    """JobSet ``digits``, replicatedJob ``workers`` with replicas 2 x parallelism 1: both pods have
    completion index 0 (examples/kubernetes/jobset.yaml's variables, JobSet v0.9.1's annotations)."""
    hostnames = [f"digits-workers-{j}-0" for j in range(2)]
    coordinator = "digits-workers-0-0.digits"
    pods(hosts, hostnames, "digits", dns={coordinator: 0})
    envs = [
        {
            "JOB_COMPLETION_INDEX": "0",
            "PET_NNODES": "2",
            "PET_NPROC_PER_NODE": "1",
            "JOBSET_NAME": "digits",
            "JOBSET_JOB_GLOBAL_INDEX": str(j),
            "JOBSET_GLOBAL_REPLICAS": "2",
            "JOBSET_COORDINATOR": coordinator,
            "JOBSET_RESTART_ATTEMPT": "1",
            **extra,
        }
        for j in range(2)
    ]
    return hostnames, envs


def test_jobset_pods_of_two_replicated_jobs_take_their_node_rank_from_job_and_pod_index(netns_hosts):
    """The job global index tells the pods apart; pod 1 starts first, so a rank by arrival would be wrong."""
    hosts = netns_hosts
    hostnames, envs = jobset_pods(hosts)
    agents = run_pods(hosts, hostnames, envs, final_world=2, last_first=True)
    records = check_world(hosts, 2, ["h0", "h1"], master_addr=hosts.addrs[0])
    assert group_rank_of(records) == {"h0": 0, "h1": 1}
    assert {r["env"]["TORCHELASTIC_RUN_ID"] for r in records} == {"jobset-digits-1"}
    for agent in agents:
        assert agent.transitions() == [("INIT", "HEALTHY", "start"), ("HEALTHY", "SUCCEEDED", "workers_succeeded")]


def test_a_jobset_pod_whose_worker_must_not_be_restarted_exits_with_the_manifests_fail_job_code(netns_hosts):
    """The worker exits 78 (do not restart): the agent exits 78 at once despite ``PET_MAX_RESTARTS=3``,
    which examples/kubernetes/jobset.yaml's ``podFailurePolicy`` fails the Job on (``FailJob``), and
    its ``failurePolicy`` then the JobSet (``FailJobSet`` on reason ``PodFailurePolicy``), deleting
    the other pods. One pod: with two, the peer of the pod that exits first may see it leave before
    its own worker's exit and wait in a new rendezvous, until JobSet deletes it (docs/schedulers.md)."""
    from tests.schedulers.kubernetes.test_manifests import documents, fail_job_codes

    hosts = netns_hosts
    hostnames, envs = jobset_pods(
        hosts, FSM_TEST_WORKER_EXIT="78", PET_MAX_RESTARTS="3", PET_NNODES="1", JOBSET_GLOBAL_REPLICAS="1"
    )
    run_pods(hosts, hostnames[:1], envs[:1], final_world=1, exit_code=78)
    job = documents("jobset.yaml")["JobSet"]["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert 78 in fail_job_codes(job, "trainer")
    assert len(hosts.records("start")) == 1  # one attempt
