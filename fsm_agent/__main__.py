"""``python -m fsm_agent``: the ``fsm-agent`` command (``fsm_agent._entry.main``)."""

from fsm_agent._entry import main

main()
