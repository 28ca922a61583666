"""``import fsm_agent`` starts no process and installs no signal handler, even in a process whose
argv looks like the agent command; only the console scripts' entry (``fsm_agent._entry``) does.
``from fsm_agent import *`` does not import torch (#31 item 5)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.unit

PROBE = textwrap.dedent("""
    import json, os, signal, sys
    sys.argv = ["fsmrun", "--launcher", "preload", "--preload-modules", "json",
                "--forward-signals", "USR1", "--drain-signals", "USR2", "w.py"]
    watched = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2]
    before = [signal.getsignal(s) for s in watched]
    import fsm_agent
    from fsm_agent import *
    after_import = [signal.getsignal(s) for s in watched]
    children = open(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read().split()
    torch_loaded = "torch" in sys.modules
    # the same argv through the console scripts' entry: now the handlers and the zygote are there
    import fsm_agent._entry, fsm_agent._early_zygote as early
    fsm_agent._entry.start_early()
    after_entry = [signal.getsignal(s) for s in watched]
    started = early._early is not None
    early.discard()
    print(json.dumps({"import_changed": [str(s) for s, b, a in zip(watched, before, after_import) if a != b],
                      "children": children, "torch": torch_loaded, "launch_agent": callable(launch_agent),
                      "entry_changed": sum(a != b for b, a in zip(before, after_entry)), "zygote": started}))
""")


def test_import_fsm_agent_installs_nothing_and_starts_nothing():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["import_changed"] == [] and seen["children"] == [], seen
    assert seen["torch"] is False and seen["launch_agent"] is True, seen
    # the probe is not vacuous: the entry point does act on this argv
    assert seen["entry_changed"] >= 4 and seen["zygote"] is True, seen


def test_every_public_name_resolves_and_star_leaves_out_only_the_torch_errors():
    import fsm_agent

    assert set(fsm_agent._EXPORTS) - set(fsm_agent.__all__) == {"WorkerGroupFailedError", "AgentFailedError"}
    for name in (*fsm_agent._EXPORTS, *fsm_agent.__all__):
        assert getattr(fsm_agent, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        fsm_agent.nope  # noqa: B018


def test_heartbeat_is_the_function_even_after_its_module_was_imported():
    """A worker that imports ``fsm_agent.heartbeat`` the module first still calls ``fsm_agent.heartbeat()``."""
    code = (
        "import fsm_agent.heartbeat as m, fsm_agent; print(callable(fsm_agent.heartbeat), callable(fsm_agent.compute))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.split() == ["True", "True"], done.stderr
