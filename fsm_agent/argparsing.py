"""The argument parser every ``fsm-agent`` subcommand uses: bad input is one line, not argparse's usage.

argparse prints the whole usage text above its error and checks required arguments before it
reports an unknown flag (``fsm-agent status --bogus`` would say "required: url"). ``OneLineParser``
raises a ``ConfigError`` instead (the CLI prints it as one ``fsm-agent: error: ...`` line, exit 2)
and names an unknown argument before a missing one.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any, NoReturn

from fsm_agent.errors import ConfigError


class OneLineParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors raise ``ConfigError`` (exit 2) ending ``(see PROG --help)``.

    ``parse_args`` reports an unrecognized argument before a missing required one, so the line names
    what the user typed wrong. ``--help`` and ``--version`` still print and exit 0 as usual.
    """

    def parse_args(
        self,
        args: Sequence[str] | None = None,  # type: ignore[override]
        namespace: Any = None,
    ) -> Any:
        try:
            return super().parse_args(args, namespace)
        except ConfigError:
            unknown = self._unrecognized(args)
            if unknown:
                self.error("unrecognized arguments: " + " ".join(unknown))
            raise

    def _unrecognized(self, args: Sequence[str] | None) -> list[str]:
        """The arguments this parser does not know, found with every argument made optional."""
        required = {action: action.required for action in self._actions}
        try:
            for action in required:
                action.required = False
            return list(self.parse_known_args(args)[1])
        except ConfigError:  # another error (a bad value) comes first: report that one
            return []
        finally:
            for action, was in required.items():
                action.required = was

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message} (see {self.prog} --help)")
