"""How often each agent asks the rendezvous store for a peer's job-wide drain: the job's total
stays flat in the number of nodes, and a look is never so rare that an announcer leaves before
its peers have seen the drain (it waits JOB_DRAIN_SEEN_WAIT_S for them)."""

from __future__ import annotations

import pytest

from fsm_agent.drain import (
    DRAIN_POLL_S,
    JOB_DRAIN_LOOKS_PER_S,
    JOB_DRAIN_SEEN_WAIT_S,
    job_drain_look_interval,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("nodes", [2, 8, 64, 256, 500])
def test_small_jobs_look_as_often_as_the_drain_file(nodes):
    assert job_drain_look_interval(nodes) == DRAIN_POLL_S


@pytest.mark.parametrize("nodes", [1_000, 2_048, 4_096, 10_000])
def test_the_store_sees_a_flat_rate_of_looks_at_scale(nodes):
    interval = job_drain_look_interval(nodes)
    assert nodes / interval == pytest.approx(JOB_DRAIN_LOOKS_PER_S)  # the whole job's looks per second


@pytest.mark.parametrize("nodes", [10_000, 30_000, 100_000])
def test_every_agent_looks_well_within_the_announcers_wait(nodes):
    # jittered by up to +50 %: still under the wait, with room for the look's own round trip
    assert 1.5 * job_drain_look_interval(nodes) < JOB_DRAIN_SEEN_WAIT_S
    assert nodes / job_drain_look_interval(nodes) >= JOB_DRAIN_LOOKS_PER_S  # capped: more, never less often
