"""The agent command's early stop-signal handling (fsm_agent._early_signals): a stop signal that
lands while torch is being imported waits for the import's end, since an exception raised by a
handler inside torch's C++ module initialisation cannot unwind it (the process aborts with
SIGABRT, exit 134, instead of stopping with 128+N)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from fsm_agent._early_signals import held, undisturbed

pytestmark = pytest.mark.unit


def _handler(seen: list[int]):
    def handle(signum: int, frame: object) -> None:
        if held(signum):
            return
        seen.append(signum)

    return handle


def test_a_stop_signal_inside_undisturbed_is_delivered_at_its_end():
    seen: list[int] = []
    previous = signal.signal(signal.SIGUSR2, _handler(seen))
    try:
        with undisturbed():
            os.kill(os.getpid(), signal.SIGUSR2)
            time.sleep(0.05)  # Python runs signal handlers between bytecodes: it has run by now
            assert seen == []
            with undisturbed():  # nested (an import inside an import): still held
                pass
            assert seen == []
        assert seen == [signal.SIGUSR2]
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_two_signals_held_deliver_the_first_once():
    seen: list[int] = []
    previous = {s: signal.signal(s, _handler(seen)) for s in (signal.SIGUSR1, signal.SIGUSR2)}
    try:
        with undisturbed():
            os.kill(os.getpid(), signal.SIGUSR2)
            time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.05)
        assert seen == [signal.SIGUSR2]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_outside_undisturbed_nothing_is_held():
    assert held(signal.SIGTERM) is False
