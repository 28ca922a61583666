"""fsm_agent.cli: torchrun flag parity, env fallbacks, LaunchConfig building and one-line errors."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import types
import uuid
from pathlib import Path

import pytest

from fsm_agent import cli
from fsm_agent.errors import ConfigError, FsmAgentError
from tests.helpers.processes import checkout_env, run_cli

pytestmark = pytest.mark.unit

REPO_ROOT = Path(__file__).resolve().parents[2]

#: Every torchrun flag set, in torchrun's underscored spelling where it has one.
ALL_TORCH_FLAGS = [
    "--nnodes",
    "1:3",
    "--nproc_per_node",
    "4",
    "--rdzv_backend",
    "c10d",
    "--rdzv_endpoint",
    "host:1234",
    "--rdzv_id",
    "job",
    "--rdzv_conf",
    "join_timeout=5,read_timeout=7",
    "--standalone",
    "--max_restarts",
    "2",
    "--monitor_interval",
    "0.5",
    "--start_method",
    "fork",
    "--event_log_handler",
    "console",
    "--role",
    "trainer",
    "-m",
    "--log_dir",
    "/tmp/logs",
    "-r",
    "3",
    "-t",
    "0:1,1:2",
    "--local_ranks_filter",
    "0,1",
    "--duplicate_stdout_filters",
    "a,,b,c",
    "--duplicate_stderr_filters",
    "err",
    "--node_rank",
    "1",
    "--master_addr",
    "10.0.0.1",
    "--master_port",
    "1234",
    "--local_addr",
    "me",
    "--logs_specs",
    "spec",
    "--numa_binding",
    "socket",
    "--signals_to_handle",
    "SIGTERM,SIGUSR1",
    "--shutdown_timeout",
    "5",
    "--virtual_local_rank",
]


def dashed(argv: list[str]) -> list[str]:
    return [a.replace("_", "-") if a.startswith("--") else a for a in argv]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No PET_*/FSM_AGENT_* or torch knobs from the outer environment; OMP_NUM_THREADS preset."""
    for name in list(os.environ):
        if name.startswith(("PET_", "FSM_AGENT_")):
            monkeypatch.delenv(name)
    for name in ("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "PYTHON_EXEC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "4")


@pytest.fixture
def script(tmp_path) -> str:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


def parse(*argv: str):
    return cli.get_run_parser().parse_args(list(argv))


def build(*argv: str):
    return cli.config_from_args(parse(*argv))


def torch_parser():
    from torch.distributed.run import get_args_parser

    return get_args_parser()


def torch_actions() -> dict:
    return {a.dest: a for a in torch_parser()._actions if a.dest != "help"}


def own_actions() -> dict:
    return {a.dest: a for a in cli.get_run_parser()._actions if a.dest != "help"}


# ------------------------------------------------------------------ parity with torchrun's parser


def test_every_torchrun_flag_has_same_spellings_default_and_choices():
    ours = own_actions()
    for dest, theirs in torch_actions().items():
        assert dest in ours, f"missing torchrun flag {dest}"
        mine = ours[dest]
        assert set(mine.option_strings) == set(theirs.option_strings), dest
        assert mine.default == theirs.default, dest
        assert list(mine.choices or []) == list(theirs.choices or []), dest
        assert mine.nargs == theirs.nargs, dest


def test_env_fallback_exactly_where_torchrun_has_one():
    from torch.distributed.argparse_util import check_env, env

    ours = own_actions()
    for dest, theirs in torch_actions().items():
        if isinstance(theirs, (env, check_env)):
            assert isinstance(ours[dest], cli._EnvAction), dest
            assert ours[dest].env_var == f"PET_{dest.upper()}"
        else:
            assert not isinstance(ours[dest], cli._EnvAction), dest


@pytest.mark.parametrize(
    "argv",
    [
        ["x.py"],
        ALL_TORCH_FLAGS + ["x.py", "--nproc-per-node", "5", "--foo"],
        dashed(ALL_TORCH_FLAGS) + ["x.py", "a", "--", "-m"],
        ["--no_python", "--run_path", "/bin/true", "-x", "--standalone"],
        ["--nproc-per-node=2", "--rdzv-endpoint=h:1", "x.py", "--rdzv-endpoint=other"],
    ],
)
def test_parsed_values_equal_torchrun(argv):
    theirs = torch_parser().parse_args(argv)
    mine = parse(*argv)
    for dest in torch_actions():
        assert getattr(mine, dest) == getattr(theirs, dest), dest


def test_fsm_agent_flags_defaults_and_help():
    args = parse("x.py")
    assert args.exit_barrier_timeout == 300
    assert args.events_file is None
    assert args.launcher == "subprocess"
    assert args.disabled_plugins == ()
    help_text = " ".join(cli.get_run_parser().format_help().split())
    for flag in ("--exit-barrier-timeout", "--events-file", "--launcher", "--disable-plugin"):
        assert flag in help_text
    assert help_text.count("fsm-agent:") >= 4


def test_fsm_agent_flags_both_spellings():
    args = parse(
        "--exit_barrier_timeout",
        "12.5",
        "--events-file",
        "/tmp/e.jsonl",
        "--launcher",
        "mine",
        "--disable_plugin",
        "a",
        "--disable-plugin",
        "b,c",
        "x.py",
    )
    assert args.exit_barrier_timeout == 12.5
    assert args.events_file == "/tmp/e.jsonl"
    assert args.launcher == "mine"
    assert args.disabled_plugins == ("a", "b", "c")


def test_disabled_plugins_env_adds_to_flag(monkeypatch, script):
    monkeypatch.setenv("FSM_AGENT_DISABLE_PLUGINS", "x, y")
    config, _, _ = build("--disable-plugin", "z", "--disable-plugin", "x", script)
    assert config.disabled_plugins == ("x", "y", "z")


# ------------------------------------------------------------------ PET_* fallbacks


def test_pet_value_is_used_and_converted(monkeypatch):
    monkeypatch.setenv("PET_NPROC_PER_NODE", "4")
    monkeypatch.setenv("PET_MAX_RESTARTS", "3")
    monkeypatch.setenv("PET_MONITOR_INTERVAL", "0.25")
    monkeypatch.setenv("PET_DUPLICATE_STDOUT_FILTERS", "a,,b,c")
    args = parse("x.py")
    assert (args.nproc_per_node, args.max_restarts, args.monitor_interval) == ("4", 3, 0.25)
    assert args.duplicate_stdout_filters == ["a,b", "c"]


def test_command_line_wins_over_pet(monkeypatch):
    monkeypatch.setenv("PET_NPROC_PER_NODE", "4")
    monkeypatch.setenv("PET_STANDALONE", "0")
    args = parse("--nproc_per_node", "2", "--standalone", "x.py")
    assert args.nproc_per_node == "2"
    assert args.standalone is True


def test_pet_read_at_parse_time(monkeypatch):
    parser = cli.get_run_parser()
    monkeypatch.setenv("PET_ROLE", "late")
    assert parser.parse_args(["x.py"]).role == "late"


@pytest.mark.parametrize(
    "raw,expected",
    [
        ("1", True),
        ("true", True),
        ("TRUE", True),
        ("yes", True),
        ("y", True),
        ("on", True),
        ("0", False),
        ("false", False),
        ("no", False),
        ("off", False),
    ],
)
@pytest.mark.parametrize("dest", ["standalone", "module", "no_python", "run_path", "virtual_local_rank"])
def test_pet_booleans(monkeypatch, dest, raw, expected):
    monkeypatch.setenv(f"PET_{dest.upper()}", raw)
    assert getattr(parse("x.py"), dest) is expected


def test_empty_pet_counts_as_unset(monkeypatch):
    monkeypatch.setenv("PET_STANDALONE", "")
    monkeypatch.setenv("PET_MASTER_PORT", "")
    args = parse("x.py")
    assert args.standalone is False
    assert args.master_port is None


@pytest.mark.parametrize(
    "name,raw",
    [
        ("PET_STANDALONE", "maybe"),
        ("PET_MAX_RESTARTS", "three"),
        ("PET_MONITOR_INTERVAL", "fast"),
        ("PET_START_METHOD", "thread"),
        ("PET_NNODES", "3:2"),
        ("PET_NPROC_PER_NODE", "0"),
        ("PET_RDZV_CONF", "a="),
        ("PET_REDIRECTS", "7"),
        ("PET_SIGNALS_TO_HANDLE", "SIGNOPE"),
    ],
)
def test_bad_pet_value_names_the_env_var(monkeypatch, name, raw):
    monkeypatch.setenv(name, raw)
    with pytest.raises(ConfigError, match=name):
        parse("x.py")


def test_no_env_for_logs_specs_and_numa_binding(monkeypatch):
    monkeypatch.setenv("PET_LOGS_SPECS", "spec")
    monkeypatch.setenv("PET_NUMA_BINDING", "node")
    args = parse("x.py")
    assert args.logs_specs is None and args.numa_binding is None


# ------------------------------------------------------------------ --nnodes


@pytest.mark.parametrize("value,expected", [("1", (1, 1)), ("2", (2, 2)), ("1:4", (1, 4)), ("3:3", (3, 3))])
def test_nnodes_forms(value, expected, script):
    config, _, _ = build("--nnodes", value, script)
    assert (config.min_nodes, config.max_nodes) == expected


def test_nnodes_min_greater_than_max():
    with pytest.raises(ConfigError) as err:
        cli.parse_nnodes("3:2")
    assert str(err.value) == "--nnodes '3:2': MIN must be <= MAX (e.g. --nnodes 2:3)"


@pytest.mark.parametrize("value", ["0", "0:2", "-1", "a", "1:b", "1:2:3", ""])
def test_nnodes_errors(value):
    with pytest.raises(ConfigError, match="--nnodes"):
        parse("--nnodes", value, "x.py")


# ------------------------------------------------------------------ --nproc-per-node


def test_nproc_int(script):
    config, _, _ = build("--nproc-per-node", "3", script)
    assert config.nproc_per_node == 3


@pytest.mark.parametrize("value", ["0", "-2", ""])
def test_nproc_not_positive(value):
    with pytest.raises(ConfigError, match="--nproc-per-node"):
        parse("--nproc-per-node", value, "x.py")


def test_nproc_cpu_counts_usable_cpus():
    expected = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert cli.resolve_nproc_per_node("cpu") == expected


def test_nproc_gpu_without_cuda(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="CUDA is not available"):
        cli.resolve_nproc_per_node("gpu")


def test_nproc_gpu_counts_devices(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert cli.resolve_nproc_per_node("gpu") == 3


def test_nproc_auto(monkeypatch):
    import torch

    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    assert cli.resolve_nproc_per_node("auto") == cli._cpu_count()
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 8)
    assert cli.resolve_nproc_per_node("auto") == 8


def test_nproc_unknown_name():
    with pytest.raises(ConfigError, match="--nproc-per-node 'tpu'"):
        cli.resolve_nproc_per_node("tpu")


def test_int_nproc_does_not_import_torch():
    code = (
        "import sys, fsm_agent.cli as c; before = 'torch' in sys.modules; "
        "c.config_from_args(c.get_run_parser().parse_args(['--nproc-per-node', '2', '-m', 'pkg'])); "
        "assert before or 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True, env=checkout_env(), capture_output=True)


# ------------------------------------------------------------------ rendezvous settings


def test_standalone(script):
    config, _, _ = build("--standalone", "--rdzv-backend", "etcd", "--rdzv-endpoint", "h:1", "--rdzv-id", "j", script)
    assert (config.rdzv_backend, config.rdzv_endpoint) == ("fsm", "127.0.0.1:0")  # torchrun: c10d, localhost:0
    assert uuid.UUID(config.run_id)
    assert config.standalone is True
    assert "rank" not in config.rdzv_configs


def test_standalone_ids_are_fresh(script):
    assert build("--standalone", script)[0].run_id != build("--standalone", script)[0].run_id


def test_implicit_standalone(script):
    config, _, _ = build("--nproc-per-node", "2", script)
    assert (config.rdzv_backend, config.rdzv_endpoint) == ("fsm", "127.0.0.1:0")  # torchrun: c10d, localhost:0
    assert uuid.UUID(config.run_id)
    assert config.standalone is False


def test_master_port_turns_off_implicit_standalone(script):
    config, _, _ = build("--master-port", "1234", script)
    assert (config.rdzv_backend, config.rdzv_endpoint, config.run_id) == ("static", "127.0.0.1:1234", "none")
    assert config.rdzv_configs == {"rank": 0}


def test_static_multi_node_endpoint_from_master(script):
    config, _, _ = build("--nnodes", "2", "--node-rank", "1", "--master-addr", "10.1.2.3", script)
    assert (config.rdzv_backend, config.rdzv_endpoint) == ("static", "10.1.2.3:29500")
    assert config.rdzv_configs["rank"] == 1
    assert (config.master_addr, config.master_port, config.node_rank) == ("10.1.2.3", 29500, 1)


def test_static_explicit_endpoint_kept(script):
    config, _, _ = build("--rdzv-endpoint", "h:5", "--rdzv-conf", "timeout=9", script)
    assert (config.rdzv_backend, config.rdzv_endpoint) == ("static", "h:5")
    assert config.rdzv_configs == {"timeout": "9", "rank": 0}


def test_c10d_kept_as_given(script):
    config, _, _ = build(
        "--nnodes",
        "1:2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "h:29400",
        "--rdzv-id",
        "job",
        "--rdzv-conf",
        "join_timeout=5",
        script,
    )
    assert (config.rdzv_backend, config.rdzv_endpoint, config.run_id) == ("c10d", "h:29400", "job")
    assert config.rdzv_configs == {"join_timeout": "5"}


def test_unknown_backend_is_left_for_the_registry(script):
    assert build("--rdzv-backend", "mine", "--nnodes", "2", script)[0].rdzv_backend == "mine"


@pytest.mark.parametrize(
    "value,expected",
    [
        ("", {}),
        ("  ", {}),
        ("a=1", {"a": "1"}),
        ("a=1, b = 2", {"a": "1", "b": "2"}),
        ("k=v=w", {"k": "v=w"}),
    ],
)
def test_rdzv_conf(value, expected):
    assert cli.parse_rdzv_conf(value) == expected


@pytest.mark.parametrize(
    "value,match",
    [("a=", "'a' has no value"), ("a", "'a' has no value"), ("=1", "empty key"), ("a=1,,b=2", "empty key")],
)
def test_rdzv_conf_errors(value, match):
    with pytest.raises(ConfigError, match=match):
        parse("--rdzv-conf", value, "x.py")


# ------------------------------------------------------------------ entrypoints and script args


def test_script_args_verbatim(script):
    args = parse(script, "--nproc-per-node", "5", "--foo", "-m", "--", "x")
    assert args.nproc_per_node == "1" and args.module is False
    assert args.training_script_args == ["--nproc-per-node", "5", "--foo", "-m", "--", "x"]
    _, entrypoint, entry_args = cli.config_from_args(args)
    assert entrypoint == sys.executable
    assert entry_args == ("-u", script, "--nproc-per-node", "5", "--foo", "-m", "--", "x")


#: Script arguments that look like abbreviations of launcher flags (--r: --redirects/--role/--rdzv-*...).
LOOKALIKE_SCRIPT_ARGS = ["--r=16", "--ma", "3", "--log", "x", "--no", "-m", "pkg", "--nproc-per-node", "5"]


def test_script_args_that_abbreviate_launcher_flags_are_the_scripts(fake_launch, script):
    """pytorch#120601: argparse read the script's ``--r=16`` as an ambiguous launcher flag."""
    fake = fake_launch(exit_code=0)
    assert exit_code_of(cli.main, ["run", "--nproc_per", "2", script, *LOOKALIKE_SCRIPT_ARGS]) == 0
    config, entrypoint, entry_args = fake.calls[0]
    assert config.nproc_per_node == 2 and config.redirects == "0"
    assert (entrypoint, entry_args) == (sys.executable, ("-u", script, *LOOKALIKE_SCRIPT_ARGS))


@pytest.mark.parametrize(
    "argv,dest,value",
    [
        (["--nproc_per", "2"], "nproc_per_node", "2"),
        (["--max-r", "3"], "max_restarts", 3),
        (["--rdzv-b=c10d"], "rdzv_backend", "c10d"),
        (["-r3"], "redirects", "3"),
        (["--no-p"], "no_python", True),
    ],
)
def test_abbreviations_before_the_script_still_work(argv, dest, value):
    args = parse(*argv, "train.py", *LOOKALIKE_SCRIPT_ARGS)
    assert getattr(args, dest) == value
    assert (args.training_script, args.training_script_args) == ("train.py", LOOKALIKE_SCRIPT_ARGS)


def test_an_ambiguous_abbreviation_before_the_script_is_still_an_error():
    with pytest.raises(ConfigError, match="ambiguous option: --r could match"):
        parse("--r", "3", "train.py")


def test_python_exec(monkeypatch, script, tmp_path):
    python = tmp_path / "py"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    monkeypatch.setenv("PYTHON_EXEC", str(python))
    assert build(script)[1] == str(python)
    monkeypatch.setenv("PYTHON_EXEC", "sh")  # a name, looked up on PATH as exec does
    assert build(script)[1] == "sh"


def test_module_entrypoint():
    _, entrypoint, entry_args = build("-m", "pkg.train", "--lr", "1")
    assert (entrypoint, entry_args) == (sys.executable, ("-u", "-m", "pkg.train", "--lr", "1"))


def test_no_python_entrypoint():
    _, entrypoint, entry_args = build("--no-python", "true", "--x")  # a binary on PATH
    assert (entrypoint, entry_args) == ("true", ("--x",))


def test_no_python_binary_must_exist():
    with pytest.raises(ConfigError, match="--no-python binary 'my_binary' not found"):
        build("--no-python", "my_binary", "--x")


@pytest.mark.parametrize(
    "body,mode,message",
    [
        ("print('hi')\n", 0o755, "has no '#!' line, so it cannot be executed: add one"),
        ("#!/bin/sh\necho hi\n", 0o644, "is not executable: chmod +x it"),
    ],
)
def test_no_python_file_the_os_cannot_run(tmp_path, body, mode, message):
    path = tmp_path / "train"
    path.write_text(body)
    path.chmod(mode)
    with pytest.raises(ConfigError, match=re.escape(f"--no-python binary '{path}' {message}")):
        build("--no-python", str(path))


def test_no_python_file_here_but_not_on_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.sh").write_text("#!/bin/sh\n")
    (tmp_path / "train.sh").chmod(0o755)
    with pytest.raises(ConfigError, match="not on PATH; for the file in this directory, say ./train.sh"):
        build("--no-python", "train.sh")
    assert build("--no-python", "./train.sh")[1] == "./train.sh"


def test_module_with_no_python_is_an_error():
    with pytest.raises(ConfigError, match="--no-python and -m"):
        build("-m", "--no-python", "pkg")


def test_run_path_entrypoint(script):
    _, entrypoint, entry_args = build("--run-path", "--no-python", script, "a")
    assert entrypoint is cli.run_script_path
    assert entry_args == (script, "a")


def test_run_script_path_runs_as_main(monkeypatch, tmp_path):
    out = tmp_path / "out.txt"
    path = tmp_path / "s.py"
    path.write_text(f"import sys\nif __name__ == '__main__':\n    open({str(out)!r}, 'w').write(' '.join(sys.argv))\n")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    cli.run_script_path(str(path), "--a", "1")
    assert out.read_text() == f"{path} --a 1"


def test_missing_script():
    with pytest.raises(ConfigError) as err:
        build("x.py")
    assert str(err.value) == (
        "training script 'x.py' not found: check the path (or use -m for a module, --no-python for a binary)"
    )


def test_missing_script_with_run_path():
    with pytest.raises(ConfigError, match="not found"):
        build("--run-path", "/no/such/x.py")


# ------------------------------------------------------------------ the rest of LaunchConfig


def test_defaults_config(script):
    config, _, _ = build(script)
    assert (config.nproc_per_node, config.max_restarts, config.monitor_interval) == (1, 0, 0.1)
    assert (config.role, config.start_method, config.event_log_handler) == ("default", "spawn", "null")
    assert (config.redirects, config.tee, config.local_ranks_filter) == ("0", "0", None)
    assert config.shutdown_timeout == 30
    assert config.signals_to_handle == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    assert (config.exit_barrier_timeout, config.events_file, config.launcher) == (300, None, "subprocess")
    assert config.duplicate_stdout_filters == config.duplicate_stderr_filters == ()
    assert config.log_line_prefix_template is None


def test_all_flags_reach_config(script):
    argv = [a for a in ALL_TORCH_FLAGS if a not in ("-m", "--standalone")]
    config, _, _ = build(*argv, script)
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (1, 3, 4)
    assert (config.rdzv_backend, config.rdzv_endpoint, config.run_id) == ("c10d", "host:1234", "job")
    assert config.rdzv_configs == {"join_timeout": "5", "read_timeout": "7"}
    assert (config.max_restarts, config.monitor_interval, config.start_method) == (2, 0.5, "fork")
    assert (config.event_log_handler, config.role, config.log_dir) == ("console", "trainer", "/tmp/logs")
    assert (config.redirects, config.tee, config.local_ranks_filter) == ("3", "0:1,1:2", frozenset({0, 1}))
    assert config.duplicate_stdout_filters == ("a,b", "c")
    assert config.duplicate_stderr_filters == ("err",)
    assert (config.local_addr, config.logs_specs, config.numa_binding) == ("me", "spec", "socket")
    assert (config.signals_to_handle, config.shutdown_timeout) == ("SIGTERM,SIGUSR1", 5)
    assert config.virtual_local_rank is True


def test_shutdown_timeout_sources(monkeypatch, script):
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "12")
    assert build(script)[0].shutdown_timeout == 12
    assert build("--shutdown-timeout", "3", script)[0].shutdown_timeout == 3
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "soon")
    with pytest.raises(ConfigError, match="TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        build(script)


def test_log_line_prefix_template(monkeypatch, script):
    monkeypatch.setenv("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[${rank}]")
    assert build(script)[0].log_line_prefix_template == "[${rank}]"


@pytest.mark.parametrize(
    "value,expected", [("", None), ("0", frozenset({0})), ("0,1", frozenset({0, 1})), ("3,12", frozenset({3, 12}))]
)
def test_local_ranks_filter(value, expected):
    assert cli.parse_local_ranks_filter(value) == expected


@pytest.mark.parametrize("value", ["a", "0,,1", "-1", "0,x"])
def test_local_ranks_filter_errors(value):
    with pytest.raises(ConfigError, match="--local-ranks-filter"):
        parse("--local-ranks-filter", value, "x.py")


@pytest.mark.parametrize(
    "value,expected", [("a", ["a"]), ("a,b", ["a", "b"]), ("a,,b", ["a,b"]), ("x,,,y", ["x,", "y"]), ("", [])]
)
def test_duplicate_filters(value, expected):
    assert parse("--duplicate-stdout-filters", value, "x.py").duplicate_stdout_filters == expected


@pytest.mark.parametrize("value", ["0", "3", "0:3", "0:3,1:2", "10:1,11:2"])
@pytest.mark.parametrize("flag", ["-r", "--redirects", "-t", "--tee"])
def test_std_values(flag, value):
    args = parse(flag, value, "x.py")
    assert value in (args.redirects, args.tee)


@pytest.mark.parametrize("value", ["4", "a", "0:4", "0:1,", "0-1", " 1"])
@pytest.mark.parametrize("flag", ["-r", "-t"])
def test_std_errors(flag, value):
    with pytest.raises(ConfigError, match="--redirects|--tee"):
        parse(flag, value, "x.py")


@pytest.mark.parametrize(
    "value,match", [("SIGFOO", "SIGFOO"), ("SIGTERM,NOPE", "'NOPE' is not a signal"), ("SIGKILL", "cannot be")]
)
def test_signals_errors(value, match):
    with pytest.raises(ConfigError, match=match):
        parse("--signals-to-handle", value, "x.py")


def test_numa_binding_choices(script):
    assert build("--numa-binding", "core-complex", script)[0].numa_binding == "core-complex"
    with pytest.raises(ConfigError, match="invalid choice"):
        parse("--numa-binding", "everything", "x.py")


def test_max_restarts_negative(script):
    with pytest.raises(ConfigError, match="--max-restarts"):
        build("--max-restarts", "-1", script)


def test_omp_num_threads_default(monkeypatch, caplog, script):
    """torch's banner is a warning of the log (LOGLEVEL=ERROR hides it, as torchrun's), not a print."""
    monkeypatch.delenv("OMP_NUM_THREADS")
    with caplog.at_level("WARNING", logger=cli.log.name):
        build("--nproc-per-node", "2", script)
    assert os.environ["OMP_NUM_THREADS"] == "1"
    [record] = caplog.records
    assert record.levelname == "WARNING"
    assert "Setting OMP_NUM_THREADS environment variable for each process to be 1" in record.getMessage()


def test_omp_num_threads_kept_or_not_needed(monkeypatch, capsys, script):
    build("--nproc-per-node", "2", script)
    assert os.environ["OMP_NUM_THREADS"] == "4"
    monkeypatch.delenv("OMP_NUM_THREADS")
    build(script)
    assert "OMP_NUM_THREADS" not in os.environ
    assert capsys.readouterr().err == ""


def test_omp_untouched_on_error(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS")
    with pytest.raises(ConfigError):
        build("--nproc-per-node", "2", "missing.py")
    assert "OMP_NUM_THREADS" not in os.environ


def test_unknown_flag_before_script_is_an_error():
    with pytest.raises(ConfigError, match=r"unrecognized arguments: --foo \(see fsm-agent run --help\)"):
        parse("--foo", "x.py")


# ------------------------------------------------------------------ entry points and exit codes


class FakeLaunch:
    """Stands in for fsm_agent.launch: records the call, returns ``exit_code`` or raises ``error``."""

    def __init__(self, exit_code=0, error=None):
        self.exit_code, self.error, self.calls = exit_code, error, []

    def run_agent(self, config, entrypoint, args, plugins=None):
        self.calls.append((config, entrypoint, args))
        if self.error is not None:
            raise self.error
        return types.SimpleNamespace(exit_code=self.exit_code)


@pytest.fixture
def fake_launch(monkeypatch):
    def install(**kwargs):
        fake = FakeLaunch(**kwargs)
        monkeypatch.setitem(sys.modules, "fsm_agent.launch", fake)
        return fake

    return install


def exit_code_of(entry, argv) -> int:
    with pytest.raises(SystemExit) as exc:
        entry(argv)
    return exc.value.code


def test_main_run_exits_with_result_code(fake_launch, script):
    fake = fake_launch(exit_code=3)
    assert exit_code_of(cli.main, ["run", "--nproc-per-node", "1", script, "--lr", "1"]) == 3
    config, entrypoint, args = fake.calls[0]
    assert config.nproc_per_node == 1
    assert (entrypoint, args) == (sys.executable, ("-u", script, "--lr", "1"))


def test_fsmrun_is_run(fake_launch, script):
    fake = fake_launch(exit_code=0)
    assert exit_code_of(cli.fsmrun_main, ["--max-restarts", "2", script]) == 0
    assert fake.calls[0][0].max_restarts == 2


def test_agent_error_is_one_line_with_its_exit_code(fake_launch, capsys, script):
    error = FsmAgentError("rendezvous failed:\n  backend c10d")
    error.exit_code = 7
    fake_launch(error=error)
    assert exit_code_of(cli.main, ["run", script]) == 7
    assert capsys.readouterr().err == "fsm-agent: error: rendezvous failed: backend c10d\n"


def test_keyboard_interrupt_is_130(fake_launch, capsys, script):
    fake_launch(error=KeyboardInterrupt())
    assert exit_code_of(cli.main, ["run", script]) == 130
    assert capsys.readouterr().err == ""


def test_fsmrun_error_hint(capsys):
    assert exit_code_of(cli.fsmrun_main, ["--bogus", "x.py"]) == 2
    assert capsys.readouterr().err == "fsmrun: error: unrecognized arguments: --bogus (see fsmrun --help)\n"


def test_help_states_each_default_once(capsys):
    """Not ``(default: none) (default: '')``, nor ``(default: None)`` where the help says what unset does."""
    from fsm_agent.plugins.manager import collect_options, get_plugin_manager

    parser = cli.get_run_parser(options=collect_options(get_plugin_manager(load_entry_points=False)))
    helps = {action.dest: parser._get_formatter()._expand_help(action) for action in parser._actions if action.help}
    for text in helps.values():
        assert text.count("(default:") <= 1, text
        for shown in ("(default: None)", "(default: '')", "(default: )", "(default: [])", "(default: ())"):
            assert shown not in text, text
    assert helps["plugin:health-check:command"].endswith("(default: none) [env FSM_AGENT_HEALTH_CHECK_COMMAND]")
    assert helps["max_restarts"].endswith("(default: 0)")  # torchrun's defaults are still shown
    assert exit_code_of(cli.main, ["run", "--help"]) == 0
    assert "(default: none) (default: '')" not in " ".join(capsys.readouterr().out.split())


def test_version(capsys):
    assert exit_code_of(cli.main, ["--version"]) == 0
    assert capsys.readouterr().out.startswith("fsm-agent ")


@pytest.mark.parametrize(
    "command,module", [("statechart", "fsm_agent.states.statechart"), ("plugins", "fsm_agent.plugins.manager")]
)
def test_delegated_commands_get_argv_verbatim(monkeypatch, command, module):
    seen = []
    fake = types.SimpleNamespace(cli_main=lambda argv: seen.append(argv) or 5)
    monkeypatch.setitem(sys.modules, module, fake)
    assert exit_code_of(cli.main, [command, "--list", "x", "--help"]) == 5
    assert seen == [["--list", "x", "--help"]]


def test_missing_delegate_module_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "fsm_agent.states.statechart", None)
    assert exit_code_of(cli.main, ["statechart"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fsm-agent: error: ") and err.count("\n") == 1


@pytest.mark.parametrize("argv", [[], ["frob"], ["--frob"]])
def test_main_usage_errors(capsys, argv):
    assert exit_code_of(cli.main, argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("fsm-agent: error: ") and err.endswith("(see fsm-agent --help)\n")


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--foo", "SCRIPT"], "unrecognized arguments: --foo"),
        (["--nnodes", "3:2", "SCRIPT"], "--nnodes '3:2': MIN must be <= MAX"),
        (["--nproc-per-node", "0", "SCRIPT"], "--nproc-per-node '0'"),
        (["does_not_exist.py"], "training script 'does_not_exist.py' not found"),
        (["-m", "--no-python", "pkg"], "--no-python and -m"),
    ],
)
def test_bad_input_is_one_stderr_line(argv, message, script, tmp_path):
    argv = [script if a == "SCRIPT" else a for a in argv]
    proc = run_cli(argv, tmp_path)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("fsm-agent: error: ") and message in lines[0]
    assert proc.stdout == ""


@pytest.mark.parametrize(
    "value, warning",
    [
        (
            "5",
            "--local-ranks-filter 5: no local rank 5 with --nproc-per-node 2 (local ranks 0..1); no worker's output "
            "is shown",
        ),
        ("1,5", "--local-ranks-filter 1,5: no local rank 5 with --nproc-per-node 2 (local ranks 0..1)"),
    ],
)
def test_local_ranks_filter_names_ranks_this_node_does_not_have(script, caplog, value, warning):
    with caplog.at_level("WARNING", logger=cli.log.name):
        build("--local-ranks-filter", value, "--nproc-per-node", "2", script)
    assert [r.getMessage() for r in caplog.records] == [warning]


def test_local_ranks_filter_within_the_node_warns_nothing(script, caplog):
    with caplog.at_level("WARNING", logger=cli.log.name):
        build("--local-ranks-filter", "0,1", "--nproc-per-node", "2", script)
    assert caplog.records == []
