"""examples/kubernetes/: the manifests parse as YAML, name what docs/schedulers.md says, and their
exit codes are the exit-code table's (docs/failure-handling.md#exit-codes, fsm_agent constants).

No cluster is reachable from CI: this checks the manifests' text, the contract tests in
tests/schedulers/kubernetes/test_kubernetes_pods.py run agents with the environment these pods receive.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

from fsm_agent.plugins.restart_policy import DO_NOT_RESTART_EXIT_CODE  # noqa: E402
from fsm_agent.plugins.scheduler_kubernetes import JOBSET_VARIABLES  # noqa: E402
from fsm_agent.worker import DO_NOT_REQUEUE_EXIT_CODE  # noqa: E402

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "examples" / "kubernetes"
#: Exit codes after which a new pod would fail the same way: bad input, do-not-restart, no progress.
FAIL_AT_ONCE = {2, DO_NOT_RESTART_EXIT_CODE, DO_NOT_REQUEUE_EXIT_CODE}


def documents(name: str) -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all((EXAMPLES / name).read_text())}


def exit_code_table() -> dict[int, str]:
    """docs/failure-handling.md's table: {exit code: the row's requeue advice}."""
    text = (ROOT / "docs" / "failure-handling.md").read_text()
    table = text.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3:
            continue
        if re.fullmatch(r"\d+( \(.*\))?", cells[1]):
            rows[int(cells[1].split()[0])] = cells[2]
        elif cells[1].startswith("128+N: 143 for SIGTERM"):  # the agent got a signal
            rows[143] = cells[2]
    return rows


def fail_job_codes(job_spec: dict, container: str) -> set[int]:
    codes = set()
    for rule in job_spec["podFailurePolicy"]["rules"]:
        if rule["action"] == "FailJob":
            assert rule["onExitCodes"]["operator"] == "In" and rule["onExitCodes"]["containerName"] == container
            codes |= set(rule["onExitCodes"]["values"])
    return codes


def test_the_fail_at_once_codes_are_the_tables_do_not_requeue_rows():
    table = exit_code_table()
    assert {0, 1, 2, 69, 78, 79, 124} <= set(table), table
    for code in FAIL_AT_ONCE:
        assert re.match(r"(no|never)\b", table[code]), (code, table[code])
    for code in (69, 124):  # a hang or a failed health check: another node may do
        assert table[code].startswith("requeue") or "requeue" in table[code]


def test_jobset_fails_at_once_on_the_do_not_restart_codes_and_restarts_otherwise():
    jobset = documents("jobset.yaml")["JobSet"]
    assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    rjob = jobset["spec"]["replicatedJobs"][0]
    job = rjob["template"]["spec"]
    container = job["template"]["spec"]["containers"][0]
    assert fail_job_codes(job, container["name"]) == FAIL_AT_ONCE
    assert job["backoffLimit"] == 0 and job["template"]["spec"]["restartPolicy"] == "Never"
    rules = jobset["spec"]["failurePolicy"]["rules"]
    assert rules[0]["action"] == "FailJobSet" and rules[0]["onJobFailureReasons"] == ["PodFailurePolicy"]
    assert rules[-1]["action"] == "RestartJobSet" and jobset["spec"]["failurePolicy"]["maxRestarts"] >= 1
    # the variables the plugin reads, each from the JobSet annotation it names
    env = {e["name"]: e for e in container["env"]}
    for name, annotation in JOBSET_VARIABLES.items():
        assert env[name]["valueFrom"]["fieldRef"]["fieldPath"] == f"metadata.annotations['{annotation}']"
    assert (
        int(env["PET_NNODES"]["value"])
        == rjob["replicas"] * job["parallelism"]
        == rjob["replicas"] * job["completions"]
    )
    coordinator = jobset["spec"]["coordinator"]
    assert coordinator["replicatedJob"] == rjob["name"] and coordinator["jobIndex"] == coordinator["podIndex"] == 0
    assert container["command"][:2] == ["fsm-agent", "run"]


def test_trainjob_runtime_fails_at_once_on_the_do_not_restart_codes():
    docs = documents("trainjob.yaml")
    runtime, trainjob = docs["TrainingRuntime"], docs["TrainJob"]
    assert runtime["apiVersion"] == trainjob["apiVersion"] == "trainer.kubeflow.org/v1alpha1"
    assert "torch" in runtime["spec"]["mlPolicy"]
    rjob = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]
    assert rjob["name"] == "node"  # the torch plugin's container and Job name (PET_MASTER_ADDR <job>-node-0-0)
    job = rjob["template"]["spec"]
    container = job["template"]["spec"]["containers"][0]
    assert container["name"] == "node"
    assert fail_job_codes(job, "node") == FAIL_AT_ONCE
    assert trainjob["spec"]["runtimeRef"]["name"] == runtime["metadata"]["name"]
    assert trainjob["spec"]["trainer"]["command"][:2] == ["fsm-agent", "run"]


def test_pytorchjob_is_elastic_c10d_and_restarts_only_on_signal_codes():
    job = documents("pytorchjob.yaml")["PyTorchJob"]
    assert job["apiVersion"] == "kubeflow.org/v1"
    policy = job["spec"]["elasticPolicy"]
    assert policy["rdzvBackend"] == "c10d" and policy["minReplicas"] < policy["maxReplicas"]
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    # ExitCode (training-operator v1.9.0): 1-127 permanent, 128-255 retried; the table's codes fall so
    assert worker["restartPolicy"] == "ExitCode"
    assert all(code < 128 for code in FAIL_AT_ONCE)
    assert exit_code_table()[143].startswith("yes"), "143 (SIGTERM: preempted, evicted) is to be run again"
    assert worker["template"]["spec"]["containers"][0]["command"][:2] == ["fsm-agent", "run"]
