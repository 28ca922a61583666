"""The plugins of a run are loaded once per process: one plugin manager, one backend registry,
one collection of options (``fsm_agent.plugins.manager.LoadedPlugins``), handed from the CLI down
to the launch.

The witness is a real plugin installed the way a third-party one is: a distribution (a
``.dist-info`` with an ``fsm_agent`` entry point, in a temporary directory the agent gets on
``PYTHONPATH``) whose ``fsm_agent_register_backends`` and ``fsm_agent_addoption`` append one line
per call, with the calling process's pid, to a file. Real agents run a real worker; nothing of the
product is replaced.
"""

from __future__ import annotations

import os
import sys

import pytest

pytestmark = pytest.mark.integration

COUNTING_PLUGIN = """\
import os

from fsm_agent.plugins import hookimpl


def _note(hook):
    with open(os.environ["COUNTING_PLUGIN_CALLS"], "a") as calls:
        calls.write(f"{hook} {os.getpid()}\\n")


@hookimpl
def fsm_agent_register_backends(registry):
    _note("register_backends")


@hookimpl
def fsm_agent_addoption(options):
    _note("addoption")
    options.add("level", type=int, default=1, help="a level (shows that its flag is read)")
"""


@pytest.fixture
def counting(tmp_path, request):
    """``run(argv) -> (pid, calls)``: ``python ARGV`` with the counting plugin installed (entry point
    ``counting``), the calls its hooks noted, and the pid of the process (it must succeed)."""
    site = tmp_path / "site"
    dist_info = site / "fsm_agent_counting_fixture-0.0.1.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: fsm-agent-counting-fixture\nVersion: 0.0.1\n")
    (dist_info / "entry_points.txt").write_text("[fsm_agent]\ncounting = fsm_agent_counting_fixture\n")
    (site / "fsm_agent_counting_fixture.py").write_text(COUNTING_PLUGIN)
    calls = tmp_path / "calls.txt"
    env = {
        "PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p),
        "COUNTING_PLUGIN_CALLS": str(calls),
    }

    processes = request.getfixturevalue("launcher")

    def run(argv: list[str]) -> tuple[int, list[str]]:
        calls.unlink(missing_ok=True)
        proc = processes.start([sys.executable, *argv], env=env)
        proc.wait().check()
        return proc.pid, calls.read_text().splitlines()

    return run


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    return path


@pytest.mark.parametrize(
    "argv",
    [
        ["-m", "fsm_agent", "run", "--standalone", "--counting-level", "2"],
        ["-m", "fsm_agent", "run", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0"],
        ["-c", "import sys; from fsm_agent.cli import run_main; run_main(sys.argv[1:])", "--standalone"],
    ],
    ids=["fsm-agent-run", "fsm-agent-run-c10d", "run_main"],
)
def test_a_run_asks_the_plugins_for_their_backends_and_options_once(counting, tmp_path, script, argv):
    """``fsm-agent run`` (and torch's ``run.main`` shape, ``run_main``) load the plugins once to
    read their options and check the rendezvous flags, and launch with the same ones."""
    pid, calls = counting([*argv, str(script)])
    assert (tmp_path / "ran").exists()
    assert sorted(calls) == [f"addoption {pid}", f"register_backends {pid}"]


def test_fsm_agent_config_asks_once(counting, script):
    pid, calls = counting(["-m", "fsm_agent", "config", "--counting-level", "3", str(script)])
    assert sorted(calls) == [f"addoption {pid}", f"register_backends {pid}"]


def test_the_python_api_loads_the_plugins_itself_once(counting, tmp_path, script):
    """``launch_agent`` with no plugins handed in loads its own: the backends once, and no options
    (a Python caller sets them in ``LaunchConfig.plugins``)."""
    code = (
        "import sys; from fsm_agent import LaunchConfig, launch_agent; "
        "launch_agent(LaunchConfig(rdzv_backend='fsm', rdzv_endpoint='127.0.0.1:0', run_id='api'), "
        "sys.executable, (sys.argv[1],))"
    )
    pid, calls = counting(["-c", code, str(script)])
    assert (tmp_path / "ran").exists()
    assert calls == [f"register_backends {pid}"]
