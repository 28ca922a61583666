"""States, in the terminal summary, which hypothesis profile the property tests ran (CI output)."""

from __future__ import annotations

import os

_RAN: list[str] = []


def pytest_runtest_logreport(report):
    if report.when == "call" and "test_agent_properties.py::" in report.nodeid:
        _RAN.append(report.outcome)


def pytest_terminal_summary(terminalreporter):
    if not _RAN:
        return
    import sys

    from hypothesis import settings

    module = next((m for name, m in list(sys.modules.items()) if name.endswith("test_agent_properties")), None)
    if module is None:
        return
    CI_PROFILE, LAST_RESORT, PROFILE_ENV, SEED = module.CI_PROFILE, module.LAST_RESORT, module.PROFILE_ENV, module.SEED

    name = os.environ.get(PROFILE_ENV, CI_PROFILE)
    profile = settings.get_profile(name)
    seeded = f"seed {SEED} (fixed)" if name == CI_PROFILE else "random seed"
    terminalreporter.write_sep("-", "fsm-agent property tests")
    terminalreporter.write_line(
        f"hypothesis profile {name}: {seeded}, max_examples={profile.max_examples}, "
        f"stateful_step_count={profile.stateful_step_count}, derandomize={profile.derandomize}, "
        f"database={'none' if profile.database is None else 'on'}"
    )
    if LAST_RESORT["examples"]:
        terminalreporter.write_line(
            f"known gap hit in {LAST_RESORT['examples']} example(s): the agent's last-resort UNKNOWN "
            f"(ElasticAgent._fire_error) recorded {', '.join(sorted(LAST_RESORT['edges outside the table'])) or 'no'} "
            f"edge(s) outside the table and left live workers {LAST_RESORT['ended with live workers']} time(s)"
        )
