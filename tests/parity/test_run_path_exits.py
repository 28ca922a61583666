"""Every way a ``--run-path`` script or a callable entrypoint can end, beside torchrun (#30.2).

A ``--run-path`` script runs in a multiprocessing child under ``@record``; ``sys.exit(0)`` there
raised ``SystemExit`` through fsm-agent's worker body, so no return value was written and the
agent failed the succeeded job (``FileNotFoundError: ... return_value.pkl``, exit 1). torchrun
exits 0. Success is success whichever way the script ends; every failure is a failure with the
worker named in the verdict.
"""

from __future__ import annotations

import os
import sys

import pytest

from tests.conftest import write_script
from tests.launch_api.test_launcher_api import torch_config
from tests.parity.conftest import FSM_AGENT, TORCHRUN

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.usefixtures("own_tempdir")]

#: case -> (the script's last line, succeeds)
ENDINGS = {
    "falls-through": ("pass", True),
    "sys.exit(0)": ("sys.exit(0)", True),
    "sys.exit()": ("sys.exit()", True),
    "sys.exit(3)": ("sys.exit(3)", False),
    "exception": ("raise ValueError('the script failed')", False),
    "os._exit(5)": ("os._exit(5)", False),
    "SIGKILL": ("os.kill(os.getpid(), signal.SIGKILL)", False),
}


@pytest.mark.parametrize("case", list(ENDINGS))
def test_run_path_script_ends_as_under_torchrun(parity, case):
    last_line, succeeds = ENDINGS[case]

    def scenario(tool, launcher):
        script = write_script(
            launcher.dir,
            "ends.py",
            f"import os, signal, sys\nprint('ran', os.environ['RANK'], flush=True)\n{last_line}\n",
        )
        return tool.start(launcher, "--standalone", "--nproc-per-node", "2", "--run-path", script).wait()

    # torchrun 2.13 hangs on sys.exit() (SystemExit(None) passes torch's @record, no value is
    # queued, its agent waits for one forever): fsm-agent alone there.
    outcomes = parity.both(scenario, tools=(FSM_AGENT,) if case == "sys.exit()" else (TORCHRUN, FSM_AGENT))
    report = "\n\n".join(o.describe() for o in outcomes.values())
    for outcome in outcomes.values():
        assert (outcome.result.returncode == 0) == succeeds, report
    fsm = outcomes[FSM_AGENT].result
    if case != "exception":  # there, the worker's own traceback
        assert "Traceback" not in fsm.stderr, report
    assert "return_value.pkl" not in fsm.stderr, report
    if not succeeds:
        assert "run_script_path FAILED" in fsm.stderr and "rank      : " in fsm.stderr, report  # torchrun's title
    if case == "exception":
        assert "ValueError" in fsm.stderr and "the script failed" in fsm.stderr, report
    assert not outcomes[FSM_AGENT].leftovers, report


# -- the Python API: a callable entrypoint that calls sys.exit ----------------------------------------
def _exits(code):
    sys.exit(code)


def _os_exit_zero():
    os._exit(0)


@pytest.mark.parametrize("fn, args", [(_exits, (0,)), (_exits, (None,)), (_os_exit_zero, ())])
def test_a_callable_that_exits_zero_returns_none_per_rank(fn, args):
    """``elastic_launch(fn)`` where ``fn`` ends in ``sys.exit(0)``, ``sys.exit()`` or ``os._exit(0)``:
    ``{global_rank: None}``, not a failure."""
    from fsm_agent import elastic_launch

    assert elastic_launch(torch_config(run_id="exits"), fn)(*args) == {0: None, 1: None}


def test_a_callable_that_exits_non_zero_fails_naming_the_exit_code():
    """``sys.exit(3)`` in a callable: torch's ChildFailedError, the worker's exit code 3 in it."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from fsm_agent import elastic_launch

    with pytest.raises(ChildFailedError) as raised:
        elastic_launch(torch_config(run_id="exits"), _exits)(3)
    assert {failure.exitcode for failure in raised.value.failures.values()} == {3}, raised.value.failures
