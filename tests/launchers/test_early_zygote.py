"""``fsm_agent._early_zygote``: the preload launcher's zygote starts when the agent command starts.

Each case runs a fresh interpreter whose argv is the agent command (``python -m fsm_agent run ...``
is what ``_early_signals`` and this module recognise) and calls what the console scripts call first
(``fsm_agent._entry.start_early``); ``json`` stands in for torch (the zygote imports it in no time).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.unit

#: Run as ``python -c CODE`` with sys.argv/orig_argv made to look like ``python -m fsm_agent run ARGS``.
CHECK = textwrap.dedent("""
    import json, sys
    args = json.loads(sys.argv[1])
    sys.argv = ["fsm-agent", "run", *args]
    import fsm_agent._early_zygote as early, fsm_agent._entry
    fsm_agent._entry.start_early()
    started = early._early is not None
    modules = early._early[0] if started else None
    zygote = None
    taken = early.take(sys.argv[-1])
    if taken is not None:
        zygote, sock = taken
        sock.close()  # the zygote ends when the agent's end of its socket closes
        zygote.wait(60)
    print(json.dumps({"started": started, "modules": modules, "taken": taken is not None,
                      "zygote_ended": zygote is None or zygote.returncode is not None,
                      "again": early.take(sys.argv[-1]) is not None}))
""")


def run_check(args: list[str], env: dict[str, str] | None = None) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", CHECK, json.dumps(args)], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize(
    "args, started, taken",
    [
        (["--launcher", "preload", "--preload-modules", "json", "w.py", "json"], True, True),
        (["--launcher=preload", "--preload-modules=json", "w.py", "json"], True, True),
        # configured with other modules than the quick look saw: ended, the launcher starts its own
        (["--launcher", "preload", "--preload-modules", "json", "w.py", "csv"], True, False),
        (["--launcher", "subprocess", "w.py", "json"], False, False),
        (["w.py", "json"], False, False),
    ],
)
def test_started_for_the_preload_launcher_only_and_taken_once(args, started, taken):
    seen = run_check(args)
    assert (seen["started"], seen["taken"]) == (started, taken)
    assert seen["modules"] == ("json" if started else None)
    assert seen["zygote_ended"] and not seen["again"]  # one taker; an untaken one is ended by take()


def test_the_environment_chooses_the_launcher_too():
    import os

    env = {**os.environ, "FSM_AGENT_LAUNCHER": "preload", "FSM_AGENT_PRELOAD_MODULES": "json"}
    seen = run_check(["w.py", "json"], env=env)
    assert seen["started"] and seen["taken"] and seen["modules"] == "json"


def test_a_program_that_imports_fsm_agent_starts_no_zygote():
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import fsm_agent._early_zygote as e, fsm_agent; print(e._early)",
            "--launcher",
            "preload",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and done.stdout.strip() == "None", done.stderr


def test_discard_ends_a_zygote_nobody_took():
    """What the preload plugin's configure hook does when the run's launcher is another one."""
    code = textwrap.dedent("""
        import sys
        sys.argv = ["fsm-agent", "run", "--launcher", "preload", "--preload-modules", "json", "w.py"]
        import fsm_agent._early_zygote as early, fsm_agent._entry
        fsm_agent._entry.start_early()
        zygote = early._early[1]
        early.discard()
        print(zygote.returncode is not None, early.take("json") is None)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.split() == ["True", "True"], done.stderr
