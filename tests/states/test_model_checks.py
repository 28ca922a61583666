"""Model checks of the transition table: each passes on the real table and fails on a broken one.

Every broken table below is the real table with one deliberate mistake, so each test shows the
check catching the mistake it exists for (and not passing vacuously).
"""

from __future__ import annotations

import pytest

from fsm_agent.agent import ElasticAgent
from fsm_agent.states import checks
from fsm_agent.states.facts import FACTS
from fsm_agent.states.machine import build_machine
from fsm_agent.states.table import DECIDERS, STATES, TRANSITIONS
from fsm_agent.states.worker_state import WorkerState as S

pytestmark = pytest.mark.unit


def without(trigger: str, table: list[dict] = TRANSITIONS) -> list[dict]:
    """A copy of ``table`` without the rows of ``trigger``."""
    return [dict(row) for row in table if row["trigger"] != trigger]


def replaced(trigger: str, /, table: list[dict] = TRANSITIONS, **changes) -> list[dict]:
    """A copy of ``table`` whose rows of ``trigger`` get ``changes``."""
    return [dict(row, **changes) if row["trigger"] == trigger else dict(row) for row in table]


# -- the real table ---------------------------------------------------------------------------


def test_real_table_passes_every_check():
    assert checks.check_all(TRANSITIONS, ElasticAgent) == []


@pytest.mark.parametrize(
    "check",
    [
        lambda table: checks.check_states_declared(table),
        lambda table: checks.check_reachable(table),
        lambda table: checks.check_can_terminate(table),
        lambda table: checks.check_terminal_absorbing(table),
        lambda table: checks.check_callbacks_resolve(table, ElasticAgent),
        lambda table: checks.check_triggers_bindable(table, ElasticAgent),
        lambda table: checks.check_deterministic(table),
    ],
    ids=[
        "declared",
        "reachable",
        "can_terminate",
        "terminal_absorbing",
        "callbacks_resolve",
        "triggers_bindable",
        "deterministic",
    ],
)
def test_each_check_passes_on_the_real_table(check):
    assert check(TRANSITIONS) == []


def test_real_table_builds_a_machine_with_every_state():
    class Model:
        pass

    machine = build_machine(Model())
    assert set(machine.states) == {s.value for s in STATES}


# -- one broken table per check ----------------------------------------------------------------


def test_undeclared_state_is_reported():
    broken = [*TRANSITIONS, dict(trigger="workers_hung", source=S.UNHEALTHY, dest="HUNG")]
    problems = checks.check_states_declared(broken)
    assert len(problems) == 1 and "'HUNG' is not declared" in problems[0]


def test_unreachable_state_is_reported():
    broken = without("health_check_failed", without("workers_hung"))  # nothing enters UNHEALTHY any more
    assert checks.check_reachable(broken) == ["state UNHEALTHY is unreachable from INIT: no chain of rows leads to it"]


def test_trap_state_is_reported():
    # UNHEALTHY can only go back to HEALTHY, and HEALTHY only to UNHEALTHY: a run never ends.
    broken = [
        dict(trigger="start", source=S.INIT, dest=S.HEALTHY),
        dict(trigger="workers_hung", source=S.HEALTHY, dest=S.UNHEALTHY),
        dict(trigger="workers_recovered", source=S.UNHEALTHY, dest=S.HEALTHY),
        dict(trigger="stop_requested", source=[S.INIT, S.STOPPED], dest=S.FAILED),
    ]
    problems = checks.check_can_terminate(broken)
    assert problems == [
        f"state {name} cannot reach SUCCEEDED or FAILED: a run entering it never ends"
        for name in ("HEALTHY", "UNHEALTHY")
    ]


def test_unknown_alone_does_not_count_as_an_outcome():
    # Reaching only UNKNOWN (terminal, but neither success nor failure) is not enough.
    broken = [dict(trigger="agent_errored", source=S.INIT, dest=S.UNKNOWN)]
    problems = checks.check_can_terminate(broken, states=[S.INIT, S.UNKNOWN])
    assert problems == ["state INIT cannot reach SUCCEEDED or FAILED: a run entering it never ends"]


def test_exit_from_a_terminal_state_is_reported():
    broken = [*TRANSITIONS, dict(trigger="restart", source=S.FAILED, dest=S.HEALTHY)]
    problems = checks.check_terminal_absorbing(broken)
    assert len(problems) == 1 and "leaves terminal state FAILED" in problems[0]


def test_wildcard_source_leaves_every_terminal_state():
    broken = replaced("agent_errored", source="*")
    problems = checks.check_terminal_absorbing(broken)
    assert [p.rsplit("terminal state ", 1)[1].split(";")[0] for p in problems] == ["UNKNOWN", "SUCCEEDED", "FAILED"]


def test_misspelled_callback_is_reported():
    broken = replaced("workers_hung", before="_stop_wrokers")
    problems = checks.check_callbacks_resolve(broken, ElasticAgent)
    assert len(problems) == 1
    assert "before='_stop_wrokers' is not an attribute of ElasticAgent" in problems[0]


def test_misspelled_guard_is_reported():
    broken = replaced("workers_failed", conditions=None, unless="has_restart_left")
    problems = checks.check_callbacks_resolve(broken, ElasticAgent)
    assert problems and all("unless='has_restart_left'" in p for p in problems)


def test_callback_naming_a_non_method_is_reported():
    broken = replaced("start", before="restart_count")  # an attribute set in __init__, not a method

    class Model(ElasticAgent):
        restart_count = 0

    problems = checks.check_callbacks_resolve(broken, Model)
    assert problems == [problems[0]] and "is not a method of Model (found int)" in problems[0]


def test_trigger_shadowed_by_a_model_attribute_is_reported():
    broken = replaced("start", trigger="run")  # ElasticAgent.run exists: transitions would skip it
    problems = checks.check_triggers_bindable(broken, ElasticAgent)
    assert len(problems) == 1 and "trigger 'run' is already an attribute of ElasticAgent" in problems[0]


@pytest.mark.parametrize(
    "broken, expected",
    [
        pytest.param(
            [*TRANSITIONS, dict(trigger="health_check_failed", source=S.HEALTHY, dest=S.FAILED)],
            "HEALTHY --health_check_failed--> is ambiguous when always",
            id="two-unguarded-rows",
        ),
        pytest.param(
            [*TRANSITIONS, dict(trigger="workers_failed", source=S.UNHEALTHY, dest=S.FAILED)],
            "UNHEALTHY --workers_failed--> is ambiguous when excludes_this_node=True, has_restarts_left=True",
            id="unguarded-row-beside-guarded-rows",
        ),
        pytest.param(
            replaced("workers_failed", conditions="has_restarts_left", unless=None),
            "HEALTHY --workers_failed--> is ambiguous when has_restarts_left=True",
            id="same-guard-twice",
        ),
        pytest.param(
            [row for row in TRANSITIONS if not (row["trigger"] == "workers_failed" and "unless" in row)],
            "HEALTHY --workers_failed--> has no enabled row when recovers_in_process=False",
            id="guard-without-its-complement",
        ),
    ],
)
def test_nondeterministic_rows_are_reported(broken, expected):
    problems = checks.check_deterministic(broken)
    assert any(p.startswith(expected) for p in problems), problems


def test_check_all_collects_every_problem():
    broken = [
        *replaced("membership_changed", before="_stop_wrokers"),
        dict(trigger="restart", source=S.FAILED, dest=S.HEALTHY),
    ]
    problems = checks.check_all(broken, ElasticAgent)
    assert any("_stop_wrokers" in p for p in problems)
    assert any("leaves terminal state FAILED" in p for p in problems)


# -- one decider per trigger, and one fact per trigger ------------------------------------------


def test_a_guarded_trigger_without_a_decider_is_caught():
    """workers_failed's guards read the restart policy's decision: without its decider they would
    read a decision made for another event, or none."""
    deciders = {t: step for t, step in DECIDERS.items() if t != "workers_failed"}
    problems = checks.check_deciders(TRANSITIONS, deciders)
    assert problems == ["workers_failed's rows are guarded but no step decides for them: add it to DECIDERS"]


def test_a_row_with_its_own_prepare_and_a_decider_for_no_trigger_are_caught():
    table = [dict(row) for row in TRANSITIONS]
    next(row for row in table if row["trigger"] == "workers_failed")["prepare"] = "_decide_on_failed_workers"
    problems = checks.check_deciders(table, {**DECIDERS, "workers_teleported": "_decide_on_failed_workers"})
    assert any("declares prepare='_decide_on_failed_workers'" in p for p in problems)
    assert any("DECIDERS names 'workers_teleported', which is no trigger of the table" in p for p in problems)
    assert checks.check_all(table, ElasticAgent)  # check_all runs it


def test_the_deciding_triggers_are_the_guarded_ones():
    guarded = {row["trigger"] for row in TRANSITIONS if row.get("conditions") or row.get("unless")}
    assert guarded == set(DECIDERS) == {"workers_failed", "inprocess_failed", "membership_changed", "drain_requested"}
    assert all(callable(getattr(ElasticAgent, step)) for step in DECIDERS.values())


def test_every_trigger_has_its_fact_and_a_drifted_fact_is_caught():
    assert checks.check_facts(TRANSITIONS) == []
    assert set(FACTS) == {row["trigger"] for row in TRANSITIONS}
    assert all(cls.trigger == trigger for trigger, cls in FACTS.items())
    drifted = {**FACTS, "workers_failed": FACTS["workers_hung"]}
    del drifted["agent_errored"]
    problems = checks.check_facts(TRANSITIONS, drifted)
    assert "trigger 'agent_errored' has no fact class in fsm_agent.states.facts" in problems
    assert "FACTS['workers_failed'] is WorkersHung, whose trigger is 'workers_hung'" in problems
    extra = checks.check_facts([row for row in TRANSITIONS if row["trigger"] != "workers_hung"])
    assert extra == ["fact WorkersHung names trigger 'workers_hung', which the table lacks"]
