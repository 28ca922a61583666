"""HookRecorder: every fsm-agent hook call, in order, with its arguments, split per transition.

Two sources feed it, so that each hook call is recorded exactly once:

- ``pm.add_hookcall_monitoring`` (what pytest's ``pytester.HookRecorder`` uses) sees the hooks
  the agent calls through pluggy (``fsm_agent_configure``, ``fsm_agent_worker_env``).
- The agent calls listener hooks (``fsm_agent_state_changed``, ``fsm_agent_put_metric``, ...)
  implementation by implementation, so that one failing listener cannot silence the others;
  those calls never pass through pluggy's hook caller, so monitoring cannot see them. A spy
  plugin implementing every hookspec (``tryfirst``) records them; while a monitored call of
  the same hook is in progress the spy stays silent.

``attach(agent)`` additionally marks where each transition's hooks end (a ``finalize_event``
callback on the agent's machine), so ``transition_hooks(i)`` gives the exact hooks of the
i-th transition: everything after the previous transition ended (observations such as
``fsm_agent_worker_exited`` included) up to this transition's own listeners.
"""

from __future__ import annotations

import difflib
import inspect
import types
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import pluggy

__all__ = ["HookCall", "HookRecorder", "TransitionHooks", "HOOK_PREFIX", "SPY_PLUGIN_NAME"]

HOOK_PREFIX = "fsm_agent_"
SPY_PLUGIN_NAME = "fsm-agent-testing-hook-recorder"


def full_name(name: str) -> str:
    """``"state_changed"`` -> ``"fsm_agent_state_changed"``; full names pass through."""
    return name if name.startswith(HOOK_PREFIX) else HOOK_PREFIX + name


def expand(names: Iterable[str]) -> list[str]:
    """Full hook names; ``"put_metric*3"`` stands for three ``fsm_agent_put_metric`` in a row."""
    result = []
    for item in names:
        name, _, count = item.partition("*")
        result.extend([full_name(name.strip())] * (int(count) if count else 1))
    return result


@attrs.frozen
class HookCall:
    """One hook call: the hook's full name and the keyword arguments it was called with."""

    name: str
    kwargs: dict[str, Any]

    @property
    def short(self) -> str:
        return self.name.removeprefix(HOOK_PREFIX)

    def __getitem__(self, key: str) -> Any:
        return self.kwargs[key]


@attrs.frozen
class TransitionHooks:
    """The hooks of one transition.

    Attributes:
        index: position in ``agent.transitions``.
        transition: the TransitionRecord.
        label: ``"SOURCE->DEST"``.
        calls: the HookCalls, in order.
    """

    index: int
    transition: Any
    label: str
    calls: tuple[HookCall, ...]

    def names(self, ignore: Iterable[str] = ()) -> list[str]:
        skip = set(expand(ignore))
        return [c.name for c in self.calls if c.name not in skip]


def _spy_function(name: str, spec_function: Any, argnames: Sequence[str], record) -> Any:
    """An implementation of hook ``name`` that takes every argument of its spec and records the call.

    pluggy learns which arguments to pass from the implementation: 1.6 reads ``__signature__``,
    1.7 unwraps ``__wrapped__`` and reads the code's argument names, so the spy carries both
    (``__wrapped__`` is the hookspec function itself, which has exactly the spec's arguments).
    """

    def spy(*args: Any, **kwargs: Any) -> None:
        record(name, {**dict(zip(argnames, args)), **kwargs})

    spy.__signature__ = inspect.Signature(
        [inspect.Parameter(a, inspect.Parameter.POSITIONAL_OR_KEYWORD) for a in argnames]
    )
    spy.__wrapped__ = spec_function
    spy.__name__ = spy.__qualname__ = name  # no "." in the qualname: pluggy keeps the first argument
    return spy


class HookRecorder:
    """Records every hook call of ``plugin_manager``.

    Args:
        plugin_manager: the agent's PluginManager (register the recorder before the agent is
            built to see ``fsm_agent_configure``).

    Use ``close()`` (or ``with HookRecorder(pm) as rec:``) to stop recording.
    """

    def __init__(self, plugin_manager: pluggy.PluginManager):
        self.plugin_manager = plugin_manager
        self._calls: list[HookCall] = []
        self._monitored: list[str] = []  # hooks being called through pluggy right now
        self._undo = plugin_manager.add_hookcall_monitoring(self._before, self._after)
        self._spy = self._make_spy(plugin_manager)
        plugin_manager.register(self._spy, name=SPY_PLUGIN_NAME)
        self._agent: Any = None
        self._setup_end = 0
        self._ends: dict[int, int] = {}  # transitions count -> call index where that transition's hooks end

    # -- recording ---------------------------------------------------------------------------------
    def _before(self, hook_name: str, hook_impls, kwargs) -> None:
        self._monitored.append(hook_name)
        self._calls.append(HookCall(hook_name, dict(kwargs)))

    def _after(self, outcome, hook_name: str, hook_impls, kwargs) -> None:
        self._monitored.pop()

    def _from_spy(self, hook_name: str, kwargs: dict[str, Any]) -> None:
        if self._monitored and self._monitored[-1] == hook_name:
            return  # a monitored call: already recorded by _before
        self._calls.append(HookCall(hook_name, kwargs))

    def _make_spy(self, pm: pluggy.PluginManager) -> Any:
        mark = pluggy.HookimplMarker(pm.project_name)
        spy = types.SimpleNamespace()
        for name, caller in vars(pm.hook).items():
            if isinstance(caller, pluggy.HookCaller) and caller.spec is not None:
                setattr(
                    spy,
                    name,
                    mark(tryfirst=True)(
                        _spy_function(name, caller.spec.function, caller.spec.argnames, self._from_spy)
                    ),
                )
        return spy

    def attach(self, agent: Any) -> HookRecorder:
        """Follow ``agent``'s transitions so that hooks can be split per transition.

        The calls recorded so far (construction: ``fsm_agent_configure``) become ``"setup"``.
        """
        self._agent = agent
        self._setup_end = len(self._calls)
        self._ends = {}
        agent.machine.finalize_event.append(self._on_finalize)
        return self

    def _on_finalize(self, event_data) -> None:
        count = len(self._agent.transitions)
        if count and count not in self._ends:
            self._ends[count] = len(self._calls)

    def close(self) -> None:
        """Stop recording (the calls recorded so far stay available)."""
        if self._undo is not None:
            self._undo()
            self._undo = None
        if self.plugin_manager.is_registered(self._spy):
            self.plugin_manager.unregister(self._spy)
        if self._agent is not None and self._on_finalize in self._agent.machine.finalize_event:
            self._agent.machine.finalize_event.remove(self._on_finalize)

    def __enter__(self) -> HookRecorder:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def clear(self) -> None:
        self._calls.clear()
        self._setup_end, self._ends = 0, {}

    # -- queries ---------------------------------------------------------------------------------
    def calls(self, name: str | None = None) -> list[HookCall]:
        """Every recorded call, or those of hook ``name`` (short or full name)."""
        if name is None:
            return list(self._calls)
        name = full_name(name)
        return [c for c in self._calls if c.name == name]

    def names(self, ignore: Iterable[str] = ()) -> list[str]:
        """Full hook names in call order, without the hooks named in ``ignore``."""
        skip = set(expand(ignore))
        return [c.name for c in self._calls if c.name not in skip]

    def get(self, name: str) -> HookCall:
        """The one call of hook ``name``; AssertionError unless there was exactly one."""
        found = self.calls(name)
        if len(found) != 1:
            raise AssertionError(f"expected exactly one call of {full_name(name)}, got {len(found)}")
        return found[0]

    def by_transition(self) -> list[TransitionHooks]:
        """One TransitionHooks per ``agent.transitions`` entry (needs ``attach``)."""
        agent = self._require_agent()
        result, start = [], self._setup_end
        for index, record in enumerate(agent.transitions):
            end = self._ends.get(index + 1)
            if end is None:  # changed outside a trigger (the agent's last-resort UNKNOWN): end at its state_changed
                end = next(
                    (
                        i + 1
                        for i in range(start, len(self._calls))
                        if self._calls[i].kwargs.get("transition") is record
                    ),
                    len(self._calls),
                )
            result.append(
                TransitionHooks(
                    index=index,
                    transition=record,
                    label=f"{record.source}->{record.dest}",
                    calls=tuple(self._calls[start:end]),
                )
            )
            start = end
        return result

    def segment(self, which: int | str) -> list[HookCall]:
        """The calls of one part of the run.

        Args:
            which: a transition index into ``agent.transitions`` (negative counts from the end), a
                label ``"SOURCE->DEST"`` that occurs once in the trace, ``"setup"`` (agent
                construction) or ``"end"`` (after the last transition: final metrics,
                ``run_end``, ``fsm_agent_unconfigure``).
        """
        transitions = self.by_transition()
        if which == "setup":
            return list(self._calls[: self._setup_end])
        if which == "end":
            done = self._setup_end + sum(len(t.calls) for t in transitions)
            return list(self._calls[done:])
        if isinstance(which, str):
            matches = [t for t in transitions if t.label == which]
            if len(matches) != 1:
                raise LookupError(
                    f"transition {which!r} occurs {len(matches)} times in "
                    f"{[t.label for t in transitions]}; pass its index instead"
                )
            return list(matches[0].calls)
        return list(transitions[which].calls)

    def transition_names(self, which: int | str, ignore: Iterable[str] = ()) -> list[str]:
        """Full hook names of one segment (see ``segment``), without those in ``ignore``."""
        skip = set(expand(ignore))
        return [c.name for c in self.segment(which) if c.name not in skip]

    def assert_sequence(
        self, expected: Iterable[str], *, transition: int | str | None = None, ignore: Iterable[str] = ()
    ) -> None:
        """Assert the exact hook sequence, of the whole run or of one ``transition`` (see ``segment``).

        Names may omit the ``fsm_agent_`` prefix and use ``"name*N"`` for N calls in a row; hooks
        named in ``ignore`` are dropped from the recorded sequence before comparing.
        """
        want = expand(expected)
        got = self.names(ignore) if transition is None else self.transition_names(transition, ignore)
        if got != want:
            where = "the run" if transition is None else f"transition {transition!r}"
            diff = "\n".join(
                difflib.unified_diff(
                    [n.removeprefix(HOOK_PREFIX) for n in want],
                    [n.removeprefix(HOOK_PREFIX) for n in got],
                    "expected",
                    "recorded",
                    lineterm="",
                )
            )
            raise AssertionError(f"hook sequence of {where} differs:\n{diff}")

    def _require_agent(self) -> Any:
        if self._agent is None:
            raise RuntimeError("HookRecorder.attach(agent) first (the make_agent fixture does it)")
        return self._agent
