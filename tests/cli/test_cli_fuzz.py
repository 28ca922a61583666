"""Fuzzing the command line: user error never shows a traceback.

In process, ``get_run_parser().parse_args`` + ``config_from_args`` (and the layered
``resolve_run_args`` with fuzzed environment variables, and ``fsm-agent config``) either succeed or
raise ``FsmAgentError`` (``ConfigError`` for bad input). As a subprocess, ``python -m fsm_agent run``
on bad argv prints exactly one ``fsm-agent: error:`` line, no traceback, and exits non-zero.

Nothing here launches a worker: the in-process tests stop at ``config_from_args``; the subprocess
tests always name a training script that does not exist and never pass ``-m``/``--no-python``/
``--run-path`` (the only flags that skip the script check), with the environment's PET_*/FSM_AGENT_*
removed. Hypothesis runs derandomized (fixed seed), with bounded examples and no deadline.
"""

from __future__ import annotations

import contextlib
import io
import subprocess

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fsm_agent import cli
from fsm_agent.errors import FsmAgentError
from tests.helpers.fuzz import FUZZ, MISSING_SCRIPT, clean_environment
from tests.helpers.processes import run_cli

pytestmark = pytest.mark.fuzz

_PARSER = cli.get_run_parser()
#: Every option string of the run parser (dashed and underscored spellings), without --help.
FLAGS = sorted(s for a in _PARSER._actions for s in a.option_strings if s not in ("-h", "--help"))
#: Flags that run something other than an existing script: never in subprocess argv.
LAUNCHING = {"-m", "--module", "--no-python", "--no_python", "--run-path", "--run_path"}
SAFE_FLAGS = [f for f in FLAGS if f not in LAUNCHING]
LAUNCHING_ENV = {
    "PET_MODULE",
    "PET_NO_PYTHON",
    "PET_RUN_PATH",
    "FSM_AGENT_MODULE",
    "FSM_AGENT_NO_PYTHON",
    "FSM_AGENT_RUN_PATH",
}
#: Every environment variable the run parser reads (FSM_AGENT_<DEST>, PET_<DEST>, FSM_AGENT_*).
ENV_VARS = sorted(
    {v for a in _PARSER._actions for v in cli.env_vars(a)}
    | {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "FSM_AGENT_DISABLE_PLUGINS"}
)

INTERESTING = [
    "",
    " ",
    "0",
    "1",
    "-1",
    "2",
    "3",
    "00",
    "+1",
    "1.5",
    "1e3",
    "-0",
    "nan",
    "inf",
    "-inf",
    "1e309",
    "0x10",
    "99999999999999999999",
    "1:2",
    "2:1",
    "0:1",
    "1:0",
    "1:",
    ":1",
    ":",
    "1:2:3",
    "a:b",
    " 1 : 2 ",
    "٣",
    "²",
    "１",
    "auto",
    "cpu",
    "gpu",
    "xpu",
    "privateuseone",
    "c10d",
    "static",
    "fsm",
    "etcd-v3",
    "nope",
    "localhost:0",
    "127.0.0.1:29400",
    "[::1]:0",
    "host:port",
    "a=b",
    "a=",
    "=b",
    ",",
    "a=b,,c=d",
    "join_timeout=x",
    "SIGTERM",
    "SIGKILL",
    "SIGTERM,SIGFOO",
    "SIGUSR1,",
    "spawn",
    "fork",
    "forkserver",
    "0:3,1:2",
    "0:4",
    "10:1",
    "0,1",
    "0,,1",
    "-1,2",
    "node",
    "socket",
    "subprocess",
    "true",
    "false",
    "yes",
    "maybe",
    "--",
    "-",
    "--x",
    "\x7f",
    "é",
    "\u2028",
    "a\tb",
    "/nonexistent/config.toml",
    "/",
    "/dev/null",
]
values = st.one_of(
    st.sampled_from(INTERESTING),
    st.integers(-(2**70), 2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12),
)


#: Plausible values per argparse dest, so that many argvs get past the parser into config_from_args.
PLAUSIBLE = {
    "nnodes": ["1", "2", "1:2", "2:4", "1:1"],
    "nproc_per_node": ["1", "2", "cpu", "auto", "4"],
    "rdzv_backend": ["c10d", "static", "fsm", "etcd-v3"],
    "rdzv_endpoint": ["localhost:0", "10.0.0.1:29400", ""],
    "rdzv_id": ["job", "none"],
    "rdzv_conf": ["join_timeout=5", "a=1,b=2", ""],
    "max_restarts": ["0", "3"],
    "monitor_interval": ["0.1", "5"],
    "start_method": ["spawn", "fork"],
    "redirects": ["3", "0:3,1:2"],
    "tee": ["1", "2"],
    "local_ranks_filter": ["0", "0,1", ""],
    "node_rank": ["0", "1"],
    "master_port": ["29500", "1"],
    "signals_to_handle": ["SIGTERM", "SIGTERM,SIGUSR1"],
    "shutdown_timeout": ["0", "2.5"],
    "exit_barrier_timeout": ["0", "10"],
    "hang_timeout": ["1", "0.5"],
    "forward_signals": ["SIGUSR1", ""],
    "numa_binding": ["node", "socket"],
    "log_dir": ["logs"],
    "disabled_plugins": ["status-http", "a,b"],
}
_ACTIONS = {s: a for a in _PARSER._actions for s in a.option_strings}


@st.composite
def flag_items(draw, flags=FLAGS, plausible_only: bool = False) -> list[str]:
    """One flag with zero, one or two values, as separate words or ``--flag=value``.

    ``plausible_only``: a flag that takes no value, or one of PLAUSIBLE's values for its flag.
    """
    if plausible_only:
        flags = [f for f in flags if _ACTIONS[f].nargs == 0 or _ACTIONS[f].dest in PLAUSIBLE]
    flag = draw(st.sampled_from(flags))
    action = _ACTIONS[flag]
    if plausible_only:
        if action.nargs == 0:
            return [flag]
        value = draw(st.sampled_from(PLAUSIBLE[action.dest]))
        return [f"{flag}={value}"] if draw(st.booleans()) and flag.startswith("--") else [flag, value]
    shape = draw(
        st.sampled_from(
            ["bare", "value", "value", "equals", "two"]
            if action.nargs != 0
            else ["bare", "bare", "bare", "value", "equals"]
        )
    )
    if shape == "bare":
        return [flag]
    plausible = PLAUSIBLE.get(action.dest)
    value = draw(st.sampled_from(plausible) if plausible and draw(st.booleans()) else values)
    if shape == "equals" and flag.startswith("--"):
        return [f"{flag}={value}"]
    if shape == "two":
        return [flag, value, draw(values)]
    return [flag, value]


@st.composite
def argvs(draw, flags=FLAGS, script=None, plausible_only: bool = False) -> list[str]:
    script = script if script is not None else st.just(MISSING_SCRIPT)
    words: list[str] = []
    for item in draw(st.lists(flag_items(flags, plausible_only), max_size=6)):
        words += item
    if flags is FLAGS and not plausible_only and draw(st.booleans()):  # stray words among the flags
        words.insert(draw(st.integers(0, len(words))), draw(values))
    if draw(st.integers(0, 9)):  # usually a script and its arguments
        words.append(draw(script))
        words += draw(st.lists(values, max_size=3))
    return words


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """cwd without a pyproject.toml, OMP_NUM_THREADS preset (config_from_args would set it)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('the fuzzer must never launch a worker')\n")
    return script


def parse_and_build(argv: list[str]) -> str:
    """``"ok"`` or ``"error"``; anything but FsmAgentError (or --help's exit 0) propagates."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            args = cli.get_run_parser().parse_args(argv)
            config, entrypoint, _ = cli.config_from_args(args, set_omp_num_threads=False)
    except FsmAgentError as exc:
        assert str(exc).strip(), f"empty error message for {argv!r}"
        return "error"
    except SystemExit as exc:  # only --help (e.g. a word "-h" or "-mh") may exit, with usage on stdout
        assert exc.code == 0 and out.getvalue().startswith("usage:"), (argv, exc.code, err.getvalue())
        return "help"
    assert config.min_nodes <= config.max_nodes and config.nproc_per_node > 0
    assert entrypoint is not None or args.training_script is None
    return "ok"


# -- in process ----------------------------------------------------------------------------------------


@FUZZ
@given(
    argv=st.one_of(
        argvs(script=st.sampled_from([MISSING_SCRIPT, "train.py", "some.module"])),
        argvs(script=st.sampled_from(["train.py", "some.module"]), plausible_only=True),
    )
)
@example(argv=["--nnodes", "²", "train.py"])
@example(argv=["--master-port", "99999", "train.py"])
@example(argv=["--rdzv-conf", "a=b=c,d", "train.py"])
@example(argv=["--local-ranks-filter", "0,,1", "train.py"])
@example(argv=["--monitor-interval", "nan", "train.py"])
@example(argv=["--nproc-per-node", "privateuseone", "train.py"])
def test_run_parser_and_config_from_args_raise_only_fsm_agent_errors(argv):
    parse_and_build(argv)


@settings(FUZZ, max_examples=100)
@given(
    env=st.dictionaries(st.sampled_from(ENV_VARS), values.filter(lambda v: "\x00" not in v), max_size=4),
    argv=argvs(flags=SAFE_FLAGS, script=st.sampled_from(["train.py", MISSING_SCRIPT])),
)
def test_environment_fallbacks_raise_only_fsm_agent_errors(env, argv):
    """``resolve_run_args`` (env vars, pyproject lookup, plugin options) then ``config_from_args``."""
    with clean_environment(env), contextlib.redirect_stderr(io.StringIO()):
        try:
            resolved = cli.resolve_run_args(argv)
            cli.config_from_args(resolved.args, set_omp_num_threads=False)
        except FsmAgentError as exc:
            assert str(exc).strip()


@settings(FUZZ, max_examples=100)
@given(argv=argvs(flags=SAFE_FLAGS, script=st.sampled_from(["train.py", MISSING_SCRIPT])), as_json=st.booleans())
def test_config_command_exits_with_one_error_line(argv, as_json):
    """``fsm-agent config`` (it never launches): exit 0, or one ``fsm-agent: error:`` line."""
    out, err = io.StringIO(), io.StringIO()
    with clean_environment(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli._exit_code(cli.config_command, [*(["--json"] if as_json else []), *argv])
    errors = [line for line in err.getvalue().splitlines() if line.startswith("fsm-agent: error:")]
    if code == 0:
        assert not errors, err.getvalue()
    else:
        assert len(errors) == 1 and err.getvalue().rstrip("\n").splitlines()[-1] == errors[0], err.getvalue()


# -- as a subprocess -----------------------------------------------------------------------------------

BAD_ITEMS = [
    ["--nnodes", "0"],
    ["--nnodes", "3:2"],
    ["--nnodes", "x"],
    ["--nproc-per-node", "0"],
    ["--nproc-per-node", ""],
    ["--nproc-per-node", "gpu"],
    ["--max-restarts", "x"],
    ["--monitor-interval", "nan"],
    ["--start-method", "nope"],
    ["--redirects", "7"],
    ["--tee", "0:9"],
    ["--local-ranks-filter", "a"],
    ["--signals-to-handle", "SIGKILL"],
    ["--rdzv-conf", "=1"],
    ["--rdzv-conf", "a="],
    ["--shutdown-timeout", "-1"],
    ["--hang-timeout", "0"],
    ["--numa-binding", "planet"],
    ["--config", "/nonexistent/fsm.toml"],
    ["--not-a-flag"],
    ["--nnodes"],
    ["--max-restarts", "-3"],
    ["--exit-barrier-timeout", "-1"],
    [],  # [] : only the missing script is wrong
]


def assert_one_error_line(proc: subprocess.CompletedProcess, argv: list[str]) -> None:
    shown = f"argv={argv!r}\nrc={proc.returncode}\nstdout={proc.stdout!r}\nstderr={proc.stderr!r}"
    assert proc.returncode not in (0, None), shown
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, shown
    errors = [line for line in proc.stderr.splitlines() if line.startswith("fsm-agent: error:")]
    assert len(errors) == 1, shown
    assert proc.stderr.rstrip("\n").splitlines()[-1] == errors[0], shown  # the verdict comes last
    assert proc.stdout == "", shown


@settings(FUZZ, max_examples=15)
@given(
    bad=st.sampled_from(BAD_ITEMS),
    noise=st.lists(flag_items(SAFE_FLAGS), max_size=3),
    bad_first=st.booleans(),
    script_args=st.lists(values.filter(lambda v: "\x00" not in v), max_size=2),
)
def test_bad_argv_subprocess_prints_one_error_line(tmp_path, bad, noise, bad_first, script_args):
    words = [w for item in noise for w in item]
    words = [*bad, *words] if bad_first else [*words, *bad]
    argv = [w for w in words if "\x00" not in w] + [MISSING_SCRIPT, *script_args]
    assert_one_error_line(run_cli(argv, tmp_path), argv)


@settings(FUZZ, max_examples=8)
@given(
    env=st.dictionaries(
        st.sampled_from([v for v in ENV_VARS if v.startswith("PET_") and v not in LAUNCHING_ENV]),
        st.sampled_from(INTERESTING).filter(bool),
        min_size=1,
        max_size=3,
    )
)
def test_bad_environment_subprocess_prints_one_error_line(tmp_path, env):
    argv = [MISSING_SCRIPT]
    assert_one_error_line(run_cli(argv, tmp_path, env), [f"{k}={v!r}" for k, v in env.items()] + argv)


# -- --rdzv-conf for the fsm backend -------------------------------------------------------------------

FSM_CONF_KEYS = [
    "join_timeout",
    "last_call_timeout",
    "rejoin_timeout",
    "keep_alive_interval",
    "keep_alive_max_attempt",
    "read_timeout",
    "handshake_timeout",
    "linger_timeout",
    "is_host",
    "bind_addr",
    "node_rank",
    "rank",
    "other",
]


def non_finite(value: str) -> bool:
    import math

    try:
        return not math.isfinite(float(value))
    except (ValueError, OverflowError):
        return False


conf_values = st.one_of(
    st.sampled_from(INTERESTING),
    st.integers(-5, 10**6).map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    values,
)


def fsm_settings(conf: str):
    from fsm_agent.plugins.rendezvous_fsm import (
        FsmRendezvousParameters,
        FsmRendezvousSettings,
    )

    return FsmRendezvousSettings.from_params(
        FsmRendezvousParameters("fsm", "127.0.0.1:0", "run", 1, 2, **cli.parse_rdzv_conf(conf))
    )


def check_fsm_settings(conf: str) -> None:
    """``--rdzv-conf`` for ``fsm``: a ConfigError, or settings whose times are finite and in range."""
    try:
        s = fsm_settings(conf)
    except FsmAgentError:
        return
    import math

    for name in ("join_timeout", "keep_alive_interval", "read_timeout", "handshake_timeout"):
        assert math.isfinite(getattr(s, name)) and getattr(s, name) > 0, (conf, s)
    for name in ("last_call_timeout", "rejoin_timeout", "linger_timeout"):
        assert math.isfinite(getattr(s, name)) and getattr(s, name) >= 0, (conf, s)
    assert s.keep_alive_max_attempt >= 1


@FUZZ
@given(items=st.lists(st.tuples(st.sampled_from(FSM_CONF_KEYS), conf_values), max_size=4))
@example(items=[("handshake_timeout", "1e309")])
def test_fsm_rdzv_conf_is_a_config_error_or_sane(items):
    """Non-finite numbers are covered by the explicit cases below."""
    items = [(k, v) for k, v in items if not non_finite(v)]
    conf = ",".join(f"{k}={v}" for k, v in items)
    try:
        cli.parse_rdzv_conf(conf)
    except FsmAgentError:
        return
    check_fsm_settings(conf)


@pytest.mark.parametrize(
    "conf",
    [
        "handshake_timeout=nan",
        "handshake_timeout=1e309",
        "keep_alive_interval=nan",
        "keep_alive_interval=inf",
        "join_timeout=nan",
        "rejoin_timeout=nan",
    ],
)
def test_fsm_rdzv_conf_non_finite_is_a_config_error(conf):
    check_fsm_settings(conf)
