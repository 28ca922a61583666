"""The configuration schema: every setting of ``fsm-agent run`` declared once.

A ``Setting`` names one value with everything the rest of the house builds from it: its argparse
dest and flag spellings (torchrun's, the ``--snake_case`` twin added by the parser), the default
(torchrun's), the command-line/environment value parser (its check: a bad value raises a
``ConfigError`` naming the flag and the fix), the environment variables (``FSM_AGENT_<DEST>``,
then torchrun's ``PET_<DEST>``, or fsm-agent's own ``FSM_AGENT_*``), the configuration-file key
and its strict TOML ``Kind``, the ``LaunchConfig`` field and the help line.

Built from ``SETTINGS``: the run parser (``fsm_agent.run_parser.get_run_parser``), the environment
reader (``read_environment`` here), the TOML loader (``fsm_agent.config.load_file_values``, through
``KEYS``), the merge (``fsm_agent.resolve``), ``fsm-agent config`` and ``docs/configuration.md``
(``fsm_agent.reference``). A plugin's option is a ``Setting`` too (``plugin_option``, what
``options.add(...)`` returns): those same functions read it, its kind checks its values, its flag and
variable say booleans with the same words (``bool_word``).

This module imports nothing of fsm-agent but its errors.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, cast

import attrs

from fsm_agent.errors import ConfigError, FsmAgentError
from fsm_agent.signal_names import signal_names

DEFAULT_MASTER_PORT = 29500
#: Seconds between the death signal and SIGKILL when neither the flag nor the env var says.
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
DISABLE_PLUGINS_ENV = "FSM_AGENT_DISABLE_PLUGINS"

#: Named ``--nproc-per-node`` values (torch also accepts its privateuse1 backend name).
NPROC_NAMES = ("auto", "cpu", "gpu", "xpu")
NUMA_BINDING_MODES = ("node", "socket", "exclusive", "core-complex")
START_METHODS = ("spawn", "fork", "forkserver")
#: The words a boolean environment variable (or a plugin option's flag) may say, any case.
TRUE_WORDS = frozenset({"1", "true", "t", "yes", "y", "on"})
FALSE_WORDS = frozenset({"0", "false", "f", "no", "n", "off"})
#: torch's ``Std`` syntax, but a map may name multi-digit local ranks (torch: single digit only).
STD_VALUE = re.compile(r"[0-3]")
STD_MAP = re.compile(r"\d+:[0-3](,\d+:[0-3])*")


def env_name(*parts: str) -> str:
    """``FSM_AGENT_`` + the parts upper-cased, dashes as underscores: ``("status-http", "port")``."""
    return "FSM_AGENT_" + "_".join(p.upper().replace("-", "_") for p in parts)


def bool_word(value: object) -> bool | None:
    """``str(value)`` as one of the boolean words (``TRUE_WORDS``/``FALSE_WORDS``, any case, blanks
    around ignored): True, False, or None for any other text."""
    lowered = str(value).strip().lower()
    return True if lowered in TRUE_WORDS else False if lowered in FALSE_WORDS else None


# ------------------------------------------------------------------------------------------------
# Command-line and environment values: parsing and checking. Each raises ConfigError naming the
# flag, the value and the fix.
# ------------------------------------------------------------------------------------------------


def parse_nnodes(value: str) -> tuple[int, int]:
    """``--nnodes N`` or ``MIN:MAX`` -> (min_nodes, max_nodes), with 0 < MIN <= MAX."""
    parts = value.split(":")
    try:
        if len(parts) > 2:
            raise ValueError(value)
        min_nodes, max_nodes = int(parts[0]), int(parts[-1])
    except ValueError:
        raise ConfigError(
            f"--nnodes {value!r}: expected N or MIN:MAX with integers (e.g. --nnodes 2 or --nnodes 1:4)"
        ) from None
    if min_nodes <= 0:
        raise ConfigError(f"--nnodes {value!r}: node counts must be > 0 (e.g. --nnodes 1 or --nnodes 1:4)")
    if min_nodes > max_nodes:
        raise ConfigError(f"--nnodes {value!r}: MIN must be <= MAX (e.g. --nnodes {max_nodes}:{min_nodes})")
    return min_nodes, max_nodes


def nproc_as_int(value: str) -> int | None:
    """The worker count if ``value`` is an integer (must be > 0), None if it is a device name."""
    try:
        count = int(value)
    except ValueError:
        if not value.strip():
            raise ConfigError(nproc_hint(value, "is empty")) from None
        return None
    if count <= 0:
        raise ConfigError(nproc_hint(value, "must be > 0"))
    return count


def nproc_hint(value: str, problem: str) -> str:
    """The ``--nproc-per-node`` error line for ``value`` with ``problem``."""
    return (
        f"--nproc-per-node {value!r}: {problem}; give a positive number of workers "
        f"(e.g. --nproc-per-node 2) or one of {', '.join(NPROC_NAMES)}"
    )


def parse_master_port(value: str) -> int:
    """``--master-port N`` -> N, a TCP port 0..65535 (torch: ``int``, then a ValueError in the rendezvous)."""
    port = port_number(value.strip())
    if port is None:
        raise ConfigError(
            f"--master-port {value!r}: not a TCP port; use an integer from 0 to 65535 "
            f"(e.g. --master-port {DEFAULT_MASTER_PORT})"
        )
    return port


def port_number(text: str) -> int | None:
    """``text`` as a TCP port number (1 to 5 digits, below 65536, as torch's ``_try_parse_port``), else None."""
    return int(text) if re.fullmatch(r"[0-9]{1,5}", text) and int(text) < 65536 else None


def parse_rdzv_conf(value: str) -> dict[str, str]:
    """``--rdzv-conf k1=v1,k2=v2`` -> {k: v} (values stay strings), as torch's ``_parse_rendezvous_config``."""
    config: dict[str, str] = {}
    if not value.strip():
        return config
    for item in value.split(","):
        key, _, item_value = item.partition("=")
        key, item_value = key.strip(), item_value.strip()
        if not key:
            raise ConfigError(
                f"--rdzv-conf {value!r}: empty key in {item!r}; use key=value pairs "
                f"separated by commas (e.g. --rdzv-conf join_timeout=900,read_timeout=120)"
            )
        if not item_value:
            raise ConfigError(f"--rdzv-conf {value!r}: option {key!r} has no value (e.g. {key}=...)")
        config[key] = item_value
    return config


def check_std(value: str, flag: str) -> str:
    """Validate a ``-r/--redirects`` or ``-t/--tee`` value (torch's ``Std``); returns it unchanged.

    Either one value for every local rank (0 none, 1 stdout, 2 stderr, 3 both) or a map
    ``LOCAL_RANK:VALUE,...`` such as ``0:3,1:2``.
    """
    if not (STD_VALUE.fullmatch(value) or STD_MAP.fullmatch(value)):
        raise ConfigError(
            f"{flag} {value!r}: use 0 (none), 1 (stdout), 2 (stderr), 3 (both) "
            f"or a map of local rank to value (e.g. {flag} 0:3,1:2)"
        )
    return value


def parse_local_ranks_filter(value: str) -> frozenset[int] | None:
    """``--local-ranks-filter 0,1`` -> frozenset({0, 1}); empty -> None (show every rank)."""
    if not value.strip():
        return None
    try:
        ranks = frozenset(int(item) for item in value.split(","))
        if min(ranks) >= 0:
            return ranks
    except ValueError:
        pass
    raise ConfigError(
        f"--local-ranks-filter {value!r}: must be a comma-separated list of local ranks "
        f"(e.g. --local-ranks-filter 0,1,2)"
    )


def parse_filters(value: str) -> list[str]:
    """``--duplicate-std*-filters``: comma-separated substrings, ``,,`` escaping a comma (as torch).

    Empty items are dropped (torch keeps them, and an empty substring matches every line).
    """
    placeholder = "\0"
    items = value.replace(",,", placeholder).split(",")
    return [item.replace(placeholder, ",") for item in items if item]


def parse_signals(value: str, flag: str = "--signals-to-handle") -> tuple[str, ...]:
    """``SIGTERM,SIGINT`` -> the names (``fsm_agent.signal_names``: ``TERM`` is ``SIGTERM``); each
    must be a signal the agent can trap (``flag`` names the option in the error:
    ``--signals-to-handle`` or ``--forward-signals``)."""
    try:
        return signal_names(value)
    except ValueError as exc:
        raise ConfigError(f"{flag} {value!r}: {exc}; use names such as SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1") from None


def parse_forward_signals(value: str) -> tuple[str, ...]:
    """``--forward-signals SIGUSR1,SIGUSR2`` -> the names (the agent traps each to relay it)."""
    return parse_signals(value, flag="--forward-signals")


def parse_names(value: str) -> tuple[str, ...]:
    """``a,b`` -> ("a", "b"), blanks dropped (plugin names)."""
    return tuple(name.strip() for name in value.split(",") if name.strip())


def parse_bool(value: str, source: str) -> bool:
    """An environment flag: 1/true/yes/on or 0/false/no/off (any case); ``source`` names it in the error."""
    word = bool_word(value)
    if word is None:
        raise ConfigError(f"{source}={value!r}: not a boolean; use 1/0, true/false or yes/no (or unset it)")
    return word


def checked(parse: Callable[[str], Any]) -> Callable[[str], str]:
    """An argparse ``type`` that checks with ``parse`` but keeps the torchrun-shaped string (torchrun's
    namespace holds strings; ``fsm_agent.resolve.config_from_args`` converts them)."""

    def validated(value: str) -> str:
        parse(value)
        return value

    validated.__name__ = getattr(parse, "__name__", "value")
    return validated


# ------------------------------------------------------------------------------------------------
# Value kinds: what a file (or a plugin option) may hold, checked strictly.
# ------------------------------------------------------------------------------------------------


def show(value: Any) -> str:
    """A value as the user wrote it in TOML: ``"abc"``, ``true``, ``[1, 2]``."""
    try:
        shown = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return repr(value)
    # json leaves these unescaped, and str.splitlines breaks a one-line error at each of them
    return shown.translate(_LINE_BREAKS)


_LINE_BREAKS = {ord(c): f"\\u{ord(c):04x}" for c in "\x85\u2028\u2029"}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class Rejected(ValueError):
    """A value failed its check; the text is the reason as the user reads it ("expected ..., got ...").

    ``Kind.structure`` and a plugin option's ``parse`` raise it; ``Setting.from_env`` and the run
    parser show its text after the variable or the flag that gave the value.
    """


class _Invalid(ValueError):
    """A value failed its kind's check; the kind turns it into "expected ..., got ..."."""


def _need(condition: bool) -> None:
    if not condition:
        raise _Invalid()


@attrs.frozen
class Kind:
    """One kind of configuration value.

    Attributes:
        describe: what is expected, completing "expected ...", e.g. ``seconds > 0``.
        toml: the TOML type(s), for docs/configuration.md.
        convert: TOML value -> the value the flag's argparse action stores; raises ValueError
            (a bare ``_Invalid`` gets the "expected ..., got ..." message).
        type: a unique class standing for this kind in attrs/cattrs schemas.
    """

    describe: str
    toml: str
    convert: Callable[[Any], Any]
    type: type = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "type", type(f"Kind[{self.describe}]", (), {"fsm_agent_kind": self}))

    def structure(self, value: Any) -> Any:
        """Check and convert a TOML value; raises Rejected("expected ..., got ...")."""
        try:
            return self.convert(value)
        except _Invalid as exc:
            detail = f" ({exc.args[0]})" if exc.args else ""
            raise Rejected(f"expected {self.describe}, got {show(value)}{detail}") from None


def _string(value: Any) -> str:
    _need(isinstance(value, str))
    return cast(str, value)


def _bool(value: Any) -> bool:
    _need(isinstance(value, bool))
    return cast(bool, value)


def _int_at_least(minimum: int) -> Callable[[Any], int]:
    def convert(value: Any) -> int:
        _need(_is_int(value) and value >= minimum)
        return cast(int, value)

    return convert


def _seconds(positive: bool) -> Callable[[Any], float]:
    def convert(value: Any) -> float:
        _need(_is_number(value) and (value > 0 if positive else value >= 0))
        return cast(float, value)

    return convert


def _port(value: Any) -> int:
    _need(_is_int(value) and 1 <= value <= 65535)
    return cast(int, value)


def _nnodes(value: Any) -> str:
    if _is_int(value):
        _need(value > 0)
        return str(value)
    _need(isinstance(value, str))
    parts = value.split(":")
    _need(1 <= len(parts) <= 2 and all(p.strip().isdigit() for p in parts))
    low, high = int(parts[0]), int(parts[-1])
    _need(0 < low <= high)
    return cast(str, value)


def _nproc(value: Any) -> str:
    if _is_int(value):
        _need(value > 0)
        return str(value)
    _need(value in NPROC_NAMES)
    return cast(str, value)


def _std(value: Any) -> str:
    if _is_int(value):
        _need(0 <= value <= 3)
        return str(value)
    _need(isinstance(value, str) and bool(STD_VALUE.fullmatch(value) or STD_MAP.fullmatch(value)))
    return cast(str, value)


def _signals(value: Any) -> str:
    names = value.split(",") if isinstance(value, str) else value
    _need(isinstance(names, list) and all(isinstance(n, str) for n in names))
    try:
        return ",".join(signal_names(",".join(names)))
    except ValueError as exc:
        raise _Invalid(str(exc)) from None


def _ranks(value: Any) -> str:
    _need(isinstance(value, list) and all(_is_int(r) and r >= 0 for r in value))
    return ",".join(str(r) for r in value)


def _strings(value: Any) -> list[str]:
    _need(isinstance(value, list) and all(isinstance(s, str) for s in value))
    return list(value)


def _names(value: Any) -> tuple[str, ...]:
    _need(isinstance(value, list) and all(isinstance(s, str) and s.strip() for s in value))
    return tuple(s.strip() for s in value)


def _conf(value: Any) -> dict[str, Any]:
    _need(isinstance(value, dict))
    for key, item in value.items():
        if not key or not isinstance(item, (str, int, float, bool)):
            raise _Invalid(f"key {key!r}: expected a string, number or boolean" if key else "empty key")
        if key in RENDEZVOUS_OPTIONS:
            raise _Invalid(f"set {key!r} as rendezvous.{key}, where its type is checked")
    return dict(value)


def _int(value: Any) -> int:
    _need(_is_int(value))
    return cast(int, value)


def _number(value: Any) -> float:
    _need(_is_number(value))
    return float(value)


def choice_kind(values: Iterable[Any]) -> Kind:
    """A kind accepting exactly one of ``values`` (same type: no ``"1"`` for ``1``)."""
    values = tuple(values)

    def convert(value: Any) -> Any:
        _need(any(type(value) is type(v) and value == v for v in values))
        return value

    return Kind(f"one of {', '.join(show(v) for v in values)}", "string", convert)


STRING = Kind("a string", "string", _string)
BOOL = Kind("true or false", "boolean", _bool)
COUNT = Kind("an integer >= 0", "integer", _int_at_least(0))
POSITIVE_INT = Kind("an integer > 0", "integer", _int_at_least(1))
SECONDS = Kind("seconds >= 0", "number", _seconds(positive=False))
POSITIVE_SECONDS = Kind("seconds > 0", "number", _seconds(positive=True))
PORT = Kind("a port number 1-65535", "integer", _port)
NNODES = Kind('a node count > 0 or "MIN:MAX" with 0 < MIN <= MAX', 'integer or "MIN:MAX"', _nnodes)
NPROC = Kind(f"a worker count > 0 or one of {', '.join(show(n) for n in NPROC_NAMES)}", "integer or string", _nproc)
STD = Kind(
    '0 (none), 1 (stdout), 2 (stderr), 3 (both) or a map of local rank to value such as "0:3,1:2"',
    "integer or string",
    _std,
)
SIGNALS = Kind('signal names the agent can trap, such as ["SIGTERM", "SIGINT"]', "array of strings", _signals)
RANKS = Kind("a list of local ranks >= 0, such as [0, 1]", "array of integers", _ranks)
STRINGS = Kind("a list of strings", "array of strings", _strings)
NAMES = Kind("a list of plugin names", "array of strings", _names)
#: Passed through unchecked (``[plugins]`` is checked against the declared options separately).
RAW = Kind("anything", "table", lambda value: value)
CONF = Kind("a table of backend options (strings, numbers or booleans)", "table", _conf)
#: The kind of a plugin option of each Python type (``plugin_option``).
TYPE_KINDS: dict[type, Kind] = {
    str: STRING,
    bool: BOOL,
    int: Kind("an integer", "integer", _int),
    float: Kind("a number", "number", _number),
}


def _checked_kind(base: Kind, check: Callable[[Any], None] | None) -> Kind:
    """``base``, then a plugin's own ``check`` of the value (it raises ValueError("expected ..."))."""
    if check is None:
        return base

    def convert(value: Any) -> Any:
        value = base.structure(value)
        try:
            check(value)
        except ValueError as exc:  # a check that names the value already says "got ..."
            text = str(exc)
            raise Rejected(text if ", got " in text else f"{text}, got {show(value)}") from None
        return value

    return Kind(base.describe, base.toml, convert)


def _text_parser(value_type: type, kind: Kind) -> Callable[[str], Any]:
    """A plugin option's flag or variable text -> its typed value, then checked by ``kind`` (as the
    file's value): a boolean is one of the boolean words, a number as Python reads it; raises Rejected."""

    def parse(raw: str) -> Any:
        text = raw.strip()
        value: Any = raw
        try:
            if value_type is bool:
                value = bool_word(text)
                if value is None:
                    raise ValueError(raw)
            elif value_type is int:
                value = int(text)
            elif value_type is float:
                value = float(text)
        except ValueError:
            raise Rejected(f"expected {TYPE_KINDS[value_type].describe}, got {show(raw)}") from None
        return kind.structure(value)

    parse.__name__ = value_type.__name__
    return parse


# ------------------------------------------------------------------------------------------------
# The settings: each declared once.
# ------------------------------------------------------------------------------------------------

#: How a flag takes its value: ``store`` one value, ``flag`` none (``store_true``; its variable is a
#: boolean word), ``extend`` repeatable and comma-splitting (the command line adds to the variable's list).
ACTIONS = ("store", "flag", "extend")


@attrs.frozen
class Setting:
    """One setting: a flag of ``fsm-agent run``, its environment variables, its file key.

    Attributes:
        dest: the argparse dest (torchrun's), or None for a rendezvous option that only exists as a
            ``--rdzv-conf KEY=V`` item and a ``[rendezvous]`` key.
        flags: the flag spellings as declared (``-r``, ``--redirects``); the parser adds each long
            flag's ``--snake_case`` twin, as torchrun.
        help: one line for ``--help`` and docs/configuration.md (``fsm-agent:`` is prefixed to an own flag's).
        default: the value when no source sets it (torchrun's), as the namespace holds it.
        parse: the command-line/environment value -> what the namespace holds; raises ConfigError
            (naming the flag and the fix) or ValueError for a bad value. None: the string as is.
        action: one of ``ACTIONS``.
        choices: the allowed values, or None.
        torch_env: reads torchrun's ``PET_<DEST>`` (torch's ``argparse_util.env``/``check_env``).
        env: fsm-agent's own variable (``FSM_AGENT_*``), for a flag that is not torchrun's.
        key: the configuration-file key (``rendezvous.backend``: ``[rendezvous]`` table, key
            ``backend``), or None for a per-command flag (``-m``, ``--config``).
        kind: what the file's value may be; it converts it to what the namespace holds.
        field: the ``LaunchConfig`` field(s) it ends up in.
        doc_default: the default as docs/configuration.md says it, where ``default`` does not.
        fallback_env: torch's own variable, read below the others and above the file
            (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``).
        metavar: the value's name in ``--help``.
        plugin: the plugin that declared it in ``fsm_agent_addoption`` (``plugin_option``), or None
            for fsm-agent's and torchrun's settings.
        type: a plugin option's Python type (``str``, ``int``, ``float``, ``bool``); None for the
            others, whose ``parse`` and ``kind`` say what they hold.
    """

    dest: str | None
    flags: tuple[str, ...]
    help: str
    default: Any = None
    parse: Callable[[str], Any] | None = attrs.field(default=None, eq=False)
    action: str = "store"
    choices: tuple[str, ...] | None = None
    torch_env: bool = False
    env: str | None = None
    key: str | None = None
    kind: Kind | None = None
    field: str = ""
    doc_default: str | None = None
    fallback_env: str | None = None
    metavar: str | None = None
    plugin: str | None = None
    type: type | None = None

    @property
    def own(self) -> bool:
        """fsm-agent's flag, not torchrun's nor a plugin's."""
        return self.env is not None and self.plugin is None

    @property
    def flag(self) -> str:
        """The spelling messages name: the first long flag (``--redirects`` of ``-r``/``--redirects``)."""
        return next((f for f in self.flags if f.startswith("--")), self.flags[0])

    @property
    def section(self) -> str:
        """The file table: ``rendezvous``, ``logs`` or ``""`` (top level)."""
        return (self.key or "").rpartition(".")[0]

    @property
    def name(self) -> str:
        """The key within its table."""
        return (self.key or "").rpartition(".")[2]

    @property
    def envs(self) -> tuple[str, ...]:
        """The environment variables read, highest precedence first: a file key's ``FSM_AGENT_<DEST>``
        before torchrun's ``PET_<DEST>``; an own flag's one ``FSM_AGENT_*`` (``fallback_env`` aside)."""
        if self.dest is None:
            return ()
        if self.env is not None:
            return (self.env,)
        names = [env_name(self.dest)] if self.key else []
        return (*names, f"PET_{self.dest.upper()}") if self.torch_env else tuple(names)

    def from_string(self, raw: str) -> Any:
        """A flag's or a variable's text -> what the namespace holds: ``parse(raw)``, or ``raw`` itself.

        Raises:
            ConfigError: the value is bad (its text names the flag).
            Rejected: the value is bad (a plugin option's: "expected ..., got ...").
            ValueError: the value is bad (from a plain ``int``/``float`` parse).
        """
        return self.parse(raw) if self.parse else raw

    def from_env(self, var: str, raw: str) -> Any:
        """The value of env var ``var`` set to ``raw``, checked like the flag's.

        Raises:
            ConfigError: naming ``var`` and the fix.
        """
        if self.action == "flag":
            return parse_bool(raw, var)
        try:
            value = self.from_string(raw)
        except Rejected as exc:  # it says what was expected
            raise ConfigError(f"{var}={raw!r}: {exc}") from None
        except FsmAgentError as exc:  # its text names the flag; the value came from ``var``
            text = str(exc).removeprefix(f"{self.flags[0]} {raw!r}: ")
            raise ConfigError(f"{var}={raw!r}: {text}") from None
        except (TypeError, ValueError):
            type_name = getattr(self.parse, "__name__", "value")
            raise ConfigError(f"{var}={raw!r}: not a valid {type_name} for {self.flags[0]}; fix or unset it") from None
        if self.choices is not None and value not in self.choices:
            raise ConfigError(f"{var}={raw!r}: choose from {', '.join(map(str, self.choices))}")
        return value


def _torchrun(
    dest: str | None,
    *flags: str,
    help: str,
    key: str | None = None,  # noqa: A002
    field: str = "",
    **kwargs: Any,
) -> Setting:
    """A torchrun flag that reads ``PET_<DEST>`` (unless ``torch_env=False``, as torch's plain flags)."""
    kwargs.setdefault("torch_env", True)
    return Setting(dest=dest, flags=flags, help=help, key=key, field=field or (dest or "") if key else "", **kwargs)


def _own(
    dest: str,
    *flags: str,
    help: str,
    env: str,
    key: str | None = None,  # noqa: A002
    **kwargs: Any,
) -> Setting:
    """An fsm-agent flag (not torchrun's) with its one ``FSM_AGENT_*`` variable."""
    return Setting(dest=dest, flags=flags, help=help, env=env, key=key, field=dest if key else "", **kwargs)


def _rendezvous_option(name: str, kind: Kind, help: str) -> Setting:  # noqa: A002
    """A typed ``[rendezvous]`` key that goes into ``rdzv_configs`` (set by ``--rdzv-conf NAME=V``)."""
    return Setting(
        dest=None,
        flags=(),
        help=help,
        key=f"rendezvous.{name}",
        kind=kind,
        field="rdzv_configs",
        doc_default="unset (the backend's)",
    )


#: The file table of the plugins' options (``[plugins.<plugin>]``) and their ``LaunchConfig`` field.
PLUGINS_SECTION = "plugins"


def plugin_option(
    plugin: str,
    name: str,
    *,
    value_type: type,
    default: Any,
    help: str,  # noqa: A002
    flag: str,
    env: str,
    choices: tuple[Any, ...] | None = None,
    check: Callable[[Any], None] | None = None,
) -> Setting:
    """The ``Setting`` of option ``name`` of plugin ``plugin`` (``options.add(...)`` in its
    ``fsm_agent_addoption``; ``fsm_agent.config.OptionRegistry.add`` checks the declaration).

    The flag ``flag`` takes one value, booleans too (``--x true``); the one variable is ``env``; the
    file key is ``plugins.<plugin>.<name>``; the value lands in ``LaunchConfig.plugins``. Its
    ``kind`` checks a file value strictly against ``value_type`` (or ``choices``), then ``check``;
    its ``parse`` reads a flag's or variable's text into that type and checks it with the same kind.
    """
    kind = _checked_kind(choice_kind(choices) if choices else TYPE_KINDS[value_type], check)
    return Setting(
        dest=f"plugin:{plugin}:{name}",  # not an identifier: it cannot clash with torchrun's
        flags=(flag,),
        help=help,
        default=default,
        parse=_text_parser(value_type, kind),
        env=env,
        key=f"{PLUGINS_SECTION}.{plugin}.{name}",
        kind=kind,
        field=PLUGINS_SECTION,
        metavar=name.upper(),
        plugin=plugin,
        type=value_type,
    )


#: Typed rendezvous options (``[rendezvous]`` keys that go into ``rdzv_configs``; torch's names).
RENDEZVOUS_SETTINGS: tuple[Setting, ...] = (
    _rendezvous_option(
        "join_timeout", POSITIVE_SECONDS, "c10d: seconds to wait for the rendezvous to complete (torch: 600)"
    ),
    _rendezvous_option(
        "last_call_timeout",
        POSITIVE_SECONDS,
        "c10d, fsm: seconds to wait for more nodes once min_nodes joined (torch: 30; fsm: 30, and only for nodes "
        "new to the run)",
    ),
    _rendezvous_option(
        "close_timeout", POSITIVE_SECONDS, "c10d: seconds to wait for the rendezvous to close (torch: 30)"
    ),
    _rendezvous_option("read_timeout", POSITIVE_SECONDS, "c10d: seconds for a store read (torch: 60)"),
    _rendezvous_option(
        "keep_alive_interval", POSITIVE_SECONDS, "c10d: seconds between keep-alive heartbeats (torch: 5)"
    ),
    _rendezvous_option(
        "keep_alive_max_attempt", POSITIVE_INT, "c10d: missed heartbeats before a node is dead (torch: 3)"
    ),
    _rendezvous_option(
        "is_host", BOOL, "c10d: whether this node hosts the rendezvous store (torch: inferred from the endpoint)"
    ),
    _rendezvous_option("timeout", POSITIVE_SECONDS, "static: seconds to wait for all nodes (torchrun: 900)"),
)
#: ``{name: setting}`` of the typed rendezvous options.
RENDEZVOUS_OPTIONS: dict[str, Setting] = {s.name: s for s in RENDEZVOUS_SETTINGS}

#: Every setting, in the order of the file's keys (``fsm-agent config``, docs/configuration.md):
#: top-level keys, then ``[rendezvous]``, then ``[logs]``, then the per-command flags. ``--help``
#: lists torchrun's flags in this order, then fsm-agent's own.
SETTINGS: tuple[Setting, ...] = (
    _torchrun(
        "nnodes",
        "--nnodes",
        key="nnodes",
        kind=NNODES,
        field="min_nodes, max_nodes",
        default="1:1",
        parse=checked(parse_nnodes),
        help="number of nodes, or the range MIN:MAX for an elastic job",
    ),
    _torchrun(
        "nproc_per_node",
        "--nproc-per-node",
        key="nproc_per_node",
        kind=NPROC,
        default="1",
        parse=checked(nproc_as_int),
        help=f"workers per node: a number or one of {', '.join(NPROC_NAMES)}",
    ),
    _torchrun(
        "max_restarts",
        "--max-restarts",
        key="max_restarts",
        kind=COUNT,
        default=0,
        parse=int,
        help="restarts of the worker group before the job fails",
    ),
    _torchrun(
        "monitor_interval",
        "--monitor-interval",
        key="monitor_interval",
        kind=POSITIVE_SECONDS,
        default=0.1,
        parse=float,
        help="seconds between checks of the workers",
    ),
    _torchrun("role", "--role", key="role", kind=STRING, default="default", help="role name of the workers"),
    _torchrun(
        "start_method",
        "--start-method",
        key="start_method",
        kind=choice_kind(START_METHODS),
        default="spawn",
        choices=START_METHODS,
        help="multiprocessing start method for function entrypoints (--run-path)",
    ),
    _torchrun(
        "standalone",
        "--standalone",
        key="standalone",
        kind=BOOL,
        action="flag",
        default=False,
        field="standalone, rdzv_backend, rdzv_endpoint, run_id",
        help="single-node job: fsm-agent's own torch-free rendezvous (backend fsm) on a free local port "
        "with a fresh id (--rdzv-backend/--rdzv-endpoint/--rdzv-id are ignored)",
    ),
    _torchrun(
        "shutdown_timeout",
        "--shutdown-timeout",
        key="shutdown_timeout",
        kind=SECONDS,
        parse=float,
        fallback_env=SHUTDOWN_TIMEOUT_ENV,
        doc_default="`$TORCH_ELASTIC_SHUTDOWN_TIMEOUT`, else `30`",
        help=f"seconds between the stop signal and SIGKILL at shutdown; "
        f"unset: ${SHUTDOWN_TIMEOUT_ENV}, else {DEFAULT_SHUTDOWN_TIMEOUT_S:g}",
    ),
    _own(
        "exit_barrier_timeout",
        "--exit-barrier-timeout",
        env="FSM_AGENT_EXIT_BARRIER_TIMEOUT",
        key="exit_barrier_timeout",
        kind=SECONDS,
        default=300.0,
        parse=float,
        metavar="SECONDS",
        help="seconds to wait at exit for the other nodes' workers to finish",
    ),
    _torchrun(
        "signals_to_handle",
        "--signals-to-handle",
        key="signals_to_handle",
        kind=SIGNALS,
        default="SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        parse=checked(parse_signals),
        help="comma-separated signals that stop the job: the workers get the same signal (SIGINT as "
        "SIGINT, SIGUSR1 as SIGUSR1), SIGKILL after --shutdown-timeout or at a second such signal; "
        "the agent exits 128+N",
    ),
    _own(
        "hang_timeout",
        "--hang-timeout",
        env="FSM_AGENT_HANG_TIMEOUT",
        key="hang_timeout",
        kind=POSITIVE_SECONDS,
        parse=float,
        metavar="SECONDS",
        doc_default="unset (no heartbeat hang detection)",
        help="a worker that called fsm_agent.heartbeat() and then none for SECONDS is hung: "
        "its stacks are recorded and the group restarted",
    ),
    _own(
        "forward_signals",
        "--forward-signals",
        env="FSM_AGENT_FORWARD_SIGNALS",
        key="forward_signals",
        kind=SIGNALS,
        default="",
        parse=checked(parse_forward_signals),
        metavar="SIGNALS",
        doc_default='`""` (none)',
        help="comma-separated signals (e.g. SIGUSR1) passed on to every worker's process group "
        "without stopping anything, e.g. for checkpoint-on-preemption; dropped while no worker runs",
    ),
    _torchrun(
        "virtual_local_rank",
        "--virtual-local-rank",
        key="virtual_local_rank",
        kind=BOOL,
        action="flag",
        default=False,
        help="give every worker LOCAL_RANK=0 and only its own GPU in CUDA_VISIBLE_DEVICES",
    ),
    _torchrun(
        "numa_binding",
        "--numa-binding",
        key="numa_binding",
        kind=choice_kind(NUMA_BINDING_MODES),
        torch_env=False,
        choices=NUMA_BINDING_MODES,
        help="bind each worker to the CPUs near its GPU",
    ),
    _torchrun(
        "event_log_handler",
        "--event-log-handler",
        key="event_log_handler",
        kind=STRING,
        default="null",
        help="name of torch's event log handler (null, console, ...)",
    ),
    _own(
        "launcher",
        "--launcher",
        env="FSM_AGENT_LAUNCHER",
        key="launcher",
        kind=STRING,
        default="subprocess",
        metavar="NAME",
        help="name of the launcher backend that starts the workers",
    ),
    _own(
        "scheduler",
        "--scheduler",
        env="FSM_AGENT_SCHEDULER",
        key="scheduler",
        kind=STRING,
        default="auto",
        metavar="NAME",
        help="fill unset flags from the batch scheduler's job step: auto (any scheduler whose "
        "job step this is, e.g. slurm inside srun), none, or a scheduler's name (docs/schedulers.md)",
    ),
    _own(
        "disabled_plugins",
        "--disable-plugin",
        env=DISABLE_PLUGINS_ENV,
        key="disabled_plugins",
        kind=NAMES,
        action="extend",
        default=(),
        parse=parse_names,
        metavar="NAME",
        doc_default="`[]`; the file's list, the env list and the flags add up",
        help="do not load this plugin (repeatable, or comma-separated; adds to the env list)",
    ),
    _torchrun(
        "rdzv_backend",
        "--rdzv-backend",
        key="rendezvous.backend",
        kind=STRING,
        default="static",
        help="rendezvous backend (a registered name, e.g. c10d, static)",
    ),
    _torchrun(
        "rdzv_endpoint",
        "--rdzv-endpoint",
        key="rendezvous.endpoint",
        kind=STRING,
        default="",
        help="rendezvous endpoint, usually HOST:PORT",
    ),
    _torchrun(
        "rdzv_id",
        "--rdzv-id",
        key="rendezvous.run_id",
        kind=STRING,
        field="run_id",
        default="none",
        help="job id: agents with the same id and endpoint form one job",
    ),
    _torchrun(
        "rdzv_conf",
        "--rdzv-conf",
        key="rendezvous.conf",
        kind=CONF,
        field="rdzv_configs",
        default="",
        parse=checked(parse_rdzv_conf),
        doc_default="`{}`; per option, `--rdzv-conf` (or its env var) wins over the file",
        help="extra rendezvous settings KEY=VALUE,KEY=VALUE,...",
    ),
    *RENDEZVOUS_SETTINGS,
    _torchrun(
        "node_rank",
        "--node-rank",
        key="rendezvous.node_rank",
        kind=COUNT,
        default=0,
        parse=int,
        help="rank of this node (static rendezvous only)",
    ),
    _torchrun(
        "master_addr",
        "--master-addr",
        key="rendezvous.master_addr",
        kind=STRING,
        default="127.0.0.1",
        help="address of the rank-0 node (static rendezvous only)",
    ),
    _torchrun(
        "master_port",
        "--master-port",
        key="rendezvous.master_port",
        kind=PORT,
        parse=parse_master_port,
        doc_default="unset (`29500`)",
        help=f"port on the rank-0 node (static rendezvous only; {DEFAULT_MASTER_PORT} when unset): the "
        "agents' store, and the workers' MASTER_PORT. Giving it turns off the implicit single-node "
        "(--standalone) rendezvous",
    ),
    _torchrun(
        "local_addr",
        "--local-addr",
        key="rendezvous.local_addr",
        kind=STRING,
        doc_default="unset (the address that routes to the endpoint)",
        help="this node's address (default: the address of the interface that routes to the rendezvous endpoint)",
    ),
    _torchrun(
        "log_dir",
        "--log-dir",
        key="logs.log_dir",
        kind=STRING,
        doc_default="unset (a new temporary directory)",
        help="base directory for log files; unset: a new temporary directory",
    ),
    _torchrun(
        "redirects",
        "-r",
        "--redirects",
        key="logs.redirects",
        kind=STD,
        default="0",
        parse=lambda value: check_std(value, "--redirects"),
        help="redirect worker streams to files: 0 none, 1 stdout, 2 stderr, 3 both, or per local rank such as 0:3,1:2",
    ),
    _torchrun(
        "tee",
        "-t",
        "--tee",
        key="logs.tee",
        kind=STD,
        default="0",
        parse=lambda value: check_std(value, "--tee"),
        help="like --redirects, but also print to the console",
    ),
    _torchrun(
        "local_ranks_filter",
        "--local-ranks-filter",
        key="logs.local_ranks_filter",
        kind=RANKS,
        default="",
        parse=checked(parse_local_ranks_filter),
        doc_default="unset (every rank)",
        help="only show these local ranks on the console, e.g. 0,1 (default: all)",
    ),
    _torchrun(
        "duplicate_stdout_filters",
        "--duplicate-stdout-filters",
        key="logs.duplicate_stdout_filters",
        kind=STRINGS,
        default=[],
        parse=parse_filters,
        help="copy stdout lines containing any of these comma-separated substrings to "
        "filtered_stdout.log (',,' is a literal comma)",
    ),
    _torchrun(
        "duplicate_stderr_filters",
        "--duplicate-stderr-filters",
        key="logs.duplicate_stderr_filters",
        kind=STRINGS,
        default=[],
        parse=parse_filters,
        help="as --duplicate-stdout-filters, for stderr (filtered_stderr.log)",
    ),
    _torchrun(
        "logs_specs",
        "--logs-specs",
        key="logs.logs_specs",
        kind=STRING,
        torch_env=False,
        doc_default="unset (the built-in layout)",
        help="name of a torchrun.logs_specs entry point that lays out the log files",
    ),
    _own(
        "events_file",
        "--events-file",
        env="FSM_AGENT_EVENTS_FILE",
        key="logs.events_file",
        kind=STRING,
        metavar="PATH",
        doc_default="unset (`events.jsonl` in the run's log directory)",
        help="JSON-lines file of agent events (default: events.jsonl in the log directory)",
    ),
    # Per command: the entrypoint's kind and the file itself.
    _torchrun(
        "module",
        "-m",
        "--module",
        action="flag",
        default=False,
        help="run the script as a Python module, like 'python -m'",
    ),
    _torchrun(
        "no_python",
        "--no-python",
        action="flag",
        default=False,
        help="run the script directly as a binary, without 'python'",
    ),
    _torchrun(
        "run_path",
        "--run-path",
        action="flag",
        default=False,
        help="run the script with runpy.run_path in a Python worker process (overrides --no-python)",
    ),
    _own(
        "config",
        "--config",
        env="FSM_AGENT_CONFIG",
        metavar="FILE",
        help="TOML configuration file (keys: docs/configuration.md); flags and env vars win "
        "over it. Without it, the [tool.fsm_agent] table of ./pyproject.toml is read, if there is one",
    ),
)

#: The settings that are flags, by argparse dest.
BY_DEST: dict[str, Setting] = {s.dest: s for s in SETTINGS if s.dest}
#: Every file key, in documentation order, and the one lookup by key.
KEYS: tuple[Setting, ...] = tuple(s for s in SETTINGS if s.key)
BY_KEY: dict[str, Setting] = {s.key: s for s in KEYS if s.key}
#: The argparse dests that are configuration (they get ``FSM_AGENT_<DEST>`` env vars).
CONFIG_DESTS: frozenset[str] = frozenset(s.dest for s in KEYS if s.dest)
SECTIONS = ("rendezvous", "logs")


def read_environment(
    settings: Iterable[Setting], environ: Mapping[str, str] | None = None, *, skip: Iterable[str] = ()
) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """The settings' values from the environment, each checked like its flag.

    For each setting (but those whose dest is in ``skip``) its first variable in ``envs`` that is
    set and not empty (an empty variable counts as unset) gives the value; ``fallback_env`` is not
    read here (it sits below the file: ``fsm_agent.resolve``).

    Returns:
        ``({dest: value}, {dest: the variable read}, [one error line per bad variable])``.
    """
    environ = os.environ if environ is None else environ
    skipped = set(skip)
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    errors: list[str] = []
    for setting in settings:
        if setting.dest is None or setting.dest in skipped:
            continue
        for var in setting.envs:
            raw = environ.get(var, "")
            if not raw:
                continue
            try:
                values[setting.dest] = setting.from_env(var, raw)
                sources[setting.dest] = var
            except ConfigError as exc:
                errors.append(str(exc))
            break
    return values, sources, errors
