"""What the fuzzers of the command line and of the configuration file share: hypothesis settings, a
script that does not exist, a clean environment."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from hypothesis import HealthCheck, settings

#: The training script of every fuzzed ``fsm-agent run``: it does not exist, so nothing is launched.
MISSING_SCRIPT = "/nonexistent/fsm-agent-fuzz/train.py"

#: Derandomized (fixed seed), bounded examples, no deadline; a test may lower ``max_examples``.
FUZZ = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
        HealthCheck.filter_too_much,
    ],
)


@contextlib.contextmanager
def clean_environment(extra: dict[str, str] | None = None) -> Iterator[None]:
    """This process's environment without PET_*/FSM_AGENT_*/torch knobs, plus ``extra``; restored
    after (hypothesis runs many examples in one test, so monkeypatch would not undo each)."""
    saved = dict(os.environ)
    try:
        for name in list(os.environ):
            if name.startswith(("PET_", "FSM_AGENT_")) or name in (
                "TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
                "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE",
                "PYTHON_EXEC",
            ):
                del os.environ[name]
        os.environ.update(extra or {})
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
