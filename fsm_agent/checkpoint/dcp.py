"""``torch.distributed.checkpoint`` storage in the agent's memory: ``FsmStorageWriter`` and ``FsmStorageReader``.

Save and restore sharded state (FSDP2, DTensor, tensor parallel...) with DCP's planners, into the
same per-worker slots as ``fsm_agent.checkpoint.save``::

    import torch.distributed.checkpoint as dcp
    from fsm_agent.checkpoint import FsmStorageReader, FsmStorageWriter

    reader = FsmStorageReader()
    if reader.step is not None:                  # the agent staged a restore for this attempt
        dcp.load(state, storage_reader=reader)
        start = reader.step + 1
    ...
    dcp.save(state, storage_writer=FsmStorageWriter(step=step))

Each rank's slot holds what *that rank* has: every item of its own local save plan (its shards
of a DTensor, its copy of a replicated tensor, the pickled non-tensor values), and a rank-local
``Metadata`` of exactly those items (``storage_data`` maps each ``MetadataIndex`` to its entry
in the payload; ``payload``'s format, kind "dcp"). Nothing is gathered across ranks: ``finish``
on the coordinator writes nothing, and ``read_metadata`` returns the rank's own metadata, so each
rank loads its own shards. A restore therefore needs the same world size and the same sharding
as the save (the agent only stages a checkpoint for the same global rank and world size);
resharding to another world size needs a DCP checkpoint on a file system.

DCP's coordinator deduplicates replicated items (a plain tensor saved by every rank is written by
one); this writer keeps the full local plan from ``prepare_local_plan`` and writes all of it, so
every rank can restore on its own. ``async_save`` is not supported (the copy is already the fast
part). This module imports torch.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    STORAGE_TYPES,
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from fsm_agent.checkpoint import _check_step, _restore_slot, _slot_pair, _staged, _torn, _Unusable, _write, payload
from fsm_agent.checkpoint.slots import Header, Slot

__all__ = ["FsmStorageReader", "FsmStorageWriter"]

#: The last usable local plan this process saved (a planner with plan caching sends an unusable
#: empty plan when nothing changed: the cached one is this one).
_last_local_plan: SavePlan | None = None


def _completed(value: Any) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(value)
    return future


def _plan_items(local: SavePlan | None, final: SavePlan) -> list[WriteItem]:
    """The local plan's items, then any of the final plan's not among them."""
    items = list(local.items) if local is not None else []
    known = {item.index for item in items}
    items.extend(item for item in final.items if item.index not in known)
    return items


def _layout(items: list[WriteItem], planner: SavePlanner, planner_data: Any) -> payload.Layout:
    """The payload (kind "dcp") of ``items``: their data resolved, and their rank-local Metadata."""
    state_dict_metadata: dict[str, STORAGE_TYPES] = {}
    storage_data: dict[MetadataIndex, int] = {}
    sources: list[torch.Tensor | bytes] = []
    for item in items:
        data = planner.resolve_data(item)
        fqn = item.index.fqn
        if item.type == WriteItemType.BYTE_IO:
            state_dict_metadata[fqn] = BytesStorageMetadata()
            sources.append(data.getvalue() if isinstance(data, io.BytesIO) else bytes(data))
        else:
            tensor_data = item.tensor_data
            if tensor_data is None or not isinstance(data, torch.Tensor):
                raise TypeError(f"DCP write item {fqn}: a tensor item without tensor data")
            found = state_dict_metadata.setdefault(
                fqn, TensorStorageMetadata(tensor_data.properties, tensor_data.size, [])
            )
            assert isinstance(found, TensorStorageMetadata)
            found.chunks.append(tensor_data.chunk)
            tensor = data.detach()
            if tuple(tensor.shape) != tuple(tensor_data.chunk.sizes):
                tensor = tensor.reshape(tensor_data.chunk.sizes)
            payload._check_tensor(tensor, (fqn,))
            sources.append(tensor)
        storage_data[item.index] = len(sources) - 1
    metadata = Metadata(state_dict_metadata, planner_data=planner_data, storage_data=storage_data)
    skeleton = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
    return payload.Layout(payload.KIND_DCP, skeleton, sources, [None] * len(sources))


class FsmStorageWriter(StorageWriter):
    """A DCP ``StorageWriter`` into this worker's checkpoint memory (mirrors
    ``torch.distributed.checkpoint.FileSystemWriter``): ``dcp.save(state,
    storage_writer=FsmStorageWriter(step=N))``.

    Args:
        step: the training step, an int >= 0 (``FsmStorageReader.step`` at the restore).

    Raises:
        TypeError, ValueError: (the constructor) ``step`` is not an int >= 0.
        torch.distributed.checkpoint.api.CheckpointException: (``dcp.save``, on every rank; a
            BaseException) wrapping this rank's error: RuntimeError (not run by fsm-agent with
            ``--checkpoint-memory``) or CheckpointTooLarge (this rank's items exceed it; nothing
            was written).
    """

    def __init__(self, step: int):
        super().__init__()
        self.step = _check_step(step)
        self._local_plan: SavePlan | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Begin a new save; ``checkpoint_id`` is ignored (the slot is this worker's)."""
        self._local_plan = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        _slot_pair("FsmStorageWriter")  # fail on every rank before planning when not enabled

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        global _last_local_plan
        if plan.usable:
            self._local_plan = _last_local_plan = plan
        else:
            self._local_plan = _last_local_plan
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Resolve every item of this rank's local plan, copy them and the rank-local Metadata
        into the slot and commit it; return a completed future of the final plan's results."""
        items = _plan_items(self._local_plan, plan)
        planner_data = self._local_plan.planner_data if self._local_plan is not None else plan.planner_data
        layout = _layout(items, planner, planner_data)
        _write(_slot_pair("FsmStorageWriter"), layout, self.step)
        where = {item.index: i for i, item in enumerate(items)}
        results = [
            WriteResult(
                index=item.index, size_in_bytes=layout.entries[where[item.index]].nbytes, storage_data=where[item.index]
            )
            for item in plan.items
        ]
        return _completed(results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Nothing: each rank's slot already holds its own metadata."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """False: never chosen from a ``checkpoint_id``; pass it as ``storage_writer``."""
        return False


class FsmStorageReader(StorageReader):
    """A DCP ``StorageReader`` of the checkpoint the agent staged for this worker (mirrors
    ``torch.distributed.checkpoint.FileSystemReader``): ``dcp.load(state,
    storage_reader=FsmStorageReader())``. Needs the world size and sharding of the save.

    Attributes:
        step: the staged checkpoint's step, or None when no restore was staged (do not load then).
        source: where the agent found it (``memory``, ``peer``, ``disk``), or None.

    Raises:
        ValueError: (the constructor) ``FSM_AGENT_CHECKPOINT_RESTORE`` is malformed.
        torch.distributed.checkpoint.api.CheckpointException: (``dcp.load``, on every rank; a
            BaseException) wrapping this rank's RuntimeError: no restore staged; the slot does not
            hold this rank's checkpoint of that step and world size; it was saved with
            ``fsm_agent.checkpoint.save`` (use ``load``); or it was overwritten while being read.
    """

    def __init__(self) -> None:
        super().__init__()
        self._slot: Slot | None = None
        self._header: Header | None = None
        self._contents: payload.Contents | None = None
        self._metadata: Metadata | None = None
        self.reset()

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Read ``FSM_AGENT_CHECKPOINT_RESTORE`` again; ``checkpoint_id`` is ignored."""
        self._close()
        staged = _staged()
        self.step = staged.step if staged is not None else None
        self.source = staged.source if staged is not None else None

    def _close(self) -> None:
        if self._slot is not None:
            self._slot.close()
        self._slot = self._header = self._contents = self._metadata = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """This rank's own Metadata, from the staged slot."""
        self._close()
        staged = _staged()
        if staged is None:
            raise RuntimeError(
                "FsmStorageReader: no checkpoint was staged for this worker (FSM_AGENT_CHECKPOINT_RESTORE "
                "is unset); check FsmStorageReader().step is not None before dcp.load"
            )
        try:
            slot, header = _restore_slot(staged)
        except _Unusable as exc:
            raise RuntimeError(str(exc)) from None
        try:
            contents = payload.read_contents(slot.payload, header.payload_len)
            if contents.kind != payload.KIND_DCP:
                raise RuntimeError(
                    f"checkpoint of step {header.step} was saved with fsm_agent.checkpoint.save: "
                    "load it with fsm_agent.checkpoint.load()"
                )
            metadata = pickle.loads(contents.skeleton)
            if not isinstance(metadata, Metadata):
                raise payload.PayloadError(f"checkpoint of step {header.step}: no DCP Metadata in its payload")
        except BaseException:
            slot.close()
            raise
        self._slot, self._header, self._contents, self._metadata = slot, header, contents, metadata
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Serve ``plan``'s items from the slot (bytes through ``planner.load_bytes``; tensors
        narrowed to the item's box and copied into ``planner.resolve_tensor``'s); then check the
        slot was not overwritten meanwhile and close it. Returns a completed future."""
        slot, header, contents, metadata = self._slot, self._header, self._contents, self._metadata
        if slot is None or header is None or contents is None or metadata is None:
            raise RuntimeError("FsmStorageReader.read_data before read_metadata")
        try:
            self._read_items(plan, planner, slot, contents, metadata.storage_data)
            if _torn(slot, header):
                raise RuntimeError(f"checkpoint {slot.path} not restored: it was overwritten while being read")
        finally:
            self._close()
        return _completed(None)

    @staticmethod
    def _read_items(
        plan: LoadPlan, planner: LoadPlanner, slot: Slot, contents: payload.Contents, storage: dict[MetadataIndex, int]
    ) -> None:
        base = torch.frombuffer(slot.payload, dtype=torch.uint8)
        try:
            for item in plan.items:
                index = storage.get(item.storage_index)
                if index is None:
                    raise RuntimeError(f"checkpoint holds no {item.storage_index} for this rank")
                if item.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(item, io.BytesIO(payload.entry_bytes(slot.payload, contents, index)))
                    continue
                source = payload.entry_tensor(base, contents, index)
                for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                    source = source.narrow(dim, offset, length)
                target = planner.resolve_tensor(item).detach()
                if target.shape != source.shape:
                    raise RuntimeError(
                        f"{item.dest_index.fqn}: checkpoint box {tuple(source.shape)} != target {tuple(target.shape)}"
                    )
                with torch.no_grad():
                    target.copy_(source)
                planner.commit_tensor(item, target)
        finally:
            del base

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """False: never chosen from a ``checkpoint_id``; pass it as ``storage_reader``."""
        return False
