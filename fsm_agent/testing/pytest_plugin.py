"""pytest fixtures and options of the fsm-agent test kit (entry point ``pytest11: fsm_agent``).

Loaded for every pytest run where fsm-agent is installed, so it imports nothing heavy until a
fixture or an option is used.

Fixtures: ``plugin_manager``, ``hook_recorder``, ``make_agent`` (alias ``agent_factory``),
``agent_processes`` (real ``fsm-agent run`` processes in ``tmp_path``, killed by process group).

Options (docs/testing.md): ``--statechart-coverage`` reports which (source, trigger, dest) edges
of the statechart the agents of the run took (agents in the test process and agents started as
subprocesses, through ``FSM_STATECHART_COVERAGE_DIR``), lists the missing ones and the edges the
run loop cannot take; ``--statechart-coverage-fail-under PCT`` (or the ini key
``statechart_coverage_fail_under``, enforced on whole-suite runs only) fails the run below PCT;
``--statechart-coverage-report PATH`` writes the report as JSON.
"""

from __future__ import annotations

import os

import pytest


@pytest.fixture
def plugin_manager():
    """A fresh fsm-agent PluginManager: hookspecs and built-in plugins, no entry points.

    Override this fixture to load entry points or block plugins.
    """
    from fsm_agent.plugins.manager import get_plugin_manager

    return get_plugin_manager(load_entry_points=False)


@pytest.fixture
def hook_recorder(plugin_manager):
    """A HookRecorder watching ``plugin_manager``; ``make_agent`` attaches it to each agent."""
    from fsm_agent.testing.recorder import HookRecorder

    recorder = HookRecorder(plugin_manager)
    yield recorder
    recorder.close()


@pytest.fixture
def make_agent(plugin_manager, hook_recorder, tmp_path):
    """An AgentFactory: ``make_agent(rendezvous=FakeRendezvous(...), launcher=FakeLauncher(...),
    max_restarts=..., plugins=[...], ...)`` builds the real ElasticAgent (run it with ``.run()``).

    The agent uses ``plugin_manager``, is followed by ``hook_recorder`` and logs under ``tmp_path/logs``.
    """
    from fsm_agent.testing.scenario import AgentFactory

    factory = AgentFactory(plugin_manager=plugin_manager, recorder=hook_recorder, log_dir=str(tmp_path / "logs"))
    yield factory
    factory.close()


@pytest.fixture
def agent_factory(make_agent):
    """The same AgentFactory as ``make_agent``."""
    return make_agent


# ------------------------------------------------------------------------------------------------
# --statechart-coverage: which transitions of the table the run exercised
# ------------------------------------------------------------------------------------------------

COVERAGE_PLUGIN_NAME = "fsm_agent_statechart_coverage"


@pytest.fixture
def agent_processes(tmp_path):
    """An AgentProcesses in ``tmp_path``; every agent's process group is killed after the test."""
    from fsm_agent.testing.processes import AgentProcesses

    group = AgentProcesses(tmp_path)
    yield group
    group.kill_all()


def pytest_addoption(parser):
    group = parser.getgroup("fsm-agent", "fsm-agent statechart test kit")
    group.addoption(
        "--statechart-coverage",
        action="store_true",
        default=False,
        help="report which (source, trigger, dest) edges of the worker-group statechart the "
        "agents of this run took, in-process and in subprocesses, and which are missing",
    )
    group.addoption(
        "--no-statechart-coverage",
        action="store_true",
        default=False,
        help="turn statechart coverage off (wins over --statechart-coverage, e.g. from addopts)",
    )
    group.addoption(
        "--statechart-coverage-fail-under",
        type=float,
        default=None,
        metavar="PCT",
        help="fail the run when less than PCT%% of the transitions were exercised (implies --statechart-coverage)",
    )
    group.addoption(
        "--statechart-coverage-report",
        default=None,
        metavar="PATH",
        help="also write the coverage report as JSON to PATH (implies --statechart-coverage)",
    )
    parser.addini(
        "statechart_coverage_fail_under",
        default="",
        help="like --statechart-coverage-fail-under, but enforced only when pytest runs its whole "
        "testpaths with nothing deselected (a partial run reports without failing)",
    )


def pytest_configure(config):
    option = config.option
    wanted = (
        option.statechart_coverage
        or option.statechart_coverage_fail_under is not None
        or option.statechart_coverage_report
    )
    if wanted and not option.no_statechart_coverage and not hasattr(config, "workerinput"):
        config.pluginmanager.register(StatechartCoverage(config), COVERAGE_PLUGIN_NAME)


class StatechartCoverage:
    """Collects the transitions every agent of the session records (built-in plugin
    ``statechart-coverage``, through ``FSM_STATECHART_COVERAGE_DIR``) and reports them."""

    def __init__(self, config):
        import tempfile

        from fsm_agent.plugins.coverage_recorder import COVERAGE_DIR_ENV

        self.config = config
        self.env = COVERAGE_DIR_ENV
        self.outer = os.environ.get(COVERAGE_DIR_ENV)  # a pytest run inside a covered run: forward to it
        self.directory = tempfile.mkdtemp(prefix="fsm_agent_statechart_coverage_")
        os.environ[COVERAGE_DIR_ENV] = self.directory
        self.deselected = 0
        self.threshold_note = ""
        self.report = None
        self.error = None

    def _threshold(self) -> tuple[float | None, str]:
        option = self.config.option.statechart_coverage_fail_under
        if option is not None:
            return option, "--statechart-coverage-fail-under"
        ini = str(self.config.getini("statechart_coverage_fail_under") or "").strip()
        if not ini:
            return None, ""
        whole = self.config.args_source == pytest.Config.ArgsSource.TESTPATHS and not self.deselected
        if not whole:
            return None, (
                f"statechart_coverage_fail_under = {ini} not enforced: this run is narrowed "
                f"(paths given or tests deselected)"
            )
        return float(ini), "statechart_coverage_fail_under"

    def pytest_deselected(self, items):
        self.deselected += len(items)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session):
        from fsm_agent.testing.coverage import build_report, read_observations

        threshold, self.threshold_note = self._threshold()
        try:
            self.report = build_report(read_observations(self.directory), threshold=threshold)
        except Exception as exc:  # a broken analysis must be visible, not a crash of the whole run
            self.error = f"{type(exc).__name__}: {exc}"
            session.exitstatus = pytest.ExitCode.INTERNAL_ERROR
            return
        path = self.config.option.statechart_coverage_report
        if path:
            import json

            with open(path, "w", encoding="utf-8") as f:
                json.dump(self.report.to_json(), f, indent=2)
        if not self.report.passed and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter):
        terminalreporter.write_sep("=", "fsm-agent statechart coverage")
        if self.error is not None:
            terminalreporter.write_line(f"statechart coverage could not be computed: {self.error}", red=True)
            return
        if self.report is None:
            return
        for line in self.report.format().splitlines():
            terminalreporter.write_line(line, red=line.startswith("  required") and not self.report.passed)
        if self.threshold_note and self.report.threshold is None:
            terminalreporter.write_line(f"  ({self.threshold_note})")

    def pytest_unconfigure(self, config):
        import glob
        import shutil
        import uuid

        if self.outer is None:
            os.environ.pop(self.env, None)
        else:
            os.environ[self.env] = self.outer
            if os.path.isdir(self.outer):
                for path in glob.glob(os.path.join(self.directory, "transitions-*.jsonl")):
                    shutil.copy(path, os.path.join(self.outer, f"transitions-nested-{uuid.uuid4().hex}.jsonl"))
        shutil.rmtree(self.directory, ignore_errors=True)
