"""How workers get process-group generations (fsm_agent/pg_generations.py): the start-up hook of
subprocess workers shadows no one, and the handler is replaced whether torch comes first or later.
What it is for (re-created groups, rank 0 destroying late): tests/agent/test_reinit_process_group*.py."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import pytest

from fsm_agent.pg_generations import PROBES_PER_S_AT_RANK0, _wait_until_listening
from tests.conftest import write_script

pytestmark = [pytest.mark.e2e]

PROBE = r"""
import json, os, sys
import torch.distributed.rendezvous
handlers = sys.modules["torch.distributed.rendezvous"]._rendezvous_handlers  # the name is also a function
with open(os.path.join(os.environ["FSM_E2E_OUT"], "probe.json"), "w") as f:
    json.dump({"generations": getattr(handlers["env"], "_fsm_agent_generations", False),
               "sitecustomize": sys.modules["sitecustomize"].__file__,
               "user_site_ran": os.environ.get("USER_SITECUSTOMIZE_RAN"), "pid": os.getpid(),
               "pythonpath": os.environ.get("PYTHONPATH"), "path": sys.path}, f)
"""


@pytest.mark.parametrize("launcher_name", ["subprocess", "preload"])
def test_a_workers_own_sitecustomize_still_runs(launcher, launcher_name):
    user_site = launcher.dir / "user_site"
    user_site.mkdir()
    write_script(user_site, "sitecustomize.py", "import os\nos.environ['USER_SITECUSTOMIZE_RAN'] = str(os.getpid())\n")
    script = write_script(launcher.dir, "probe.py", PROBE)
    env = launcher.env({"PYTHONPATH": str(user_site)})
    launcher.fsm("--standalone", "--nproc-per-node", "1", "--launcher", launcher_name, script, env=env).wait(
        120
    ).check()
    probe = json.loads((launcher.out / "probe.json").read_text())
    assert probe["generations"] is True, probe
    # the user's sitecustomize ran in the worker (subprocess) or in the zygote it forked from
    # (preload); it is sys.modules' one; PYTHONPATH and sys.path are the user's
    if launcher_name == "subprocess":
        assert probe["user_site_ran"] == str(probe["pid"]), probe
    assert probe["sitecustomize"] == str(user_site / "sitecustomize.py"), probe
    assert probe["pythonpath"] == str(user_site), probe
    assert not any("_worker_site" in p for p in probe["path"]), probe


@pytest.mark.parametrize("torch_first", [True, False])
def test_env_and_tcp_handlers_are_replaced_whether_torch_is_imported_before_or_after(torch_first):
    code = (
        "import sys\n"
        + ("import torch.distributed.rendezvous\n" if torch_first else "assert 'torch' not in sys.modules\n")
        + "from fsm_agent.pg_generations import install\ninstall()\n"
        + ("" if torch_first else "assert 'torch' not in sys.modules, 'install imported torch'\n")
        + "import torch.distributed.rendezvous\n"
        "h = sys.modules['torch.distributed.rendezvous']._rendezvous_handlers\n"
        "assert h['env']._fsm_agent_generations and h['tcp']._fsm_agent_generations, h\n"
        "assert not hasattr(h['file'], '_fsm_agent_generations')\n"
        "install()\n"  # twice: still one wrapper, not a wrapper of a wrapper
        "assert all(h[s].__closure__ and not any(getattr(c.cell_contents, '_fsm_agent_generations', False)"
        " for c in h[s].__closure__ if callable(c.cell_contents)) for s in ('env', 'tcp'))\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


LATE_RANK_0 = r"""
import datetime, json, os, time
rank = int(os.environ["RANK"])
if rank == 0:
    time.sleep(2.0)  # rank 0 is slow to start (importing torch on a busy node): the others knock first
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=60))
value = torch.tensor([1.0])
dist.all_reduce(value)
with open(os.path.join(os.environ["FSM_E2E_OUT"], "late_%d.json" % rank), "w") as f:
    json.dump({"sum": value.item()}, f)
dist.destroy_process_group()
"""


@pytest.mark.parametrize("launcher_name", ["subprocess", "preload"])
def test_ranks_that_start_before_rank_0_wait_for_its_store(launcher, launcher_name):
    script = write_script(launcher.dir, "late.py", LATE_RANK_0)
    launcher.fsm("--standalone", "--nproc-per-node", "3", "--launcher", launcher_name, script).wait(120).check()
    records = [json.loads(p.read_text()) for p in launcher.out.glob("late_*.json")]
    assert sorted(r["sum"] for r in records) == [3.0, 3.0, 3.0], records


def test_the_wait_for_rank_0s_store_returns_once_it_listens():
    """What spares ranks > 0 torch's 0.5 s backoff after a refused connection: they try again
    within a short pause (tests the order of events, not a speed; the speed is benchmark (c))."""
    with socket.socket() as probe:  # a free port, then nobody listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started: list[float] = []
    server = socket.socket()

    def listen_later() -> None:
        time.sleep(0.5)
        server.bind(("127.0.0.1", port))
        server.listen()
        started.append(time.monotonic())

    thread = threading.Thread(target=listen_later)
    thread.start()
    try:
        assert _wait_until_listening("127.0.0.1", port, 60.0, world_size=2) is True
        returned = time.monotonic()
        thread.join()
        assert started and returned >= started[0]
    finally:
        thread.join()
        server.close()


def test_the_wait_for_rank_0s_store_gives_up_at_its_timeout():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    begun = time.monotonic()
    assert _wait_until_listening("127.0.0.1", port, 0.3, world_size=2) is False
    assert time.monotonic() - begun < 30  # generous: it stops trying, it does not hang


def test_a_large_job_knocks_less_often(monkeypatch):
    """Each rank > 0 pauses up to max(PROBE_PAUSE_MAX_S, world_size / PROBES_PER_S_AT_RANK0) s
    between tries, so rank 0's host is not flooded by a large job's ranks while it starts."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    tries: list[int] = []
    connect = socket.create_connection

    def counted(*args, **kwargs):
        tries.append(1)
        return connect(*args, **kwargs)

    monkeypatch.setattr(socket, "create_connection", counted)
    counts = {}
    for world_size in (2, 100 * PROBES_PER_S_AT_RANK0):  # longest pause 0.05 s, then 100 s
        tries.clear()
        assert _wait_until_listening("127.0.0.1", port, 2.0, world_size) is False
        counts[world_size] = len(tries)
    # 5 ms doubling: about 40 tries in 2 s capped at 0.05 s, at most 10 uncapped (5 ms * 2**9 > 2 s)
    assert counts[2] >= 15 and counts[100 * PROBES_PER_S_AT_RANK0] <= 10, counts
