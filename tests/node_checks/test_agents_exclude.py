"""Real agents exclude the node that fails its check before any worker starts, and a hot spare
takes its seat: ``fsm`` and ``c10d`` backends on loopback, ``--nnodes 2:2``, three agents, the device check
(``--node-check-device-command``) failing on one of them.

The check sleeps a moment on every node so that the third agent, started once the round formed,
waits as a standby while the round is being checked (the order the test needs, not a race).
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from fsm_agent.testing.processes import wait_until
from tests.conftest import free_port, write_script
from tests.helpers.events import read_events, transitions

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

WORKER = r"""
import datetime, torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == dist.get_world_size() == 2, t
dist.destroy_process_group()  # gloo's threads joined: no "terminate called" abort at exit
"""
#: The device command: every node takes 2 s; the node given BAD=1 then fails, naming the device.
CHECK = 'sleep 2; if [ -n "$BAD" ]; then echo "GPU 3: uncorrectable ECC error" >&2; exit 1; fi'


def flags(backend: str, port: int, events: Path) -> list[str]:
    return [
        "--nnodes", "2:2", "--nproc-per-node", "1", "--max-restarts", "0", "--monitor-interval", "0.1",
        "--rdzv-backend", backend, "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"node-checks-{backend}",
        "--local-addr", "127.0.0.1", "--rdzv-conf", "join_timeout=120",
        "--node-check-device-command", CHECK, "--node-check-timeout", "20",
        "--events-file", str(events),
    ]  # fmt: skip


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize(
    ("backend", "extra"),
    [("fsm", ()), ("c10d", ()), ("fsm", ("--node-check-every-round", "false"))],
    ids=["fsm", "c10d", "fsm-first-round-only"],
)
def test_the_bad_node_is_excluded_and_a_hot_spare_takes_its_seat(launcher, backend, extra):
    """With ``--node-check-every-round false`` the nodes that checked skip their own checks in the
    re-formed round, never the exchange: the spare checks, every node reads one decision."""
    port = free_port()
    script = write_script(launcher.dir, "train.py", WORKER)
    events = {name: Path(launcher.dir) / f"{name}.jsonl" for name in "abc"}
    a = launcher.fsm(
        *flags(backend, port, events["a"]), *extra, script, env={"LOGLEVEL": "INFO"}
    )  # its "rendezvous complete"
    assert wait_until(lambda: _listening(port), timeout=60), a.output()[1]  # a hosts the store
    b = launcher.fsm(*flags(backend, port, events["b"]), *extra, script, env={"BAD": "1"})
    assert wait_until(lambda: "rendezvous complete" in a.output()[1], timeout=60), a.output()[1]
    c = launcher.fsm(*flags(backend, port, events["c"]), *extra, script)  # the round is full: a standby
    bad = b.wait(120)
    assert bad.returncode == 69, bad.stderr  # EX_UNAVAILABLE: requeue elsewhere, as a failed health check
    assert "node check failed (node_check)" in bad.stderr and "GPU 3: uncorrectable ECC error" in bad.stderr
    assert not any(e["kind"] == "worker_exit" for e in read_events(events["b"])), "a worker started on the bad node"
    for proc in (a, c):
        result = proc.wait(120)
        assert result.returncode == 0, result.stderr
    checks = [e for e in read_events(events["a"]) if e["kind"] == "node_check"]
    assert list(checks[0]["excluded"]) == ["1"] and "GPU 3" in checks[0]["excluded"]["1"], checks[0]
    assert checks[-1]["excluded"] == {} and len(checks) == 2, checks  # the re-formed round passed
    assert transitions(events["a"]) == [
        ("INIT", "INIT", "nodes_excluded"),
        ("INIT", "HEALTHY", "start"),
        ("HEALTHY", "SUCCEEDED", "workers_succeeded"),
    ]
    assert transitions(events["b"]) == [("INIT", "FAILED", "node_check_failed")]
    assert transitions(events["c"]) == [("INIT", "HEALTHY", "start"), ("HEALTHY", "SUCCEEDED", "workers_succeeded")]
    found = checks[0]["ts"]
    started = next(e["ts"] for e in read_events(events["a"]) if e["kind"] == "transition" and e["trigger"] == "start")
    print(f"excluded at +{checks[0]['seconds']:.1f}s of checks; the spare's round started {started - found:.1f}s later")


def test_with_static_rendezvous_every_node_ends_naming_the_bad_one(launcher):
    """``static`` cannot re-form a round without a node: every node ends, each naming the bad one,
    and no worker starts anywhere."""
    port = free_port()
    script = write_script(launcher.dir, "train.py", WORKER)
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    common += ["--node-check-device-command", CHECK, "--node-check-timeout", "20"]
    procs = [
        launcher.fsm(*common, "--node-rank", str(rank), script, env={"BAD": "1"} if rank == 1 else {})
        for rank in (0, 1)
    ]
    for proc in procs:
        result = proc.wait(120)
        assert result.returncode == 69, result.stderr
        assert "group rank 1" in result.stderr or "node check failed (node_check): localhost: device" in result.stderr
        assert "GPU 3: uncorrectable ECC error" in result.stderr
    assert "the static rendezvous cannot re-form the round without it" in procs[0].wait(1).stderr


def test_when_the_store_host_fails_its_check_every_node_ends_naming_it(launcher):
    """The node hosting the ``fsm`` store fails its check: the round cannot re-form without the
    store, so every node ends with ``node_check_failed`` (exit 69) naming it, no worker started."""
    port = free_port()
    script = write_script(launcher.dir, "train.py", WORKER)
    events = {name: Path(launcher.dir) / f"{name}.jsonl" for name in "ab"}
    a = launcher.fsm(*flags("fsm", port, events["a"]), script, env={"BAD": "1"})
    assert wait_until(lambda: _listening(port), timeout=60), a.output()[1]  # a hosts the store
    b = launcher.fsm(*flags("fsm", port, events["b"]), script)
    for proc, name in ((a, "a"), (b, "b")):
        result = proc.wait(120)
        assert result.returncode == 69, result.stderr
        assert transitions(events[name]) == [("INIT", "FAILED", "node_check_failed")]
        assert not any(e["kind"] == "worker_exit" for e in read_events(events[name]))
    assert "hosts the rendezvous store: the round cannot re-form without it" in b.wait(1).stderr
