"""The console scripts' entry points (``fsm-agent``, ``fsmrun``, ``python -m fsm_agent``).

What the agent command needs in its first milliseconds happens here, before the CLI's imports (a
few tenths of a second): ``_early_signals.install()`` (stop, relay and drain signals handled
from now on) and ``_early_zygote.install()`` (``--launcher preload``'s zygote starts importing
torch while the agent starts). Both act only when argv is the agent command (``run``). Importing
the ``fsm_agent`` package does neither: a program or a worker that imports it is left alone.
"""

from __future__ import annotations

from typing import NoReturn

from fsm_agent import _early_signals, _early_zygote


def start_early() -> None:
    """The early signal handlers, then the early zygote (each only for the agent command)."""
    _early_signals.install()
    _early_zygote.install()


def main() -> NoReturn:
    """Console script ``fsm-agent`` (``fsm_agent.cli.main``)."""
    start_early()
    from fsm_agent.cli import main as cli_main

    cli_main()


def fsmrun_main() -> NoReturn:
    """Console script ``fsmrun``, the torchrun drop-in (``fsm_agent.cli.fsmrun_main``)."""
    start_early()
    from fsm_agent.cli import fsmrun_main as cli_fsmrun_main

    cli_fsmrun_main()
