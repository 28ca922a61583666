"""Built-in scheduler plugin ``scheduler-kubernetes``: a Kubernetes pod's defaults (``--scheduler kubernetes``).

It answers ``--scheduler auto`` only in a pod (``KUBERNETES_SERVICE_HOST``, which the kubelet sets
in every container). What each operator gives the pod, and what is read (docs/schedulers.md):

* **Kubeflow Trainer v2** (TrainJob, torch runtime; kubeflow/trainer v2.3.0,
  ``pkg/runtime/framework/plugins/torch/torch.go``): ``PET_NNODES``, ``PET_NPROC_PER_NODE``
  (``auto`` or a number), ``PET_NODE_RANK`` (the Job's completion index), ``PET_MASTER_ADDR``
  (``<trainjob>-node-0-0.<trainjob>``) and ``PET_MASTER_PORT`` (29500). fsm-agent reads every
  ``PET_<FLAG>`` as torchrun does (``fsm_agent.cli``), above any discovered value: the job runs
  on the ``static`` rendezvous as under torchrun, and this plugin adds nothing.
* **PyTorchJob** (kubeflow/training-operator v1.9.0, ``pkg/controller.v1/pytorch/elastic.go``),
  elastic: ``PET_RDZV_BACKEND`` (``c10d``), ``PET_RDZV_ENDPOINT`` (``<job>-worker-0:<port>``),
  ``PET_NNODES`` (``MIN:MAX``), ``PET_MAX_RESTARTS``, ``PET_NPROC_PER_NODE``, ``PET_RDZV_ID`` and
  ``PET_RDZV_CONF`` when set: read as torchrun does too; this plugin adds nothing.
* **JobSet** (kubernetes-sigs/jobset v0.9.1) injects no ``PET_*`` variables, and every Job of a
  replicated Job numbers its pods from 0 (``JOB_COMPLETION_INDEX``, which Kubernetes sets in an
  Indexed Job's pods). The node rank therefore comes from the Job's index and the pod's index
  together, from variables the manifest maps with the downward API (examples/kubernetes/jobset.yaml):

  ===========================  ===============================================================
  key                          from
  ===========================  ===============================================================
  ``rendezvous.node_rank``     ``JOBSET_JOB_GLOBAL_INDEX`` (annotation ``jobset.sigs.k8s.io/job-global-index``)
                               x pods per Job + ``JOB_COMPLETION_INDEX``; pods per Job is
                               ``PET_NNODES`` / ``JOBSET_GLOBAL_REPLICAS`` (annotation
                               ``jobset.sigs.k8s.io/global-replicas``); one Job: the completion index
  ``rendezvous.endpoint``      ``JOBSET_COORDINATOR`` (annotation ``jobset.sigs.k8s.io/coordinator``:
                               the pod that ``spec.coordinator`` names), port 29400
  ``rendezvous.backend``       ``fsm`` (its store in the coordinator pod's agent), with an endpoint
  ``rendezvous.run_id``        ``jobset-<JOBSET_NAME>-<JOBSET_RESTART_ATTEMPT or 0>`` (annotations
                               ``jobset-name``, ``restart-attempt``): a restarted JobSet never
                               meets its own closed rendezvous
  ===========================  ===============================================================

* Any other **Indexed Job** pod: ``rendezvous.node_rank`` from ``JOB_COMPLETION_INDEX``.
"""

from __future__ import annotations

from collections.abc import Mapping

from fsm_agent.errors import ConfigError
from fsm_agent.plugins import hookimpl
from fsm_agent.scheduler import AUTO, DiscoveredJob

PLUGIN_NAME = "scheduler-kubernetes"
SCHEDULER = "kubernetes"
FSM_AGENT_KINDS = ("scheduler",)
#: The rendezvous backend of a discovered JobSet.
BACKEND = "fsm"
#: torchrun's c10d port: the coordinator pod's agent hosts the fsm store there.
PORT = 29400
#: Set by the kubelet in every container of every pod.
IN_A_POD = "KUBERNETES_SERVICE_HOST"
#: Set by the Job controller in an Indexed Job's pods (its annotation ``batch.kubernetes.io/job-completion-index``).
COMPLETION_INDEX = "JOB_COMPLETION_INDEX"
#: The downward-API variables a JobSet manifest maps (examples/kubernetes/jobset.yaml) -> the JobSet annotation it holds.
JOBSET_VARIABLES = {
    "JOBSET_NAME": "jobset.sigs.k8s.io/jobset-name",
    "JOBSET_JOB_GLOBAL_INDEX": "jobset.sigs.k8s.io/job-global-index",
    "JOBSET_GLOBAL_REPLICAS": "jobset.sigs.k8s.io/global-replicas",
    "JOBSET_COORDINATOR": "jobset.sigs.k8s.io/coordinator",
    "JOBSET_RESTART_ATTEMPT": "jobset.sigs.k8s.io/restart-attempt",
}


def _index(environ: Mapping[str, str], name: str, default: int | None = None) -> int | None:
    value = environ.get(name, "").strip()
    if not value:
        return default
    if not value.isdigit():
        label = JOBSET_VARIABLES.get(name)
        where = f" (the downward API of annotation {label})" if label else ""
        raise ConfigError(
            f"{name}={value!r}: not a whole number >= 0{where}; fix the pod's env in the manifest "
            f"or give --scheduler none"
        )
    return int(value)


def jobset_node_rank(environ: Mapping[str, str]) -> tuple[int, str] | None:
    """This pod's node rank in its JobSet and the variables it came from, or None without a completion index.

    Raises:
        ConfigError: several Jobs but ``PET_NNODES`` or ``JOBSET_GLOBAL_REPLICAS`` missing or not
            dividing into pods per Job, or a variable that is not a number.
    """
    pod = _index(environ, COMPLETION_INDEX)
    if pod is None:
        return None
    job = _index(environ, "JOBSET_JOB_GLOBAL_INDEX", 0)
    replicas = _index(environ, "JOBSET_GLOBAL_REPLICAS", 1)
    assert job is not None and replicas is not None
    if replicas <= 1 and job == 0:
        return pod, COMPLETION_INDEX
    nnodes = environ.get("PET_NNODES", "").strip()
    if not nnodes.isdigit() or replicas < 1 or int(nnodes) % replicas:
        raise ConfigError(
            f"JobSet with {replicas} Jobs (JOBSET_GLOBAL_REPLICAS): the node rank is job index x pods "
            f"per Job + JOB_COMPLETION_INDEX, and pods per Job is PET_NNODES / JOBSET_GLOBAL_REPLICAS; "
            f"set PET_NNODES to the total node count (a multiple of {replicas}, got {nnodes or 'unset'}), "
            f"or give --node-rank yourself"
        )
    per_job = int(nnodes) // replicas
    if pod >= per_job or job >= replicas:
        raise ConfigError(
            f"JobSet: JOB_COMPLETION_INDEX={pod} / JOBSET_JOB_GLOBAL_INDEX={job} lie outside "
            f"{replicas} Jobs of {per_job} pods (PET_NNODES={nnodes}); fix the manifest"
        )
    return job * per_job + pod, f"JOBSET_JOB_GLOBAL_INDEX,{COMPLETION_INDEX},PET_NNODES,JOBSET_GLOBAL_REPLICAS"


def discover_kubernetes(environ: Mapping[str, str], scheduler: str = AUTO) -> DiscoveredJob | None:
    """The pod ``environ`` describes (see the module docstring), or None outside a pod.

    Args:
        environ: the environment (``os.environ`` of the pod's container).
        scheduler: ``auto`` or ``kubernetes`` (``--scheduler``); any other name: None.

    Raises:
        ConfigError: ``scheduler == "kubernetes"`` outside a pod, or a malformed variable.
    """
    if scheduler not in (AUTO, SCHEDULER):
        return None
    if not environ.get(IN_A_POD, "").strip():
        if scheduler == AUTO:
            return None
        raise ConfigError(
            f"--scheduler kubernetes: not in a Kubernetes pod ({IN_A_POD} is unset); give "
            f"--scheduler none and the rendezvous flags"
        )
    values: dict[str, object] = {}
    origins: dict[str, str] = {}
    rank = jobset_node_rank(environ)
    if rank is not None:
        values["rendezvous.node_rank"], origins["rendezvous.node_rank"] = rank
    name = environ.get("JOBSET_NAME", "").strip()
    if name:
        attempt = _index(environ, "JOBSET_RESTART_ATTEMPT", 0)
        values["rendezvous.run_id"] = f"jobset-{name}-{attempt}"
        origins["rendezvous.run_id"] = "JOBSET_NAME,JOBSET_RESTART_ATTEMPT"
        coordinator = environ.get("JOBSET_COORDINATOR", "").strip()
        if coordinator:
            values["rendezvous.endpoint"], origins["rendezvous.endpoint"] = (
                f"{coordinator}:{PORT}",
                "JOBSET_COORDINATOR",
            )
            values["rendezvous.backend"], origins["rendezvous.backend"] = BACKEND, "(its default backend)"
    return DiscoveredJob(scheduler=SCHEDULER, values=values, origins=origins)


@hookimpl
def fsm_agent_discover_job(environ: Mapping[str, str], scheduler: str) -> DiscoveredJob | None:
    return discover_kubernetes(environ, scheduler)
