"""A staggered start of ``--nnodes 1:2`` waits for the late node instead of restarting for it (#30.8).

The first agent is in its rendezvous (it hosts the store: its port answers) for a few seconds
before the second one starts. With the backend's default ``last_call_timeout`` the first round
waits for ``max_nodes`` as torch's c10d does (30 s), so both workers start once, in a world of
two, with restart_count 0. The fsm backend's old default (0.5 s) started the first node alone
and restarted its worker into a second round when the other node came: a model load per
staggered start.
"""

from __future__ import annotations

import json
import time

import pytest

from fsm_agent.plugins.rendezvous_fsm.params import FsmRendezvousSettings
from fsm_agent.plugins.rendezvous_fsm.planner import DEFAULT_LAST_CALL_TIMEOUT_S
from tests.conftest import free_port, write_script
from tests.parity.conftest import wait_listening

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

#: Seconds the first agent waits in its rendezvous before the second agent is started.
STAGGER_S = 3.0

WORKER = r"""
import json, os
out = os.environ["FSM_E2E_OUT"]
with open(os.path.join(out, "start_%s_%s.json" % (os.environ["GROUP_RANK"], os.getpid())), "w") as f:
    json.dump({k: os.environ[k] for k in ("WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT", "GROUP_WORLD_SIZE")}, f)
"""


def test_the_default_settle_window_is_torchs():
    assert FsmRendezvousSettings().last_call_timeout == DEFAULT_LAST_CALL_TIMEOUT_S == 30.0


@pytest.mark.parametrize("backend", ["fsm", "c10d"])
def test_a_staggered_start_waits_for_the_late_node(launcher, backend):
    script = write_script(launcher.dir, "staggered.py", WORKER)
    port = free_port()

    def agent(hosts: bool):
        return launcher.fsm(
            *("--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "1", "--monitor-interval", "0.2"),
            *("--rdzv-backend", backend, "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "staggered"),
            *("--rdzv-conf", f"is_host={int(hosts)}", "--local-addr", "127.0.0.1"),
            script,
        )

    first = agent(hosts=True)
    wait_listening(port, first)
    time.sleep(STAGGER_S)  # well past the old 0.5 s window, well inside the default 30 s
    second = agent(hosts=False)
    for result in (second.wait().check(), first.wait().check()):
        assert "re-rendezvous" not in result.stderr and "membership changed" not in result.stderr, result.stderr
    starts = [json.loads(p.read_text()) for p in launcher.out.glob("start_*.json")]
    assert len(starts) == 2, f"a worker was started again: {starts}"
    assert all(s == {"WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "0", "GROUP_WORLD_SIZE": "2"} for s in starts), (
        starts
    )
