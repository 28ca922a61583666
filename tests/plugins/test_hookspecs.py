"""Every hookspec is documented: an ``Args:`` entry per argument, ``Returns:`` and ``Called from:``.

After datasette's ``test_plugin_hooks_are_documented``: the docstrings are the plugin authors'
reference (and ``docs/statechart.md`` quotes "Called from:"), so an undocumented hook fails here.
"""

from __future__ import annotations

import inspect

import pytest

from fsm_agent.plugins import hookspec
from fsm_agent.plugins import hookspecs as hookspecs_module
from fsm_agent.plugins.hookspec_info import docstring_problems, hookspecs

pytestmark = pytest.mark.unit


def test_there_are_hookspecs():
    names = list(hookspecs())
    assert len(names) >= 10
    assert all(name.startswith("fsm_agent_") for name in names)


@pytest.mark.parametrize("name", list(hookspecs()))
def test_hookspec_is_documented(name):
    assert docstring_problems(hookspecs()[name]) == [], f"hookspec {name} in fsm_agent/plugins/hookspecs.py"


def test_every_module_level_hook_function_is_a_hookspec():
    """A ``fsm_agent_*`` function without ``@hookspec`` would be silently ignored by pluggy."""
    unmarked = [
        name
        for name, obj in vars(hookspecs_module).items()
        if name.startswith("fsm_agent_") and inspect.isfunction(obj) and name not in hookspecs()
    ]
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
