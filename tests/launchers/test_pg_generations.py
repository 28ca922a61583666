"""How workers get process-group generations (fsm_agent/pg_generations.py): the start-up hook of
subprocess workers shadows no one, and the handler is replaced whether torch comes first or later.
What it is for (re-created groups, rank 0 destroying late): tests/agent/test_reinit_process_group*.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

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
def test_the_env_handler_is_replaced_whether_torch_is_imported_before_or_after(torch_first):
    code = (
        "import sys\n"
        + ("import torch.distributed.rendezvous\n" if torch_first else "assert 'torch' not in sys.modules\n")
        + "from fsm_agent.pg_generations import install\ninstall()\n"
        + ("" if torch_first else "assert 'torch' not in sys.modules, 'install imported torch'\n")
        + "import torch.distributed.rendezvous\n"
        "h = sys.modules['torch.distributed.rendezvous']._rendezvous_handlers\n"
        "assert h['env']._fsm_agent_generations, h\n"
        "assert not hasattr(h['tcp'], '_fsm_agent_generations')\n"
        "install()\n"  # twice: still one wrapper, not a wrapper of a wrapper
        "assert h['env'].__closure__ and not any(getattr(c.cell_contents, '_fsm_agent_generations', False)"
        " for c in h['env'].__closure__ if callable(c.cell_contents))\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
