"""Reading an agent's events file (``--events-file``, ``events.jsonl``): one JSON record a line."""

from __future__ import annotations

import json
from pathlib import Path


def read_events(path: Path | str, *, missing_ok: bool = False, while_written: bool = False) -> list[dict]:
    """The records of the events file ``path``, in order; blank lines are skipped.

    By default the file must exist and every line be a record. ``missing_ok``: no file yet is no
    records. ``while_written``: an agent may still be writing it: no file yet is no records, and a
    line that is no record yet (being written) is left out.
    """
    path = Path(path)
    if (missing_ok or while_written) and not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            events.append(json.loads(line))
        except ValueError:
            if not while_written:
                raise
    return events


def transitions(path: Path | str, *, while_written: bool = False) -> list[tuple[str, str, str]]:
    """``(source, dest, trigger)`` of every transition record of the events file ``path``."""
    return [
        (e["source"], e["dest"], e["trigger"])
        for e in read_events(path, while_written=while_written)
        if e["kind"] == "transition"
    ]
