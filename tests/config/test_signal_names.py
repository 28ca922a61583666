"""One parser for every signal list (``fsm_agent.signal_names``): the settings, the agent, the
launch API, the drain plugin and the early handlers read ``TERM``, ``term`` and ``SIGTERM`` alike,
and refuse a name that is no signal or cannot be trapped, naming it."""

from __future__ import annotations

import signal

import pytest

from fsm_agent.errors import ConfigError
from fsm_agent.settings import parse_signals
from fsm_agent.signal_names import canonical_name, signal_names, signal_numbers

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("spelling", ["SIGUSR1", "USR1", "usr1", " sigusr1 "])
def test_every_spelling_is_one_signal(spelling):
    assert canonical_name(spelling) == "SIGUSR1"
    assert signal_numbers(spelling) == (signal.SIGUSR1,)


def test_a_list_keeps_its_order_and_drops_blanks():
    assert signal_names("TERM, int,,SIGHUP,") == ("SIGTERM", "SIGINT", "SIGHUP")
    assert signal_names("") == () and signal_numbers(" ") == ()


@pytest.mark.parametrize(
    "bad, says", [("SIGNOPE", "'SIGNOPE' is not a signal"), ("KILL", "'SIGKILL' cannot be trapped")]
)
def test_a_bad_name_is_named(bad, says):
    with pytest.raises(ValueError, match=says):
        signal_names(f"SIGTERM,{bad}")
    with pytest.raises(ConfigError, match=f"--forward-signals 'SIGTERM,{bad}': {says}"):
        parse_signals(f"SIGTERM,{bad}", flag="--forward-signals")


def test_the_settings_hand_on_canonical_names():
    assert parse_signals("term,USR2") == ("SIGTERM", "SIGUSR2")


def test_the_drain_plugin_and_the_early_handlers_read_the_same_names():
    from fsm_agent import _early_signals
    from fsm_agent.plugins import drain

    assert drain._signal_numbers("usr2,SIGTERM") == (signal.SIGUSR2, signal.SIGTERM)
    assert drain._signal_number("USR1") == signal.SIGUSR1
    with pytest.raises(ValueError, match="one signal name"):
        drain._signal_number("USR1,USR2")
    # the early handlers skip what the agent's own parse will name in its error
    assert _early_signals._names("usr1,SIGNOPE,KILL,term") == [signal.SIGUSR1, signal.SIGTERM]
