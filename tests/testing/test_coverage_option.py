"""``pytest --statechart-coverage``: the option, the report in the terminal, the thresholds, and
coverage of nested pytest runs. Each case runs pytest (pytester, in-process) on a small test file."""

from __future__ import annotations

import json
import os
import textwrap

import pytest
import torch  # noqa: F401  (see below)

from fsm_agent.testing.coverage import COVERAGE_DIR_ENV, read_observations

# pytester's in-process runs drop from sys.modules every module first imported inside them; torch
# dropped that way is later garbage-collected and crashes the interpreter (SIGSEGV when this file
# ran alone). Imported here first, it stays.

pytestmark = pytest.mark.unit

pytest_plugins = ["pytester"]

ONE_RUN = textwrap.dedent("""
    from fsm_agent.testing import Scenario

    def test_success(make_agent):
        Scenario("all succeed").run(make_agent).assert_trace(["INIT->HEALTHY", "HEALTHY->SUCCEEDED"])

    def test_restart(make_agent):
        Scenario("worker 1 exits 1 -> restart -> all succeed", max_restarts=1).run(make_agent)
""")


@pytest.fixture
def suite(pytester):
    pytester.makepyfile(test_agent_paths=ONE_RUN)
    return pytester


def test_without_the_option_nothing_is_reported(suite):
    result = suite.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    assert "statechart coverage" not in result.stdout.str()


def test_the_report_lists_what_was_exercised_and_what_is_missing(suite):
    result = suite.runpytest(
        "-p", "no:cacheprovider", "-q", "--statechart-coverage", "--statechart-coverage-report", "cov.json"
    )
    result.assert_outcomes(passed=2)
    assert result.ret == 0
    result.stdout.fnmatch_lines(
        [
            "*= fsm-agent statechart coverage =*",
            "statechart coverage: 4/38 transitions exercised (10.5%)",
            "*INIT --start--> HEALTHY * 2x  e.g. test_agent_paths.py::test_success",
            "*HEALTHY --workers_failed--> STOPPED * 1x  e.g. test_agent_paths.py::test_restart",
            "  missing (34):",
            "    UNHEALTHY --workers_failed--> STOPPED",
            "  cannot be taken by the run loop (not counted):",
            "    UNHEALTHY --workers_succeeded--> SUCCEEDED: workers_succeeded comes only from*",
        ]
    )
    report = json.loads((suite.path / "cov.json").read_text())
    assert (report["covered"], report["counted"], report["threshold"]) == (4, 38, None)


def test_fail_under_fails_a_green_run(suite):
    result = suite.runpytest("-p", "no:cacheprovider", "--statechart-coverage-fail-under", "90")
    result.assert_outcomes(passed=2)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["  required: 90% -> FAILED"])
    ok = suite.runpytest("-p", "no:cacheprovider", "--statechart-coverage-fail-under", "10")
    assert ok.ret == 0
    ok.stdout.fnmatch_lines(["  required: 10% -> passed"])


def test_no_statechart_coverage_wins(suite):
    result = suite.runpytest(
        "-p", "no:cacheprovider", "--statechart-coverage-fail-under", "90", "--no-statechart-coverage"
    )
    assert result.ret == 0 and "statechart coverage" not in result.stdout.str()


def test_the_ini_threshold_applies_to_whole_suite_runs_only(suite):
    suite.makeini("""
        [pytest]
        testpaths = .
        addopts = --statechart-coverage
        statechart_coverage_fail_under = 100
    """)
    whole = suite.runpytest("-p", "no:cacheprovider")
    assert whole.ret == pytest.ExitCode.TESTS_FAILED
    whole.stdout.fnmatch_lines(["  required: 100% -> FAILED"])
    narrowed = suite.runpytest("-p", "no:cacheprovider", "test_agent_paths.py")
    assert narrowed.ret == 0
    narrowed.stdout.fnmatch_lines(["*statechart_coverage_fail_under = 100 not enforced: this run is narrowed*"])
    deselected = suite.runpytest("-p", "no:cacheprovider", "-k", "restart")
    assert deselected.ret == 0


def test_a_nested_run_forwards_its_observations(suite, tmp_path, monkeypatch):
    outer = tmp_path / "outer"
    outer.mkdir()
    monkeypatch.setenv(COVERAGE_DIR_ENV, str(outer))
    result = suite.runpytest("-p", "no:cacheprovider", "--statechart-coverage")
    assert result.ret == 0
    assert len(read_observations(str(outer))) == 6  # 2 + 4 transitions
    assert all(p.name.startswith("transitions-nested-") for p in outer.iterdir())


def test_agents_of_an_uncovered_nested_run_record_into_the_outer_directory(suite, tmp_path, monkeypatch):
    monkeypatch.setenv(COVERAGE_DIR_ENV, str(tmp_path))
    suite.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=2)
    assert len(read_observations(str(tmp_path))) == 6
    assert os.environ[COVERAGE_DIR_ENV] == str(tmp_path)
