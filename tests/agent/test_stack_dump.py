"""The non-fatal stack dump of hung workers (fsm_agent/stack_dump.py), on real processes: the worker
dumps its main thread's stack on the agent's signal and lives on; one without the handler is seen
as such (the agent then falls back to SIGABRT)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from fsm_agent.stack_dump import DUMP_SIGNAL, STACK_DUMP_SIGNAL_ENV, catches, running, signal_main_thread

pytestmark = pytest.mark.unit

# The main thread blocks in a C call (GIL released) while a helper thread runs: the dump must still
# come, and mark the main thread as the current one.
WORKER = """
import sys, threading, time
from fsm_agent.stack_dump import install
install()
threading.Thread(target=lambda: time.sleep(60), daemon=True, name="helper").start()
def stuck_in_c_call():
    print("ready", flush=True)
    threading.Event().wait(60)
stuck_in_c_call()
"""


def _start(tmp_path, env_extra: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    stderr_path = str(tmp_path / "stderr.log")
    env = {**{k: v for k, v in os.environ.items() if k != STACK_DUMP_SIGNAL_ENV}, **env_extra}
    with open(stderr_path, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", WORKER],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
            start_new_session=True,
        )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc, stderr_path


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def test_a_registered_worker_dumps_its_main_thread_and_lives_on(tmp_path):
    proc, stderr_path = _start(tmp_path, {STACK_DUMP_SIGNAL_ENV: str(int(DUMP_SIGNAL))})
    try:
        assert catches(proc.pid, DUMP_SIGNAL)
        signal_main_thread(proc.pid, DUMP_SIGNAL)
        deadline = time.monotonic() + 30
        text = ""
        while "stuck_in_c_call" not in text and time.monotonic() < deadline:
            time.sleep(0.05)
            text = open(stderr_path).read()
        assert "Current thread" in text
        current = text[text.index("Current thread") :].split("\n\n")[0]
        assert "stuck_in_c_call" in current  # the main thread is the one marked current
        assert "Fatal Python error" not in text
        time.sleep(0.2)
        assert proc.poll() is None and running(proc.pid)  # it lives on until the agent kills it
    finally:
        _stop(proc)


def test_a_worker_without_the_variable_does_not_catch_the_signal(tmp_path):
    proc, _ = _start(tmp_path, {})
    try:
        assert not catches(proc.pid, DUMP_SIGNAL)
    finally:
        _stop(proc)


def test_a_gone_process_catches_nothing_and_cannot_be_signalled():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    assert not catches(proc.pid, DUMP_SIGNAL) and not running(proc.pid)
    with pytest.raises(ProcessLookupError):
        signal_main_thread(proc.pid, DUMP_SIGNAL)
