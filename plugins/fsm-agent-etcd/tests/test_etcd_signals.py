"""Stop signals with the etcd-v3 plugin backend, against a real etcd: in every state the agent ends
at once with 128+N, no traceback, and its workers get the signal it got (SIGINT: KeyboardInterrupt).

The same guarantees for the built-in backends, side by side with torchrun: tests/parity/test_signals.py.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from pathlib import Path

import pytest

from fsm_agent.testing import wait_until

pytestmark = pytest.mark.slow

STOP_BOUND_S = 20.0  # far below the workers' grace (GRACE_S) and any rendezvous timeout
GRACE_S = "90"

#: Writes started_<RANK> once its handlers are in place, signal_<RANK> with the first signal it gets
#: (SIGINT: KeyboardInterrupt), then dies of that signal; EXIT_AFTER seconds: exits 0 by itself.
WORKER = r"""
import os, signal, sys, time
rank = os.environ["RANK"]
def note(what):
    with open("signal_%s" % rank, "w") as f:
        f.write(what)
def on(signum, frame):
    note(signal.Signals(signum).name)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):
    signal.signal(s, on)
open("started_%s" % rank, "w").close()
try:
    time.sleep(float(os.environ.get("EXIT_AFTER", "120")))
except KeyboardInterrupt:
    note("KeyboardInterrupt")
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
"""


def agent_args(etcd_server, run_id: str) -> list[str]:
    return [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "etcd-v3",
        "--rdzv-endpoint",
        etcd_server.endpoint,
        "--rdzv-id",
        run_id,
        "--local-addr",
        "127.0.0.1",
        "--monitor-interval",
        "0.1",
        "--shutdown-timeout",
        GRACE_S,
        "--exit-barrier-timeout",
        "200",
        "--rdzv-conf",
        "join_timeout=120",
    ]


def stop(proc, sig: int) -> None:
    sent = time.monotonic()
    proc.send_signal(sig)
    stopped(proc, sig, sent)


def stopped(proc, sig: int, sent: float) -> None:
    """``proc`` ends with 128+``sig`` within the bound of the signal ``sent`` (monotonic seconds)."""
    if not wait_until(lambda: proc.poll() is not None, STOP_BOUND_S):
        os.killpg(proc.pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    took = time.monotonic() - sent
    why = f"exit {proc.returncode} after {took:.1f}s\n{err[-4000:]}"
    assert proc.returncode == 128 + sig and took < STOP_BOUND_S, why
    assert "Traceback" not in err, why


def joined(etcd_server, run_id: str) -> bool:
    values = etcd_server.client().get(f"/torch/elastic/rendezvous/{run_id}")
    return bool(values)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_stop_while_waiting_for_the_other_node(tmp_path, agents, etcd_server, sig):
    run_id = f"wait-{uuid.uuid4().hex[:8]}"
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    proc = agents.start(*agent_args(etcd_server, run_id), str(script))
    assert wait_until(lambda: joined(etcd_server, run_id) or proc.poll() is not None, 90)
    time.sleep(0.5)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    stop(proc, sig)
    assert not list(tmp_path.glob("started_*"))


def test_workers_get_the_signal_and_the_exit_barrier_stops(tmp_path, agents, etcd_server):
    """Agent b's worker is done at once, a's runs: b waits in the exit barrier and ends on SIGTERM;
    then a on SIGINT, its worker gets KeyboardInterrupt."""
    run_id = f"bar-{uuid.uuid4().hex[:8]}"
    dirs = {name: tmp_path / name for name in ("a", "b")}
    procs = {}
    for name, path in dirs.items():
        path.mkdir()
        (path / "worker.py").write_text(WORKER)
        agents.cwd = path
        procs[name] = agents.start(
            *agent_args(etcd_server, run_id), "worker.py", env={"EXIT_AFTER": "0" if name == "b" else "120"}
        )
    assert wait_until(lambda: all(list(p.glob("started_*")) for p in dirs.values()), 120), [
        p.communicate()[1][-2000:] for p in procs.values() if p.poll() is not None
    ]
    time.sleep(2.0)  # b's worker is done: b is in the exit barrier
    assert procs["b"].poll() is None
    # Both at once: b leaves its round on SIGTERM, and a, given time, would see it leave and stop
    # its worker for the re-rendezvous (SIGTERM) before the SIGINT this test is about.
    sent = time.monotonic()
    procs["b"].send_signal(signal.SIGTERM)
    procs["a"].send_signal(signal.SIGINT)
    stopped(procs["b"], signal.SIGTERM, sent)
    stopped(procs["a"], signal.SIGINT, sent)
    assert [Path(p).read_text() for p in dirs["a"].glob("signal_*")] == ["KeyboardInterrupt"]
    assert json.dumps([str(p) for p in dirs["b"].glob("signal_*")]) == "[]"
