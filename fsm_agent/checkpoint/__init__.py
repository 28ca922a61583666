"""Checkpoints held by the agent in memory: the worker's API (``save``, ``load``, the DCP storage classes).

Run the job with ``fsm-agent run --checkpoint-memory SIZE ...`` (bytes per worker: the largest
checkpoint one rank saves; ``payload.needed_bytes(state_dict)`` tells it), and in the training
script::

    import fsm_agent.checkpoint as ckpt

    start = 0
    restored = ckpt.load(into={"model": model.state_dict(), "optim": optim.state_dict()})
    if restored is not None:                      # the agent staged a restore for this attempt
        model.load_state_dict(restored.state_dict["model"])
        optim.load_state_dict(restored.state_dict["optim"])
        start = restored.step + 1
    for step in range(start, steps):
        ...
        if ckpt.enabled() and step % 50 == 0:
            ckpt.save({"model": model.state_dict(), "optim": optim.state_dict()}, step)

``save`` copies the state dict into this worker's shared memory (``/dev/shm``, held by the agent)
and returns: one memory copy per tensor, no pickling of tensor data, no checksum (the agent
computes it in the background). The agent then, while training goes on, copies each new
checkpoint to the next node's agent (``--checkpoint-replicas 1``) and to ``--checkpoint-dir``.

What survives what:

- a worker's crash, kill, hang or restart, and a re-rendezvous: the copy in this node's memory;
- a ``save`` killed mid-copy: the previous checkpoint (two slots per worker, written in turn);
- the loss of a node or of its agent: the replica the next node's agent holds (or the disk copy);
- the loss of the whole job (every agent): only ``--checkpoint-dir`` (an agent removes its
  shared memory when it ends);
- a change of world size: nothing restorable from memory (a checkpoint is for one global rank in
  one world size); resharding needs a DCP checkpoint on a file system.

At each restart the agents agree on the newest step that *every* rank holds somewhere, stage it
in each worker's slots, checksums checked, and ``load`` returns it (``Restored.source``: where it
came from).

The environment (set by the agent, read at each call, again in a process forked after import):

- ``FSM_AGENT_CHECKPOINT_SLOTS=<dir>/local-<local_rank>``: the prefix of this worker's two slot
  files (``slots.SlotPair``); ``save`` writes there; unset: ``enabled()`` is False.
- ``FSM_AGENT_CHECKPOINT_PERSIST=1``: the agent persists checkpoints (``--checkpoint-dir``).
- ``FSM_AGENT_CHECKPOINT_RESTORE=<step>:<source>:<slot path>``: only when a restore was staged:
  the slot file holding the checkpoint, its step, and where it came from (memory, peer or disk).
- ``RANK`` and ``WORLD_SIZE`` (torchrun's): a checkpoint is only loaded by the same global rank
  in a world of the same size (default 0 and 1 when unset).

With ``torch.distributed.checkpoint`` (FSDP2/DTensor, sharded state): ``dcp.save(state,
storage_writer=FsmStorageWriter(step=N))`` and ``dcp.load(state, storage_reader=FsmStorageReader())``
(``fsm_agent.checkpoint.dcp``); each rank keeps its own shards, so a restore needs the same world
size and the same sharding.

Importing this package does not import torch: ``save``, ``load`` and the DCP classes do, when
first used.
"""

from __future__ import annotations

import math
import operator
import os
import threading
import time
import warnings
from typing import TYPE_CHECKING, Any, NamedTuple

from fsm_agent.checkpoint.slots import BAD, COMPLETE, PERSIST, STATE_NAMES, Header, Slot, SlotPair, format_bytes

if TYPE_CHECKING:
    from fsm_agent.checkpoint.dcp import FsmStorageReader, FsmStorageWriter
    from fsm_agent.checkpoint.payload import Layout

__all__ = [
    "CheckpointTooLarge",
    "FsmStorageReader",
    "FsmStorageWriter",
    "Restored",
    "enabled",
    "load",
    "save",
]

SLOTS_ENV = "FSM_AGENT_CHECKPOINT_SLOTS"
RESTORE_ENV = "FSM_AGENT_CHECKPOINT_RESTORE"
#: "1" when the agent persists checkpoints (``--checkpoint-dir``): ``save``'s default for ``persist``.
PERSIST_ENV = "FSM_AGENT_CHECKPOINT_PERSIST"
#: How long a save waits for the agent to persist the checkpoint it would overwrite, seconds.
PERSIST_WAIT_S = 600.0
_NOT_ENABLED = (
    "{what}: " + SLOTS_ENV + " is not set: this worker was not started by fsm-agent with "
    "--checkpoint-memory SIZE (e.g. fsm-agent run --checkpoint-memory 4GiB ...); "
    "check fsm_agent.checkpoint.enabled() to train without it"
)


class CheckpointTooLarge(ValueError):
    """A checkpoint larger than this worker's checkpoint memory (``--checkpoint-memory``).

    Attributes:
        needed: bytes the checkpoint takes.
        capacity: bytes a slot holds.
    """

    def __init__(self, needed: int, capacity: int):
        self.needed, self.capacity = needed, capacity
        mib = math.ceil(needed / (1 << 20))
        super().__init__(
            f"checkpoint of {needed} bytes ({format_bytes(needed)}) does not fit this worker's checkpoint memory of "
            f"{capacity} bytes ({format_bytes(capacity)}): run fsm-agent with --checkpoint-memory at least {needed} "
            f"(e.g. --checkpoint-memory {mib}MiB); nothing was written"
        )


class Restored(NamedTuple):
    """A checkpoint ``load`` restored.

    Attributes:
        step: the step it was saved at (``save``'s ``step``).
        source: where the agent found it: ``memory``, ``peer`` or ``disk``.
        state_dict: the state dict as saved, its tensors copied out of shared memory.
    """

    step: int
    source: str
    state_dict: dict[str, Any]


class _Staged(NamedTuple):
    step: int
    source: str
    path: str


class _Unusable(Exception):
    """The staged slot does not hold the checkpoint this worker was told (the reason)."""


_lock = threading.Lock()
_cached: tuple[str, SlotPair] | None = None


def _forget_after_fork() -> None:
    global _lock, _cached
    _lock, _cached = threading.Lock(), None


os.register_at_fork(after_in_child=_forget_after_fork)


def enabled() -> bool:
    """Whether this worker can ``save``: it runs under fsm-agent with ``--checkpoint-memory``
    (``FSM_AGENT_CHECKPOINT_SLOTS`` is set)."""
    return bool(os.environ.get(SLOTS_ENV))


def _identity() -> tuple[int, int]:
    """(global rank, world size) of this worker, torchrun's ``RANK`` and ``WORLD_SIZE``."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _check_step(step: int) -> int:
    if isinstance(step, bool):
        raise TypeError(f"step must be an int >= 0, got {step!r}")
    try:
        value = operator.index(step)
    except TypeError:
        raise TypeError(f"step must be an int >= 0, got {type(step).__name__} {step!r}") from None
    if value < 0:
        raise ValueError(f"step must be an int >= 0, got {value}")
    return value


def _slot_pair(what: str = "fsm_agent.checkpoint.save") -> SlotPair:
    """This worker's SlotPair, opened once per process (and again after a fork or a new prefix).

    Raises:
        RuntimeError: FSM_AGENT_CHECKPOINT_SLOTS is unset.
        SlotError: its files are missing.
    """
    global _cached
    prefix = os.environ.get(SLOTS_ENV)
    if not prefix:
        raise RuntimeError(_NOT_ENABLED.format(what=what))
    cached = _cached
    if cached is not None and cached[0] == prefix:
        return cached[1]
    pair = SlotPair.open(prefix, populate=True)  # the first save pays no page faults
    if cached is not None:
        cached[1].close()
    _cached = (prefix, pair)
    return pair


def _write(pair: SlotPair, layout: Layout, step: int, persist: bool | None = None) -> None:
    """Write ``layout`` as ``step`` into the pair's slot that is not its newest, then commit it.
    ``persist``: ask the agent for a disk copy (None: whenever it has ``--checkpoint-dir``); a
    slot still holding a checkpoint the agent is persisting is waited for (``_wait_for_persist``).

    Raises:
        CheckpointTooLarge: before any byte is written.
    """
    from fsm_agent.checkpoint import payload

    if layout.length > pair.capacity:
        raise CheckpointTooLarge(layout.length, pair.capacity)
    rank, world_size = _identity()
    wanted = os.environ.get(PERSIST_ENV) == "1" if persist is None else persist
    with _lock:
        _wait_for_persist(pair)
        slot = pair.begin_write(step, rank, world_size, PERSIST if wanted else 0)
        slot.commit(payload.write(layout, slot.payload))


def _wait_for_persist(pair: SlotPair) -> None:
    """Wait until the agent is done persisting the checkpoint the next save overwrites (at most
    ``PERSIST_WAIT_S`` seconds): every checkpoint asked to persist reaches the disk, on every rank,
    so the disk holds the same steps for all. Only saves faster than the disk wait."""
    target = pair.next_target()
    if not target.header().awaiting_persist:
        return
    deadline = time.monotonic() + PERSIST_WAIT_S
    while target.header().awaiting_persist:
        if time.monotonic() > deadline:
            warnings.warn(
                f"fsm_agent.checkpoint.save: the agent has not persisted step {target.header().step} after "
                f"{PERSIST_WAIT_S:.0f} s: overwriting it in memory (it will be missing on disk)",
                RuntimeWarning,
                stacklevel=4,
            )
            return
        time.sleep(0.002)


def save(state_dict: dict[str, Any], step: int, persist: bool | None = None) -> None:
    """Copy ``state_dict`` into this worker's checkpoint memory as the checkpoint of ``step``
    (mirrors ``torch.save``'s role; the agent persists and replicates it in the background).

    Every tensor (any dtype, shape, strides; on the CPU, or copied from its device to the CPU's
    shared memory by that same call: untested on GPUs so far) is copied with one ``Tensor.copy_`` into shared memory, 64-byte
    aligned; the rest (nested dicts, lists, tuples, numbers, strings, an optimizer's state dict...)
    is pickled. Returns when the copy is done: the caller may change its tensors again. The
    previous checkpoint stays intact until this one is complete (a process killed mid-``save``
    leaves it the newest).

    Args:
        state_dict: the state (any picklable structure whose tensors are dense plain tensors).
        step: the training step, an int >= 0 (``load`` returns it).
        persist: whether the agent writes this checkpoint to ``--checkpoint-dir`` too; None (the
            default): yes when the agent has one. Decide it the same way on every rank (e.g.
            ``persist=step % 1000 == 0`` beside memory checkpoints every 50 steps): a disk step is
            restorable only when every rank persisted it. A save that would overwrite a checkpoint
            the agent is still persisting waits for it (saves faster than the disk block).

    Raises:
        RuntimeError: not run by fsm-agent with ``--checkpoint-memory`` (``enabled()`` is False).
        slots.SlotError: the slot files are gone (the agent that made them ended).
        CheckpointTooLarge: (a ValueError) the checkpoint is larger than ``--checkpoint-memory``;
            raised before anything is written.
        TypeError: ``step`` is not an int, or a tensor is a DTensor, sparse, quantized or meta
            (DTensors: use ``FsmStorageWriter``), or a value cannot be pickled.
        ValueError: ``step`` is negative.
    """
    step = _check_step(step)
    pair = _slot_pair()
    from fsm_agent.checkpoint import payload

    _write(pair, payload.plan_state_dict(state_dict), step, persist)


def _staged() -> _Staged | None:
    """The restore the agent staged for this attempt (``FSM_AGENT_CHECKPOINT_RESTORE``), or None.

    Raises:
        ValueError: the variable is malformed.
    """
    value = os.environ.get(RESTORE_ENV)
    if not value:
        return None
    parts = value.split(":", 2)
    try:
        step = int(parts[0])
        if len(parts) != 3 or not parts[2]:
            raise ValueError
    except ValueError:
        raise ValueError(f"{RESTORE_ENV}={value!r}: expected <step>:<source>:<slot path>") from None
    return _Staged(step, parts[1], parts[2])


def _restore_slot(staged: _Staged) -> tuple[Slot, Header]:
    """The staged slot, opened, and its header, checked against this worker.

    Raises:
        SlotError: the file is missing or not a slot.
        _Unusable: it is not COMPLETE, or holds another step, rank or world size.
    """
    slot = Slot.open(staged.path, populate=True)
    header = slot.header()
    rank, world_size = _identity()
    reason = ""
    if not header.complete:
        reason = f"the slot is {STATE_NAMES.get(header.state, header.state)}, not complete"
    elif (header.step, header.global_rank, header.world_size) != (staged.step, rank, world_size):
        reason = (
            f"it holds step {header.step} of rank {header.global_rank} in a world of {header.world_size}, "
            f"this worker expects step {staged.step} of rank {rank} in a world of {world_size}"
        )
    if reason:
        slot.close()
        raise _Unusable(f"checkpoint {staged.path} not restored: {reason}")
    return slot, header


def _torn(slot: Slot, before: Header) -> bool:
    """Whether a writer began another write into ``slot`` since ``before`` was read (seqlock)."""
    after = slot.header()
    return after.seq != before.seq or after.state not in (COMPLETE, BAD)


def load(into: Any = None) -> Restored | None:
    """The checkpoint the agent staged for this attempt, or None (mirrors ``torch.load``'s role).

    None when no restore was staged (``FSM_AGENT_CHECKPOINT_RESTORE`` unset: a first start, or no
    step that every rank holds), and, with a ``RuntimeWarning``, when the staged slot is not
    complete, holds another step, global rank or world size than this worker's ``RANK`` and
    ``WORLD_SIZE``, or was overwritten while being read.

    Args:
        into: None, or a state dict shaped like the saved one (nested dicts, lists, tuples), e.g.
            ``{"model": model.state_dict(), "optim": optim.state_dict()}``: each checkpoint tensor
            whose key path, dtype and shape match a tensor there is copied into that tensor in
            place (``Tensor.copy_``: no fresh allocation, any device), and the returned state dict
            holds those same tensor objects; ``model.load_state_dict`` of it then copies nothing.

    Returns:
        ``Restored(step, source, state_dict)``: every tensor is a copy (out of shared memory,
        which later saves reuse), contiguous, on the CPU unless copied ``into`` another device.

    Raises:
        ValueError: ``FSM_AGENT_CHECKPOINT_RESTORE`` is malformed.
        SlotError: its slot file is missing or not a slot.
        RuntimeError: the checkpoint was saved with ``FsmStorageWriter`` (load it with ``dcp.load``).
        payload.PayloadError: the payload is not in this format.
    """
    staged = _staged()
    if staged is None:
        return None
    from fsm_agent.checkpoint import payload

    try:
        slot, header = _restore_slot(staged)
    except _Unusable as exc:
        warnings.warn(str(exc), RuntimeWarning, stacklevel=2)
        return None
    try:
        try:
            contents = payload.read_contents(slot.payload, header.payload_len)
            if contents.kind == payload.KIND_DCP:
                raise RuntimeError(
                    f"checkpoint of step {header.step} was saved with FsmStorageWriter: load it with "
                    "torch.distributed.checkpoint.load(state, storage_reader=FsmStorageReader())"
                )
            state = payload.load_state_dict(slot.payload, header.payload_len, contents, into)
        except Exception:
            if not _torn(slot, header):
                raise
            state = None  # a torn read may fail in any way
        if state is None or _torn(slot, header):
            warnings.warn(
                f"checkpoint {staged.path} not restored: it was overwritten while being read",
                RuntimeWarning,
                stacklevel=2,
            )
            return None
        return Restored(header.step, staged.source, state)
    finally:
        slot.close()


def __getattr__(name: str) -> Any:
    if name in ("FsmStorageWriter", "FsmStorageReader"):
        from fsm_agent.checkpoint import dcp

        return getattr(dcp, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
