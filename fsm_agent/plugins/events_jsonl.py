"""Built-in event recorder: one JSON object per line in the events file (schema: docs/events.md).

The file is ``--events-file`` or ``events.jsonl`` in the run's log directory; each record is
flushed as it is written so a crash loses nothing already recorded.
"""

from __future__ import annotations

import json
import os

from fsm_agent.plugins import hookimpl


class JsonlEventWriter:
    """Appends event dicts to ``path`` as JSON lines."""

    def __init__(self, path: str):
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")

    @hookimpl
    def fsm_agent_record_event(self, event):
        self._file.write(json.dumps(event, sort_keys=True, default=str) + "\n")
        self._file.flush()

    @hookimpl
    def fsm_agent_unconfigure(self, result):
        self._file.close()


@hookimpl
def fsm_agent_configure(config, agent):
    path = agent.events_path
    if path and path != os.devnull:
        agent.plugin_manager.register(JsonlEventWriter(path), "events-jsonl-writer")
