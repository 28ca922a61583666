"""Built-in event recorder: one JSON object per line in the events file (schema: docs/events.md).

The file is ``--events-file`` or ``events.jsonl`` in the run's log directory; each record is
flushed as it is written so a crash loses nothing already recorded.
"""

from __future__ import annotations

import json
import os

from fsm_agent.errors import ConfigError
from fsm_agent.plugins import hookimpl


class JsonlEventWriter:
    """Appends event dicts to ``path`` as JSON lines."""

    def __init__(self, path: str):
        """Open ``path`` for appending (its directory made first).

        Raises:
            ConfigError: ``path`` is a directory, or it cannot be created or written (the message
                names ``--events-file``, the path and the OS's reason).
        """
        self.path = path
        if os.path.isdir(path):
            raise ConfigError(
                f"--events-file {path!r} is a directory: pass a file path, e.g. "
                f"--events-file {os.path.join(path, 'events.jsonl')}"
            )
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")
        except OSError as exc:
            raise ConfigError(
                f"--events-file {path!r}: cannot write the events file there "
                f"({exc.strerror or exc}): pass a writable file path"
            ) from None

    @hookimpl
    def fsm_agent_record_event(self, event):
        self._file.write(json.dumps(event, sort_keys=True, default=str) + "\n")
        self._file.flush()

    @hookimpl
    def fsm_agent_unconfigure(self, result):
        self._file.close()


class TorchEventBridge:
    """``--event-log-handler NAME`` (not ``null``): each record also goes to torch's ``events.record``.

    Transitions become torch ``Event`` objects named ``torchelastic.worker.status.<STATE>`` with
    source AGENT, as torch's agent names its own, so torch's handlers (e.g. ``console``) show them.
    """

    def __init__(self, destination: str):
        self.destination = destination

    @hookimpl
    def fsm_agent_record_event(self, event):
        from torch.distributed.elastic.events import Event, EventSource, record

        name = event.get("dest") or event.get("state") or event["kind"]
        metadata = {k: v for k, v in event.items() if isinstance(v, (str, int, float, bool)) or v is None}
        record(
            Event(
                name=f"torchelastic.worker.status.{name}",
                source=EventSource.AGENT,
                timestamp=int(event["ts"]),
                metadata=metadata,
            ),
            destination=self.destination,
        )


@hookimpl
def fsm_agent_configure(config, agent):
    path = agent.events_path
    if path and path != os.devnull:
        agent.plugin_manager.register(JsonlEventWriter(path), f"events-jsonl-writer-{id(agent)}")
    destination = getattr(config, "event_log_handler", "null") if config is not None else "null"
    if destination and destination != "null":
        agent.plugin_manager.register(TorchEventBridge(destination), f"events-torch-{id(agent)}")
