"""Signal names as users write them, and their numbers: the one parser of every signal list.

``--signals-to-handle``, ``--forward-signals`` and ``--drain-signals`` (and their variables and file
keys), the agent's and the launch API's handlers, the drain plugin and the early handlers all read
a list through ``signal_names``/``signal_numbers``: ``SIGTERM``, ``TERM`` and ``term`` are one
signal; a name that is no signal on this platform, or one no handler can catch (SIGKILL,
SIGSTOP), is a ``ValueError`` naming it. torch's ``--signals-to-handle`` takes exact names only
(``getattr(signal, name)``); every torch spelling means the same here. Standard library only: the
early handlers (``_early_signals``) read it in the agent command's first milliseconds.
"""

from __future__ import annotations

import signal

#: Signals no handler can catch.
UNTRAPPABLE = frozenset({"SIGKILL", "SIGSTOP"})


def canonical_name(name: str) -> str:
    """``term``, ``TERM`` or ``SIGTERM`` -> ``SIGTERM``.

    Raises:
        ValueError: not a signal on this platform, or one that cannot be trapped (the message names it).
    """
    text = name.strip().upper()
    text = text if text.startswith("SIG") else "SIG" + text
    if text not in signal.Signals.__members__:
        raise ValueError(f"{name.strip()!r} is not a signal on this platform")
    if text in UNTRAPPABLE:
        raise ValueError(f"{text!r} cannot be trapped")
    return text


def signal_names(value: str) -> tuple[str, ...]:
    """``"SIGTERM, int"`` -> ``("SIGTERM", "SIGINT")``; blank items are dropped.

    Raises:
        ValueError: as ``canonical_name``, for the first bad item.
    """
    return tuple(canonical_name(name) for name in value.split(",") if name.strip())


def signal_numbers(value: str) -> tuple[int, ...]:
    """``"SIGTERM,SIGINT"`` -> their numbers (``signal.Signals`` members).

    Raises:
        ValueError: as ``canonical_name``.
    """
    return tuple(signal.Signals[name] for name in signal_names(value))
