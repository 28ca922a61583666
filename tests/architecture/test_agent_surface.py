"""What plugins read of the agent is a documented, read-only surface: properties with docstrings
(the agent alone changes them), read as attributes, never guessed at with ``getattr``."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from fsm_agent.agent import ElasticAgent

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
#: What the built-in and packaged plugins read of the agent besides its torch-named API.
READ_BY_PLUGINS = ("hostname", "events_path", "standby", "cycles", "step_times", "drain", "drain_request")


@pytest.mark.parametrize("name", READ_BY_PLUGINS)
def test_a_read_only_property_with_a_docstring(name):
    member = inspect.getattr_static(ElasticAgent, name)  # on PluginSurface, ElasticAgent's base
    assert isinstance(member, property), f"ElasticAgent.{name} is not a property"
    assert member.fset is None and member.fdel is None, f"ElasticAgent.{name} can be set from outside"
    assert member.__doc__ and member.__doc__.strip(), f"ElasticAgent.{name} has no docstring"


def _getattr_reads(path: Path) -> list[str]:
    """``getattr(agent, "NAME", ...)`` of a surface NAME, in one module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
        ):
            continue
        owner, *rest = node.args
        name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
        if (
            name in ("agent", "_agent")
            and rest
            and isinstance(rest[0], ast.Constant)
            and rest[0].value in READ_BY_PLUGINS
        ):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.func.id}(agent, {rest[0].value!r})")
    return found


def test_plugins_read_the_surface_as_attributes():
    modules = [*(ROOT / "fsm_agent" / "plugins").rglob("*.py"), *ROOT.glob("plugins/*/src/**/*.py")]
    assert [hit for module in modules for hit in _getattr_reads(module)] == []


def test_the_agent_changes_them_and_plugins_see_the_change(make_agent):
    agent = make_agent()
    try:
        agent.report_step_times({"median_s": 0.5, "ranks": []})
        assert agent.step_times == {"median_s": 0.5, "ranks": []}
        with pytest.raises(TypeError):
            agent.step_times["median_s"] = 1.0  # type: ignore[index]
        agent.report_step_times(None)
        assert agent.step_times is None
        assert agent.cycles == () and agent.drain is None and agent.standby is None and agent.hostname
    finally:
        agent.close()


def test_the_agent_reads_backend_extras_only_through_the_protocol_adapters():
    """The optional members of a rendezvous handler or a launcher (``fsm_agent/plugins/protocols.py``)
    are read through ``RendezvousAdapter``/``LauncherAdapter``: no ``getattr``/``hasattr`` on the
    handler or the launcher in agent.py, and every declared member has its adapter accessor."""
    from fsm_agent.plugins.protocols import LAUNCHER_OPTIONAL, RENDEZVOUS_OPTIONAL, LauncherAdapter, RendezvousAdapter

    backends = {"_rdzv_handler", "rdzv_handler", "_launcher", "launcher", "handler"}
    probes = []
    for node in ast.walk(ast.parse((ROOT / "fsm_agent" / "agent.py").read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            owner = node.args[0]
            name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
            if name in backends:
                probes.append(f"agent.py:{node.lineno} {node.func.id}({name}, ...)")
    assert probes == []
    for adapter, members in ((RendezvousAdapter, RENDEZVOUS_OPTIONAL), (LauncherAdapter, LAUNCHER_OPTIONAL)):
        for member in members:
            accessor = "set_on_standby" if member.kind == "callback" else member.name
            assert accessor in vars(adapter), f"{adapter.__name__} has no accessor for {member.name}"
