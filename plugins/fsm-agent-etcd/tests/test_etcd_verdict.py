"""etcd-v3: a failed two-node job ends on both nodes with one verdict, within the bound, as on the
built-in backends (tests/agent/test_job_verdict.py, whose job and checks this reuses): the verdict
travels through the round's store, which for etcd-v3 is etcd itself."""

from __future__ import annotations

import uuid

import pytest

from tests.agent.test_job_verdict import BAD_RANK, NPROC, check_one_verdict, run_failing_job
from tests.conftest import launcher  # noqa: F401, F811  (the fixture: its teardown fails on orphans)

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("peers", ["computing", "in_collective"])
def test_every_node_ends_with_the_same_verdict(launcher, etcd_server, peers):  # noqa: F811
    run_id = f"verdict-{uuid.uuid4().hex[:8]}"

    def flags(node: int) -> list[str]:
        return [
            "--nnodes", "2", "--nproc-per-node", str(NPROC), "--max-restarts", "0", "--monitor-interval", "0.1",
            "--local-addr", "127.0.0.1", "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", etcd_server.endpoint,
            "--rdzv-id", run_id,
        ]  # fmt: skip

    verdict = check_one_verdict(run_failing_job(launcher, flags, peers))
    assert verdict["classes"][str(BAD_RANK)] == "root_cause"
