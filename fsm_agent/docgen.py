"""Every generated document of the repository, and the one command that rewrites them all.

    python -m fsm_agent.docgen           # rewrite the documents that are out of date
    python -m fsm_agent.docgen --check   # exit 1, naming each one that is out of date

Each document is the output of one renderer over the code it describes (the table, the
hookspecs, the settings); nobody edits them by hand. ``tests/architecture/test_generated_docs.py`` fails when
any of them differs from its renderer, byte for byte. Each renderer also has its own way in
(``fsm-agent statechart --format markdown``, ``python -m fsm_agent.plugins.docs``,
``fsm-agent config --reference``), which prints the same bytes.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

COMMAND = "python -m fsm_agent.docgen"
#: ``{path relative to the repository root: "module:function"}``; each function returns the text.
GENERATED: dict[str, str] = {
    "docs/statechart.md": "fsm_agent.states.statechart:render_markdown",
    "docs/plugins.md": "fsm_agent.plugins.docs:render",
    "docs/configuration.md": "fsm_agent.reference:configuration_reference",
    "docs/events.md": "fsm_agent.events_doc:render",
}
#: The repository root of a source checkout (the generated documents are not installed).
ROOT = Path(__file__).resolve().parents[1]


def renderer(path: str) -> Callable[[], str]:
    module, _, function = GENERATED[path].partition(":")
    return getattr(importlib.import_module(module), function)


def stale(root: Path | None = None) -> list[str]:
    """The generated documents under ``root`` (default: ``ROOT``) whose bytes differ from their
    renderer's output."""
    root = ROOT if root is None else root
    return [
        path
        for path in GENERATED
        if not (root / path).exists() or (root / path).read_bytes() != renderer(path)().encode("utf-8")
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check: exit 1 if any document is out of date")
    args = parser.parse_args(argv)
    out_of_date = stale()
    if args.check:
        for path in out_of_date:
            print(f"{path} is out of date: run {COMMAND}", file=sys.stderr)
        return 1 if out_of_date else 0
    for path in out_of_date:
        (ROOT / path).write_text(renderer(path)(), encoding="utf-8")
        print(f"rewrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
