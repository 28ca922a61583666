"""What the hookspecs say about themselves: names, arguments, dispatch options and docstring sections.

The one reader of ``fsm_agent/plugins/hookspecs.py`` for everything that documents or checks the
hooks: the statechart renderer (each hook's "Called from:"), the plugin guide's generator
(``fsm_agent.plugins.docs``) and the tests that require every hook to be documented. Docstrings
are Google style: a summary, then ``Args:``, ``Returns:``, ``Raises:`` and ``Called from:``.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

#: A hookspec function (any signature).
Hookspec = Callable[..., Any]

#: The section titles of a hookspec docstring, in the order they are written.
SECTIONS = ("Args", "Returns", "Raises", "Called from")
#: The sections every hookspec must have.
REQUIRED_SECTIONS = ("Args", "Returns", "Called from")
_SECTION = re.compile(rf"^({'|'.join(SECTIONS)}):[ \t]*$", re.MULTILINE)
_BANNER = re.compile(r"^# -{20,}\n# (?P<title>[^\n]+)\n# -{20,}$", re.MULTILINE)
_ARG_ENTRY = re.compile(r"^(\w+)(?:\s*\([^)]*\))?:\s*(.*)$")


def hookspecs() -> dict[str, Hookspec]:
    """Every ``@hookspec`` function of ``fsm_agent.plugins.hookspecs``, in declaration order."""
    from fsm_agent.plugins import PROJECT_NAME
    from fsm_agent.plugins import hookspecs as module

    marker = f"{PROJECT_NAME}_spec"
    found = [obj for obj in vars(module).values() if inspect.isfunction(obj) and hasattr(obj, marker)]
    return {func.__name__: func for func in sorted(found, key=lambda f: f.__code__.co_firstlineno)}


def hookspec_groups() -> list[tuple[str, Hookspec]]:
    """``(group title, hookspec)`` in declaration order; the titles are hookspecs.py's banners
    (``# ----`` / ``# title`` / ``# ----``), ``"hooks"`` before the first one."""
    from fsm_agent.plugins import hookspecs as module

    source = inspect.getsource(module)
    banners = [(source[: m.start()].count("\n") + 1, m.group("title")) for m in _BANNER.finditer(source)]
    return [
        (next((title for start, title in reversed(banners) if start < func.__code__.co_firstlineno), "hooks"), func)
        for func in hookspecs().values()
    ]


def spec_options(func: Hookspec) -> dict[str, Any]:
    """The hookspec's pluggy options (``firstresult``, ``historic``, ...)."""
    from fsm_agent.plugins import PROJECT_NAME

    return dict(getattr(func, f"{PROJECT_NAME}_spec", None) or {})


def docstring_sections(doc: str | None) -> dict[str, str]:
    """Split a Google-style docstring into its sections.

    Returns:
        ``{title: text}`` for each of ``SECTIONS`` present (dedented, stripped); the summary is
        under ``""``.
    """
    parts = _SECTION.split(inspect.cleandoc(doc or ""))
    return {"": parts[0].strip(), **{title: inspect.cleandoc(body) for title, body in zip(parts[1::2], parts[2::2])}}


def args_entries(section: str) -> dict[str, str]:
    """``{name: description}`` of an ``Args:`` section: unindented ``name:`` or ``name (type):``
    lines, continuation lines indented."""
    entries: dict[str, str] = {}
    current = None
    for line in section.splitlines():
        match = _ARG_ENTRY.match(line)
        if match:
            current = match.group(1)
            entries[current] = match.group(2)
        elif current is not None and line.strip():
            entries[current] += " " + line.strip()
    return entries


def called_from() -> dict[str, str]:
    """Each hook's "Called from:" text, on one line."""
    return {
        name: " ".join(docstring_sections(func.__doc__).get("Called from", "").split())
        for name, func in hookspecs().items()
    }


def _annotation(value: object) -> str:
    if value is inspect.Parameter.empty or value is inspect.Signature.empty:
        return ""
    text = value if isinstance(value, str) else getattr(value, "__name__", repr(value))
    return text.replace('"', "").replace("'", "")


def signature(func: Hookspec) -> str:
    """``name(arg: Type, ...) -> Returns`` with the string annotations unquoted."""
    sig = inspect.signature(func)
    params = ", ".join(
        f"{p.name}: {_annotation(p.annotation)}" if _annotation(p.annotation) else p.name
        for p in sig.parameters.values()
    )
    returns = _annotation(sig.return_annotation)
    return f"{func.__name__}({params})" + (f" -> {returns}" if returns else "")


def docstring_problems(func: Hookspec) -> list[str]:
    """What ``func``'s docstring lacks: a summary, each of ``REQUIRED_SECTIONS`` (not empty), an
    ``Args:`` entry for each argument and none for a name that is not one. Empty: documented."""
    doc = func.__doc__ or ""
    if not doc.strip():
        return ["no docstring"]
    found = docstring_sections(doc)
    problems = []
    if not found[""]:
        problems.append("no summary line before the sections")
    for title in REQUIRED_SECTIONS:
        if title not in found:
            problems.append(f"no '{title}:' section")
        elif not found[title]:
            problems.append(f"empty '{title}:' section")
    arguments = list(inspect.signature(func).parameters)
    entries = list(args_entries(found.get("Args", "")))
    problems += [f"argument {name!r} has no 'Args:' entry" for name in arguments if name not in entries]
    problems += [f"'Args:' documents {name!r}, which is not an argument" for name in entries if name not in arguments]
    return problems
