"""End to end: the worker environment, key by key, against the real torchrun for the same command.

Both launchers run the same probe workers from the same parent environment (OMP_NUM_THREADS
unset, no PET_*/TORCHELASTIC_* variables); each worker dumps ``dict(os.environ)``. Keys that both
inherit unchanged from the parent are dropped; every other key must be present in both with the
same value, except exactly these differences (``EXPECTED`` lists them per case):

* ``MASTER_PORT`` - differs by nature under ``--standalone``: an OS-chosen free port in every run.
  Both must be valid port numbers. With static rendezvous torchrun hands the workers
  ``--master-port``, its agents' store; fsm-agent a free port for the workers' own store (see
  ``TORCHELASTIC_USE_AGENT_STORE``).
* ``TORCHELASTIC_ERROR_FILE`` - differs by nature: the log directory is a fresh temporary
  directory (``torchelastic_*`` vs ``fsm_agent_*``). Both must end in the same
  ``<run_id>_<random>/attempt_0/<local_rank>/error.json`` shape.
* ``TORCHELASTIC_RUN_ID`` - differs by nature under ``--standalone``: a fresh uuid4 per run (both
  must be uuids). With static rendezvous both are ``none`` and must be equal.
* ``MASTER_ADDR`` - spelling, under ``--standalone``: torchrun names this node by its FQDN
  (``socket.getfqdn()``, e.g. ``localhost``); fsm-agent's standalone rendezvous (its torch-free
  ``fsm`` backend) is loopback-only and says ``127.0.0.1``. With static rendezvous both use
  ``--master-addr`` and must be equal.
* ``TORCHELASTIC_USE_AGENT_STORE`` - a deliberate fsm-agent difference: torchrun's agent hosts the
  workers' store (``True``) under ``--standalone`` and static rendezvous; fsm-agent's workers' rank
  0 hosts it (``False``), a new one for each ``init_process_group``, so a worker that destroys and
  re-creates its process group does not meet the earlier group's keys (#39.1). With
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` torchrun does the same, so there it must be equal.
* ``TORCHELASTIC_SIGNALS_TO_HANDLE`` - a deliberate fsm-agent difference: torchrun leaks its
  ``--signals-to-handle`` list into every worker (torchrun-contract.md §6.19); fsm-agent does not
  set it, so it is missing from fsm-agent's workers.
"""

from __future__ import annotations

import re
import socket
import uuid

import pytest

from tests.conftest import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SIGNALS = "TORCHELASTIC_SIGNALS_TO_HANDLE"
STANDALONE = {"MASTER_PORT", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_RUN_ID", SIGNALS}
if socket.getfqdn() != "127.0.0.1":
    STANDALONE.add("MASTER_ADDR")

#: case id -> (flags, extra parent env, nproc, the keys whose values differ: exactly these)
CASES = {
    "standalone-2": (["--standalone", "--nproc-per-node", "2"], {}, 2, STANDALONE | {"TORCHELASTIC_USE_AGENT_STORE"}),
    "static-master-port-2": (
        ["--master-port", "{port}", "--nproc-per-node", "2"],
        {},
        2,
        {"TORCHELASTIC_ERROR_FILE", SIGNALS, "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"},
    ),
    "standalone-unshared-store": (
        ["--standalone", "--nproc-per-node", "1"],
        {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
        1,
        STANDALONE,
    ),
}
_ERROR_FILE_TAIL = re.compile(r"/[^/]+_[^/]+/attempt_0/(\d+)/error\.json$")


def _run_both(launcher, flags: list[str], extra_env: dict[str, str], nproc: int):
    port = str(free_port())  # one --master-port for both runs, one after the other

    def flags_now() -> list[str]:
        return [f.replace("{port}", port) for f in flags]

    env = {**extra_env, "FSM_E2E_TAG": "torch_"}
    launcher.torchrun(*flags_now(), launcher.probe, env=env, unset=("OMP_NUM_THREADS",)).wait().check()
    env = {**extra_env, "FSM_E2E_TAG": "fsm_"}
    launcher.fsm(*flags_now(), launcher.probe, env=env, unset=("OMP_NUM_THREADS",)).wait().check()
    torch_records, fsm_records = launcher.records("torch_"), launcher.records("fsm_")
    assert sorted(torch_records) == sorted(fsm_records) == list(range(nproc))
    return launcher.env(extra_env, unset=("OMP_NUM_THREADS",)), torch_records, fsm_records


@pytest.mark.parametrize("case", list(CASES))
def test_worker_env_matches_torchrun(launcher, case):
    flags, extra_env, nproc, expected = CASES[case]
    parent, torch_records, fsm_records = _run_both(launcher, flags, extra_env, nproc)
    for rank in range(nproc):
        t_env = {k: v for k, v in torch_records[rank]["env"].items() if k != "FSM_E2E_TAG"}
        f_env = {k: v for k, v in fsm_records[rank]["env"].items() if k != "FSM_E2E_TAG"}
        inherited = {k for k, v in parent.items() if t_env.get(k) == v and f_env.get(k) == v}
        t_set = {k: v for k, v in t_env.items() if k not in inherited}
        f_set = {k: v for k, v in f_env.items() if k not in inherited}

        # The set of keys: the same, except the signal list torchrun leaks.
        assert set(t_set) - set(f_set) == {SIGNALS}, f"rank {rank}: only in torchrun: {set(t_set) - set(f_set)}"
        assert set(f_set) - set(t_set) == set(), f"rank {rank}: only in fsm-agent: {set(f_set) - set(t_set)}"
        assert t_set[SIGNALS] == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"

        # The values: equal, except exactly the listed differences, each of which does differ.
        differing = {k for k in set(t_set) | set(f_set) if t_set.get(k) != f_set.get(k)}
        assert differing == expected, (
            f"rank {rank}: unexpected differences {sorted(differing - expected)}, "
            f"expected but equal {sorted(expected - differing)}\n"
            + "\n".join(f"  {k}: torchrun={t_set.get(k)!r} fsm-agent={f_set.get(k)!r}" for k in sorted(differing))
        )

        # ... and each difference is of the kind the docstring says.
        for env in (t_set, f_set):
            assert 0 < int(env["MASTER_PORT"]) < 65536
            match = _ERROR_FILE_TAIL.search(env["TORCHELASTIC_ERROR_FILE"])
            assert match and match.group(1) == env["LOCAL_RANK"], env["TORCHELASTIC_ERROR_FILE"]
            if "TORCHELASTIC_RUN_ID" in expected:
                uuid.UUID(env["TORCHELASTIC_RUN_ID"])
        if "MASTER_ADDR" in expected:
            assert (t_set["MASTER_ADDR"], f_set["MASTER_ADDR"]) == (socket.getfqdn(), "127.0.0.1")
        if "TORCHELASTIC_USE_AGENT_STORE" in expected:
            assert (t_set["TORCHELASTIC_USE_AGENT_STORE"], f_set["TORCHELASTIC_USE_AGENT_STORE"]) == ("True", "False")
        if nproc > 1:
            assert t_set["OMP_NUM_THREADS"] == f_set["OMP_NUM_THREADS"] == "1"
