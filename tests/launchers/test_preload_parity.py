"""End to end: the preload launcher's first start against the subprocess launcher's, same command.

``--launcher preload`` forks even the first attempt's workers from a zygote that imported torch.
A worker must not be able to tell, except by these differences, each checked:

* ``MASTER_PORT``, ``TORCHELASTIC_RUN_ID`` and the ``TORCHELASTIC_ERROR_FILE`` directory: fresh per
  run under ``--standalone`` (the same shape in both runs).

Logs (``--log-dir`` tree, each file's content, the teed console lines) and error files (torch's
``@record`` ``error.json``, the summary's root cause) are the same. A worker that crashes before
rank 0 listens (before any worker reached the store) is reported as the root cause under both.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.conftest import write_script

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

LAUNCHERS = {"subprocess": ["--launcher", "subprocess"], "preload": ["--launcher", "preload"]}
#: Keys whose values differ between the two runs: exactly these.
DIFFER = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"}
_ERROR_FILE_TAIL = re.compile(r"/([^/]+)/(attempt_0/\d+/error\.json)$")  # <run_id>_<random>/...

#: Local rank CRASH raises under @record before init_process_group (so before rank 0 listens, or
#: reaches the store); the other rank joins the process group and waits for it there.
CRASH_EARLY = r"""
import os, sys
from datetime import timedelta
from torch.distributed.elastic.multiprocessing.errors import record

def crash_before_the_store_e2e():
    raise ValueError("early crash from rank " + os.environ["RANK"])

@record
def main():
    print("store %s" % os.environ["TORCHELASTIC_USE_AGENT_STORE"], flush=True)
    if os.environ["LOCAL_RANK"] == sys.argv[1]:
        crash_before_the_store_e2e()
    import torch.distributed as dist
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # waits for the crashed rank

main()
"""


def run_dir_of(log_dir) -> Path:  # noqa: F821
    (run_dir,) = [p for p in log_dir.iterdir() if p.is_dir()]
    return run_dir


def tree(run_dir) -> dict[str, str | None]:
    """``{relative path: content}`` of a run directory (None for directories), events.jsonl left out."""
    return {
        str(p.relative_to(run_dir)): (p.read_text() if p.is_file() else None)
        for p in sorted(run_dir.rglob("*"))
        if p.name != "events.jsonl"
    }


def test_first_start_gives_the_same_environment_and_logs(launcher):
    flags = ["--standalone", "--nproc-per-node", "2", "--tee", "3"]
    results, records, trees = {}, {}, {}
    for name, launcher_flags in LAUNCHERS.items():
        log_dir = launcher.dir / f"logs_{name}"
        results[name] = launcher.run_fsm(
            *flags, *launcher_flags, "--log-dir", log_dir, launcher.probe, env={"FSM_E2E_TAG": name}
        ).check()
        records[name] = launcher.records(name)
        trees[name] = tree(run_dir_of(log_dir))
    sub, pre = records["subprocess"], records["preload"]
    assert sorted(sub) == sorted(pre) == [0, 1]
    for rank in (0, 1):
        s_env = {k: v for k, v in sub[rank]["env"].items() if k != "FSM_E2E_TAG"}
        p_env = {k: v for k, v in pre[rank]["env"].items() if k != "FSM_E2E_TAG"}
        assert set(s_env) == set(p_env), f"only in one: {set(s_env) ^ set(p_env)}"
        differing = {k for k in s_env if s_env[k] != p_env[k]}
        assert differing == DIFFER, "\n".join(
            f"{k}: subprocess={s_env[k]!r} preload={p_env[k]!r}" for k in sorted(differing ^ DIFFER)
        )
        # under both, the workers' rank 0 hosts their store (a new one for each init_process_group)
        assert s_env["TORCHELASTIC_USE_AGENT_STORE"] == p_env["TORCHELASTIC_USE_AGENT_STORE"] == "False"
        for env in (s_env, p_env):
            match = _ERROR_FILE_TAIL.search(env["TORCHELASTIC_ERROR_FILE"])
            assert match and match.group(1).startswith(env["TORCHELASTIC_RUN_ID"] + "_")
            assert match.group(2) == f"attempt_0/{env['LOCAL_RANK']}/error.json"
        assert sub[rank]["argv"] == pre[rank]["argv"] and sub[rank]["name"] == pre[rank]["name"] == "__main__"
        assert not sub[rank]["torch_loaded"] and pre[rank]["torch_loaded"]  # forked from the torch zygote
    # The same files with the same content; the same lines on the console.
    assert trees["subprocess"] == trees["preload"]
    assert trees["preload"]["attempt_0/1/stdout.log"] == "probe-out rank=1 local_rank=1\n"
    for stream in ("stdout", "stderr"):
        lines = {
            name: sorted(line for line in getattr(result, stream).splitlines() if "probe-" in line)
            for name, result in results.items()
        }
        assert lines["subprocess"] == lines["preload"] and len(lines["preload"]) == 2, lines


@pytest.mark.parametrize("crash", ["0", "1"])
def test_a_worker_crashing_before_rank_0_listens_is_the_root_cause(launcher, crash):
    """Rank ``crash`` raises before any worker reached the store: under both launchers it is the one
    failure, with its error.json and traceback in the summary; the rank waiting in init_process_group
    is stopped by the agent and is no failure."""
    script = write_script(launcher.dir, "crash_early.py", CRASH_EARLY)
    reports = {}
    for name, launcher_flags in LAUNCHERS.items():
        log_dir = launcher.dir / f"logs_{name}"
        result = launcher.run_fsm(
            "--standalone",
            "--nproc-per-node",
            "2",
            "-r",
            "3",
            "--shutdown-timeout",
            "5",
            *launcher_flags,
            "--log-dir",
            log_dir,
            script,
            crash,
        )
        assert result.returncode == 1, result.stderr  # the root cause's exit code: an uncaught exception
        run_dir = run_dir_of(log_dir)
        files = tree(run_dir)
        assert [p for p in files if p.endswith("error.json")] == [f"attempt_0/{crash}/error.json"]
        error = json.loads(files[f"attempt_0/{crash}/error.json"])["message"]
        assert error["message"] == f"ValueError: early crash from rank {crash}"
        assert "crash_before_the_store_e2e" in error["extraInfo"]["py_callstack"]
        root = result.stderr.split("Root Cause")[1]
        assert f"ValueError: early crash from rank {crash}" in root and "crash_before_the_store_e2e" in root
        assert re.search(rf"rank\s*: {crash} \(local_rank: {crash},", root), root
        assert str(run_dir / f"attempt_0/{crash}/error.json") in root
        assert "<NO_OTHER_FAILURES>" in result.stderr
        reports[name] = (files[f"attempt_0/{crash}/stdout.log"], sorted(error), sorted(error["extraInfo"]))
    assert reports["subprocess"] == reports["preload"]
    assert reports["preload"][0] == "store False\n"
