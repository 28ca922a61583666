"""End to end: bad input is one clear stderr line and a non-zero exit, never a traceback; and the
three ways to start the launcher (``fsm-agent run``, ``fsmrun``, ``python -m fsm_agent run``) agree."""

from __future__ import annotations

import re
import socket
import sys

import pytest

from tests.conftest import free_port, fsm_agent_cmd, fsmrun_cmd, one_error_line, write_script

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

#: id -> (arguments before the script (None: no script at all), extra env, text the line must contain)
BAD = {
    "unknown-flag": (["--bogus-flag", "1"], {}, "--bogus-flag"),
    "nnodes-min-above-max": (["--nnodes", "3:2"], {}, "--nnodes"),
    "nnodes-zero": (["--nnodes", "0"], {}, "--nnodes"),
    "nnodes-not-a-number": (["--nnodes", "two"], {}, "--nnodes"),
    "nproc-zero": (["--nproc-per-node", "0"], {}, "--nproc-per-node"),
    "nproc-unknown-name": (["--nproc-per-node", "tpu"], {}, "--nproc-per-node"),
    "unknown-rdzv-backend": (["--rdzv-backend", "nope", "--rdzv-endpoint", "127.0.0.1:1", "--nnodes", "2"], {}, "nope"),
    "rdzv-conf-no-value": (["--rdzv-conf", "join_timeout"], {}, "--rdzv-conf"),
    "rdzv-conf-empty-key": (["--rdzv-conf", "=5"], {}, "--rdzv-conf"),
    "rdzv-conf-no-backend-reads": (
        ["--rdzv-conf", "join_timout=5"],
        {},
        "--rdzv-conf join_timout=5: no loaded rendezvous backend reads 'join_timout'; did you mean join_timeout?",
    ),
    "redirects-out-of-range": (["-r", "7"], {}, "--redirects"),
    "redirects-bad-map": (["-r", "0:4,1:3"], {}, "--redirects"),
    "tee-not-a-std": (["-t", "x"], {}, "--tee"),
    "local-ranks-filter": (["--local-ranks-filter", "a,b"], {}, "--local-ranks-filter"),
    "start-method": (["--start-method", "thread"], {}, "--start-method"),
    "numa-binding": (["--numa-binding", "everything"], {}, "--numa-binding"),
    "monitor-interval-zero": (["--monitor-interval", "0"], {}, "--monitor-interval"),
    "max-restarts-negative": (["--max-restarts", "-1"], {}, "--max-restarts"),
    "signals-untrappable": (["--signals-to-handle", "SIGKILL"], {}, "SIGKILL"),
    "no-python-with-module": (["--no-python", "-m"], {}, "--no-python"),
    "plugin-option-check": (["--health-check-interval", "0"], {}, "expected seconds > 0, got 0.0 (see"),
    "plugin-option-choice": (["--exclude-node-on", "gpu"], {}, "straggler, got 'gpu' (see"),
    "forward-signals-unknown": (["--forward-signals", "SIGFOO"], {}, "--forward-signals 'SIGFOO'"),
    "forward-signals-untrappable": (["--forward-signals", "SIGKILL"], {}, "cannot be trapped"),
    "forward-signals-env": ([], {"FSM_AGENT_FORWARD_SIGNALS": "SIGNOPE"}, "FSM_AGENT_FORWARD_SIGNALS='SIGNOPE'"),
    "log-dir-cannot-be-made": (["--log-dir", "/proc/no/such/dir"], {}, "--log-dir '/proc/no/such/dir'"),
    "no-python-binary-missing": (["--no-python", "{missing}"], {}, "--no-python binary"),
    "unknown-launcher": (["--launcher", "nope"], {}, "nope"),
    "disable-essential-plugin": (["--disable-plugin", "launcher-subprocess"], {}, "launcher-subprocess"),
    "disable-unknown-plugin": (
        ["--disable-plugin", "events-jsonl,nope"],
        {},
        "unknown plugin 'nope' in --disable-plugin: known plugins are ",
    ),
    "disable-unknown-plugin-env": (
        [],
        {"FSM_AGENT_DISABLE_PLUGINS": "nope"},
        "unknown plugin 'nope' in FSM_AGENT_DISABLE_PLUGINS: known plugins are ",
    ),
    "log-dir-is-a-file": (["--log-dir", "{probe}"], {}, "--log-dir"),
    "logs-specs-unknown": (["--logs-specs", "nope"], {}, "--logs-specs"),
    "pet-env-not-a-number": ([], {"PET_NPROC_PER_NODE": "abc"}, "PET_NPROC_PER_NODE='abc': unknown value"),
    "pet-env-not-a-bool": ([], {"PET_STANDALONE": "maybe"}, "PET_STANDALONE"),
    "node-rank-beyond-nnodes": (
        ["--node-rank", "5", "--nnodes", "2"],
        {},
        "--node-rank 5: with --nnodes 2 the node ranks are 0..1",
    ),
    "node-rank-negative": (["--node-rank", "-1", "--nnodes", "2"], {}, "--node-rank -1"),
    "missing-script": (["{missing}"], {}, "not found"),
    "static-timeout-negative": (
        ["--rdzv-conf", "timeout=-5", "--nnodes", "2"],
        {},
        "--rdzv-conf timeout=-5: must be a whole number of seconds > 0 (e.g. ",
    ),
    "static-timeout-zero": (["--rdzv-conf", "timeout=0", "--nnodes", "2"], {}, "--rdzv-conf timeout=0: must be"),
    "c10d-join-timeout-negative": (
        ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:1", "--nnodes", "2", "--rdzv-conf", "join_timeout=-5"],
        {},
        "--rdzv-conf join_timeout=-5: must be a whole number of seconds > 0 (e.g. ",
    ),
    "master-port-out-of-range": (
        ["--master-port", "99999"],
        {},
        "--master-port '99999': not a TCP port; use an integer from 0 to 65535",
    ),
    "rdzv-endpoint-port-not-a-number": (
        ["--rdzv-endpoint", "localhost:abc", "--nnodes", "2"],
        {},
        "--rdzv-endpoint 'localhost:abc': the port 'abc' is not a TCP port",
    ),
    "standalone-multi-node": (
        ["--standalone", "--nnodes", "2"],
        {},
        "--standalone with --nnodes 2: no other node can join a standalone rendezvous",
    ),
    "events-file-is-a-directory": (
        ["--events-file", "{dir}"],
        {},
        "is a directory: pass a file path, e.g. --events-file ",
    ),
    "no-script": (None, {}, "training_script"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line(launcher, case):
    flags, env, needle = BAD[case]
    if flags is None:
        args = []
    else:
        args = [
            a.replace("{probe}", str(launcher.probe))
            .replace("{missing}", str(launcher.dir / "missing.py"))
            .replace("{dir}", str(launcher.dir))
            for a in flags
        ]
        if case not in ("missing-script", "no-python-binary-missing"):
            args.append(str(launcher.probe))
    assert_rejected(launcher, launcher.run_fsm(*args, env=env, timeout=60), needle)


def assert_rejected(launcher, result, needle: str) -> None:
    """One ``fsm-agent: error:`` line containing ``needle``, a non-zero exit, no output, no worker."""
    assert result.returncode != 0
    line = one_error_line(result.stderr)
    assert line.startswith("fsm-agent: error: "), line
    assert needle in line, line
    assert result.stdout == ""
    assert launcher.records() == {}, "a worker was started"


@pytest.mark.parametrize("name, table", [("fsm.toml", ""), ("pyproject.toml", "[tool.fsm_agent]\n")])
def test_unknown_plugin_in_the_config_files_disabled_plugins(launcher, name, table):
    """``disabled_plugins`` in a ``--config`` file or in ./pyproject.toml: the line names the file and the key."""
    config = launcher.dir / name
    config.write_text(table + 'disabled_plugins = ["nope"]\n')
    args, label = ([], "pyproject.toml [tool.fsm_agent]") if table else (["--config", str(config)], str(config))
    assert_rejected(
        launcher,
        launcher.run_fsm(*args, launcher.probe, timeout=60),
        f"unknown plugin 'nope' in disabled_plugins of {label}: known plugins are ",
    )


@pytest.mark.parametrize(
    "body, mode, needle",
    [
        ("print('no shebang')\n", 0o755, "has no '#!' line"),
        ("#!/bin/sh\necho hi\n", 0o644, "is not executable"),
    ],
    ids=["no-shebang", "not-executable"],
)
def test_no_python_file_the_os_cannot_run(launcher, body, mode, needle):
    """Not an ``OSError: Exec format error`` per worker (44 lines), nor "not found" for a file that is there."""
    binary = write_script(launcher.dir, "train", body)
    binary.chmod(mode)
    assert_rejected(
        launcher, launcher.run_fsm("--no-python", str(binary), timeout=60), f"--no-python binary '{binary}' {needle}"
    )


#: id -> (torch's variables as set, text the line must contain): read before any worker starts
BAD_TORCH_ENV = {
    "loglevel-unknown": (
        {"LOGLEVEL": "NOPE"},
        "LOGLEVEL='NOPE': not a log level; use one of DEBUG, INFO, WARNING, ERROR, CRITICAL (any case), or unset it",
    ),
    "loglevel-empty": ({"LOGLEVEL": ""}, "LOGLEVEL='': not a log level"),
    "python-exec-missing": (
        {"PYTHON_EXEC": "/nonexistent/python"},
        "PYTHON_EXEC='/nonexistent/python': does not exist; set it to the Python interpreter the workers run (e.g. ",
    ),
    "python-exec-not-executable": ({"PYTHON_EXEC": "{probe}"}, "PYTHON_EXEC='{probe}': is not executable; set it"),
    "python-exec-a-directory": ({"PYTHON_EXEC": "{dir}"}, "PYTHON_EXEC='{dir}': is a directory; set it"),
    "python-exec-not-on-path": ({"PYTHON_EXEC": "no-such-python3.99"}, "'no-such-python3.99': not found on PATH; set"),
    "python-exec-empty": ({"PYTHON_EXEC": ""}, "PYTHON_EXEC='': is empty; set it"),
}


@pytest.mark.parametrize("case", list(BAD_TORCH_ENV))
def test_a_bad_torch_variable_is_one_line_before_any_worker(launcher, case):
    """Not logging's ``ValueError: Unknown level`` traceback (LOGLEVEL), nor exec's ~40 lines per
    worker (PYTHON_EXEC): one line naming the variable, exit 2, no worker started."""
    env, needle = BAD_TORCH_ENV[case]

    def filled(text: str) -> str:
        return text.replace("{probe}", str(launcher.probe)).replace("{dir}", str(launcher.dir))

    env = {name: filled(value) for name, value in env.items()}
    result = launcher.run_fsm("--standalone", "--nproc-per-node", "2", launcher.probe, env=env, timeout=60)
    assert_rejected(launcher, result, filled(needle))
    assert result.returncode == 2
    assert one_error_line(result.stderr).endswith(", or unset it")


@pytest.mark.parametrize("name, table", [("fsm.toml", ""), ("pyproject.toml", "[tool.fsm_agent]\n")])
def test_a_config_file_that_is_not_utf8_is_one_line(launcher, name, table):
    """A Latin-1 byte in a comment of a ``--config`` file or of ./pyproject.toml (read by every run in
    that folder): not tomllib's ``UnicodeDecodeError`` traceback (exit 1), one line naming the file."""
    config = launcher.dir / name
    config.write_bytes(b"# fsm-agent's settings\n# caf\xe9\n" + table.encode() + b"max_restarts = 1\n")
    args, label = ([], "pyproject.toml") if table else (["--config", str(config)], str(config))
    result = launcher.run_fsm(*args, launcher.probe, timeout=60)
    assert_rejected(launcher, result, f"{label}: byte 0xe9 on line 2 is not UTF-8; TOML is UTF-8: save it as UTF-8")
    assert result.returncode == 2


def test_static_master_port_in_use(launcher):
    """Node rank 0 of a static job cannot host its store: one line naming the port, not EADDRINUSE's 40."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = launcher.run_fsm("--master-port", str(port), launcher.probe, timeout=60)
    assert_rejected(launcher, result, f"port {port} (--master-port) is already in use on this host")


def root_cause(stderr: str) -> str:
    """The line after the summary's ``Root Cause`` heading."""
    lines = stderr.splitlines()
    return lines[lines.index("Root Cause (first observed failure):") + 1].strip()


@pytest.mark.parametrize("backend", ["c10d", "static"])
def test_a_rendezvous_timeout_says_what_timed_out_after_how_long(launcher, backend):
    """Not ``RendezvousTimeoutError: `` (c10d), nor ``join_timeout=600s`` where static waited ``timeout=3``."""
    endpoint = f"127.0.0.1:{free_port()}"
    key = "join_timeout" if backend == "c10d" else "timeout"
    result = launcher.run_fsm(
        "--rdzv-backend",
        backend,
        "--rdzv-endpoint",
        endpoint,
        "--nnodes",
        "2",
        "--rdzv-conf",
        f"{key}=3",
        launcher.probe,
        timeout=120,
    )
    assert result.returncode != 0 and launcher.records() == {}
    cause = root_cause(result.stderr)
    assert f"endpoint={endpoint} run_id=none {key}=3s" in cause, cause
    # The default join timeout (600 s) is not what timed out (the port may contain "600": look for a duration).
    assert not re.search(r"\b600(\.0)? ?s\b", cause) and ("is_host=" in cause) == (backend == "c10d"), cause
    if backend == "c10d":
        assert cause.endswith(
            f"RendezvousTimeoutError: the round did not complete within join_timeout=3s: "
            f"fewer than 2 agents (--nnodes 2:2) joined run id 'none' at {endpoint}; start the "
            f"other nodes, or give them longer with --rdzv-conf join_timeout=SECONDS"
        ), cause


def test_a_closed_rendezvous_asks_for_a_new_rdzv_id(launcher):
    """A second job with the id of one that ended on the same store: not ``RendezvousClosedError: ``."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    args = [
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{store.port}",
        "--rdzv-id",
        "job7",
        "--rdzv-conf",
        "is_host=0",
        launcher.probe,
    ]
    launcher.run_fsm(*args, timeout=120).check()
    again = launcher.run_fsm(*args, timeout=120)
    assert again.returncode != 0
    assert root_cause(again.stderr).endswith(
        f"RendezvousClosedError: the rendezvous of run id 'job7' at 127.0.0.1:{store.port} is closed: a job with "
        f"this id already ended there; start the job with a new --rdzv-id"
    ), again.stderr


def test_a_c10d_host_that_does_not_resolve_is_named(launcher):
    """Not "did not answer as a TCPStore within 65s". In a network namespace of its own (loopback only),
    so the name lookup fails at once and nothing leaves the machine."""
    import shutil
    import subprocess

    if shutil.which("unshare") is None or subprocess.run(["unshare", "-n", "true"]).returncode != 0:
        pytest.skip("cannot make a network namespace (unshare -n)")
    result = launcher.run(
        [
            "unshare",
            "-n",
            *fsm_agent_cmd(),
            "run",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "no-such-host.invalid:29400",
            "--nnodes",
            "2",
            "--rdzv-conf",
            "read_timeout=1",
            str(launcher.probe),
        ],
        timeout=120,
    )
    assert result.returncode != 0 and launcher.records() == {}
    line = result.stderr.splitlines()[-1]
    assert line.startswith(
        "fsm-agent: error: rendezvous endpoint no-such-host.invalid:29400 (backend c10d): the "
        "host 'no-such-host.invalid' does not resolve ("
    ), result.stderr
    assert line.endswith("s): check the host name in --rdzv-endpoint") and "TCPStore" not in line


def test_fsmrun_is_fsm_agent_run(launcher):
    """``fsmrun ARGS`` launches the same job as ``fsm-agent run ARGS``, and rejects the same input."""
    launcher.run(
        [*fsmrun_cmd(), "--nproc-per-node", "2", "--role", "r", launcher.probe, "x"], env={"FSM_E2E_TAG": "fsmrun_"}
    ).check()
    launcher.run_fsm("--nproc-per-node", "2", "--role", "r", launcher.probe, "x", env={"FSM_E2E_TAG": "agent_"}).check()
    via_fsmrun, via_agent = launcher.records("fsmrun_"), launcher.records("agent_")
    assert sorted(via_fsmrun) == sorted(via_agent) == [0, 1]
    for rank in (0, 1):
        a, b = via_fsmrun[rank], via_agent[rank]
        assert set(a["env"]) == set(b["env"])
        assert a["argv"][1:] == b["argv"][1:] == ["x"]
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "ROLE_NAME", "GROUP_RANK", "TORCHELASTIC_MAX_RESTARTS"):
            assert a["env"][key] == b["env"][key], key

    bad_fsmrun = launcher.run([*fsmrun_cmd(), "--nnodes", "3:2", launcher.probe])
    bad_agent = launcher.run_fsm("--nnodes", "3:2", launcher.probe)
    assert bad_fsmrun.returncode == bad_agent.returncode != 0
    # the same line, under the name the user typed
    agent_line = one_error_line(bad_agent.stderr)
    assert one_error_line(bad_fsmrun.stderr) == "fsmrun: " + agent_line.removeprefix("fsm-agent: ")
    help_text = launcher.run([*fsmrun_cmd(), "--help"]).check().stdout
    assert "--nproc-per-node" in help_text and "--rdzv-endpoint" in help_text


def test_python_m_fsm_agent_run(launcher):
    launcher.run([sys.executable, "-m", "fsm_agent", "run", "--nproc-per-node", "2", launcher.probe]).check()
    assert sorted(launcher.records()) == [0, 1]


@pytest.mark.parametrize("args, needle", [([], "command"), (["nope"], "nope")], ids=["no-command", "bad-command"])
def test_fsm_agent_without_a_valid_command(launcher, args, needle):
    result = launcher.run([*fsm_agent_cmd(), *args], timeout=60)
    assert result.returncode != 0
    assert needle in one_error_line(result.stderr).lower()


#: id -> (fsm-agent's arguments, the one line it must print): every subcommand, as ``run`` does
SUBCOMMAND_BAD = {
    "main-unknown-flag": (["--bogus"], "unrecognized arguments: --bogus (see fsm-agent --help)"),
    "replay-no-file": (["replay"], "required: EVENTS.jsonl (see fsm-agent replay --help)"),
    "replay-unknown-flag": (
        ["replay", "--bogus", "x"],
        "unrecognized arguments: --bogus (see fsm-agent replay --help)",
    ),
    "statechart-extra": (["statechart", "extra"], "unrecognized arguments: extra (see fsm-agent statechart --help)"),
    "statechart-format": (["statechart", "--format", "dot"], "invalid choice: 'dot'"),
    "plugins-unknown-flag": (["plugins", "--bogus"], "unrecognized arguments: --bogus (see fsm-agent plugins --help)"),
    "status-unknown-flag": (["status", "--bogus"], "unrecognized arguments: --bogus (see fsm-agent status --help)"),
    "status-no-url": (["status"], "required: url (see fsm-agent status --help)"),
    "config-unknown-flag": (["config", "--bogus"], "unrecognized arguments: --bogus (see fsm-agent config --help)"),
}


@pytest.mark.parametrize("case", list(SUBCOMMAND_BAD))
def test_every_subcommand_rejects_bad_input_in_one_line(launcher, case):
    """Not argparse's usage text above the error, nor "required: url" for a flag that does not exist."""
    args, needle = SUBCOMMAND_BAD[case]
    result = launcher.run([*fsm_agent_cmd(), *args], timeout=60)
    assert result.returncode == 2
    assert result.stdout == ""
    line = one_error_line(result.stderr)
    assert line.startswith("fsm-agent: error: ") and needle in line, line


def test_fsm_agent_run_help_lists_every_torchrun_flag(launcher):
    from torch.distributed.run import get_args_parser

    result = launcher.run([*fsm_agent_cmd(), "run", "--help"], timeout=60).check()
    for action in get_args_parser()._actions:
        if action.option_strings:
            assert action.option_strings[-1] in result.stdout or action.option_strings[0] in result.stdout, action


def test_an_agent_that_fails_while_being_built_leaves_no_temporary_directory(launcher, tmp_path):
    """The temporary log dir and the heartbeat dir are removed when a plugin fails to configure."""
    scratch = tmp_path / "scratch_tmp"
    scratch.mkdir()
    result = launcher.run_fsm(
        "--events-file", "/proc/no/such/dir/events.jsonl", str(launcher.probe), env={"TMPDIR": str(scratch)}, timeout=60
    )
    assert result.returncode == 2
    assert "--events-file '/proc/no/such/dir/events.jsonl': cannot write" in one_error_line(result.stderr)
    assert list(scratch.iterdir()) == []


@pytest.mark.parametrize("args", [["statechart"], ["config", "--json"], ["plugins", "--json"]])
def test_a_reader_that_left_is_no_traceback(launcher, args):
    """``fsm-agent statechart | head -c 10``: stdout's reader is gone; exit 141 (SIGPIPE's), no traceback."""
    import os
    import subprocess

    read_end, write_end = os.pipe()
    os.close(read_end)  # every write to stdout now fails with EPIPE
    try:
        done = subprocess.run(
            [*fsm_agent_cmd(), *args], stdout=write_end, stderr=subprocess.PIPE, text=True, cwd=launcher.dir, timeout=60
        )
    finally:
        os.close(write_end)
    assert done.returncode == 141, done.stderr
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr


@pytest.mark.parametrize("module", ["fsm_agent.states.statechart", "fsm_agent.replay"])
def test_python_m_of_a_subcommand_rejects_bad_input_in_one_line(launcher, module):
    result = launcher.run([sys.executable, "-m", module, "--bogus", "x"], timeout=60)
    assert result.returncode == 2
    assert "unrecognized arguments: --bogus" in one_error_line(result.stderr)
