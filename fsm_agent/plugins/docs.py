"""Render ``docs/plugins.md``, the plugin author's guide, from the code it describes.

The hook reference comes from ``fsm_agent.plugins.hookspecs`` (signatures and docstrings), the
built-in plugins table from ``BUILTIN_PLUGINS`` (the same rows ``fsm-agent plugins`` prints), the
conformance checklist from ``fsm_agent/testing/conformance.py`` (read with ``ast``, so rendering
needs no pytest) and the plugin-option rules from ``OptionRegistry.add``. Regenerate with::

    python -m fsm_agent.plugins.docs > docs/plugins.md

``tests/plugins/test_plugins_doc.py`` fails, naming that command, when the file is out of date,
and runs the example plugin and its tests below.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from fsm_agent.plugins.hookspec_info import args_entries, docstring_sections, hookspec_groups, signature, spec_options

REGENERATE_COMMAND = "python -m fsm_agent.plugins.docs > docs/plugins.md"

# ------------------------------------------------------------------------------------------------
# The example plugin: real files in docs/examples/fsm-agent-printmetrics, quoted here.
# tests/plugins/test_plugins_doc.py runs their tests with pytest and installs the distribution,
# so what the guide shows is known to work.
# ------------------------------------------------------------------------------------------------

EXAMPLE_DIR = Path(__file__).resolve().parents[2] / "docs" / "examples" / "fsm-agent-printmetrics"
EXAMPLE_FILES = {
    "module": "fsm_agent_printmetrics.py",
    "pyproject": "pyproject.toml",
    "test": "tests/test_printmetrics.py",
}


def example_lines(which: str) -> list[str]:
    """The lines of one file of the example plugin (``module``, ``pyproject`` or ``test``), or of the
    example attribution rule (``attribution_rule``: its code, without the module docstring).

    Raises:
        FileNotFoundError: not run from a source checkout (the example is not installed).
    """
    if which == "attribution_rule":
        text = (EXAMPLE_DIR.parent / "attribution_rule.py").read_text(encoding="utf-8")
        return text.split('"""', 2)[2].strip("\n").splitlines()
    return (EXAMPLE_DIR / EXAMPLE_FILES[which]).read_text(encoding="utf-8").rstrip("\n").splitlines()


# ------------------------------------------------------------------------------------------------
# Reading the code
# ------------------------------------------------------------------------------------------------


def md(text: str) -> str:
    """reST inline literals (````x````) as Markdown code spans, whitespace folded."""
    return re.sub(r"``(.+?)``", r"`\1`", " ".join(text.split()))


def cell(text: str) -> str:
    return md(text).replace("|", "\\|")


def first_sentence(text: str) -> str:
    text = md(text)
    match = re.match(r"(.+?[.;])(\s|$)", text)
    return match.group(1).rstrip(".;") if match else text


def builtin_rows() -> list[dict]:
    """The rows ``fsm-agent plugins`` prints for the built-ins alone, independent of the environment:
    no entry points, no ``FSM_AGENT_DISABLE_PLUGINS``, and without the backends the torchrun bridge
    would find installed."""
    import pluggy

    from fsm_agent.plugins import PROJECT_NAME, hookspecs
    from fsm_agent.plugins.manager import BUILTIN_PLUGINS, plugin_rows
    from fsm_agent.plugins.registry import BackendRegistry

    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    for name, module_name in BUILTIN_PLUGINS.items():
        pm.register(importlib.import_module(module_name), name)
    registry = BackendRegistry()
    for impl in pm.hook.fsm_agent_register_backends.get_hookimpls():
        if impl.plugin_name != "rendezvous-torchrun-handlers":
            registry.current_plugin = impl.plugin_name
            impl.function(registry=registry)
    return plugin_rows(pm, registry)


def conformance_outline() -> dict[str, dict]:
    """``{suite class: {"capabilities": {attr: default}, "tests": {name: first docstring line}}}``,
    read from fsm_agent/testing/conformance.py without importing it ({} when it is absent)."""
    spec = importlib.util.find_spec("fsm_agent.testing.conformance")
    if spec is None or not spec.origin:
        return {}
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    suites: dict[str, dict] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name.endswith("Conformance"):
            capabilities, tests = {}, {}
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.value is not None:
                    capabilities[item.target.id] = ast.unparse(item.value)
                elif isinstance(item, ast.FunctionDef) and item.name.startswith("test_"):
                    doc = ast.get_docstring(item) or ""
                    tests[item.name] = doc.strip().splitlines()[0] if doc.strip() else ""
                elif isinstance(item, ast.FunctionDef) and item.name.startswith("make_"):
                    capabilities.setdefault(
                        "__factory__", f"{item.name}({', '.join(a.arg for a in item.args.args[1:])})"
                    )
            suites[node.name] = {"capabilities": capabilities, "tests": tests, "doc": ast.get_docstring(node) or ""}
    return suites


# ------------------------------------------------------------------------------------------------
# Rendering
# ------------------------------------------------------------------------------------------------


def render_hook(func: Callable) -> list[str]:
    from fsm_agent.plugins.listeners import LISTENER_HOOKS

    found = docstring_sections(func.__doc__)
    opts = spec_options(func)
    lines = [f"#### `{func.__name__}`", "", "```python", signature(func), "```", "", md(found[""]), ""]
    args = args_entries(found.get("Args", ""))
    if args:
        lines += ["| Argument | |", "|---|---|"]
        lines += [f"| `{name}` | {cell(text)} |" for name, text in args.items()]
        lines.append("")
    lines += [
        f"**Returns:** {md(found.get('Returns', 'Nothing.'))}",
        "",
        f"**When it fires:** {md(found.get('Called from', ''))}",
        "",
    ]
    notes = []
    if opts.get("firstresult"):
        notes.append(
            "first result wins: implementations are called until one returns something other than "
            "None (order them with `tryfirst`/`trylast`)"
        )
    if func.__name__ in LISTENER_HOOKS:
        notes.append(
            "listener: each implementation is called on its own, so one that raises is logged and the "
            "others still run; `wrapper=True` implementations are refused"
        )
    if opts.get("historic"):
        notes.append("historic: a plugin registered later still receives the earlier calls")
    if notes:
        lines += ["**Dispatch:** " + "; ".join(notes) + ".", ""]
    return lines


def render_hooks() -> list[str]:
    from fsm_agent.plugins.listeners import LISTENER_HOOKS

    specs = hookspec_groups()
    lines = [
        "## Every hook",
        "",
        "Generated from [`fsm_agent/plugins/hookspecs.py`](../fsm_agent/plugins/hookspecs.py), grouped by "
        "kind in lifecycle order. An implementation may accept any subset of a hook's arguments, by name "
        "(pluggy passes only those it asks for). Setup hooks run once per process, one plugin at a time; "
        "an unexpected exception there stops the agent with one line naming the plugin.",
        "",
        "| Hook | Group | Dispatch | When it fires |",
        "|---|---|---|---|",
    ]
    for title, func in specs:
        found = docstring_sections(func.__doc__)
        opts = spec_options(func)
        dispatch = (
            "first result"
            if opts.get("firstresult")
            else "listener"
            if func.__name__ in LISTENER_HOOKS
            else "every plugin"
        )
        lines.append(
            f"| [`{func.__name__}`](#{func.__name__}) | {cell(title.split(':')[0])} | {dispatch} | "
            f"{cell(first_sentence(found.get('Called from', '')))} |"
        )
    lines.append("")
    current = None
    for title, func in specs:
        if title != current:
            current = title
            lines += [f"### {md(title[:1].upper() + title[1:])}", ""]
        lines += render_hook(func)
    return lines


def render_builtins() -> list[str]:
    from fsm_agent.plugins.manager import BUILTIN_PLUGINS, ESSENTIAL_PLUGINS

    lines = [
        "## Built-in plugins",
        "",
        "fsm-agent's own backends and listeners are plugins too, registered by name before the entry "
        "points (generated from `BUILTIN_PLUGINS` in "
        "[`fsm_agent/plugins/manager.py`](../fsm_agent/plugins/manager.py); `fsm-agent plugins` lists "
        "them with the installed ones). Any of them can be disabled by name except the essential "
        f"{', '.join(f'`{n}`' for n in sorted(ESSENTIAL_PLUGINS))}.",
        "",
        "| Plugin | Kinds | Backends | Hooks | What it does |",
        "|---|---|---|---|---|",
    ]
    for row in builtin_rows():
        module = importlib.import_module(BUILTIN_PLUGINS[row["name"]])
        summary = (module.__doc__ or "").strip().splitlines()[0] if (module.__doc__ or "").strip() else ""
        summary = re.sub(r"^Built-in [^:]*:\s*", "", summary)
        backends = ", ".join(f"`{b}`" for names in row["backends"].values() for b in names)
        if row["name"] == "rendezvous-torchrun-handlers":
            backends = "one per `torchrun.handlers` entry point"
        essential = " (essential)" if row["name"] in ESSENTIAL_PLUGINS else ""
        lines.append(
            f"| `{row['name']}`{essential} | {', '.join(row['kinds'])} | {backends or '-'} | "
            f"{', '.join(h.removeprefix('fsm_agent_') for h in row['hooks'])} | {cell(summary)} |"
        )
    lines.append("")
    return lines


def render_option_reference() -> list[str]:
    from fsm_agent.config import OptionRegistry

    found = docstring_sections(OptionRegistry.add.__doc__ or "")
    params = [p for p in inspect.signature(OptionRegistry.add).parameters.values() if p.name != "self"]
    lines = [
        "`options.add(...)` ([`OptionRegistry.add`](../fsm_agent/config.py)) takes:",
        "",
        "| Parameter | Default | |",
        "|---|---|---|",
    ]
    entries = args_entries(found.get("Args", ""))
    for p in params:
        default = (
            "required"
            if p.default is inspect.Parameter.empty
            else f"`{getattr(p.default, '__name__', repr(p.default))}`"
        )
        lines.append(f"| `{p.name}` | {default} | {cell(entries.get(p.name, ''))} |")
    lines += ["", f"**Raises:** {md(found.get('Raises', ''))}", ""]
    return lines


def render_conformance() -> list[str]:
    suites = conformance_outline()
    if not suites:
        return []
    lines = [
        "### Conformance suites for backends",
        "",
        "A plugin that contributes a rendezvous backend or a launcher subclasses the matching suite "
        "of `fsm_agent.testing.conformance` in its own tests and supplies its implementation; every test "
        "of the suite then runs against it, with real stores and real processes on 127.0.0.1 (the "
        "built-ins pass them, in `tests/plugins/test_builtin_backends.py`). The suites do not start with `Test`, so pytest "
        "collects only your subclass. Capability flags switch off what a backend legitimately does not "
        "do; override a test (and mark it `xfail`) to record a known gap.",
        "",
        "```python",
        "from fsm_agent.testing.conformance import LauncherConformance, RendezvousConformance",
        "",
        "",
        "class TestMyRendezvous(RendezvousConformance):",
        "    elastic = False  # a fixed world of nodes",
        "",
        "    def make_handler(self, setup, node):  # setup: run_id, endpoint, min/max_nodes, join_timeout, ...",
        "        return create_my_handler(setup, is_host=(node == 0))",
        "",
        "",
        "class TestMyLauncher(LauncherConformance):",
        "    def make_launcher(self):",
        "        return MyLauncher()",
        "```",
        "",
    ]
    for suite, outline in suites.items():
        capabilities = {k: v for k, v in outline["capabilities"].items() if k != "__factory__"}
        factory = outline["capabilities"].get("__factory__", "")
        lines += [
            f"`{suite}`: implement `{factory}`; capability flags "
            + ", ".join(f"`{k} = {v}`" for k, v in capabilities.items())
            + ". It checks:",
            "",
        ]
        lines += [f"- `{name}`" + (f": {md(doc)}" if doc else "") for name, doc in outline["tests"].items()]
        lines.append("")
    return lines


def render_optional_members() -> list[str]:
    """The optional members of a rendezvous handler and of a launcher (``fsm_agent.plugins.protocols``)."""
    from fsm_agent.plugins.protocols import LAUNCHER_OPTIONAL, RENDEZVOUS_OPTIONAL

    lines: list[str] = []
    for title, members in (("rendezvous handler", RENDEZVOUS_OPTIONAL), ("launcher", LAUNCHER_OPTIONAL)):
        lines += [
            f"Optional members of a {title}:",
            "",
            "| member | when absent | meaning | torch |",
            "|---|---|---|---|",
        ]
        for m in members:
            lines.append(
                f"| `{cell(m.signature)}` | {cell(m.default)} | {cell(m.meaning)} | {cell(m.torch) if m.torch else '—'} |"
            )
        lines.append("")
    return lines


def render() -> str:
    from fsm_agent.plugins import ENTRY_POINT_GROUP
    from fsm_agent.plugins.manager import DISABLE_ENV, PLUGIN_KINDS

    lines = [
        "# Writing fsm-agent plugins",
        "",
        f"<!-- Generated by `{REGENERATE_COMMAND}`; do not edit by hand.",
        "     tests/plugins/test_plugins_doc.py fails when it is out of date, and runs the example below. -->",
        "",
        "fsm-agent is a torchrun whose worker-group lifecycle is a statechart "
        "([docs/statechart.md](statechart.md)); every transition dispatches [pluggy](https://pluggy.readthedocs.io) "
        f"hooks to plugins. A plugin is a module (or any object) with `@hookimpl` functions, shipped in a "
        f"distribution that names it in the entry-point group `{ENTRY_POINT_GROUP}`. fsm-agent's own backends "
        "and listeners are plugins of the same kind, registered through the same call.",
        "",
        "## Kinds of plugin",
        "",
        "| Kind | What it contributes | Used when |",
        "|---|---|---|",
        "| rendezvous | a named rendezvous backend (`registry.add_rendezvous(name, creator)`) | `--rdzv-backend NAME` |",
        "| launcher | a named launcher (`registry.add_launcher(name, factory)`) | `--launcher NAME` |",
        "| scheduler | a batch scheduler's job-step defaults (`fsm_agent_discover_job`) | `--scheduler auto` "
        "(inside that scheduler's job step) or `--scheduler NAME` |",
        "| metrics | a sink for `fsm_agent_put_metric` | always: every metric |",
        "| event recording | a sink for `fsm_agent_record_event` | always: every event |",
        "| lifecycle | anything else: options, configuration, state changes, worker env, restart policy | always |",
        "",
        "Backends (rendezvous, launcher) are selected by name: a plugin registers factories and the agent "
        "uses the one the flags name. Listeners (metrics, events, lifecycle) are all called. "
        f"`fsm-agent plugins` shows each plugin's kinds ({', '.join(PLUGIN_KINDS)}), derived from its hooks and "
        "the backends it registered; a plugin whose listener is registered later, in `fsm_agent_configure` (as "
        'the example below does), declares them with a module attribute `FSM_AGENT_KINDS = ("metrics",)`.',
        "",
        "## Write one",
        "",
        "A metrics plugin with an option. Its listener is an object registered for the run in "
        "`fsm_agent_configure` (so it can hold per-run state); a plugin may just as well implement "
        "`fsm_agent_put_metric` at module level.",
        "",
        "```python",
        "# fsm_agent_printmetrics.py",
        *example_lines("module"),
        "```",
        "",
        "Rules that keep a plugin well-behaved:",
        "",
        "- Mark every hook implementation with `@hookimpl` (`from fsm_agent.plugins import hookimpl`); an unmarked "
        "function is ignored, and a marked one whose name is not a hook of the list below (a typo) or that asks "
        "for an argument the hook does not have is refused when the plugin loads (`PluginError`, one line).",
        "- Listener hooks must be fast and must not block: they run in the agent's loop. Their exceptions are "
        "logged and do not stop the other listeners or the run.",
        "- A backend registers a factory; nothing heavy (or torch) should be imported at module level, so that "
        "`fsm-agent --help`, `fsm-agent plugins` and runs that use other backends stay fast.",
        "- Errors meant for the user raise `fsm_agent.errors.ConfigError` or `PluginError` with a message that "
        "names the input and the fix: the CLI prints it as one line and exits non-zero, never a traceback.",
        "- A rendezvous `creator(params)` takes torch's `RendezvousParameters` and returns a torch "
        "`RendezvousHandler`; a launcher factory returns an object with the subprocess launcher's interface. "
        "Beyond those, the optional members below are what the agent uses when present (the tables are "
        "rendered from `fsm_agent/plugins/protocols.py`, where the agent reads them through one adapter per "
        "kind; the conformance suites check each one a backend has against its kind). A backend built on "
        "torch's `DynamicRendezvousHandler` gets `num_nodes_lost`, `leave` and `use_agent_store` (False) by "
        "returning `FreshStoreHandler(handler, backend)` from `fsm_agent.plugins.rendezvous_c10d`, as `etcd-v3` does.",
        "",
        *render_optional_members(),
        "## A scheduler plugin (LSF, PBS, a cloud batch service)",
        "",
        "A scheduler plugin reads the variables its scheduler gives a job step and answers "
        "`fsm_agent_discover_job(environ, scheduler)` with a `fsm_agent.scheduler.DiscoveredJob`: the "
        "configuration keys it found (`nnodes`, `nproc_per_node`, `rendezvous.endpoint`, `rendezvous.run_id`, "
        "`rendezvous.node_rank`, `rendezvous.backend`) and the variable each came from. They only fill keys the "
        "user left unset, and `fsm-agent config` shows them with the plugin's `scheduler` name as their source. "
        "Answer None outside your scheduler's job steps (`--scheduler auto` asks every plugin); raise "
        "`ConfigError` when `scheduler` is your name and this is not one of your job steps. The built-in "
        "`scheduler-slurm` (`fsm_agent/plugins/scheduler_slurm.py`) is the worked example; "
        "[docs/schedulers.md](schedulers.md) says what it discovers from where.",
        "",
        "```python",
        "from fsm_agent.plugins import hookimpl",
        "from fsm_agent.scheduler import DiscoveredJob",
        "",
        "@hookimpl",
        "def fsm_agent_discover_job(environ, scheduler):",
        '    if scheduler not in ("auto", "lsf") or "LSB_JOBID" not in environ:',
        "        return None  # (with --scheduler lsf outside a job: raise ConfigError instead)",
        '    hosts = environ["LSB_HOSTS"].split()',
        "    return DiscoveredJob(",
        '        scheduler="lsf", hosts=tuple(dict.fromkeys(hosts)),',
        '        values={"nnodes": len(set(hosts)), "rendezvous.endpoint": f"{hosts[0]}:29400",',
        '                "rendezvous.backend": "fsm", "rendezvous.run_id": f"lsf-{environ[\'LSB_JOBID\']}"},',
        '        origins={"nnodes": "LSB_HOSTS", "rendezvous.endpoint": "LSB_HOSTS",',
        '                 "rendezvous.run_id": "LSB_JOBID"})',
        "```",
        "",
        "## A rule for the root-cause attribution",
        "",
        "When a job fails, the agents decide one verdict for the whole job: the root-cause rank and a class for "
        "every other failed rank (`collateral`: it failed because a peer did; `own`; `unknown`), "
        "[failure-handling.md](failure-handling.md#root-cause-the-jobs-verdict) says how. Each failed rank's "
        "`FailureReport` (exit code or signal, time, error message, traceback or stderr tail, a hung rank's "
        "stacks) is asked `fsm_agent_classify_failure(report)`; the first answer that is not None wins, and the "
        "built-in `attribution` plugin answers last. A site that knows its own failure modes adds a rule; this "
        "one (`docs/examples/attribution_rule.py`, which `tests/plugins/test_attribution_rule.py` runs) moves "
        'the blame off its training wrapper\'s "a peer went away" exit code:',
        "",
        "```python",
        *example_lines("attribution_rule"),
        "```",
        "",
        "A rule must be deterministic (it sees only the report): `fsm-agent replay` asks it again on the reports "
        "the events file recorded and names a verdict that came out differently.",
        "",
        "## Options",
        "",
        "Options are declared in `fsm_agent_addoption` and read back with `config.plugin_options(NAME)` in "
        "`fsm_agent_configure`. Option `prefix` of plugin `printmetrics` above is the flag `--printmetrics-prefix`, "
        "the environment variable `FSM_AGENT_PRINTMETRICS_PREFIX` and the key `prefix` of the "
        "`[plugins.printmetrics]` table of the configuration file, with the precedence of every other setting "
        "(flag > `FSM_AGENT_*` > file > default); `fsm-agent config` shows where each value came from and "
        "`fsm-agent run --help` lists the options of the installed plugins. The whole configuration reference, "
        "the built-in plugins' options included, is [docs/configuration.md](configuration.md#plugin-options).",
        "",
        *render_option_reference(),
        "## Package it",
        "",
        "```toml",
        "# pyproject.toml",
        *example_lines("pyproject"),
        "```",
        "",
        f"The entry-point name (`printmetrics`) is the plugin's name: `--disable-plugin printmetrics` (or "
        f"`{DISABLE_ENV}=printmetrics`, or `disabled_plugins` in the configuration file) keeps it from loading, "
        "its options are prefixed with it, and `fsm-agent plugins` lists it with its distribution and version. "
        "Its value is a module or an object (`module:attribute`). After `pip install .`, check it:",
        "",
        "```console",
        "$ fsm-agent plugins | grep printmetrics",
        "$ fsm-agent run --help | grep printmetrics",
        "```",
        "",
        "A plugin that fails to import (a missing dependency, a syntax error) or whose setup hook raises stops "
        "every `fsm-agent` command with one line naming the plugin, its distribution and the cause, and a non-zero "
        "exit; `--disable-plugin NAME` is the way out until it is fixed. Two plugins that register the same backend "
        "name, option, flag or environment variable are refused the same way, naming both; so is a name to "
        "disable that no installed plugin has (a typo), with the known names.",
        "",
        "## Test it",
        "",
        "fsm-agent installs a pytest plugin (`fsm_agent.testing`, through the `pytest11` entry point), so a plugin's "
        "tests get these fixtures with no conftest: `make_agent` builds the real `ElasticAgent` with real hook "
        "dispatch on a fake rendezvous and a fake launcher (no processes, milliseconds per test), "
        "`hook_recorder` records every hook call, `plugin_manager` is the manager they use (built-ins, no entry "
        "points; override the fixture to change that). `Scenario` scripts a run as a story and checks its trace "
        "of transitions:",
        "",
        "```python",
        "# tests/test_printmetrics.py",
        *example_lines("test"),
        "```",
        "",
        "The rest of the kit (`FakeRendezvous`, `FakeLauncher`, `HookRecorder.assert_sequence`, "
        "`pytest --statechart-coverage`) is described in the docstrings of `fsm_agent.testing`. For the real "
        "thing, start `fsm-agent run` in a subprocess with your plugin installed (or on `PYTHONPATH` with its "
        "`.dist-info`: `pip install --no-deps --target DIR .`), as the plugins in `plugins/` do.",
        "",
        *render_conformance(),
        "## Publish it",
        "",
        "- Name the distribution `fsm-agent-<name>` and the entry point `<name>`; depend on `fsm-agent` with the "
        "range of versions you test against. An implementation receives only the arguments it names, so a hook "
        "that gains an argument does not break it.",
        "- Keep the tests in the distribution (`[project.optional-dependencies] test`) and run them in CI against "
        "the lowest and the newest supported fsm-agent.",
        "- Build and upload as any Python package: `python -m build` then `twine upload dist/*`.",
        "- `plugins/` in this repository holds complete examples, each installable on its own, among them "
        "`fsm-agent-prometheus` (metrics over HTTP), `fsm-agent-etcd` (a rendezvous backend) and "
        "`fsm-agent-otel` (OpenTelemetry spans for states).",
        "",
        "## torchrun's plugins keep working",
        "",
        "torchrun has two entry-point groups of its own, and fsm-agent reads both, so a distribution written for "
        "torchrun works unchanged:",
        "",
        "- **`torchrun.handlers`**: each entry point is called with no arguments and returns a "
        "`creator(RendezvousParameters) -> RendezvousHandler`, as torch's "
        "`rendezvous/registry.py:_register_out_of_tree_handlers` does. The built-in plugin "
        "`rendezvous-torchrun-handlers` registers each as a rendezvous backend under the entry point's name, after "
        "every other plugin (a name fsm-agent or an `fsm_agent` plugin already provides keeps that one), so "
        "`--rdzv-backend NAME` selects it. `--rdzv-conf k=v,...` reaches the handler as `params.get(k)`. Where "
        "torch logs a warning and carries on when such an entry point fails to load, fsm-agent stops with one "
        "line naming it; `--disable-plugin rendezvous-torchrun-handlers` ignores the whole group.",
        "- **`torchrun.logs_specs`**: `--logs-specs NAME` (or `FSM_AGENT_LOGS_SPECS`, or `logs_specs` in the "
        "`[logs]` table) loads the entry point, a subclass of torch's `LogsSpecs`, builds it with "
        "`(log_dir, redirects, tee, local_ranks_filter)` as torchrun does and calls `reify(envs)` at every "
        "attempt (each local rank's `TORCHELASTIC_RUN_ID` and `TORCHELASTIC_RESTART_COUNT`); the files of the "
        "returned `LogsDest` are where the workers' streams, error files and filtered output go, and the "
        "events file goes to its `root_log_dir`. An unknown name is one line listing the installed ones.",
        "",
        "`tests/fixtures/torchrun-compat-plugin` is such a distribution, and "
        "`tests/plugins/test_torchrun_entry_points.py` runs it under fsm-agent and under torchrun with real workers.",
        "",
        *render_builtins(),
        *render_hooks(),
    ]
    while lines and lines[-1] == "":
        lines.pop()
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Print docs/plugins.md (``python -m fsm_agent.plugins.docs > docs/plugins.md``)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m fsm_agent.plugins.docs", description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
