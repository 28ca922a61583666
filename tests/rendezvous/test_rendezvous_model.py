"""The ``fsm`` rendezvous protocol, model-checked: ``rendezvous.pml`` beside this file is the
planner's join / complete / leave / lose protocol in Promela, run through SPIN's exhaustive
safety search (Debian's ``spin``, installed by ``.ci/install-spin.sh``; the verifier ``pan`` is
compiled with gcc). Checked for 3 participants and a store that serializes operations, with
participants that crash or leave at any step: no two participants of a round share a rank, a
round completes at most once, no deadlock (invalid end state), and every live participant is
ranked when MIN live nodes are there. A deliberately broken variant must fail."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

MODEL = Path(__file__).with_name("rendezvous.pml")
SPIN, GCC = shutil.which("spin"), shutil.which("gcc")

pytestmark = [
    pytest.mark.model,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not (SPIN and GCC), reason="needs spin and gcc: bash .ci/install-spin.sh"),
]


def check(tmp_path: Path, *defines: str) -> tuple[int, str]:
    """Generate, compile and run SPIN's verifier for the model with ``-D`` defines: (errors, output)."""
    model = tmp_path / MODEL.name
    shutil.copy(MODEL, model)
    subprocess.run(
        [SPIN, *(f"-D{d}" for d in defines), "-a", model.name], cwd=tmp_path, check=True, capture_output=True, text=True
    )
    subprocess.run([GCC, "-O2", "-w", "-DSAFETY", "-o", "pan", "pan.c"], cwd=tmp_path, check=True)
    # -m: search depth; -n: no unreached-code listing. Invalid end states (deadlocks) are checked by default.
    out = subprocess.run(["./pan", "-m2000000", "-n"], cwd=tmp_path, capture_output=True, text=True).stdout
    found = re.search(r"errors: (\d+)", out)
    assert found, out[-2000:]
    assert "invalid end states\t+" in out, "the deadlock check must be on"
    return int(found.group(1)), out


@pytest.mark.parametrize("n, lo, hi", [(3, 2, 2), (3, 2, 3)], ids=["3 nodes 2:2 (one spare)", "3 nodes 2:3"])
def test_the_protocol_model_holds(tmp_path, n, lo, hi):
    errors, out = check(tmp_path, f"N={n}", f"MIN={lo}", f"MAX={hi}")
    assert errors == 0, out[-3000:]
    assert "search depth too small" not in out, out[-3000:]  # the whole state space was searched
    stored = int(re.search(r"(\d+) states, stored", out).group(1))
    assert stored > 100_000, out[-2000:]  # crashes, leaves and restarts were explored, not a trivial run


def test_a_broken_protocol_fails_the_check(tmp_path):
    """-DBROKEN drops the rule that nodes waiting at a complete round with no live participant
    open the next round: SPIN finds the node left waiting with MIN live nodes there."""
    errors, out = check(tmp_path, "BROKEN", "N=3", "MIN=1", "MAX=2")
    assert errors >= 1, out[-2000:]
    assert "assertion violated (live<1)" in out, out[-2000:]
