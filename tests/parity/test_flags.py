"""End to end: every flag ``fsm-agent run`` accepts (torchrun 2.13's, then fsm-agent's own) has its visible effect.

Each test starts real ``fsm-agent run`` processes with real probe workers (see conftest.PROBE) and
checks what the workers saw (environment, argv, how they were started) or what the agent did
(console, files, exit code). ``test_parser_accepts_every_torchrun_flag`` ties this file to the
flag list: every option string torch's own parser has is accepted by fsm-agent's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from tests.conftest import free_port, one_error_line, write_script
from tests.helpers.events import read_events

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

FAIL_ONCE = r"""
import os, sys
count = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
print("attempt %d of max %s rank %s" % (count, os.environ["TORCHELASTIC_MAX_RESTARTS"], os.environ["RANK"]),
      flush=True)
sys.exit(3 if count < 1 else 0)
"""

#: Ignores SIGTERM (so only SIGKILL stops it) after writing $FSM_E2E_OUT/ready_<RANK>.
STUBBORN = r"""
import os, signal, time
out = os.environ["FSM_E2E_OUT"]
def on_term(signum, frame):
    open(os.path.join(out, "term_" + os.environ["RANK"]), "w").close()
def on_usr1(signum, frame):
    open(os.path.join(out, "usr1_" + os.environ["RANK"]), "w").close()
signal.signal(signal.SIGTERM, on_term)
signal.signal(signal.SIGUSR1, on_usr1)
with open(os.path.join(out, "ready_" + os.environ["RANK"]), "w") as f:
    f.write(str(os.getpid()))
time.sleep(120)
"""


def _pids_gone(pids: list[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            return True
        time.sleep(0.05)
    return False


def test_parser_accepts_every_torchrun_flag():
    """The flag list itself: every option string of torchrun 2.13 parses in fsm-agent (same dest)."""
    from torch.distributed.run import get_args_parser

    from fsm_agent.cli import get_run_parser

    ours = {s: a.dest for a in get_run_parser()._actions for s in a.option_strings}
    for action in get_args_parser()._actions:
        for option in action.option_strings:
            assert option in ours, f"torchrun flag {option} is not accepted by fsm-agent"
            if option not in ("-h", "--help"):
                assert ours[option] == action.dest, option


# ---------------------------------------------------------------------------------------------
# Size: --nnodes, --nproc-per-node
# ---------------------------------------------------------------------------------------------


def test_nproc_per_node_int(launcher):
    """An int (the underscored spelling here; the dashed one is used throughout)."""
    launcher.run_fsm("--nproc_per_node", "2", launcher.probe).check()
    records = launcher.records()
    assert sorted(records) == [0, 1]
    assert {r["env"]["LOCAL_RANK"] for r in records.values()} == {"0", "1"}
    assert all(r["env"]["LOCAL_WORLD_SIZE"] == "2" and r["env"]["WORLD_SIZE"] == "2" for r in records.values())


@pytest.mark.parametrize("value", ["cpu", "auto"])
def test_nproc_per_node_cpu_and_auto(launcher, value):
    """cpu (and auto without an accelerator) = the CPUs the agent may run on: pinned to 2 here."""
    if value == "auto":
        import torch

        accelerator = getattr(torch, "accelerator", None)
        if accelerator is not None and accelerator.is_available():
            pytest.skip("auto counts accelerators on this machine")
    cpus = min(2, len(os.sched_getaffinity(0)))
    launcher.run_fsm("--nproc-per-node", value, launcher.probe, cpus=cpus).check()
    records = launcher.records()
    assert sorted(records) == list(range(cpus))
    assert {r["env"]["LOCAL_WORLD_SIZE"] for r in records.values()} == {str(cpus)}


def test_nnodes_range_completes_with_the_nodes_present(launcher):
    """--nnodes 1:2: one agent is enough once last_call_timeout passes; GROUP_WORLD_SIZE=1."""
    port = free_port()
    launcher.run_fsm(
        "--nnodes",
        "1:2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-conf",
        "last_call_timeout=1",
        "--local-addr",
        "127.0.0.1",
        launcher.probe,
    ).check()
    env = launcher.records()[0]["env"]
    assert env["GROUP_WORLD_SIZE"] == "1" and env["WORLD_SIZE"] == "1"


def test_nnodes_two_waits_for_the_second_node_until_join_timeout(launcher):
    """--nnodes 2 with one agent never starts workers; --rdzv-conf join_timeout=2 bounds the wait."""
    port = free_port()
    result = launcher.run_fsm(
        "--nnodes",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-conf",
        "join_timeout=2",
        "--local-addr",
        "127.0.0.1",
        launcher.probe,
    )
    assert result.returncode != 0
    assert launcher.records() == {}
    assert result.duration < 60
    assert "join_timeout=2" in result.stderr and "Traceback" not in result.stderr


# ---------------------------------------------------------------------------------------------
# Rendezvous: --standalone, --rdzv-backend/--rdzv-endpoint/--rdzv-id/--rdzv-conf
# ---------------------------------------------------------------------------------------------


def test_standalone_ignores_explicit_rendezvous_flags(launcher):
    """--standalone: a fresh local rendezvous with a uuid run id, whatever the rdzv flags say (--local-addr counts)."""
    result = launcher.run_fsm(
        "--standalone",
        "--rdzv-backend",
        "nope",
        "--rdzv-endpoint",
        "127.0.0.1:1",
        "--rdzv-id",
        "ignored-id",
        "--local-addr",
        "127.0.0.1",
        launcher.probe,
    ).check()
    env = launcher.records()[0]["env"]
    assert env["MASTER_ADDR"] == "127.0.0.1"  # --local-addr (default: the FQDN)
    uuid.UUID(env["TORCHELASTIC_RUN_ID"])  # a fresh uuid4, not the given id
    assert env["TORCHELASTIC_RUN_ID"] != "ignored-id"
    assert "--standalone" in result.stderr and "ignore" in result.stderr


def test_no_flags_implicit_standalone_and_python_unbuffered(launcher):
    """No flags: torch's implicit standalone (uuid run id); the worker is ``python -u script``."""
    launcher.run_fsm(launcher.probe).check()
    record = launcher.records()[0]
    uuid.UUID(record["env"]["TORCHELASTIC_RUN_ID"])
    assert record["orig_argv"][1:3] == ["-u", str(launcher.probe)]


def test_rdzv_backend_endpoint_id_and_conf(launcher):
    """c10d at 127.0.0.1:PORT: the agent serves the rendezvous store there; the run id reaches workers and logs."""
    port = free_port()
    log_dir = launcher.dir / "logs"
    launcher.run_fsm(
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "e2e-job-42",
        "--rdzv-conf",
        "join_timeout=30,read_timeout=30,is_host=1",
        "--local-addr",
        "127.0.0.1",
        "--log-dir",
        log_dir,
        launcher.probe,
        env={"FSM_E2E_PROBE_PORT": str(port)},
    ).check()
    record = launcher.records()[0]
    assert record["env"]["TORCHELASTIC_RUN_ID"] == "e2e-job-42"
    assert record["port_open"], "nothing listened on the --rdzv-endpoint port while the workers ran"
    assert [p.name.startswith("e2e-job-42_") for p in log_dir.iterdir()] == [True]


# ---------------------------------------------------------------------------------------------
# Worker lifecycle: --max-restarts, --monitor-interval, --role
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_restarts, code", [(1, 0), (0, 3)])
def test_max_restarts(launcher, max_restarts, code):
    """A worker failing once: one restart makes the job succeed; none makes it fail with the worker's code."""
    script = write_script(launcher.dir, "fail_once.py", FAIL_ONCE)
    result = launcher.run_fsm("--max-restarts", max_restarts, script).check(code)
    attempts = re.findall(r"^attempt (\d) of max (\d) rank 0$", result.stdout, re.MULTILINE)
    assert attempts == [(str(n), str(max_restarts)) for n in range(max_restarts + 1)]
    if code:
        assert "Root Cause" in result.stderr


def test_monitor_interval_does_not_delay_exit_detection(launcher):
    """--monitor-interval 60 is accepted; worker exits are still noticed at once (not after 60 s)."""
    result = launcher.run_fsm("--monitor-interval", "60", launcher.probe).check()
    assert result.duration < 45
    assert launcher.records()


def test_role_sets_role_name_and_log_prefix(launcher):
    result = launcher.run_fsm("--role", "trainer", "--nproc-per-node", "2", "-t", "3", launcher.probe).check()
    assert {r["env"]["ROLE_NAME"] for r in launcher.records().values()} == {"trainer"}
    assert "[trainer0]:probe-out rank=0 local_rank=0" in result.stdout.splitlines()
    assert "[trainer1]:probe-out rank=1 local_rank=1" in result.stdout.splitlines()
    assert "[trainer1]:probe-err rank=1 local_rank=1" in result.stderr.splitlines()


# ---------------------------------------------------------------------------------------------
# Entrypoint: --run-path, --start-method, -m/--module, --no-python, PYTHON_EXEC, ${local_rank}
# ---------------------------------------------------------------------------------------------


def test_run_path_runs_the_script_in_a_python_worker(launcher):
    """--run-path: runpy in a multiprocessing child (as __main__), taking precedence over --no-python."""
    launcher.run_fsm(
        "--run-path", "--no-python", "--nproc-per-node", "2", launcher.probe, "a", "rank=${local_rank}"
    ).check()
    records = launcher.records()
    assert sorted(records) == [0, 1]
    for record in records.values():
        assert record["name"] == "__main__"
        assert record["argv"] == [str(launcher.probe), "a", f"rank={record['env']['LOCAL_RANK']}"]
        assert "--multiprocessing-fork" in record["orig_argv"]  # a spawned child, not `python -u probe.py`


@pytest.mark.parametrize("method", ["spawn", "fork", "forkserver"])
def test_start_method_with_run_path(launcher, method):
    """fork children inherit the agent's modules; spawn/forkserver children start a fresh interpreter."""
    launcher.run_fsm("--run-path", "--start-method", method, launcher.probe).check()
    record = launcher.records()[0]
    inherited = "fsm_agent.agent" in record["fsm_modules"]
    assert inherited == (method == "fork"), record["fsm_modules"]
    if method == "spawn":
        assert any("multiprocessing" in a for a in record["orig_argv"]), record["orig_argv"]


def test_module(launcher):
    write_script(launcher.dir, "e2e_probe_mod.py", launcher.probe.read_text())
    launcher.run_fsm("-m", "e2e_probe_mod", "x", "--y").check()
    record = launcher.records()[0]
    assert record["name"] == "__main__"
    assert record["argv"][1:] == ["x", "--y"]
    assert record["orig_argv"][1:4] == ["-u", "-m", "e2e_probe_mod"]


def test_no_python_runs_a_binary(launcher):
    wrapper = write_script(
        launcher.dir,
        "wrapper.sh",
        f'#!/bin/sh\nexport E2E_VIA_SH=1\nexec "{sys.executable}" "{launcher.probe}" "$@"\n',
        executable=True,
    )
    launcher.run_fsm("--no-python", wrapper, "arg1").check()
    record = launcher.records()[0]
    assert record["env"]["E2E_VIA_SH"] == "1"
    assert record["argv"][1:] == ["arg1"]
    assert "-u" not in record["orig_argv"]


@pytest.mark.parametrize("loglevel, shown", [(None, True), ("ERROR", False)], ids=["default", "error"])
def test_the_omp_num_threads_banner_is_a_warning_loglevel_error_hides(launcher, loglevel, shown):
    """torchrun logs its OMP_NUM_THREADS banner as a warning, so LOGLEVEL=ERROR hides it; so does fsm-agent."""
    env = {"LOGLEVEL": loglevel} if loglevel else {}
    result = launcher.run_fsm("--nproc-per-node", "2", launcher.probe, env=env, unset=("OMP_NUM_THREADS",)).check()
    assert {r["env"]["OMP_NUM_THREADS"] for r in launcher.records().values()} == {"1"}
    banner = [line for line in result.stderr.splitlines() if "Setting OMP_NUM_THREADS environment variable" in line]
    assert len(banner) == int(shown), result.stderr
    if shown:
        assert re.match(r"\[fsm-agent W [^]]+\] \*{41}$", result.stderr.splitlines()[0]), result.stderr


def test_python_exec_chooses_the_interpreter(launcher):
    wrapper = write_script(
        launcher.dir,
        "mypython",
        f'#!/bin/sh\nexport E2E_VIA_PYTHON_EXEC=1\nexec "{sys.executable}" "$@"\n',
        executable=True,
    )
    launcher.run_fsm(launcher.probe, env={"PYTHON_EXEC": str(wrapper)}).check()
    record = launcher.records()[0]
    assert record["env"]["E2E_VIA_PYTHON_EXEC"] == "1"
    assert record["orig_argv"][1:3] == ["-u", str(launcher.probe)]


def test_local_rank_macro_in_script_args(launcher):
    launcher.run_fsm(
        "--nproc-per-node", "2", launcher.probe, "--local-rank=${local_rank}", "${local_rank}", "x${local_rank}y"
    ).check()
    for record in launcher.records().values():
        lr = record["env"]["LOCAL_RANK"]
        assert record["argv"][1:] == [f"--local-rank={lr}", lr, f"x{lr}y"]


def test_script_args_that_look_like_launcher_flags_reach_the_script_verbatim(launcher):
    args = [
        "--nproc-per-node",
        "5",
        "--standalone",
        "-r",
        "3",
        "--max-restarts=9",
        "-m",
        "x",
        "--",
        "--help",
        "--log-dir",
        "/nonexistent",
    ]
    result = launcher.run_fsm(launcher.probe, *args).check()
    records = launcher.records()
    assert sorted(records) == [0]  # the launcher still ran one worker, not five
    assert records[0]["argv"][1:] == args
    assert "probe-out rank=0 local_rank=0" in result.stdout  # -r 3 was not applied either


# ---------------------------------------------------------------------------------------------
# Static rendezvous and addresses: --node-rank, --master-addr, --master-port, --local-addr
# ---------------------------------------------------------------------------------------------


def test_static_single_node(launcher):
    """--master-port turns off implicit standalone: static rendezvous served at MASTER_ADDR:PORT."""
    port = free_port()
    launcher.run_fsm(
        "--node-rank",
        "0",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        port,
        "--nproc-per-node",
        "2",
        launcher.probe,
        env={"FSM_E2E_PROBE_PORT": str(port)},
    ).check()
    records = launcher.records()
    for record in records.values():
        env = record["env"]
        assert env["TORCHELASTIC_RUN_ID"] == "none"  # static keeps --rdzv-id's default, no uuid
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["GROUP_RANK"] == "0" and env["GROUP_WORLD_SIZE"] == "1"
        assert record["port_open"], "the static rendezvous store was not served on --master-port"


# ---------------------------------------------------------------------------------------------
# Logs: --log-dir, -r/--redirects, -t/--tee, --local-ranks-filter, --logs-specs,
# --duplicate-std*-filters, TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE
# ---------------------------------------------------------------------------------------------


def _rank_dir(log_dir: Path, local_rank: int, attempt: int = 0) -> Path:
    (run_dir,) = [p for p in log_dir.iterdir() if p.is_dir()]
    return run_dir / f"attempt_{attempt}" / str(local_rank)


def test_redirects_both_streams_to_files(launcher):
    log_dir = launcher.dir / "logs"
    result = launcher.run_fsm("--log-dir", log_dir, "-r", "3", "--nproc-per-node", "2", launcher.probe).check()
    assert "probe-out" not in result.stdout and "probe-err" not in result.stderr
    for lr in (0, 1):
        assert _rank_dir(log_dir, lr).joinpath("stdout.log").read_text() == f"probe-out rank={lr} local_rank={lr}\n"
        assert _rank_dir(log_dir, lr).joinpath("stderr.log").read_text() == f"probe-err rank={lr} local_rank={lr}\n"


def test_redirects_per_rank_map(launcher):
    """-r 0:1,1:2: rank 0's stdout and rank 1's stderr go to files; the other streams stay on the console."""
    log_dir = launcher.dir / "logs"
    result = launcher.run_fsm(
        "--log-dir", log_dir, "--redirects", "0:1,1:2", "--nproc-per-node", "2", launcher.probe
    ).check()
    assert "probe-out rank=0" not in result.stdout and "probe-out rank=1 local_rank=1" in result.stdout
    assert "probe-err rank=0 local_rank=0" in result.stderr and "probe-err rank=1" not in result.stderr
    assert "probe-out rank=0" in _rank_dir(log_dir, 0).joinpath("stdout.log").read_text()
    assert "probe-err rank=1" in _rank_dir(log_dir, 1).joinpath("stderr.log").read_text()


LINES = r"""
import os, sys
r = os.environ["LOCAL_RANK"]
for i in range(300):
    sys.stdout.write("line-%s-%d-" % (r, i) + "x" * 40)
    sys.stdout.flush()  # half a line now, the rest later: the console must still get whole lines
    sys.stdout.write("END\n")
    sys.stdout.flush()
sys.stdout.write("last-%s-no-newline" % r)
sys.stdout.flush()
print("stderr-%s" % r, file=sys.stderr, flush=True)
"""


def test_tee_prefixes_whole_lines_and_keeps_files(launcher):
    """--tee (-t is used elsewhere): prefixed, whole console lines, even for lines written in pieces."""
    script = write_script(launcher.dir, "lines.py", LINES)
    log_dir = launcher.dir / "logs"
    result = launcher.run_fsm("--log-dir", log_dir, "--tee", "3", "--nproc-per-node", "2", script).check()
    pattern = re.compile(r"^\[default([01])\]:(line-\1-\d+-x{40}END|last-\1-no-newline)$")
    out_lines = result.stdout.splitlines()
    assert len(out_lines) == 2 * 301
    bad = [line for line in out_lines if not pattern.match(line)]
    assert not bad, f"torn or unprefixed console lines: {bad[:5]}"
    for lr in (0, 1):
        assert f"[default{lr}]:stderr-{lr}" in result.stderr.splitlines()
        text = _rank_dir(log_dir, lr).joinpath("stdout.log").read_text()
        assert text.count("END\n") == 300 and text.endswith(f"last-{lr}-no-newline")


def test_local_ranks_filter(launcher):
    log_dir = launcher.dir / "logs"
    result = launcher.run_fsm(
        "--log-dir", log_dir, "-t", "3", "--local-ranks-filter", "1", "--nproc-per-node", "2", launcher.probe
    ).check()
    assert "[default1]:probe-out rank=1 local_rank=1" in result.stdout
    assert "probe-out rank=0" not in result.stdout and "probe-err rank=0" not in result.stderr
    assert "probe-out rank=0" in _rank_dir(log_dir, 0).joinpath("stdout.log").read_text()


def test_log_line_prefix_template(launcher):
    result = launcher.run_fsm(
        "-t",
        "1",
        "--nproc-per-node",
        "2",
        "--role",
        "w",
        launcher.probe,
        env={"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "<${role_name}|${rank}|${local_rank}> "},
    ).check()
    assert "<w|0|0> probe-out rank=0 local_rank=0" in result.stdout.splitlines()
    assert "<w|1|1> probe-out rank=1 local_rank=1" in result.stdout.splitlines()


FILTERED = r"""
import os, sys
r = os.environ["LOCAL_RANK"]
print("KEEP, comma %s" % r, flush=True)
print("drop %s" % r, flush=True)
print("ERRKEEP %s" % r, file=sys.stderr, flush=True)
print("errdrop %s" % r, file=sys.stderr, flush=True)
"""


def test_duplicate_stdout_and_stderr_filters(launcher):
    """The files hold what torchrun's hold: each matching line with the console's ``[role rank]:`` prefix."""
    script = write_script(launcher.dir, "filtered.py", FILTERED)
    flags = [
        "-t",
        "3",
        "--nproc-per-node",
        "2",
        "--duplicate-stdout-filters",
        "KEEP,, comma,nomatch",
        "--duplicate-stderr-filters",
        "ERRKEEP",
    ]
    files = {}
    for name, start in (("fsm", launcher.fsm), ("torchrun", launcher.torchrun)):
        log_dir = launcher.dir / f"logs_{name}"
        start("--standalone", "--log-dir", str(log_dir), *flags, str(script)).wait().check()
        attempt = _rank_dir(log_dir, 0).parent
        files[name] = [
            sorted(attempt.joinpath(f"filtered_{stream}.log").read_text().splitlines())
            for stream in ("stdout", "stderr")
        ]
    assert files["fsm"] == [
        ["[default0]:KEEP, comma 0", "[default1]:KEEP, comma 1"],
        ["[default0]:ERRKEEP 0", "[default1]:ERRKEEP 1"],
    ]
    assert files["fsm"] == files["torchrun"]


def test_logs_specs_unknown_name_is_a_clean_error(launcher):
    result = launcher.run_fsm("--logs-specs", "some_entry_point", launcher.probe)
    assert result.returncode != 0
    assert "--logs-specs" in one_error_line(result.stderr)
    assert launcher.records() == {}


def test_logs_specs_default_is_torchs_layout(launcher):
    """--logs-specs default: torch's own DefaultLogsSpecs (entry point) lays out the files."""
    log_dir = launcher.dir / "logs"
    result = launcher.run_fsm("--logs-specs", "default", "--log-dir", log_dir, "-r", "3", launcher.probe).check()
    assert "probe-out" not in result.stdout
    (run_dir,) = [p for p in log_dir.iterdir() if p.is_dir()]
    assert run_dir.name.startswith(launcher.records()[0]["env"]["TORCHELASTIC_RUN_ID"] + "_")
    assert {str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.name != "events.jsonl"} == {
        "attempt_0",
        "attempt_0/0",
        "attempt_0/0/stdout.log",
        "attempt_0/0/stderr.log",
    }
    assert run_dir.joinpath("attempt_0/0/stdout.log").read_text() == "probe-out rank=0 local_rank=0\n"


# ---------------------------------------------------------------------------------------------
# Shutdown and signals: --shutdown-timeout, --signals-to-handle
# ---------------------------------------------------------------------------------------------


def test_shutdown_timeout_bounds_the_grace_period(launcher):
    script = write_script(launcher.dir, "stubborn.py", STUBBORN)
    agent = launcher.fsm("--shutdown-timeout", "1", script)
    launcher.wait_for_file(launcher.out / "ready_0")
    worker_pid = int((launcher.out / "ready_0").read_text())
    sent = time.monotonic()
    agent.send_signal(signal.SIGTERM)
    result = agent.wait()
    elapsed = time.monotonic() - sent
    assert result.returncode == 128 + signal.SIGTERM
    assert elapsed < 20, f"took {elapsed:.1f}s: --shutdown-timeout 1 was not applied (default is 30 s)"
    assert (launcher.out / "term_0").exists(), "the worker never got SIGTERM before SIGKILL"
    assert "SIGKILL" in result.stderr
    assert _pids_gone([worker_pid])


@pytest.mark.parametrize("handled", [True, False], ids=["SIGUSR1-handled", "SIGUSR1-default"])
def test_signals_to_handle(launcher, handled):
    """A listed signal stops the workers with that same signal (torch's ``death_sig``), SIGKILL after
    the grace, and the agent exits 128+N; an unlisted one just kills the agent."""
    script = write_script(launcher.dir, "stubborn.py", STUBBORN)
    flags = ["--signals-to-handle", "SIGUSR1,SIGTERM"] if handled else []
    agent = launcher.fsm(*flags, "--shutdown-timeout", "1", script)
    launcher.wait_for_file(launcher.out / "ready_0")
    worker_pid = int((launcher.out / "ready_0").read_text())
    agent.send_signal(signal.SIGUSR1)
    result = agent.wait()
    if handled:
        assert result.returncode == 128 + signal.SIGUSR1
        assert (launcher.out / "usr1_0").exists(), "the worker was not sent SIGUSR1"
        assert not (launcher.out / "term_0").exists(), "the worker was sent SIGTERM, not the agent's signal"
    else:
        assert result.returncode == -signal.SIGUSR1  # default action: the agent dies of the signal
    assert _pids_gone([worker_pid]), "the worker outlived its agent"


# ---------------------------------------------------------------------------------------------
# Accepted placement/telemetry flags: --event-log-handler, --numa-binding, --virtual-local-rank
# ---------------------------------------------------------------------------------------------


def test_event_log_handler_is_accepted(launcher):
    """--event-log-handler (torch's event sink): accepted; fsm-agent records its events itself."""
    launcher.run_fsm("--event-log-handler", "console", launcher.probe).check()
    assert sorted(launcher.records()) == [0]


def test_numa_binding_without_numactl_runs_unbound_with_a_warning(launcher):
    result = launcher.run_fsm("--numa-binding", "node", launcher.probe).check()
    assert sorted(launcher.records()) == [0]
    if shutil.which("numactl") is None:
        assert "--numa-binding node not applied" in result.stderr


@pytest.mark.parametrize("parent_devices", ["5,7", None])
def test_virtual_local_rank(launcher, parent_devices):
    env = {"CUDA_VISIBLE_DEVICES": parent_devices} if parent_devices else {}
    launcher.run_fsm("--virtual-local-rank", "--nproc-per-node", "2", launcher.probe, env=env).check()
    records = launcher.records()
    assert sorted(records) == [0, 1]
    expected = parent_devices.split(",") if parent_devices else ["0", "1"]
    for rank, record in records.items():
        assert record["env"]["LOCAL_RANK"] == "0"
        assert record["env"]["CUDA_VISIBLE_DEVICES"] == expected[rank]


# ---------------------------------------------------------------------------------------------
# PET_* environment fallbacks
# ---------------------------------------------------------------------------------------------


def test_pet_env_fallbacks(launcher):
    launcher.run_fsm(
        launcher.probe,
        env={"PET_NPROC_PER_NODE": "2", "PET_ROLE": "fromenv", "PET_MAX_RESTARTS": "2", "PET_STANDALONE": "1"},
    ).check()
    records = launcher.records()
    assert sorted(records) == [0, 1]
    assert {r["env"]["ROLE_NAME"] for r in records.values()} == {"fromenv"}
    assert {r["env"]["TORCHELASTIC_MAX_RESTARTS"] for r in records.values()} == {"2"}


def test_command_line_wins_over_pet_env(launcher):
    launcher.run_fsm(
        "--nproc-per-node", "1", "--role", "cli", launcher.probe, env={"PET_NPROC_PER_NODE": "2", "PET_ROLE": "fromenv"}
    ).check()
    records = launcher.records()
    assert sorted(records) == [0] and records[0]["env"]["ROLE_NAME"] == "cli"


# ---------------------------------------------------------------------------------------------
# fsm-agent's own flags: --exit-barrier-timeout, --events-file, --disable-plugin, --launcher
# ---------------------------------------------------------------------------------------------

SLOW_ON_HOST = r"""
import os, time
if os.environ.get("E2E_SLOW"):
    time.sleep(float(os.environ["E2E_SLOW"]))
open(os.path.join(os.environ["FSM_E2E_OUT"], "done_" + os.environ["RANK"]), "w").close()
"""


@pytest.mark.parametrize("barrier", ["1", None], ids=["exit-barrier-timeout-1", "default-barrier"])
def test_exit_barrier_timeout(launcher, barrier):
    """The fast agent waits at the exit barrier for the slow one, unless --exit-barrier-timeout is shorter."""
    script = write_script(launcher.dir, "slow.py", SLOW_ON_HOST)  # the slow worker sleeps 10 s
    port = free_port()
    common = [
        "--nnodes",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "barrier",
        "--local-addr",
        "127.0.0.1",
    ]
    slow = launcher.fsm(*common, "--rdzv-conf", "is_host=1", script, env={"E2E_SLOW": "10"})
    fast_flags = ["--exit-barrier-timeout", barrier] if barrier else []
    fast = launcher.fsm(*common, "--rdzv-conf", "is_host=0", *fast_flags, script)
    fast_result = fast.wait()
    slow_done_when_fast_ended = len(list(launcher.out.glob("done_*"))) == 2
    fast_result.check()
    slow.wait().check()
    if barrier:
        assert not slow_done_when_fast_ended, "the fast agent waited for the slow one despite the 1 s barrier"
        assert "exit barrier" in fast_result.stderr
    else:
        assert slow_done_when_fast_ended, "the fast agent left before the slow agent's worker finished"


def test_events_file(launcher):
    events = launcher.dir / "sub" / "events.jsonl"
    launcher.run_fsm("--events-file", events, launcher.probe).check()
    records = read_events(events)
    kinds = [r["kind"] for r in records]
    assert "transition" in kinds and "worker_exit" in kinds and kinds[-1] == "run_end"
    assert records[-1]["exit_code"] == 0


@pytest.mark.parametrize("name", ["subprocess", "preload"])
def test_launcher(launcher, name):
    """--launcher subprocess: ``python -u script`` per worker; preload: forked from a zygote that imported torch."""
    launcher.run_fsm("--launcher", name, "--nproc-per-node", "2", launcher.probe, "${local_rank}").check()
    records = launcher.records()
    assert sorted(records) == [0, 1]
    for record in records.values():
        assert record["name"] == "__main__"
        assert record["argv"][1:] == [record["env"]["LOCAL_RANK"]]
        assert record["torch_loaded"] == (name == "preload")
        if name == "subprocess":
            assert record["orig_argv"][1:3] == ["-u", str(launcher.probe)]


def test_preload_modules_reach_the_zygote(launcher):
    """--preload-modules json: the zygote imports json, not its default torch, before forking."""
    launcher.run_fsm("--launcher", "preload", "--preload-modules", "json", launcher.probe).check()
    assert [r["torch_loaded"] for r in launcher.records().values()] == [False]


def test_preload_module_that_does_not_import(launcher):
    """A module the zygote cannot import: one line naming it and the fix, non-zero, no traceback."""
    result = launcher.run_fsm("--launcher", "preload", "--preload-modules", "nonexist_mod_q", launcher.probe)
    assert result.returncode != 0, result.stderr
    assert "could not import 'nonexist_mod_q'" in result.stderr and "--launcher subprocess" in result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert not launcher.records()


@pytest.mark.parametrize("how", ["flag", "env"])
def test_disable_plugin(launcher, how):
    log_dir = launcher.dir / "logs"
    flags = ["--disable-plugin", "metrics-logging,events-jsonl"] if how == "flag" else []
    env = {"FSM_AGENT_DISABLE_PLUGINS": "events-jsonl"} if how == "env" else {}
    launcher.run_fsm("--log-dir", log_dir, *flags, launcher.probe, env=env).check()
    run_dir = _rank_dir(log_dir, 0).parent.parent
    assert not run_dir.joinpath("events.jsonl").exists()
    assert launcher.records()


HEARTBEAT_THEN_HANG = r"""
import os, time
import fsm_agent
fsm_agent.heartbeat()
open(os.path.join(os.environ["FSM_E2E_OUT"], "ready_" + os.environ["RANK"]), "w").close()
time.sleep(120)
"""


def test_hang_timeout(launcher):
    """A worker that sent a heartbeat and then none for --hang-timeout seconds fails the job as hung."""
    script = write_script(launcher.dir, "hang.py", HEARTBEAT_THEN_HANG)
    result = launcher.run_fsm("--hang-timeout", "2", "--shutdown-timeout", "1", script)
    assert result.returncode != 0
    assert (launcher.out / "ready_0").exists()
    assert result.duration < 60
    assert "hang" in result.stderr and "Traceback (most recent call last)" not in result.stderr.split("Root Cause")[0]


FORWARDED = r"""
import os, signal, sys, time
out = os.environ["FSM_E2E_OUT"]
def on_usr1(signum, frame):
    open(os.path.join(out, "usr1_" + os.environ["RANK"]), "w").close()
    sys.exit(0)
signal.signal(signal.SIGUSR1, on_usr1)
open(os.path.join(out, "ready_" + os.environ["RANK"]), "w").close()
time.sleep(120)
sys.exit(5)
"""


def test_forward_signals(launcher):
    """--forward-signals SIGUSR1: the signal reaches the workers; nothing is stopped (the job ends with 0)."""
    script = write_script(launcher.dir, "forwarded.py", FORWARDED)
    agent = launcher.fsm("--forward-signals", "SIGUSR1", "--nproc-per-node", "2", script)
    launcher.wait_for_file(launcher.out / "ready_0")
    launcher.wait_for_file(launcher.out / "ready_1")
    agent.send_signal(signal.SIGUSR1)
    agent.wait().check()
    assert (launcher.out / "usr1_0").exists() and (launcher.out / "usr1_1").exists()


def test_config_file(launcher):
    """--config FILE: its settings apply; a flag wins over the file."""
    config = write_script(launcher.dir, "fsm.toml", 'nproc_per_node = 2\nrole = "fromfile"\nmax_restarts = 2\n')
    launcher.run_fsm("--config", config, "--role", "cli", launcher.probe).check()
    records = launcher.records()
    assert sorted(records) == [0, 1]
    assert {r["env"]["ROLE_NAME"] for r in records.values()} == {"cli"}
    assert {r["env"]["TORCHELASTIC_MAX_RESTARTS"] for r in records.values()} == {"2"}


STATUS_CLIENT = r"""
import json, os, urllib.request
base = "http://127.0.0.1:%s" % os.environ["E2E_STATUS_PORT"]
with urllib.request.urlopen(base + "/healthz", timeout=30) as r:
    health = (r.status, r.read().decode())
with urllib.request.urlopen(base + "/status", timeout=30) as r:
    status = json.loads(r.read())
with open(os.path.join(os.environ["FSM_E2E_OUT"], "status.json"), "w") as f:
    json.dump({"health": health, "status": status}, f)
"""


def test_status_port_plugin_option(launcher):
    """--status-port (an option the built-in status-http plugin adds): live status while workers run."""
    script = write_script(launcher.dir, "status_client.py", STATUS_CLIENT)
    port = free_port()
    launcher.run_fsm("--status-port", port, script, env={"E2E_STATUS_PORT": str(port)}).check()
    seen = json.loads((launcher.out / "status.json").read_text())
    assert seen["health"][0] == 200
    assert seen["status"]["state"] == "HEALTHY"
