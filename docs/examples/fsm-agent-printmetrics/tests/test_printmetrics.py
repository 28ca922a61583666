from fsm_agent_printmetrics import Printer

from fsm_agent.testing import Scenario


def test_prints_metrics_and_sees_exits_across_a_restart(make_agent, hook_recorder, capsys):
    printer = Printer(prefix="m")
    run = Scenario("worker 1 exits 1 -> restart -> all succeed", max_restarts=1, plugins={"printer": printer}).run(
        make_agent
    )
    run.assert_trace(["INIT->HEALTHY", "HEALTHY->STOPPED", "STOPPED->HEALTHY", "HEALTHY->SUCCEEDED"])
    assert printer.exits == [1, 0, 0]  # worker 1 failed (worker 0 was stopped), then both succeeded
    assert [call["exitcode"] for call in hook_recorder.calls("worker_exited")] == printer.exits
    assert "m torchelastic.workers.default.remaining_restarts=1" in capsys.readouterr().err
