"""What the whole suite (tests/ and plugins/*/tests) shares: the signal dispositions its processes
start with, and running it on a loaded machine.

``python -m pytest --cpu-hogs 2`` starts two busy loops beside the suite for its whole run (a
2-core CI machine with two other jobs on it), so timing margins are checked under load on every
machine alike, without stress-ng. The hogs are this session's children, stopped by pid when the
session ends, and each ends on its own once its parent is gone (a SIGKILLed pytest leaves none).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

# A suite started as a background job of a non-interactive shell (`... &`) inherits SIGINT and SIGQUIT
# ignored, and one started under nohup (or a CI runner that detaches the same way) SIGHUP; every
# agent and worker it starts would too, and an agent keeps an inherited SIGHUP ignored on purpose
# (nohup's meaning), so the stop-signal tests would test the shell, not the agent. Give this process
# the dispositions of a foreground one; its children inherit them. (test_nohup_keeps_sighup_ignored
# starts its agent under nohup itself.)
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
for _inherited_ignored in (signal.SIGQUIT, signal.SIGHUP):
    if signal.getsignal(_inherited_ignored) is signal.SIG_IGN:
        signal.signal(_inherited_ignored, signal.SIG_DFL)

# A busy loop that looks up once in a while whether pytest still runs (its parent pid changes when
# pytest is gone), so it never outlives the session.
_HOG = "import os,sys\nparent=int(sys.argv[1])\nwhile os.getppid()==parent:\n    for _ in range(2_000_000): pass\n"

_hogs: list[subprocess.Popen[bytes]] = []


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cpu-hogs",
        type=int,
        default=int(os.environ.get("FSM_TEST_CPU_HOGS", "0")),
        metavar="N",
        help="run N busy loops beside the suite (a loaded machine); default $FSM_TEST_CPU_HOGS or 0",
    )


def pytest_sessionstart(session: pytest.Session) -> None:
    count = session.config.getoption("--cpu-hogs")
    if count < 0:
        raise pytest.UsageError(f"--cpu-hogs {count}: give a count of busy loops, 0 or more")
    for _ in range(count):
        _hogs.append(subprocess.Popen([sys.executable, "-c", _HOG, str(os.getpid())], stdin=subprocess.DEVNULL))


def pytest_sessionfinish(session: pytest.Session) -> None:
    for hog in _hogs:
        hog.kill()
        hog.wait()
    _hogs.clear()


def pytest_report_header(config: pytest.Config) -> str | None:
    count = config.getoption("--cpu-hogs")
    return f"cpu hogs: {count} busy loops beside the suite" if count else None
