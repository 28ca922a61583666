"""The pods of examples/kubernetes/ as real containers: ``podman kube play``, fsm-agent as PID 1.

Real here: containers, each pod's own network namespace and IP on a bridge (the pod network), the
downward API turning the pods' annotations into their environment, ``restartPolicy``, signals, and
the exit code in the container's status (``State.ExitCode``, what a ``podFailurePolicy``'s
``onExitCodes`` reads). Simulated: the controllers (Job, JobSet, PyTorchJob, Trainer: each test
builds the pods they would create, from the manifest's pod template plus the annotations and
environment they add, each named below), cluster DNS (``hostAliases``), the kubelet's stop of a
deleted pod (``podman pod stop -t GRACE``). Not tested: a ``podFailurePolicy`` or ``failurePolicy``
acting, scheduling, the controllers themselves (no API server runs here). How the pods are
made, the image and the teardown: tests/schedulers/kubernetes/pods.py.

The workers are ``examples/train_digits.py`` where the manifests' command is run unchanged, else
``POD_WORKER`` (below: a gloo all_reduce every 0.2 s until a stop file appears), put in place of
``examples/train_digits.py`` in the manifest's command and named where it is.
"""

from __future__ import annotations

import json
import re
import secrets
import shutil
import time
from pathlib import Path

import pytest

from tests.schedulers.kubernetes.pods import (
    KUBELET_ENV,
    PodNet,
    container_name,
    documents,
    downward,
    pod_net,
    pod_of,
)

pytestmark = [pytest.mark.kubernetes, pytest.mark.slow]

#: A run of the whole job: generous, for a loaded 2-core machine.
JOB_TIMEOUT_S = 180.0
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"

#: argv: OUT_DIR. Records (JSON, one file each) ``<kind>_<hostname>_<restart>_<pid>_<random>.json``: "start",
#: "reduced" (after the first all_reduce: the world it saw), "sigterm", "done". Loops a gloo
#: all_reduce every 0.2 s; every rank stops in the same iteration once OUT_DIR/stop exists.
#: ``POD_TEST_WORKER_EXIT=N``: exits N at once. ``POD_TEST_CRASH_ONCE=PATH``: exits 3 if PATH does
#: not exist yet, after creating it (a file in the test's directory, as an emptyDir volume would keep).
POD_WORKER = r"""
import datetime, json, os, signal, socket, sys, time
out = sys.argv[1]
host = socket.gethostname()
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
run = os.urandom(4).hex()  # a restarted container has the same pids
KEYS = ("RANK", "WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID")

def dump(kind, **record):
    record.update(host=host, pid=os.getpid(), ts=time.time(), env={k: os.environ.get(k) for k in KEYS})
    path = os.path.join(out, "%s_%s_%d_%d_%s.json" % (kind, host, restart, os.getpid(), run))
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)

term = []
signal.signal(signal.SIGTERM, lambda signum, frame: term.append(time.time()))
dump("start")
if os.environ.get("POD_TEST_WORKER_EXIT"):
    sys.exit(int(os.environ["POD_TEST_WORKER_EXIT"]))
once = os.environ.get("POD_TEST_CRASH_ONCE")
if once and not os.path.exists(once):
    open(once, "w").close()
    sys.exit(3)
import torch
import torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
world, stop, step = dist.get_world_size(), os.path.join(out, "stop"), 0
while True:
    if term:
        dump("sigterm", at=term[0])  # the checkpoint chance
        sys.exit(143)
    value = torch.tensor([float(os.path.exists(stop)), 1.0])
    dist.all_reduce(value)
    if step == 0:
        dump("reduced", world=world, ok=value[1].item() == world, pg_rank=dist.get_rank())
    step += 1
    if value[0].item() > 0:
        break
    time.sleep(0.2)
dist.barrier()
dist.destroy_process_group()
dump("done", steps=step)
"""


@pytest.fixture
def pods():
    with pod_net() as net:
        (net.shared / "out").mkdir()
        (net.shared / "worker.py").write_text(POD_WORKER)
        yield net


# -- what the workers and agents wrote ----------------------------------------------------------------
def records(net: PodNet, kind: str) -> list[dict]:
    found = []
    for path in sorted((net.shared / "out").glob(f"{kind}_*.json")):
        found.append(json.loads(path.read_text()))
    return found


def events(net: PodNet, pod: dict) -> list[dict]:
    path = events_path(net, pod)
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip().endswith("}")]


def transitions(net: PodNet, pod: dict) -> list[tuple[str, str, str]]:
    return [(e["source"], e["dest"], e["trigger"]) for e in events(net, pod) if e["kind"] == "transition"]


def events_path(net: PodNet, pod: dict) -> Path:
    return net.shared / f"events_{pod['metadata']['name']}.jsonl"


def observed(net: PodNet, name: str) -> dict[str, str]:
    """The one addition of the test's own to every pod: the agent's events file (observation only)."""
    return {"FSM_AGENT_EVENTS_FILE": str(net.shared / f"events_{name}.jsonl")}


def stop_all(net: PodNet) -> None:
    (net.shared / "out" / "stop").touch()


def with_pod_worker(net: PodNet, command: list[str]) -> list[str]:
    """The manifest's command with ``POD_WORKER`` in place of ``examples/train_digits.py``."""
    assert "examples/train_digits.py" in command, command
    at = command.index("examples/train_digits.py")
    return [*command[:at], str(net.shared / "worker.py"), str(net.shared / "out"), *command[at + 1 :]]


def suffix() -> str:
    """The Job controller's random pod-name suffix; makes every pod name of a test unique."""
    return secrets.token_hex(3)[:5]


# -- the pods each controller would create --------------------------------------------------------------
def jobset_pod(
    net: PodNet,
    job: int,
    index: int,
    coordinator_ip: str,
    *,
    replicas: int,
    overrides: dict[str, str] | None = None,
    env: dict[str, str] | None = None,
    worker: bool = True,
    restart_policy: str | None = None,
) -> dict:
    """A pod of examples/kubernetes/jobset.yaml's replicated Job ``workers``, Job ``job``, index ``index``.

    The JobSet controller's additions (v0.9.1, ``labelAndAnnotateObject``): the annotations
    ``jobset.sigs.k8s.io/{jobset-name, replicatedjob-name, job-index, job-global-index,
    global-replicas, restart-attempt, coordinator}`` (which the manifest's own downward-API env
    reads), the pod's ``subdomain`` (the JobSet's name: its headless Service); the Job
    controller's (Indexed Job): annotation ``batch.kubernetes.io/job-completion-index``, env
    ``JOB_COMPLETION_INDEX`` from it, hostname ``<job>-<index>``; the kubelet's
    ``KUBERNETES_SERVICE_*``; cluster DNS: the coordinator's name.
    """
    jobset = documents("jobset.yaml")["JobSet"]
    rjob = jobset["spec"]["replicatedJobs"][0]
    template = rjob["template"]["spec"]["template"]
    name, coordinator = jobset["metadata"]["name"], jobset["spec"]["coordinator"]
    coordinator_name = (
        f"{name}-{coordinator['replicatedJob']}-{coordinator['jobIndex']}-{coordinator['podIndex']}.{name}"
    )
    hostname = f"{name}-{rjob['name']}-{job}-{index}"
    pod_name = f"{hostname}-{suffix()}"
    annotations = {
        COMPLETION_INDEX: str(index),
        "jobset.sigs.k8s.io/jobset-name": name,
        "jobset.sigs.k8s.io/replicatedjob-name": rjob["name"],
        "jobset.sigs.k8s.io/job-index": str(job),
        "jobset.sigs.k8s.io/job-global-index": str(job),
        "jobset.sigs.k8s.io/global-replicas": str(replicas),
        "jobset.sigs.k8s.io/restart-attempt": "0",
        "jobset.sigs.k8s.io/coordinator": coordinator_name,
    }
    (container,) = template["spec"]["containers"]
    return pod_of(
        template,
        pod_name,
        hostname,
        annotations=annotations,
        env={
            "JOB_COMPLETION_INDEX": downward(COMPLETION_INDEX),
            **KUBELET_ENV,
            **observed(net, pod_name),
            **(env or {}),
        },
        overrides=overrides,
        dns={coordinator_name: coordinator_ip},
        subdomain=name,
        command=with_pod_worker(net, container["command"]) if worker else None,
        restart_policy=restart_policy,
    )


def trainjob_pod(
    net: PodNet, index: int, master_ip: str, *, num_nodes: int, env: dict[str, str] | None = None, worker: bool = True
) -> dict:
    """Node ``index`` of examples/kubernetes/trainjob.yaml's TrainJob ``digits`` on its TrainingRuntime.

    The TrainJob's ``trainer.command`` and ``trainer.env`` go into the runtime's container (Trainer
    v2.3.0 does); the torch plugin's env: ``PET_NNODES`` (numNodes), ``PET_NPROC_PER_NODE``
    (numProcPerNode), ``PET_NODE_RANK`` (the completion index, downward API), ``PET_MASTER_ADDR``
    (``<trainjob>-node-0-0.<trainjob>``), ``PET_MASTER_PORT`` (29500); the Job controller's, the
    kubelet's and DNS as for a JobSet pod.
    """
    docs = documents("trainjob.yaml")
    runtime, trainjob = docs["TrainingRuntime"], docs["TrainJob"]
    rjob = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]
    template = json.loads(json.dumps(rjob["template"]["spec"]["template"]))
    (container,) = template["spec"]["containers"]
    trainer = trainjob["spec"]["trainer"]
    container["command"] = list(trainer["command"])
    container["env"] = container.get("env", []) + list(trainer.get("env", []))
    name = trainjob["metadata"]["name"]
    master = f"{name}-{rjob['name']}-0-0.{name}"
    hostname = f"{name}-{rjob['name']}-0-{index}"
    pod_name = f"{hostname}-{suffix()}"
    pet = {
        "PET_NNODES": str(num_nodes),
        "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]),
        "PET_NODE_RANK": downward(COMPLETION_INDEX),
        "PET_MASTER_ADDR": master,
        "PET_MASTER_PORT": "29500",
    }
    return pod_of(
        template,
        pod_name,
        hostname,
        annotations={COMPLETION_INDEX: str(index)},
        env={
            "JOB_COMPLETION_INDEX": downward(COMPLETION_INDEX),
            **pet,
            **KUBELET_ENV,
            **observed(net, pod_name),
            **(env or {}),
        },
        dns={master: master_ip},
        subdomain=name,
        command=with_pod_worker(net, container["command"]) if worker else None,
    )


def pytorchjob_pod(
    net: PodNet,
    index: int,
    worker0_ip: str,
    *,
    elastic: dict | None = None,
    env: dict[str, str] | None = None,
    worker: bool = True,
    pod_name: str | None = None,
) -> dict:
    """Worker ``index`` of examples/kubernetes/pytorchjob.yaml's elastic PyTorchJob ``digits-elastic``.

    The operator's env (training-operator v1.9.0, ``elastic.go``): ``PET_RDZV_BACKEND``,
    ``PET_RDZV_ENDPOINT`` (``<job>-worker-0:<rdzvPort>``), ``PET_NNODES`` (``min:max``),
    ``PET_MAX_RESTARTS``, ``PET_NPROC_PER_NODE``, ``PET_RDZV_CONF`` (``rdzvConf``),
    ``PYTHONUNBUFFERED=1``; the pod's ``restartPolicy`` (``Never`` for the replica's ``ExitCode``: the
    operator, not the kubelet, acts on the exit code); the hostname ``<job>-worker-<i>``; DNS: worker
    0's Service name. ``elastic`` replaces keys of the manifest's ``elasticPolicy`` (named by the caller).
    """
    job = documents("pytorchjob.yaml")["PyTorchJob"]
    policy = {**job["spec"]["elasticPolicy"], **(elastic or {})}
    spec = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    template = json.loads(json.dumps(spec["template"]))
    (container,) = template["spec"]["containers"]
    name = job["metadata"]["name"]
    hostname = f"{name}-worker-{index}"
    pod_name = pod_name or f"{hostname}-{suffix()}"
    endpoint_host = f"{name}-worker-0"
    pet = {
        "PET_RDZV_BACKEND": policy["rdzvBackend"],
        "PET_RDZV_ENDPOINT": f"{endpoint_host}:{policy['rdzvPort']}",
        "PET_NNODES": f"{policy['minReplicas']}:{policy['maxReplicas']}",
        "PET_MAX_RESTARTS": str(policy["maxRestarts"]),
        "PET_NPROC_PER_NODE": str(policy["nProcPerNode"]),
        "PET_RDZV_CONF": ",".join(f"{kv['key']}={kv['value']}" for kv in policy["rdzvConf"]),
        "PYTHONUNBUFFERED": "1",
    }
    return pod_of(
        template,
        pod_name,
        hostname,
        env={**pet, **KUBELET_ENV, **observed(net, pod_name), **(env or {})},
        dns={endpoint_host: worker0_ip},
        command=with_pod_worker(net, container["command"]) if worker else None,
        restart_policy="Never" if spec["restartPolicy"] == "ExitCode" else spec["restartPolicy"],
    )


def wait_world(
    net: PodNet, hosts: set[str], world: int, since: float = 0.0, timeout: float = JOB_TIMEOUT_S
) -> list[dict]:
    """Wait until every one of ``hosts`` has a worker that reduced in a world of ``world`` (after ``since``)."""

    def found() -> list[dict]:
        return [r for r in records(net, "reduced") if r["world"] == world and r["ts"] >= since and r["host"] in hosts]

    net.wait_for(lambda: {r["host"] for r in found()} == hosts, timeout, f"{sorted(hosts)} in a world of {world}")
    got = found()
    assert all(r["ok"] for r in got), got
    return got


def group_ranks(found: list[dict]) -> dict[str, int]:
    return {r["host"]: int(r["env"]["GROUP_RANK"]) for r in found}


# -- (1) the manifests' pods train -----------------------------------------------------------------------
def test_trainjob_pods_train_digits_unchanged_over_the_pod_network(pods):
    """trainjob.yaml as it is (2 nodes, ``fsm-agent run --max-restarts 1 examples/train_digits.py``,
    ``GLOO_SOCKET_IFNAME=eth0``): the static rendezvous at node 0's Service name, DDP over the pods' IPs."""
    ips = [pods.new_ip() for _ in range(2)]
    played = [trainjob_pod(pods, i, ips[0], num_nodes=2, worker=False) for i in range(2)]
    for pod, ip in zip(played, ips):
        pods.play(pod, ip)
    assert [pods.ip_of(p["metadata"]["name"]) for p in played] == ips
    for pod in played:
        assert pods.wait_exited(container_name(pod), JOB_TIMEOUT_S) == 0, pods.diagnostics()
    accuracy = re.findall(r"final test accuracy: ([0-9.]+)", pods.logs(container_name(played[0])))
    assert accuracy and float(accuracy[0]) >= 0.9, pods.diagnostics()
    for rank, pod in enumerate(played):
        exits = [e for e in events(pods, pod) if e["kind"] == "worker_exit"]
        assert [(e["group_rank"], e["group_world_size"], e["global_rank"]) for e in exits] == [(rank, 2, rank)]
        assert transitions(pods, pod) == [("INIT", "HEALTHY", "start"), ("HEALTHY", "SUCCEEDED", "workers_succeeded")]


def test_jobset_pods_two_jobs_of_two_train_digits_unchanged(pods):
    """jobset.yaml as it is: 2 Jobs x 2 pods, ``PET_NNODES=4``, ``fsm-agent run examples/train_digits.py``;
    the fsm store in the coordinator pod's agent, node rank = job index x 2 + completion index."""
    ips = {(j, i): pods.new_ip() for j in range(2) for i in range(2)}
    played = {(j, i): jobset_pod(pods, j, i, ips[0, 0], replicas=2, worker=False) for (j, i) in ips}
    for key in sorted(played, reverse=True):  # the coordinator last: ranks do not come from arrival
        pods.play(played[key], ips[key])
    for pod in played.values():
        assert pods.wait_exited(container_name(pod), JOB_TIMEOUT_S) == 0, pods.diagnostics()
    logs = "".join(pods.logs(container_name(pod)) for pod in played.values())
    accuracy = re.findall(r"final test accuracy: ([0-9.]+)", logs)
    assert len(accuracy) == 1 and float(accuracy[0]) >= 0.9, pods.diagnostics()
    for (j, i), pod in played.items():
        (exit_,) = [e for e in events(pods, pod) if e["kind"] == "worker_exit"]
        assert (exit_["group_rank"], exit_["group_world_size"]) == (2 * j + i, 4)
        assert exit_["rdzv_backend"] == "fsm" and exit_["run_id"] == "jobset-digits-0"
        assert exit_["master_addr"] == ips[0, 0]  # rank 0's pod IP, found by address
        assert transitions(pods, pod) == [("INIT", "HEALTHY", "start"), ("HEALTHY", "SUCCEEDED", "workers_succeeded")]


# -- (2) a rescheduled pod: a new pod, the same name's hostname and index, a new IP -------------------------
def test_a_rescheduled_jobset_pod_rejoins_with_its_rank_on_fsm(pods):
    """docs/schedulers.md, ``fsm`` (JobSet), a pod other than the store's: the loss is seen at once, the
    survivor waits (``PET_NNODES`` fixed) for the new pod, which rejoins with its old rank.
    Changes of the test's: 2 Jobs x 1 pod (``PET_NNODES=2``), ``POD_WORKER``."""
    ips = [pods.new_ip() for _ in range(2)]
    first = [jobset_pod(pods, j, 0, ips[0], replicas=2, overrides={"PET_NNODES": "2"}) for j in range(2)]
    for pod, ip in zip(first, ips):
        pods.play(pod, ip)
    hosts = {"digits-workers-0-0", "digits-workers-1-0"}
    assert group_ranks(wait_world(pods, hosts, 2)) == {"digits-workers-0-0": 0, "digits-workers-1-0": 1}

    deleted_at = time.time()
    pods.delete(first[1]["metadata"]["name"])  # SIGKILL, the pod gone: a lost node
    pods.wait_for(lambda: any(t[2] == "membership_changed" for t in transitions(pods, first[0])), 60, "the loss seen")
    seen = next(e["ts"] for e in events(pods, first[0]) if e.get("trigger") == "membership_changed")
    new_ip = pods.new_ip()
    again = jobset_pod(pods, 1, 0, ips[0], replicas=2, overrides={"PET_NNODES": "2"})
    pods.play(again, new_ip)
    assert pods.ip_of(again["metadata"]["name"]) == new_ip != ips[1]
    rejoined = wait_world(pods, hosts, 2, since=deleted_at)
    assert group_ranks(rejoined) == {"digits-workers-0-0": 0, "digits-workers-1-0": 1}  # its old rank hint
    assert {r["env"]["MASTER_ADDR"] for r in rejoined} == {ips[0]}
    stop_all(pods)
    for pod in (first[0], again):
        assert pods.wait_exited(container_name(pod), JOB_TIMEOUT_S) == 0, pods.diagnostics()
    assert transitions(pods, first[0]) == [
        ("INIT", "HEALTHY", "start"),
        ("HEALTHY", "STOPPED", "membership_changed"),
        ("STOPPED", "HEALTHY", "restart"),
        ("HEALTHY", "SUCCEEDED", "workers_succeeded"),
    ]
    print(f"\nfsm: the pod's loss seen by the coordinator after {seen - deleted_at:.2f}s")
    assert seen - deleted_at < 15.0  # at once or within 1.5 s; generous for a loaded machine


#: The test's changes to pytorchjob.yaml's elasticPolicy: maxReplicas 2 (the pods it plays), so a
#: round closes when both are in, and last_call_timeout 3 s (30 in the manifest) for one pod alone.
ELASTIC_2 = {
    "maxReplicas": 2,
    "rdzvConf": [{"key": "join_timeout", "value": "600"}, {"key": "last_call_timeout", "value": "3"}],
}


def test_a_rescheduled_pytorchjob_worker_is_survived_and_rejoins_on_c10d(pods):
    """docs/schedulers.md, ``c10d`` (PyTorchJob), a pod other than the store's: the survivor notices
    it lost, goes on alone within ``MIN:MAX``, and the new pod joins as a new node."""
    ips = [pods.new_ip() for _ in range(2)]
    first = [pytorchjob_pod(pods, i, ips[0], elastic=ELASTIC_2) for i in range(2)]
    for pod, ip in zip(first, ips):
        pods.play(pod, ip)
    hosts = {"digits-elastic-worker-0", "digits-elastic-worker-1"}
    wait_world(pods, hosts, 2)
    deleted_at = time.time()
    pods.delete(first[1]["metadata"]["name"])
    alone = wait_world(pods, {"digits-elastic-worker-0"}, 1, since=deleted_at)
    print(f"\nc10d: the survivor runs alone {alone[0]['ts'] - deleted_at:.2f}s after the loss")
    rejoin_at = time.time()
    again = pytorchjob_pod(pods, 1, ips[0], elastic=ELASTIC_2)
    pods.play(again, pods.new_ip())
    rejoined = wait_world(pods, hosts, 2, since=rejoin_at)
    assert {r["env"]["MASTER_ADDR"] for r in rejoined} == {ips[0]}, rejoined
    stop_all(pods)
    for pod in (first[0], again):
        assert pods.wait_exited(container_name(pod), JOB_TIMEOUT_S) == 0, pods.diagnostics()


@pytest.mark.parametrize("backend", ["fsm", "c10d"])
def test_losing_the_store_pod_ends_the_job_with_exit_1(pods, backend):
    """docs/schedulers.md, the store's pod (JobSet's coordinator, PyTorchJob's worker 0) lost: the other
    agents exit 1 (a rendezvous failure), which JobSet restarts whole and ``ExitCode`` does not retry."""
    ips = [pods.new_ip() for _ in range(2)]
    if backend == "fsm":
        # the test's addition: read_timeout 15 s (60 by default), how long the survivor tries to
        # reach the store again before it fails the rendezvous: the lane's time, not the claim
        conf = {"PET_RDZV_CONF": "read_timeout=15"}
        played = [jobset_pod(pods, j, 0, ips[0], replicas=2, overrides={"PET_NNODES": "2"}, env=conf) for j in range(2)]
        hosts = {"digits-workers-0-0", "digits-workers-1-0"}
    else:
        played = [pytorchjob_pod(pods, i, ips[0], elastic=ELASTIC_2) for i in range(2)]
        hosts = {"digits-elastic-worker-0", "digits-elastic-worker-1"}
    for pod, ip in zip(played, ips):
        pods.play(pod, ip)
    wait_world(pods, hosts, 2)
    deleted_at = time.time()
    pods.delete(played[0]["metadata"]["name"])
    assert pods.wait_exited(container_name(played[1]), JOB_TIMEOUT_S) == 1, pods.diagnostics()
    print(f"\n{backend}: the store's pod lost, the other agent exited 1 after {time.time() - deleted_at:.2f}s")


def etcd_pod(net: PodNet) -> tuple[dict, str]:
    """Your etcd (the table's ``--rdzv-endpoint your etcd``): Debian's etcd 3.4 as a pod of its own,
    no pod of the job. Not from a manifest: the examples run none."""
    ip = net.new_ip()
    url = f"http://{ip}:2379"
    template = {
        "spec": {
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "etcd",
                    "image": "fsm-agent-train:latest",
                    "command": ["etcd", "--data-dir", "/tmp/etcd", "--listen-client-urls", url,
                                "--advertise-client-urls", url, "--listen-peer-urls", "http://127.0.0.1:2380"],
                }
            ],
        }
    }  # fmt: skip
    return pod_of(template, f"etcd-{suffix()}", "etcd"), ip


def test_a_rescheduled_pytorchjob_worker_0_is_survived_on_etcd(pods):
    """docs/schedulers.md, ``etcd-v3``: the pod that hosts the store under ``c10d`` (worker 0) is lost
    and rescheduled: survived, since the rendezvous lives in etcd. The test's changes to the
    elasticPolicy: ``rdzvBackend: etcd-v3``, ``rdzvHost: etcd``, ``rdzvPort: 2379`` (the operator
    then sets ``PET_RDZV_ENDPOINT=etcd:2379``), and ``ELASTIC_2``."""
    if shutil.which("etcd") is None:
        pytest.skip("etcd is not installed (bash .ci/install-etcd.sh)")
    etcd, etcd_ip = etcd_pod(pods)
    pods.play(etcd, etcd_ip)
    elastic = {**ELASTIC_2, "rdzvBackend": "etcd-v3", "rdzvPort": 2379}
    ips = [pods.new_ip() for _ in range(2)]

    def worker(index: int) -> dict:
        pod = pytorchjob_pod(pods, index, ips[0], elastic=elastic)
        pod["spec"]["hostAliases"] = [{"ip": etcd_ip, "hostnames": ["etcd"]}]  # the Service of your etcd
        for item in pod["spec"]["containers"][0]["env"]:
            if item["name"] == "PET_RDZV_ENDPOINT":
                item["value"] = "etcd:2379"  # rdzvHost: etcd
        return pod

    first = [worker(i) for i in range(2)]
    for pod, ip in zip(first, ips):
        pods.play(pod, ip)
    hosts = {"digits-elastic-worker-0", "digits-elastic-worker-1"}
    wait_world(pods, hosts, 2)
    deleted_at = time.time()
    pods.delete(first[0]["metadata"]["name"])
    alone = wait_world(pods, {"digits-elastic-worker-1"}, 1, since=deleted_at)
    print(f"\netcd-v3: the survivor runs alone {alone[0]['ts'] - deleted_at:.2f}s after losing worker 0")
    rejoin_at = time.time()
    again = worker(0)
    pods.play(again, pods.new_ip())
    wait_world(pods, hosts, 2, since=rejoin_at)
    stop_all(pods)
    for pod in (first[1], again):
        assert pods.wait_exited(container_name(pod), JOB_TIMEOUT_S) == 0, pods.diagnostics()


# -- (3) a deleted pod: SIGTERM, the grace period ------------------------------------------------------------
#: Kubernetes' default ``terminationGracePeriodSeconds`` (the manifests set none).
GRACE_S = 30


def test_a_deleted_pod_gets_sigterm_and_the_agent_exits_143_within_the_grace_period(pods):
    """The kubelet's stop of a deleted (evicted, preempted, drained) pod: SIGTERM, SIGKILL after the
    grace period, the pod's network kept until its containers exited (``PodNet.stop``). The agent
    (PID 1) passes SIGTERM on to its worker (its checkpoint chance) and exits 143
    (docs/failure-handling.md#exit-codes), which JobSet's ``failurePolicy`` restarts."""
    ip = pods.new_ip()
    pod = jobset_pod(pods, 0, 0, ip, replicas=1, overrides={"PET_NNODES": "1"})
    name = pods.play(pod, ip)
    wait_world(pods, {"digits-workers-0-0"}, 1)
    took = pods.stop(name, GRACE_S)
    assert pods.state(container_name(pod))["ExitCode"] == 143, pods.diagnostics()
    assert took < GRACE_S / 2, f"the agent needed {took:.1f}s of the {GRACE_S}s grace period"
    (term,) = records(pods, "sigterm")
    assert term["host"] == "digits-workers-0-0"
    (end,) = [e for e in events(pods, pod) if e["kind"] == "run_end"]
    assert end["exit_code"] == 143
    assert pods.died(container_name(pod)) == [143]
    print(f"\nSIGTERM -> the container exited 143 after {took:.2f}s (grace {GRACE_S}s)")


def test_podman_kube_down_gives_no_grace_period(pods):
    """Why the test above does not use ``podman kube down``: podman 4.3.1 stops the pod with a timeout
    of 0, SIGKILL at once (exit 137, the worker never saw SIGTERM): a force-deleted pod, not the kubelet."""
    ip = pods.new_ip()
    pod = jobset_pod(pods, 0, 0, ip, replicas=1, overrides={"PET_NNODES": "1"})
    name = pods.play(pod, ip)
    wait_world(pods, {"digits-workers-0-0"}, 1)
    pods.kube_down(name)
    assert pods.died(container_name(pod)) == [137], "kube down now gives a grace period: use it in the test above"
    assert not records(pods, "sigterm")


def test_sigterm_while_the_pods_network_goes_away_still_exits_143_within_the_grace_period(pods):
    """``podman pod stop -t 10`` removes the pod's network while the agent shuts down (podman 4.3.1
    stops the infra container with the others). The agent's leave request to its own store, at the
    pod's IP, is never answered: the fsm handler waits for it at most ``handshake_timeout`` on the
    way out (it waited the join's patience, 600 s, and was SIGKILLed at the grace period's end with
    137 before), so it still exits 143. The same holds wherever the store is unreachable at shutdown
    (its node lost or partitioned when this pod is deleted)."""
    ip = pods.new_ip()
    pod = jobset_pod(pods, 0, 0, ip, replicas=1, overrides={"PET_NNODES": "1"})
    name = pods.play(pod, ip)
    wait_world(pods, {"digits-workers-0-0"}, 1)
    pods.pod_stop(name, 10)
    assert records(pods, "sigterm")  # the worker had its SIGTERM
    assert pods.state(container_name(pod))["ExitCode"] == 143, pods.diagnostics()


# -- (4) the do-not-restart exit codes reach the container's status ---------------------------------------------
@pytest.mark.parametrize("code", [78, 79])
def test_the_fail_job_exit_codes_reach_the_containers_status(pods, code):
    """78: a worker asked not to be restarted (it exits 78), despite ``PET_MAX_RESTARTS=3``: a pod of
    jobset.yaml. 79: no progress, ``--max-no-progress-restarts 1`` (``FSM_AGENT_MAX_NO_PROGRESS_RESTARTS``,
    the test's addition) with a worker that fails at once every time, despite trainjob.yaml's
    ``--max-restarts 1``. The container's ``State.ExitCode`` is the code, and the manifest's
    ``podFailurePolicy`` names it for that container (``FailJob``): the Job would fail at once."""
    from tests.schedulers.kubernetes.test_manifests import fail_job_codes

    ip = pods.new_ip()
    if code == 78:
        pod = jobset_pod(
            pods, 0, 0, ip, replicas=1, overrides={"PET_NNODES": "1"},
            env={"POD_TEST_WORKER_EXIT": "78", "PET_MAX_RESTARTS": "3"},
        )  # fmt: skip
        job = documents("jobset.yaml")["JobSet"]["spec"]["replicatedJobs"][0]["template"]["spec"]
    else:
        pod = trainjob_pod(
            pods, 0, ip, num_nodes=1, env={"POD_TEST_WORKER_EXIT": "3", "FSM_AGENT_MAX_NO_PROGRESS_RESTARTS": "1"}
        )
        runtime = documents("trainjob.yaml")["TrainingRuntime"]
        job = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]
    pods.play(pod, ip)
    assert pods.wait_exited(container_name(pod), JOB_TIMEOUT_S) == code, pods.diagnostics()
    assert pods.state(container_name(pod))["ExitCode"] == code
    assert pods.restarts(container_name(pod)) == 0  # restartPolicy: Never, as the manifests say
    assert code in fail_job_codes(job, pod["spec"]["containers"][0]["name"])
    assert len(records(pods, "start")) == 1  # no restart: 78 at once; 79 after K=1 cycle without progress


# -- (5) a container restarted in place (restartPolicy: OnFailure) -------------------------------------------
def test_a_container_restart_under_on_failure_starts_a_fresh_agent_that_sees_no_restart(pods):
    """``restartPolicy: OnFailure`` (the test's change: the manifests say ``Never``): the agent exits 3,
    its worker's code (``PET_MAX_RESTARTS=0``, the worker failed once), the kubelet (here podman) restarts the container
    in the same pod, same IP. The new agent cannot tell: nothing in a container says it was
    restarted (Kubernetes puts ``restartCount`` in the pod's status, not in its environment or
    files), so its workers start at ``TORCHELASTIC_RESTART_COUNT=0`` under the same run id."""
    ip = pods.new_ip()
    pod = jobset_pod(
        pods, 0, 0, ip, replicas=1, overrides={"PET_NNODES": "1"}, restart_policy="OnFailure",
        env={"PET_MAX_RESTARTS": "0", "POD_TEST_CRASH_ONCE": str(pods.shared / "crashed")},
    )  # fmt: skip
    name = pods.play(pod, ip)
    wait_world(pods, {"digits-workers-0-0"}, 1)  # the second run of the container: the first crashed
    assert pods.restarts(container_name(pod)) == 1
    assert pods.ip_of(name) == ip  # the same pod, its network kept
    stop_all(pods)
    assert pods.wait_exited(container_name(pod), JOB_TIMEOUT_S) == 0, pods.diagnostics()
    assert pods.died(container_name(pod)) == [3, 0]
    starts = sorted(records(pods, "start"), key=lambda r: r["ts"])
    assert len(starts) == 2
    assert [r["env"]["TORCHELASTIC_RESTART_COUNT"] for r in starts] == ["0", "0"]  # not seen as a restart
    assert {r["env"]["TORCHELASTIC_RUN_ID"] for r in starts} == {"jobset-digits-0"}
    ends = [e for e in events(pods, pod) if e["kind"] == "run_end"]
    assert [(e["exit_code"], e["restart_count"]) for e in ends] == [(3, 0), (0, 0)]
