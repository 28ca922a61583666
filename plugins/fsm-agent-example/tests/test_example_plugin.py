"""The example plugin against the worker-group statechart, with fsm-agent's test kit.

The agent is the real ElasticAgent, with a real plugin manager and real hook dispatch; only the
rendezvous and the launcher are fakes (``make_agent`` builds them from a Scenario's script), so
every test runs in milliseconds and says exactly which path through the statechart it takes.
"""

from __future__ import annotations

import fsm_agent_example
import pytest
from fsm_agent_example import ATTEMPT_ENV

from fsm_agent.config import LaunchConfig
from fsm_agent.testing import Scenario

#: The plugin's option on, as ``--example-attempt-env true`` would set it.
ON = LaunchConfig(plugins={"example": {"attempt_env": True}})


def example(text, **agent_kwargs):
    """A Scenario whose agent loads the plugin, with its option on."""
    return Scenario(text, plugins=[fsm_agent_example], config=ON, **agent_kwargs)


def attempts(run, variable=ATTEMPT_ENV):
    """The value local rank 0 got in each attempt the fake launcher started."""
    return [start.envs[0][variable] for start in run.launcher.started]


def test_the_first_attempt_is_attempt_0(make_agent):
    run = example("all succeed").run(make_agent)
    run.assert_trace(["INIT->HEALTHY (start)", "HEALTHY->SUCCEEDED (workers_succeeded)"])
    assert attempts(run) == ["0"]


def test_a_restart_after_a_failure_is_counted_like_torch_counts_it(make_agent):
    run = example("worker 1 exits 1 -> restart -> all succeed", max_restarts=1).run(make_agent)
    run.assert_trace(
        ["INIT->HEALTHY", "HEALTHY->STOPPED (workers_failed)", "STOPPED->HEALTHY (restart)", "HEALTHY->SUCCEEDED"]
    )
    assert attempts(run) == ["0", "1"]
    assert attempts(run, "TORCHELASTIC_RESTART_COUNT") == ["0", "1"]


def test_a_restart_after_a_membership_change_is_counted_too(make_agent):
    run = example("node joins -> restart -> all succeed").run(make_agent)
    run.assert_trace(
        ["INIT->HEALTHY", "HEALTHY->STOPPED (membership_changed)", "STOPPED->HEALTHY (restart)", "HEALTHY->SUCCEEDED"]
    )
    assert attempts(run) == ["0", "1"]
    assert attempts(run, "TORCHELASTIC_RESTART_COUNT") == ["0", "0"]  # torch: a membership change is free


def test_a_hung_group_is_restarted_and_counted(make_agent):
    run = example("worker 1 hangs -> restart -> all succeed", max_restarts=1, hang_timeout=1).run(make_agent)
    run.assert_trace(
        [
            "INIT->HEALTHY",
            "HEALTHY->UNHEALTHY (workers_hung)",
            "UNHEALTHY->STOPPED (workers_failed)",
            "STOPPED->HEALTHY (restart)",
            "HEALTHY->SUCCEEDED",
        ]
    )
    assert attempts(run) == ["0", "1"]


@pytest.mark.parametrize("local_world_size", [1, 3])
def test_every_worker_of_an_attempt_gets_the_same_value(make_agent, local_world_size):
    run = example("worker 0 exits 1 -> restart -> all succeed", max_restarts=1, local_world_size=local_world_size).run(
        make_agent
    )
    for attempt, start in enumerate(run.launcher.started):
        assert {env[ATTEMPT_ENV] for env in start.envs.values()} == {str(attempt)}
        assert len(start.envs) == local_world_size


def test_the_variable_is_computed_while_the_group_starts(make_agent, hook_recorder):
    """The hooks of the first transition, in the order the statechart documents them: the plugin
    answers fsm_agent_worker_env once per worker, before fsm_agent_workers_started."""
    example("all succeed").run(make_agent)
    hook_recorder.assert_sequence(
        [
            "rendezvous_completed",
            "node_check",
            "worker_env*2",
            "workers_started",
            "state_changed",
            "record_event",
            "put_metric*3",
        ],
        transition="INIT->HEALTHY",
    )


def test_the_counter_leaves_with_its_agent(make_agent):
    run = example("all succeed").run(make_agent)
    names = [name for name, _ in run.agent.plugin_manager.list_name_plugin()]
    assert not any(name.startswith("example-attempts-") for name in names)


@pytest.mark.parametrize("config", [None, LaunchConfig(), LaunchConfig(plugins={"example": {"attempt_env": False}})])
def test_off_unless_asked_for(make_agent, config):
    run = Scenario("all succeed", plugins=[fsm_agent_example], config=config).run(make_agent)
    assert ATTEMPT_ENV not in run.launcher.envs()[0]
