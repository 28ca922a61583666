"""Every hookspec is documented: an ``Args:`` entry per argument, ``Returns:`` and ``Called from:``.

After datasette's ``test_plugin_hooks_are_documented``: the docstrings are the plugin authors'
reference (and ``docs/statechart.md`` quotes "Called from:"), so an undocumented hook fails here.
"""

from __future__ import annotations

import inspect
import re

import pytest

from fsm_agent.plugins import PROJECT_NAME, hookspec
from fsm_agent.plugins import hookspecs as hookspecs_module

REQUIRED_SECTIONS = ("Args", "Returns", "Called from")
_SECTION = re.compile(r"^(Args|Returns|Raises|Called from):[ \t]*$", re.MULTILINE)


def all_hookspecs() -> dict:
    """Every function of the hookspecs module marked with ``@hookspec``, in declaration order."""
    marker = f"{PROJECT_NAME}_spec"
    return {name: obj for name, obj in vars(hookspecs_module).items()
            if inspect.isfunction(obj) and hasattr(obj, marker)}


def sections(doc: str) -> dict[str, str]:
    """``{section title: body}`` of a Google-style docstring; the summary is under ``""``."""
    parts = _SECTION.split(inspect.cleandoc(doc))
    return {"": parts[0].strip(), **{title: inspect.cleandoc(body)
                                     for title, body in zip(parts[1::2], parts[2::2])}}


def documented_args(args_section: str) -> list[str]:
    """Names of the entries of an ``Args:`` section: unindented lines ``name:`` or ``name (type):``."""
    return re.findall(r"^(\w+)(?:\s*\([^)]*\))?:", args_section, re.MULTILINE)


def docstring_problems(func) -> list[str]:
    """What is missing from ``func``'s docstring; empty when it is fully documented."""
    doc = func.__doc__ or ""
    if not doc.strip():
        return ["no docstring"]
    found = sections(doc)
    problems = []
    if not found[""]:
        problems.append("no summary line before the sections")
    for title in REQUIRED_SECTIONS:
        if title not in found:
            problems.append(f"no '{title}:' section")
        elif not found[title]:
            problems.append(f"empty '{title}:' section")
    arguments = list(inspect.signature(func).parameters)
    entries = documented_args(found.get("Args", ""))
    for name in arguments:
        if name not in entries:
            problems.append(f"argument {name!r} has no 'Args:' entry")
    for name in entries:
        if name not in arguments:
            problems.append(f"'Args:' documents {name!r}, which is not an argument")
    return problems


def test_there_are_hookspecs():
    names = list(all_hookspecs())
    assert len(names) >= 10
    assert all(name.startswith("fsm_agent_") for name in names)


@pytest.mark.parametrize("name", list(all_hookspecs()))
def test_hookspec_is_documented(name):
    assert docstring_problems(all_hookspecs()[name]) == [], f"hookspec {name} in fsm_agent/plugins/hookspecs.py"


def test_every_module_level_hook_function_is_a_hookspec():
    """A ``fsm_agent_*`` function without ``@hookspec`` would be silently ignored by pluggy."""
    unmarked = [name for name, obj in vars(hookspecs_module).items()
                if name.startswith("fsm_agent_") and inspect.isfunction(obj) and name not in all_hookspecs()]
    assert unmarked == []


# -- the checker itself catches each omission ----------------------------------------------------


@hookspec
def _undocumented_hook(worker, exitcode):
    """Observe something.

    Args:
        worker: documented.
        extra: not an argument.

    Called from:
    """


def test_the_checker_reports_each_omission():
    assert docstring_problems(_undocumented_hook) == [
        "no 'Returns:' section",
        "empty 'Called from:' section",
        "argument 'exitcode' has no 'Args:' entry",
        "'Args:' documents 'extra', which is not an argument",
    ]


def test_the_checker_accepts_typed_entries_and_continuation_lines():
    def hook(config, agent):
        """Do it.

        Args:
            config (LaunchConfig): the configuration,
                continued here: with a colon.
            agent: the agent.

        Returns:
            Nothing.

        Called from:
            Somewhere.
        """

    assert docstring_problems(hook) == []
