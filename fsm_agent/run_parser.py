"""The ``fsm-agent run`` / ``fsmrun`` argument parser, built from the settings (``fsm_agent.settings``).

``get_run_parser()`` accepts every torchrun 2.13 flag with torchrun's spellings, defaults and
``PET_<DEST>`` environment fallbacks, plus fsm-agent's own flags (marked "fsm-agent:") and the
plugins' options (marked with the plugin's name). Each flag is a ``Setting`` turned into an
argparse action by one function, a plugin's option too; the parser reads every setting's variables
at parse time (``settings.read_environment``), so the command line wins over a variable, which wins
over the default. The file and the merge of every source live in
``fsm_agent.resolve``.

``cli_given`` (what the command line itself set) and ``launcher_flags`` (the launcher's words up to
the training script) serve the merge.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

from fsm_agent.argparsing import OneLineParser
from fsm_agent.errors import ConfigError, PluginError
from fsm_agent.settings import BY_DEST, SETTINGS, Rejected, Setting, read_environment


def env_vars(action: argparse.Action) -> list[str]:
    """The environment variables a flag reads, highest precedence first (its setting's ``envs``)."""
    setting = BY_DEST.get(action.dest)
    return list(setting.envs) if setting is not None and action.option_strings else []


class _Parser(OneLineParser):
    """ArgumentParser whose errors are ConfigErrors (one line) and whose env fallbacks apply at parse time.

    Attributes:
        settings: ``{dest: Setting}`` of every flag added from a setting (``_add_setting``).
        read_env: read the environment at all (off for ``cli_given``'s command-line-only parse).
        defer_env_errors: keep bad env vars in ``env_errors`` instead of raising (the caller
            reports them with the config file's errors).
        env_sources: after a parse, ``{dest: env var}`` for each value that came from the environment.
        env_errors: after a parse with ``defer_env_errors``, one message per bad env var.
    """

    read_env = True
    defer_env_errors = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.settings: dict[str, Setting] = {}

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        # A value set on the namespace beforehand is kept by argparse unless the flag is given,
        # so the command line wins over the env var, which wins over the default.
        namespace = argparse.Namespace() if namespace is None else namespace
        settings = self.settings.values() if self.read_env else ()
        values, self.env_sources, errors = read_environment(settings, skip=vars(namespace))
        for dest, value in values.items():
            setattr(namespace, dest, value)
        self.env_errors = errors
        if errors and not self.defer_env_errors:  # every bad env var at once
            raise ConfigError("; ".join(errors))
        if "training_script_args" not in {action.dest for action in self._actions}:
            return super().parse_known_args(args, namespace)
        # Only the words up to the training script are the launcher's: argparse would read the
        # script's own "--r=16" as an ambiguous abbreviation of a launcher flag (pytorch#120601).
        args = list(sys.argv[1:] if args is None else args)
        _, script = launcher_flags(args, self, unknown_takes_value=False)
        namespace, extras = super().parse_known_args(args[: script + 1], namespace)
        if script < len(args):
            namespace.training_script_args = args[script + 1 :]
        return namespace, extras


class _EnvAction(argparse.Action):
    """A flag whose default can come from an environment variable (torch's ``argparse_util.env``).

    Attributes:
        env_var: the variable (``PET_<DEST>``, or fsm-agent's own ``FSM_AGENT_*``).
    """

    def __init__(self, option_strings, dest, env_var: str | None = None, **kwargs):
        self.env_var = env_var or f"PET_{dest.upper()}"
        super().__init__(option_strings, dest, **kwargs)


class _EnvStore(_EnvAction):
    """``store`` with a ``PET_<DEST>`` fallback, converted and checked like the command-line value."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)


class _EnvFlag(_EnvAction):
    """``store_true`` with a boolean env fallback (torch's ``check_env``, without its crash on ``true``)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, True)


class _EnvExtend(_EnvAction):
    """Repeatable, comma-splitting flag; the command line adds to the env var's list."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, (*(getattr(namespace, self.dest, None) or ()), *values))


_ACTION_CLASSES: dict[str, type[_EnvAction]] = {"store": _EnvStore, "flag": _EnvFlag, "extend": _EnvExtend}


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """torchrun's ``(default: X)`` after each flag's help, except where the help already says what
    happens by default (``(default: none)``, ``unset: ...``) or there is no value to show
    (None, ``''``, an empty list): never ``(default: none) (default: '')``."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default:" in text or "unset" in text or action.default in (None, "", [], ()):
            return text
        return super()._get_help_string(action)


def _spellings(*names: str) -> list[str]:
    """Every long flag also under its underscored spelling, as torchrun (``--nproc-per-node``/``--nproc_per_node``)."""
    underscored = ["--" + name[2:].replace("-", "_") for name in names if name.startswith("--") and "-" in name[2:]]
    return [*names, *underscored]


def get_run_parser(
    prog: str = "fsm-agent run", options: Iterable[Setting] = (), *, for_config: bool = False
) -> argparse.ArgumentParser:
    """The ``fsm-agent run`` / ``fsmrun`` parser: torchrun 2.13's flags, fsm-agent's own, plugins' options.

    Flag names, dests, defaults and ``PET_<DEST>`` fallbacks equal torchrun's. Values stay
    torchrun-shaped strings (checked here, converted by ``fsm_agent.resolve.config_from_args``). Configuration
    flags also read ``FSM_AGENT_<DEST>`` (before ``PET_<DEST>``).

    Args:
        prog: the program name in messages.
        options: the plugins' options (``fsm_agent_addoption``; ``Setting``s of
            ``settings.plugin_option``), each added as a flag that takes one value.
        for_config: the ``fsm-agent config`` variant: the training script is optional, and
            ``--json``/``--reference`` are added.

    Raises:
        PluginError: a plugin option's flag is already a flag.
    """
    parser = _Parser(
        prog=prog,
        description="Launch and supervise this node's workers: a drop-in replacement for torchrun.",
        epilog="Flags also read the environment variables shown in [env ...], FSM_AGENT_* before PET_*, "
        "then the config file (--config, or [tool.fsm_agent] in ./pyproject.toml); the command "
        "line wins (--disable-plugin adds to the env and file lists). fsm-agent's own flags "
        "are marked 'fsm-agent:'. See docs/configuration.md and 'fsm-agent config'.",
        formatter_class=_HelpFormatter,
    )
    flags = [setting for setting in SETTINGS if setting.dest is not None]
    for setting in flags:  # torchrun's first, then fsm-agent's own: the usage line keeps them apart
        if not setting.own:
            _add_setting(parser, parser, setting)
    own = parser.add_argument_group("fsm-agent options (not in torchrun)")
    for setting in flags:
        if setting.own:
            _add_setting(parser, own, setting)
    options = list(options)
    if options:
        plugins = parser.add_argument_group("plugin options (fsm_agent_addoption)")
        for option in options:
            try:
                _add_setting(parser, plugins, option)
            except argparse.ArgumentError as exc:
                raise PluginError(f"plugin {option.plugin!r} option {option.name!r}: {exc}") from None
    if for_config:
        shown = parser.add_argument_group("fsm-agent config")
        shown.add_argument("--json", action="store_true", help="print JSON instead of a table")
        shown.add_argument(
            "--reference", action="store_true", help="print the reference of every key (docs/configuration.md) and exit"
        )

    # Entrypoint, then everything after it verbatim, even words that look like launcher flags.
    parser.add_argument(
        "training_script",
        nargs="?" if for_config else None,
        default=None,
        help="the training script (or module with -m, binary with --no-python)",
    )
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser


def _add_setting(parser: _Parser, group: Any, setting: Setting) -> None:
    """``setting`` as a flag of ``parser`` (in ``group``), its variables read by the parser's
    environment pass: an ``_EnvAction`` where the flag reads a variable of its own (torchrun's
    ``PET_<DEST>``, an ``FSM_AGENT_*``), else a plain ``store`` as torchrun's.

    Raises:
        argparse.ArgumentError: the flag is already a flag (a plugin option's clash).
    """
    kwargs: dict[str, Any] = {"dest": setting.dest, "default": setting.default, "help": _help(setting)}
    if setting.action != "flag":
        kwargs.update(type=_value_parser(setting), choices=setting.choices, metavar=setting.metavar)
    if setting.torch_env or setting.env is not None:
        kwargs.update(action=_ACTION_CLASSES[setting.action], env_var=setting.env)
    else:
        kwargs.update(action="store_true" if setting.action == "flag" else "store")
    group.add_argument(*_spellings(*setting.flags), **kwargs)
    parser.settings[cast(str, setting.dest)] = setting


def _help(setting: Setting) -> str:
    """The flag's ``--help`` line: whose it is (``fsm-agent:``, the plugin's name; torchrun's
    unmarked), the help, and the variables it reads. A plugin option's default is said here (as
    its ``repr``), the others' by ``_HelpFormatter``."""
    envs = f" [env {', '.join(setting.envs)}]"
    if setting.plugin is None:
        return f"{'fsm-agent: ' if setting.own else ''}{setting.help}{envs}"
    if "default:" in setting.help or "unset" in setting.help:  # the plugin's help says it already
        default = ""
    else:
        default = " (default: unset)" if setting.default in (None, "") else f" (default: {setting.default!r})"
    return f"{setting.plugin}: {setting.help}{default}{envs}"


def _value_parser(setting: Setting) -> Callable[[str], Any] | None:
    """The argparse ``type`` of ``setting``: its ``parse``, a ``Rejected`` value reported as
    ``argument --FLAG: expected ..., got ...``."""
    parse = setting.parse
    if parse is None:
        return None

    def value(raw: str) -> Any:
        try:
            return parse(raw)
        except Rejected as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    value.__name__ = getattr(parse, "__name__", "value")  # argparse's "invalid int value: 'x'"
    return value


def cli_given(
    argv: Sequence[str], prog: str = "fsm-agent run", options: Iterable[Setting] = (), *, for_config: bool = False
) -> set[str]:
    """The dests set on the command line itself: ``argv`` parsed without env vars or defaults."""
    parser = get_run_parser(prog, options, for_config=for_config)
    parser.read_env = False  # type: ignore[attr-defined]
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(list(argv))))


def prescan(argv: Sequence[str], parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    """``--config`` and ``--disable-plugin`` values among the flags before the training script.

    Needed before the real parse: they decide which plugins load, hence which flags exist.
    An unknown flag is a plugin option's, which always takes one value.
    """
    found: dict[str, list[str]] = {"config": [], "disabled_plugins": []}
    flags, _ = launcher_flags(argv, parser, unknown_takes_value=True)
    for action, value in flags:
        if action is not None and action.dest in found and value is not None:
            found[action.dest].append(value)
    return found


def launcher_flags(
    argv: Sequence[str],
    parser: argparse.ArgumentParser,
    *,
    unknown_takes_value: bool,
) -> tuple[list[tuple[argparse.Action | None, str | None]], int]:
    """Walk the launcher's flags as argparse does (known flags by their arity, abbreviations included).

    Returns:
        ([(action or None when unknown or ambiguous, value or None)], index of the training script
        in ``argv``, or ``len(argv)`` when there is none). What follows the script is the script's.
    """
    strings = parser._option_string_actions
    flags: list[tuple[argparse.Action | None, str | None]] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return flags, i + 1
        if not token.startswith("-") or token == "-":
            return flags, i  # the training script: what follows is its own
        name, eq, value = token.partition("=")
        if not name.startswith("--"):  # -r 3, -r3, -m
            action = strings.get(token[:2])
            takes_value = action is not None and action.nargs != 0 and len(token) == 2
            value = token[2:] or None
        else:
            matches = {a for s, a in strings.items() if s == name} or {
                a for s, a in strings.items() if s.startswith(name)
            }
            action = next(iter(matches)) if len(matches) == 1 else None
            takes_value = (unknown_takes_value if not matches else action is None or action.nargs != 0) and not eq
        if takes_value:
            value, i = (argv[i + 1] if i + 1 < len(argv) else None), i + 2
        else:
            value, i = (value if eq or not name.startswith("--") else None), i + 1
        flags.append((action, value))
    return flags, len(argv)
