"""``python -m fsm_agent``: the ``fsm-agent`` command (``fsm_agent.cli.main``)."""

from fsm_agent.cli import main

main()
