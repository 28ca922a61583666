"""Fuzzing the configuration file loader: user error never shows a traceback.

Hypothesis generates TOML documents (the real keys and sections mixed with random ones; values of
every TOML type: integers beyond 64 bits, inf/nan, strings with control characters, dates and
times, arrays, inline tables) and broken TOML text. Properties:

- ``find_config_file`` + ``load_file_values`` either return or raise ``ConfigError``;
- the whole ``fsm-agent run`` front end on that file (``resolve_run_args`` + ``config_from_args``)
  returns or raises ``FsmAgentError``;
- ``fsm-agent config [--json]`` on it exits 0 or prints exactly one ``fsm-agent: error:`` line;
- as a subprocess, ``python -m fsm_agent run --config FILE MISSING_SCRIPT`` prints exactly one
  ``fsm-agent: error:`` line, no traceback, and exits non-zero (the script does not exist, so
  nothing is ever launched).

Derandomized (fixed seed), bounded examples, no deadline.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import json
import math
import re
from pathlib import Path

import pytest
import tomllib
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from fsm_agent import cli
from fsm_agent import config as cfg
from fsm_agent import settings as schema
from fsm_agent.errors import ConfigError, FsmAgentError
from fsm_agent.plugins.manager import collect_options, get_plugin_manager
from tests.helpers.fuzz import FUZZ, MISSING_SCRIPT, clean_environment
from tests.helpers.processes import run_cli

pytestmark = pytest.mark.fuzz

OPTIONS = list(collect_options(get_plugin_manager()))
TOP_KEYS = [k.name for k in cfg.KEYS if not k.section]
SECTION_KEYS = {s: [k.name for k in cfg.KEYS if k.section == s] for s in cfg.SECTIONS}
PLUGIN_KEYS = {}
for _o in OPTIONS:
    PLUGIN_KEYS.setdefault(_o.plugin, []).append(_o.name)

#: Values that are valid for a kind, so that many documents get past the loader.
VALID = {
    schema.STRING: ["x", "c10d", "fsm", "default", ""],
    schema.BOOL: [True, False],
    schema.COUNT: [0, 1, 3],
    schema.POSITIVE_INT: [1, 3],
    schema.SECONDS: [0, 0.5, 30],
    schema.POSITIVE_SECONDS: [0.1, 2, 600],
    schema.PORT: [1, 29500, 65535],
    schema.NNODES: [1, 2, "1:2", "2:4"],
    schema.NPROC: [1, 2, "cpu", "auto"],
    schema.STD: [0, 3, "0:3,1:2"],
    schema.SIGNALS: [["SIGTERM"], "SIGTERM,SIGINT", []],
    schema.RANKS: [[0], [0, 1], []],
    schema.STRINGS: [["a"], []],
    schema.NAMES: [["status-http"], []],
    schema.CONF: [{"a": "b"}, {"rejoin_timeout": 5}, {}],
}
KIND_OF = {k.key: k.kind for k in cfg.KEYS}

# -- TOML values and documents -------------------------------------------------------------------------

text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=10)
bare_key = st.from_regex(r"[A-Za-z0-9_-]{1,10}", fullmatch=True)
any_key = st.one_of(bare_key, text)
scalars = st.one_of(
    st.integers(-(2**63), 2**63 - 1),
    st.integers(-(10**400), 10**400),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    text,
    st.sampled_from(
        [
            "1:2",
            "3:2",
            "0",
            "²",
            "٣",
            "auto",
            "gpu",
            "SIGTERM",
            "SIGKILL",
            "SIGTERM,,SIGINT",
            "0:3,1:2",
            "0:9",
            " ",
            "spawn",
            "node",
            "-1",
            "1e3",
        ]
    ),
    st.dates(),
    st.datetimes(),
    st.datetimes(timezones=st.just(dt.timezone.utc)),
    st.times(),
)
toml_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(any_key, inner, max_size=3)),
    max_leaves=6,
)


#: ``rendezvous.conf`` tables: backend option names (fsm's untyped ones too) with any scalar.
conf_tables = st.dictionaries(
    st.one_of(
        st.sampled_from(
            [
                "rejoin_timeout",
                "linger_timeout",
                "handshake_timeout",
                "bind_addr",
                "node_rank",
                "join_timeout",
                "is_host",
            ]
        ),
        bare_key,
    ),
    scalars,
    max_size=3,
)


def value_for(key: str):
    kind = KIND_OF.get(key)
    if kind is schema.CONF:
        return st.one_of(st.sampled_from(VALID[kind]), conf_tables, conf_tables, toml_values)
    if kind in VALID:
        return st.one_of(st.sampled_from(VALID[kind]), st.sampled_from(VALID[kind]), toml_values)
    return toml_values


def plausible_for(key: str):
    kind = KIND_OF.get(key)
    if kind is schema.CONF:
        return st.one_of(st.sampled_from(VALID[kind]), conf_tables)
    return st.sampled_from(VALID[kind]) if kind in VALID else scalars


@st.composite
def plausible_documents(draw) -> dict:
    """Known keys with mostly valid values: documents that get past the loader, into the front end."""
    doc = {k: draw(plausible_for(k)) for k in draw(st.lists(st.sampled_from(TOP_KEYS), max_size=4, unique=True))}
    for name in cfg.SECTIONS:
        keys = draw(st.lists(st.sampled_from(SECTION_KEYS[name]), max_size=3, unique=True))
        if keys:
            doc[name] = {k: draw(plausible_for(f"{name}.{k}")) for k in keys}
    if draw(st.booleans()):
        plugin = draw(st.sampled_from(sorted(PLUGIN_KEYS)))
        option = next(o for o in OPTIONS if o.plugin == plugin)
        good = {int: st.integers(1, 65535), float: st.floats(0, 100), bool: st.booleans(), str: text}[option.type]
        doc[cfg.PLUGINS_SECTION] = {plugin: {option.name: draw(st.one_of(good, scalars))}}
    return doc


@st.composite
def section(draw, name: str, keys: list[str]) -> dict:
    table = {}
    known = st.sampled_from(keys) if keys else any_key
    for key in draw(
        st.lists(st.one_of(known, known, known, any_key), max_size=4) if keys else st.lists(any_key, max_size=3)
    ):
        table[key] = draw(value_for(f"{name}.{key}" if name else key))
    return table


@st.composite
def documents(draw) -> dict:
    doc = draw(section("", TOP_KEYS))
    for name in draw(
        st.lists(st.sampled_from([*cfg.SECTIONS, cfg.PLUGINS_SECTION, "tool", "misc"]), max_size=3, unique=True)
    ):
        if name in cfg.SECTIONS:
            doc[name] = draw(
                st.one_of(section(name, SECTION_KEYS[name]), section(name, SECTION_KEYS[name]), toml_values)
            )
        elif name == cfg.PLUGINS_SECTION:
            plugins = {}
            for plugin in draw(st.lists(st.one_of(st.sampled_from(sorted(PLUGIN_KEYS)), bare_key), max_size=2)):
                plugins[plugin] = draw(st.one_of(section("", PLUGIN_KEYS.get(plugin, [])), toml_values))
            doc[name] = draw(st.one_of(st.just(plugins), st.just(plugins), toml_values))
        else:
            doc[name] = draw(toml_values)
    return doc


_BARE = re.compile(r"[A-Za-z0-9_-]+")


def toml_string(s: str) -> str:
    out = []
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def toml_key(k: str) -> str:
    return k if _BARE.fullmatch(k) else toml_string(k)


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return toml_string(v)
    if isinstance(v, (dt.datetime, dt.date, dt.time)):
        return v.isoformat()
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{toml_key(k)} = {toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(type(v))


def to_toml(doc: dict, prefix: tuple[str, ...] = ()) -> str:
    """Scalars and inline values first, then each top-level table as a ``[header]`` table."""
    lines = [f"[{'.'.join(map(toml_key, prefix))}]"] if prefix else []
    tables = {k: v for k, v in doc.items() if isinstance(v, dict)}
    for k, v in doc.items():
        if k not in tables:
            lines.append(f"{toml_key(k)} = {toml_value(v)}")
    for k, v in tables.items():
        lines.append(to_toml(v, (*prefix, k)) if not prefix or len(prefix) < 3 else f"{toml_key(k)} = {toml_value(v)}")
    return "\n".join(lines) + "\n"


def same(a, b) -> bool:
    """Equality with nan == nan (TOML round trip check)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


@st.composite
def files(draw) -> tuple[str, str, dict | None]:
    """``(file name, TOML text, the parsed document or None for broken text)``."""
    kind = draw(st.sampled_from(["fsm", "fsm", "plausible", "plausible", "pyproject", "garbage", "mutated"]))
    doc = draw(plausible_documents() if kind in ("plausible", "pyproject") else documents())
    if kind == "pyproject":
        return "pyproject.toml", to_toml({"tool": {"fsm_agent": doc}}), {"tool": {"fsm_agent": doc}}
    body = to_toml(doc)
    if kind == "garbage":
        return "fsm.toml", draw(st.text(st.characters(blacklist_categories=("Cs",)), max_size=60)), None
    if kind == "mutated" and body:
        i = draw(st.integers(0, len(body)))
        return (
            "fsm.toml",
            body[:i]
            + draw(st.sampled_from(["[", "]", "=", '"', "\n", "{", "\\", "x = 1\n", ""]))
            + body[i + draw(st.integers(0, 3)) :],
            None,
        )
    return "fsm.toml", body, doc


def has_time_values(value) -> bool:
    if isinstance(value, (dt.date, dt.time)):
        return True
    if isinstance(value, dict):
        return any(has_time_values(v) for v in value.values())
    if isinstance(value, list):
        return any(has_time_values(v) for v in value)
    return False


def hits_known_bug(name: str, body: str) -> bool:
    """A TOML date/time in ``rendezvous.conf``: see test_config_command_with_a_date_in_rendezvous_conf."""
    try:
        data = tomllib.loads(body)
    except tomllib.TOMLDecodeError:
        return False
    if name == "pyproject.toml":
        data = data.get("tool", {}).get("fsm_agent", {}) if isinstance(data.get("tool"), dict) else {}
    section = data.get("rendezvous") if isinstance(data, dict) else None
    return isinstance(section, dict) and has_time_values(section.get("conf"))


# -- fixtures and helpers ------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("raise SystemExit('the fuzzer must never launch a worker')\n")
    return tmp_path


def write(workdir: Path, name: str, body: str) -> str:
    path = workdir / "cfg" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(body, encoding="utf-8")
    return str(path)


def config_command(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli._exit_code(cli.config_command, argv)
    return code, out.getvalue(), err.getvalue()


# -- in process ----------------------------------------------------------------------------------------


@FUZZ
@given(file=files())
@example(file=("fsm.toml", 'nnodes = "²"\n', {"nnodes": "²"}))
@example(file=("fsm.toml", "monitor_interval = 1" + "0" * 400 + "\n", None))
@example(file=("fsm.toml", '[plugins]\nstatus-http = "abc"\n', None))
@example(file=("fsm.toml", "[tool]\nfsm_agent = 5\n", None))
@example(file=("pyproject.toml", "[tool]\nfsm_agent = 5\n", None))
def test_loader_raises_only_config_errors(workdir, file):
    name, body, doc = file
    if doc is not None:  # the generator writes valid TOML for the document it means
        assert same(tomllib.loads(body), doc), body
    path = write(workdir, name, body)
    with clean_environment({"OMP_NUM_THREADS": "1"}):
        try:
            found = cfg.find_config_file(path)
            assert found is not None
            values = cfg.load_file_values(found, OPTIONS)
        except ConfigError as exc:
            assert str(exc).strip()
            return
    assert set(values.values) <= {k.key for k in cfg.KEYS} | {f"rendezvous.{n}" for n in cfg.RENDEZVOUS_OPTIONS}


@settings(FUZZ, max_examples=150)
@given(file=files(), script=st.sampled_from(["train.py", MISSING_SCRIPT]))
def test_run_front_end_with_the_file_raises_only_fsm_agent_errors(workdir, file, script):
    """Values the loader accepts must also get through ``config_from_args`` (or fail as user error)."""
    name, body, _ = file
    path = write(workdir, name, body)
    with clean_environment({"OMP_NUM_THREADS": "1"}), contextlib.redirect_stderr(io.StringIO()):
        try:
            resolved = cli.resolve_run_args(["--config", path, script])
            config, _, _ = cli.config_from_args(resolved.args, set_omp_num_threads=False)
        except FsmAgentError as exc:
            assert str(exc).strip()
            return
    assert isinstance(config, cfg.LaunchConfig)
    assert script == "train.py"


def ends_with_one_error(err: str) -> bool:
    """stderr ends with one ``fsm-agent: error:`` line, or with one such headline and one indented line per
    error (a config file's errors, one per line)."""
    lines = err.rstrip("\n").splitlines()
    errors = [i for i, line in enumerate(lines) if line.startswith("fsm-agent: error:")]
    if len(errors) != 1:
        return False
    rest = lines[errors[0] + 1 :]
    return not rest or (lines[errors[0]].endswith(" errors:") and all(line.startswith("  ") for line in rest))


@settings(FUZZ, max_examples=150)
@given(file=files(), as_json=st.booleans())
def test_config_command_on_the_file_exits_with_one_error_line(workdir, file, as_json):
    name, body, _ = file
    assume(not hits_known_bug(name, body))
    path = write(workdir, name, body)
    with clean_environment({"OMP_NUM_THREADS": "1"}):
        code, out, err = config_command(["--config", path, *(["--json"] if as_json else [])])
    errors = [line for line in err.splitlines() if line.startswith("fsm-agent: error:")]
    if code == 0:
        assert not errors, err
        if as_json:
            json.loads(out)
    else:
        assert code == 2 and ends_with_one_error(err), (code, err)


@pytest.mark.parametrize("flags", [[], ["--json"]], ids=["table", "json"])
def test_config_command_with_a_date_in_rendezvous_conf(workdir, flags):
    path = write(workdir, "fsm.toml", "[rendezvous]\nconf = {rejoin_timeout = 2000-01-01}\n")
    with clean_environment({"OMP_NUM_THREADS": "1"}):
        code, _, err = config_command(["--config", path, *flags])
    assert code == 2 and err.startswith("fsm-agent: error:")


# -- as a subprocess -----------------------------------------------------------------------------------


@settings(FUZZ, max_examples=12)
@given(file=files())
def test_subprocess_with_the_file_prints_one_error_line(workdir, file):
    name, body, _ = file
    path = write(workdir, name, body)
    argv = ["--config", path, MISSING_SCRIPT]
    proc = run_cli(argv, workdir)
    shown = f"file:\n{body}\nrc={proc.returncode}\nstdout={proc.stdout!r}\nstderr={proc.stderr!r}"
    assert proc.returncode == 2, shown
    assert "Traceback" not in proc.stderr + proc.stdout, shown
    assert ends_with_one_error(proc.stderr), shown
    assert proc.stdout == "", shown
