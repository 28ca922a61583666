"""In-process restart, the worker's side: ``run(train_fn)`` survives a peer's fault without a new process.

Run the job with ``fsm-agent run --restart-mode inprocess ...`` and wrap the training in
:func:`run`. When one rank fails (an exception, a kill), the agent replaces only that rank's
process; every other rank keeps its process and its memory: its ``train_fn`` is interrupted, it
destroys its process group, waits at a barrier for the new process, joins a new process group
(a fresh store prefix: a new *generation*) and calls ``train_fn`` again. The script below runs
unchanged under plain torchrun (one ``init_process_group``, one call)::

    import torch
    import torch.distributed as dist
    from fsm_agent import inprocess

    class State:                                   # in the process's memory: survives a peer's fault
        def __init__(self):
            self.model = make_model()
            self.optim = torch.optim.SGD(self.model.parameters(), lr=0.1)  # holds no group
            self.step = 0

    def train(state, steps):                       # re-entrant: called again in each generation
        gen = inprocess.context()
        if gen.replaced:                           # a new process joined: it takes a survivor's state
            mine = -1 if dist.get_rank() in gen.replaced else state.step
            newest = torch.tensor([mine])          # the most advanced survivor: the source
            dist.all_reduce(newest, op=dist.ReduceOp.MAX)
            src = torch.tensor([dist.get_rank() if mine == int(newest) else dist.get_world_size()])
            dist.all_reduce(src, op=dist.ReduceOp.MIN)
            for p in state.model.parameters():     # (and the optimizer's state, if it has any)
                dist.broadcast(p.data, int(src))
            state.step = int(newest)
        ddp = DDP(state.model)                     # tied to this generation's group: made here
        while state.step < steps:
            state.optim.zero_grad()                # first: an interrupted step left its gradients
            ddp(batch(state.step)).sum().backward()
            with inprocess.uninterrupted():        # the update and the step: all or nothing
                state.optim.step()
                state.step += 1
        return state.step

    inprocess.run(train, State(), 1000, backend="gloo")

Survivors continue from their in-memory step; every rank takes the parameters and the step of the
most advanced one (a fault may land between two ranks' updates), so the replacement is restored.

What survives: the process's memory, every Python object, tensors, optimizer state, RNG, open
files, imported modules and loaded data; not the process group and what is tied to it (DDP and
FSDP wrappers, subgroups, async work handles): make those inside ``train_fn``.

What ``train_fn`` must be able to do twice: start again from the state it was given, at the step
it reached, after ``RestartInterrupt`` landed anywhere in it (at any Python line while it runs,
as a ``KeyboardInterrupt`` would; a C call such as ``time.sleep`` or a collective finishes
first; wrap a multi-statement update in :func:`uninterrupted`); restore a replaced rank
(``context().replaced``) from a survivor; and be called again after it returned, in the rare case
where a peer failed at that very moment.

Where it cannot work:

- a worker that does not call :func:`run`: the agent restarts the whole group, as today;
- ``--launcher subprocess``: it works, but a new process pays its imports (``preload`` forks the
  replacement from a warm zygote);
- a rank hung inside a C++ collective that never returns: the interrupt is delivered only when
  Python runs again; the agent's ``--inprocess-timeout`` ends the recovery and the whole group
  restarts;
- NCCL and GPUs: untested (gloo on CPUs only).

The environment (set by the agent; the keys: ``fsm_agent.inprocess.protocol``): ``RANK``,
``WORLD_SIZE``, ``FSM_AGENT_INPROCESS_STORE`` (``host:port`` of the store; unset: torch's plain
path), ``FSM_AGENT_INPROCESS_PREFIX``, ``FSM_AGENT_INPROCESS_TIMEOUT`` (seconds),
``FSM_AGENT_INPROCESS_GENERATION``.

Importing this package does not import torch: :func:`run` does.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, TypeVar

import attrs

from fsm_agent.inprocess.protocol import (
    ABANDONED,
    ENROLLED,
    ENV_GENERATION,
    ENV_PREFIX,
    ENV_STORE,
    ENV_TIMEOUT,
    GENERATION,
    READY,
    arrived_key,
    begun_key,
    pg_prefix,
    replaced_key,
    state_key,
    worker_wait_s,
)

__all__ = ["Generation", "RecoveryTimeout", "RestartInterrupt", "context", "run", "uninterrupted"]

T = TypeVar("T")

#: Seconds a recovery may take when ``FSM_AGENT_INPROCESS_TIMEOUT`` is unset (the agent's default).
DEFAULT_TIMEOUT_S = 30.0
#: Seconds the first generation's barrier waits when no ``pg_timeout_s`` is given (torch's default
#: process-group timeout: the first processes may start far apart, as under torchrun).
FIRST_BARRIER_TIMEOUT_S = 1800.0
#: Seconds between two looks at the store while waiting for a barrier or a new generation: a
#: ``check``, since every timed-out ``TCPStore.wait`` logs two c10d warnings.
POLL_S = 0.05
#: Seconds of one blocking wait of the watcher (it waits again after each; a timed-out wait logs).
WATCH_S = 3600.0
#: Words of a ``RuntimeError`` that gloo or NCCL raises when a peer went away.
_DIST_WORDS = ("gloo", "nccl", "connection reset", "connection closed")


class RestartInterrupt(BaseException):
    """Raised in ``train_fn`` when a peer failed and a new generation began.

    A ``BaseException``: an ``except Exception`` in the training code does not swallow it.
    :func:`run` catches it; training code should let it through.
    """


class RecoveryTimeout(RuntimeError):
    """A generation's barrier did not complete within the timeout (seconds): the agent falls back."""


@attrs.frozen
class Generation:
    """The generation ``train_fn`` runs in (:func:`context`).

    Attributes:
        generation: 0 for the attempt's first process group, then one more per recovery.
        replaced: the global ranks whose processes are new since the last generation whose
            barrier completed (they must be restored from a survivor); empty in generation 0. A
            rank replaced earlier whose restore a second fault cut short is not listed again:
            pick the source by the highest step among all ranks, as the example does, not by
            "not in replaced".
        is_replacement: this process was started for a generation > 0 (it replaced a failed one).
    """

    generation: int
    replaced: tuple[int, ...]
    is_replacement: bool


_CONTEXT: Generation | None = None
_ENROLLED: set[tuple[tuple[str, int], str]] = set()  # (store address, prefix) enrolled in
_WATCHER: _Watcher | None = None


def context() -> Generation:
    """The current generation, valid while ``train_fn`` runs inside :func:`run`.

    Raises:
        RuntimeError: called outside :func:`run`.
    """
    if _CONTEXT is None:
        raise RuntimeError("fsm_agent.inprocess.context() is valid only inside run()'s train_fn")
    return _CONTEXT


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """A block that ``RestartInterrupt`` does not enter: an interrupt that comes meanwhile is raised
    when the block ends (not when it raises an exception of its own: then :func:`run` sees it).
    Use it around an update that must be all or nothing (parameters and step). Outside
    :func:`run`, or nested, it does nothing.

    Raises:
        RestartInterrupt: at the end of the block, when a new generation began during it.
    """
    watcher = _WATCHER
    paused = watcher.pause() if watcher is not None else False
    try:
        yield
    except BaseException:
        if watcher is not None:
            watcher.resume(paused, raise_now=False)
        raise
    if watcher is not None:
        watcher.resume(paused, raise_now=True)


def run(
    train_fn: Callable[..., T],
    *args: Any,
    backend: str | None = None,
    pg_timeout_s: float | None = None,
    **kwargs: Any,
) -> T:
    """Call ``train_fn(*args, **kwargs)`` in a process group, again after each peer's fault.

    Without ``FSM_AGENT_INPROCESS_STORE`` (torchrun, or an agent without in-process restart):
    ``init_process_group(backend)`` from the environment, one call, ``destroy_process_group()``.
    With it: one call per generation (see the module docstring) until one returns.

    Args:
        train_fn: the training; re-entrant (its state in its arguments, not in its locals).
        backend: the process group's backend (``"gloo"``, ``"nccl"``; None: torch's default).
        pg_timeout_s: the process group's timeout in seconds (None: torch's default).

    Returns:
        What ``train_fn`` returned (in the generation where it returned).

    Raises:
        BaseException: ``train_fn``'s own exception, at once (this rank failed: the agent
            replaces the process); a distributed error (a peer lost) when no new generation
            began within ``FSM_AGENT_INPROCESS_TIMEOUT`` seconds.
        RecoveryTimeout: a generation's barrier did not complete in time.
    """
    global _CONTEXT
    try:
        if not os.environ.get(ENV_STORE):
            return _run_plain(train_fn, args, kwargs, backend, pg_timeout_s)
        return _run_generations(train_fn, args, kwargs, backend, pg_timeout_s)
    finally:
        _CONTEXT = None


def _run_plain(
    train_fn: Callable[..., T],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    backend: str | None,
    pg_timeout_s: float | None,
) -> T:
    """torchrun's path: one process group from ``env://``, one call."""
    global _CONTEXT
    import torch.distributed as dist

    dist.init_process_group(backend, **_pg_timeout(pg_timeout_s))
    _CONTEXT = Generation(0, (), False)
    try:
        return train_fn(*args, **kwargs)
    finally:
        _destroy()


@attrs.frozen
class _Job:
    """What the agent told this process (the environment), and its store."""

    store: Any
    address: tuple[str, int]
    prefix: str
    rank: int
    world_size: int
    timeout_s: float
    started_in: int

    @classmethod
    def from_env(cls) -> _Job:
        host, _, port = os.environ[ENV_STORE].rpartition(":")
        address = (host.strip("[]"), int(port))
        # Past the agent's own timeout: its fallback, not this process's, ends a recovery.
        timeout_s = worker_wait_s(float(os.environ.get(ENV_TIMEOUT) or DEFAULT_TIMEOUT_S))
        prefix = os.environ.get(ENV_PREFIX, "")
        return cls(
            store=_connect(address, prefix, FIRST_BARRIER_TIMEOUT_S),  # the first processes start far apart
            address=address,
            prefix=prefix,
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout_s=timeout_s,
            started_in=int(os.environ.get(ENV_GENERATION) or 0),
        )

    def newest(self) -> int:
        """The newest generation (the counter; absent is 0)."""
        return int(self.store.add(GENERATION, 0))


def _connect(address: tuple[str, int], prefix: str, timeout_s: float) -> Any:
    """A new client of the agent's store, its keys under ``prefix``."""
    from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

    host, port = address
    client = TCPStore(host, port, None, False, timedelta(seconds=timeout_s), wait_for_workers=False)
    return PrefixStore(prefix, client)


def _run_generations(
    train_fn: Callable[..., T],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    backend: str | None,
    pg_timeout_s: float | None,
) -> T:
    """The in-process path: join the newest generation, run, and again after a peer's fault."""
    global _WATCHER
    job = _Job.from_env()
    if (job.address, job.prefix) not in _ENROLLED:  # once per process: the agent counts the processes
        job.store.add(ENROLLED, 1)
        _ENROLLED.add((job.address, job.prefix))
    if _WATCHER is None or _WATCHER.address != (job.address, job.prefix):
        _WATCHER = _Watcher(job.address, job.prefix, FIRST_BARRIER_TIMEOUT_S)
    generation = max(job.started_in, job.newest())
    first_barrier_s = pg_timeout_s or FIRST_BARRIER_TIMEOUT_S
    while True:
        timeout_s = first_barrier_s if generation == 0 else job.timeout_s
        generation = _join(job, generation, timeout_s)
        done, result = _run_generation(job, generation, _WATCHER, train_fn, args, kwargs, backend, pg_timeout_s)
        if done:
            return result  # type: ignore[return-value]  # done: train_fn's own value
        generation = max(generation + 1, job.newest())


def _join(job: _Job, generation: int, timeout_s: float) -> int:
    """Arrive at ``generation``'s barrier (at a newer one when it is abandoned) and return the
    generation whose barrier completed (``state_key``: ``ready``; see ``protocol``).

    Raises:
        RecoveryTimeout: no barrier completed within ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if job.store.add(arrived_key(generation), 1) == job.world_size:
            _settle(job, generation, READY)
        newer = _await_barrier(job, generation, deadline)
        if newer is None:
            return generation
        generation = newer


def _settle(job: _Job, generation: int, outcome: bytes) -> bytes:
    """Set ``generation``'s state to ``outcome`` unless it is set already; the state it has."""
    return bytes(job.store.compare_set(state_key(generation), "", outcome))


def _await_barrier(job: _Job, generation: int, deadline: float) -> int | None:
    """Wait until ``generation``'s barrier completed (None) or was abandoned for a newer one (the
    newest generation). A rank that sees a newer generation first abandons this one, unless it
    completed meanwhile: one ``compare_set`` decides, so no rank enters a generation alone.

    Raises:
        RecoveryTimeout: neither by ``deadline`` (``time.monotonic()``).
    """
    while True:
        if job.store.check([state_key(generation)]):
            if job.store.get(state_key(generation)) == READY:
                return None
            return max(generation + 1, job.newest())
        newest = job.newest()
        if newest > generation:
            return None if _settle(job, generation, ABANDONED) == READY else newest
        if time.monotonic() >= deadline:
            raise RecoveryTimeout(f"rank {job.rank}: generation {generation} did not complete its barrier in time")
        time.sleep(POLL_S)


def _await_newer(job: _Job, generation: int, deadline: float) -> int:
    """Wait until a generation newer than ``generation`` began; the newest.

    Raises:
        RecoveryTimeout: none by ``deadline`` (``time.monotonic()``).
    """
    while (newest := job.newest()) <= generation:
        if time.monotonic() >= deadline:
            raise RecoveryTimeout(f"rank {job.rank}: no generation after {generation} began in time")
        time.sleep(POLL_S)
    return newest


def _run_generation(
    job: _Job,
    generation: int,
    watcher: _Watcher,
    train_fn: Callable[..., T],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    backend: str | None,
    pg_timeout_s: float | None,
) -> tuple[bool, T | None]:
    """One generation: its process group, one call. ``(True, result)`` when ``train_fn``
    returned, ``(False, None)`` when this rank survives a peer's fault (its group destroyed).

    Raises:
        BaseException: ``train_fn``'s error when this rank failed itself (its group destroyed).
    """
    global _CONTEXT
    import torch.distributed as dist

    watcher.follow(generation)
    error: BaseException | None = None
    result: T | None = None
    try:  # a peer lost while the group forms is a peer's fault too
        pg_store = dist.PrefixStore(pg_prefix(generation), job.store)  # type: ignore[attr-defined]
        dist.init_process_group(
            backend, store=pg_store, rank=job.rank, world_size=job.world_size, **_pg_timeout(pg_timeout_s)
        )
        _CONTEXT = Generation(generation, _replaced(job, generation), job.started_in > 0)
        watcher.arm(generation)
        result = train_fn(*args, **kwargs)
    except BaseException as exc:
        error = exc
    # No call between here and the loop: a pending interrupt lands only inside it (the watcher
    # raises at most one per arming), so it cannot escape.
    interrupted = False
    while True:
        try:
            interrupted = watcher.disarm() or interrupted
            break
        except RestartInterrupt:
            interrupted = True
    _CONTEXT = None
    if error is None and not interrupted:
        _destroy()
        return True, result
    _close_connections(error)
    if not _survives(job, generation, error, interrupted):
        assert error is not None  # not interrupted and no error returned above
        raise error
    return False, None


def _close_connections(error: BaseException | None) -> None:
    """Destroy the process group so that its connections close now, before this rank waits for
    anything: a peer blocked inside a collective on one of them learns of the fault only when it
    closes (gloo has no abort for work in flight), and would otherwise never reach the barrier.
    The error's traceback holds the group (its frames' locals: the call's ``group``, the user's
    DDP wrapper) until those are cleared, and so do the errors it was raised while handling (an
    interrupt that lands in an ``except`` of a collective's error); the tracebacks' lines stay."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if error.__traceback__ is not None:
            traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__
    _destroy()
    gc.collect()  # a group in a reference cycle goes now, not at some later collection


def _survives(job: _Job, generation: int, error: BaseException | None, interrupted: bool) -> bool:
    """Whether this rank survives a peer's fault (True) or failed itself (False)."""
    if interrupted or isinstance(error, RestartInterrupt):
        return True
    try:
        if job.newest() > generation:
            return True
        if error is None or not _is_distributed_error(error):
            return False
        # A peer is gone: its agent begins the next generation, or nobody does (the fault is ours).
        _await_newer(job, generation, time.monotonic() + job.timeout_s)
    except Exception:  # no new generation in time, or the store is gone with the agent
        return False
    return True


def _is_distributed_error(error: BaseException) -> bool:
    """An error of torch.distributed, as a lost peer makes it (gloo: a plain ``RuntimeError``)."""
    import torch.distributed as dist

    if isinstance(error, dist.DistError):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(word in text for word in _DIST_WORDS)


def _replaced(job: _Job, generation: int) -> tuple[int, ...]:
    """The ranks replaced in ``generation`` and in the generations before it that never
    completed their barrier (their new processes were never restored)."""
    ranks: set[int] = set()
    for g in range(generation, 0, -1):
        if job.store.check([replaced_key(g)]):
            ranks.update(json.loads(job.store.get(replaced_key(g))))
        if job.store.check([state_key(g - 1)]) and job.store.get(state_key(g - 1)) == READY:
            break
    return tuple(sorted(ranks))


def _pg_timeout(pg_timeout_s: float | None) -> dict[str, Any]:
    return {} if pg_timeout_s is None else {"timeout": timedelta(seconds=pg_timeout_s)}


def _destroy() -> None:
    """Destroy the default process group, if any (``train_fn`` may have done it already)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _async_raise(thread_id: int, exc_type: type[BaseException] | None) -> None:
    """Raise ``exc_type`` in thread ``thread_id`` when it next runs Python (None: clear a pending one)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exc_type) if exc_type is not None else None
    )


def _watcher_lost(error: BaseException) -> None:
    """Say once that this process is no longer interrupted by a new generation (only a collective's
    error ends its ``train_fn`` now): the store went away, usually with the agent at the job's end."""
    print(
        f"fsm_agent.inprocess: rank {os.environ.get('RANK', '?')} stopped watching for new generations "
        f"({type(error).__name__}: {error})",
        file=sys.stderr,
        flush=True,
    )


class _Watcher:
    """A daemon thread with its own store client, blocked on the next generation's ``begun`` key;
    when it is set while ``train_fn`` runs (armed, not paused), it raises ``RestartInterrupt`` in
    the thread that called :func:`run`, once per arming."""

    def __init__(self, address: tuple[str, int], prefix: str, connect_timeout_s: float) -> None:
        self.address = (address, prefix)
        self._connect_timeout_s = connect_timeout_s
        self._lock = threading.Lock()
        self._target = threading.get_ident()
        self._current = -1  # the generation the target is in
        self._begun = -1  # the newest generation seen begun
        self._arming: int | None = None  # the generation whose train_fn runs
        self._paused = False  # in an uninterrupted() block
        self._fired = False  # an interrupt was raised (or is due) during this arming
        self._thread = threading.Thread(target=self._watch, name="fsm-agent-inprocess-watcher", daemon=True)
        self._started = False

    def follow(self, generation: int) -> None:
        """The target thread is in ``generation`` now: watch for the next one."""
        with self._lock:
            self._target = threading.get_ident()
            self._current = generation
        if not self._started:
            self._started = True
            self._thread.start()

    def arm(self, generation: int) -> None:
        """``train_fn`` of ``generation`` starts: interrupt it when a newer one begins.

        Raises:
            RestartInterrupt: a newer generation began already.
        """
        with self._lock:
            self._arming, self._paused, self._fired = generation, False, self._begun > generation
            if self._fired:
                raise RestartInterrupt(f"generation {self._begun} began")

    def disarm(self) -> bool:
        """Interrupt no more, and drop an interrupt raised but not yet delivered. Returns whether
        one was due during this arming (the generation is over for this rank)."""
        with self._lock:
            self._arming, self._paused = None, False
            _async_raise(self._target, None)
            return self._fired

    def pause(self) -> bool:
        """Hold interrupts for an :func:`uninterrupted` block; True for the outermost block of an
        arming (the one whose :meth:`resume` re-arms)."""
        with self._lock:
            if self._arming is None or self._paused:
                return False
            self._paused = True
            _async_raise(self._target, None)  # raised but not delivered: re-raised at resume
            return True

    def resume(self, paused: bool, raise_now: bool) -> None:
        """Re-arm after :meth:`pause`; raise ``RestartInterrupt`` (``raise_now``) when a newer
        generation began or an interrupt came meanwhile."""
        if not paused:
            return
        with self._lock:
            self._paused = False
            if self._arming is not None and self._begun > self._arming:
                self._fired = True
            if self._fired and raise_now:
                raise RestartInterrupt(f"generation {self._begun} began")

    def _watch(self) -> None:
        from torch.distributed import DistStoreError

        try:
            store = _connect(self.address[0], self.address[1], self._connect_timeout_s)
        except Exception as exc:  # the store is gone (the agent ended): nothing to watch
            _watcher_lost(exc)
            return
        while True:
            with self._lock:
                watched = max(self._current, self._begun) + 1
            try:
                store.wait([begun_key(watched)], timedelta(seconds=WATCH_S))
            except DistStoreError as exc:
                if "timeout" in str(exc).lower():
                    continue  # look again (the target may have moved on meanwhile)
                _watcher_lost(exc)
                return
            except Exception as exc:  # the store is gone: nothing to watch
                _watcher_lost(exc)
                return
            with self._lock:
                self._begun = max(self._begun, watched)
                due = self._arming is not None and self._arming < watched
                if due and not self._paused and not self._fired:
                    self._fired = True
                    _async_raise(self._target, RestartInterrupt)
