"""The payload format of a checkpoint slot: a state dict copied into shared memory and back (worker side, torch).

``fsm_agent.checkpoint.save`` and the DCP writer plan a payload (``Layout``: a small meta, then one
entry per tensor or byte blob), check it fits, and copy each tensor with one ``Tensor.copy_``
straight into the slot's memory map (no intermediate ``bytes``: a non-contiguous or CUDA tensor is
copied by that same call); ``load`` reads it back. Only the *skeleton* is pickled, never a
tensor's data. The agent never parses a payload: to it a checkpoint is bytes.

Format (integers little-endian; offsets in bytes from the payload's start, which the slot keeps
page-aligned, so every 64-byte aligned offset is 64-byte aligned in memory)::

    [0, 8)        PAYLOAD_MAGIC (b"FSMPAYL1")
    [8, 16)       u64 M: the meta's length, bytes
    [16, 16 + M)  the meta: a pickle of standard-library objects only (a dict):
                    "version":  FORMAT_VERSION (1)
                    "kind":     "state_dict" (``save``/``load``) or "dcp" (``FsmStorageWriter``/``Reader``)
                    "entries":  a list of (offset, nbytes, dtype, shape, path, requires_grad):
                                offset from the data area's start (a multiple of ALIGN), its length in
                                bytes, the torch dtype's name ("float32", "bfloat16"; None: raw bytes),
                                the shape (a tuple of ints), the key path in the state dict where the
                                tensor was first found (a tuple of dict keys and list/tuple indices;
                                None: not reachable through dicts, lists and tuples), and requires_grad
                    "skeleton": bytes: kind "state_dict": a pickle of the state dict in which every
                                tensor is a persistent id (``pickle``'s ``persistent_id``: its entry's
                                index); kind "dcp": a pickle of the rank's DCP ``Metadata`` whose
                                ``storage_data`` maps each ``MetadataIndex`` to its entry's index
    [16 + M, D)   zero to 63 bytes of padding: D = 16 + M rounded up to ALIGN (the data area)
    [D + offset, D + offset + nbytes)   each entry: a tensor's elements in C-contiguous order and
                  its dtype's native (little-endian) layout, or the raw bytes

The payload's length is D plus the end of its last entry. What is not kept: strides (a restored
tensor is contiguous), storage sharing between *different* tensor objects (the same object twice
is stored once and restored as one object), tensor subclasses (restored as plain tensors).
"""

from __future__ import annotations

import io
import pickle
import struct
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import torch

PAYLOAD_MAGIC = b"FSMPAYL1"
FORMAT_VERSION = 1
#: The alignment of every entry, bytes.
ALIGN = 64
KIND_STATE_DICT = "state_dict"
KIND_DCP = "dcp"
_PREAMBLE = struct.Struct("<8sQ")


class PayloadError(ValueError):
    """A payload that is not in this format (or of a newer version)."""


class Entry(NamedTuple):
    """One tensor or byte blob of a payload (see the module's docstring)."""

    offset: int
    nbytes: int
    dtype: str | None
    shape: tuple[int, ...]
    path: tuple[Any, ...] | None
    requires_grad: bool


class Contents(NamedTuple):
    """A payload's meta, as read by ``read_contents``."""

    kind: str
    entries: list[Entry]
    skeleton: bytes
    data_start: int


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_tensor(tensor: torch.Tensor, path: tuple[Any, ...] | None) -> None:
    """Raise TypeError for a tensor ``save`` cannot copy as plain elements."""
    where = "a tensor" if path is None else f"the tensor at {'/'.join(map(str, path))}"
    if type(tensor).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__:
        raise TypeError(
            f"{where} is a {type(tensor).__name__}, a tensor subclass with its own dispatch (DTensor, "
            "ShardedTensor...): save it with torch.distributed.checkpoint and FsmStorageWriter"
        )
    if tensor.layout != torch.strided or tensor.is_quantized:
        raise TypeError(f"{where} has layout {tensor.layout} and dtype {tensor.dtype}: only dense tensors are saved")
    if tensor.device.type == "meta":
        raise TypeError(f"{where} is on the meta device: it holds no data to save")


def tensor_items(obj: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], torch.Tensor]]:
    """(key path, tensor) of every tensor reachable from ``obj`` through dicts (any ``Mapping``),
    lists and tuples, depth first in iteration order; a tensor found twice is yielded twice."""
    seen: set[int] = set()

    def walk(node: Any, at: tuple[Any, ...]) -> Iterator[tuple[tuple[Any, ...], torch.Tensor]]:
        if isinstance(node, torch.Tensor):
            yield at, node
            return
        if not isinstance(node, (Mapping, list, tuple)) or id(node) in seen:
            return
        seen.add(id(node))
        children = node.items() if isinstance(node, Mapping) else enumerate(node)
        for key, child in children:
            yield from walk(child, (*at, key))

    yield from walk(obj, path)


class Layout:
    """A payload planned but not written: the meta, each entry's place, the total length.

    Args:
        kind: KIND_STATE_DICT or KIND_DCP.
        skeleton: the pickled skeleton (see the module's docstring).
        sources: what each entry holds: a tensor (any device, strides, dtype) or bytes.
        paths: each entry's key path, or None.
    """

    def __init__(
        self,
        kind: str,
        skeleton: bytes,
        sources: list[torch.Tensor | bytes],
        paths: list[tuple[Any, ...] | None],
    ):
        self.kind = kind
        self.sources = sources
        self.entries: list[Entry] = []
        end = 0
        for source, path in zip(sources, paths):
            offset = _align(end)
            if isinstance(source, torch.Tensor):
                nbytes = source.numel() * source.element_size()
                entry = Entry(
                    offset, nbytes, _dtype_name(source.dtype), tuple(source.shape), path, source.requires_grad
                )
            else:
                entry = Entry(offset, len(source), None, (), path, False)
            self.entries.append(entry)
            end = offset + entry.nbytes
        meta = {
            "version": FORMAT_VERSION,
            "kind": kind,
            "entries": [tuple(e) for e in self.entries],
            "skeleton": skeleton,
        }
        self.meta = pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)
        self.data_start = _align(_PREAMBLE.size + len(self.meta))
        #: The payload's length, bytes.
        self.length = self.data_start + end


class _SkeletonPickler(pickle.Pickler):
    """Pickles a state dict with its tensors as persistent ids (entry indices), gathering them."""

    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor], paths: list[tuple[Any, ...] | None]):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors, self.paths = tensors, paths
        self.index = {id(t): i for i, t in enumerate(tensors)}

    def persistent_id(self, obj: Any) -> int | None:
        if not isinstance(obj, torch.Tensor):
            return None
        found = self.index.get(id(obj))
        if found is None:  # inside an object the key-path walk does not enter
            _check_tensor(obj, None)
            found = self.index[id(obj)] = len(self.tensors)
            self.tensors.append(obj)
            self.paths.append(None)
        return found


def plan_state_dict(state_dict: Any) -> Layout:
    """The ``Layout`` of ``state_dict`` (kind KIND_STATE_DICT): its tensors gathered, the rest pickled.

    Raises:
        TypeError: a tensor that is not a dense plain tensor (DTensor, sparse, quantized, meta).
        pickle.PicklingError, AttributeError, TypeError: a non-tensor value that cannot be pickled.
    """
    tensors: list[torch.Tensor] = []
    paths: list[tuple[Any, ...] | None] = []
    seen: set[int] = set()
    for path, tensor in tensor_items(state_dict):
        if id(tensor) in seen:
            continue
        _check_tensor(tensor, path)
        seen.add(id(tensor))
        tensors.append(tensor)
        paths.append(path)
    buffer = io.BytesIO()
    pickler = _SkeletonPickler(buffer, tensors, paths)
    pickler.dump(state_dict)
    sources: list[torch.Tensor | bytes] = list(tensors)
    return Layout(KIND_STATE_DICT, buffer.getvalue(), sources, paths)


def needed_bytes(state_dict: Any) -> int:
    """Bytes of shared memory ``fsm_agent.checkpoint.save(state_dict, step)`` needs (the payload's
    length): what ``--checkpoint-memory`` must be at least. Costs one pickle of the non-tensor state.

    Raises:
        TypeError: as ``plan_state_dict``.
    """
    return plan_state_dict(state_dict).length


def write(layout: Layout, payload: memoryview) -> int:
    """Copy ``layout`` into ``payload`` (a slot's payload area, writable); return its length, bytes.

    Raises:
        ValueError: it does not fit.
    """
    if layout.length > len(payload):
        raise ValueError(f"payload of {layout.length} bytes exceeds the {len(payload)} bytes given")
    _PREAMBLE.pack_into(payload, 0, PAYLOAD_MAGIC, len(layout.meta))
    payload[_PREAMBLE.size : _PREAMBLE.size + len(layout.meta)] = layout.meta
    base = torch.frombuffer(payload, dtype=torch.uint8, count=layout.length)
    with torch.no_grad():
        for entry, source in zip(layout.entries, layout.sources):
            start = layout.data_start + entry.offset
            if entry.nbytes == 0:
                continue
            if isinstance(source, torch.Tensor):
                base.narrow(0, start, entry.nbytes).view(source.dtype).view(source.shape).copy_(source)
            else:
                payload[start : start + entry.nbytes] = source
    return layout.length


def read_contents(payload: memoryview, length: int) -> Contents:
    """The meta of the payload ``payload[:length]``.

    Raises:
        PayloadError: not a payload of this format, or of a newer version.
    """
    if length < _PREAMBLE.size:
        raise PayloadError(f"a payload of {length} bytes is not a checkpoint")
    magic, meta_len = _PREAMBLE.unpack_from(payload, 0)
    if magic != PAYLOAD_MAGIC or _PREAMBLE.size + meta_len > length:
        raise PayloadError("not a fsm_agent.checkpoint payload (bad magic or length)")
    try:
        meta = pickle.loads(payload[_PREAMBLE.size : _PREAMBLE.size + meta_len])
    except Exception as exc:
        raise PayloadError(f"unreadable checkpoint meta: {exc}") from exc
    if not isinstance(meta, dict) or meta.get("version") != FORMAT_VERSION:
        raise PayloadError(f"checkpoint payload version {meta.get('version') if isinstance(meta, dict) else '?'}")
    entries = [Entry(*e) for e in meta["entries"]]
    return Contents(meta["kind"], entries, meta["skeleton"], _align(_PREAMBLE.size + meta_len))


def entry_tensor(base: torch.Tensor, contents: Contents, index: int) -> torch.Tensor:
    """A view of tensor entry ``index`` in ``base`` (``torch.frombuffer`` of the whole payload,
    uint8): shared memory, valid until the slot is written again (copy it)."""
    entry = contents.entries[index]
    if entry.dtype is None:
        raise PayloadError(f"entry {index} holds bytes, not a tensor")
    dtype = getattr(torch, entry.dtype)
    return base.narrow(0, contents.data_start + entry.offset, entry.nbytes).view(dtype).view(entry.shape)


def entry_bytes(payload: memoryview, contents: Contents, index: int) -> bytes:
    """A copy of entry ``index``'s bytes."""
    entry = contents.entries[index]
    start = contents.data_start + entry.offset
    return bytes(payload[start : start + entry.nbytes])


class _SkeletonUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, materialize: Any):
        super().__init__(io.BytesIO(data))
        self._materialize = materialize

    def persistent_load(self, pid: Any) -> Any:
        return self._materialize(pid)


def load_state_dict(payload: memoryview, length: int, contents: Contents, into: Any = None) -> Any:
    """The state dict of a KIND_STATE_DICT payload, every tensor copied out of ``payload``.

    Args:
        payload: the slot's payload area; length: its payload's length, bytes.
        contents: ``read_contents(payload, length)``.
        into: None, or a (nested) state dict: a checkpoint tensor whose key path, dtype and shape
            match a tensor there is copied into that tensor in place (``Tensor.copy_``, any device),
            and the result holds that same tensor object; the others are fresh contiguous CPU tensors.

    Raises:
        PayloadError: not a KIND_STATE_DICT payload.
    """
    if contents.kind != KIND_STATE_DICT:
        raise PayloadError(f"a {contents.kind!r} payload is not a state dict")
    targets = dict(tensor_items(into)) if into is not None else {}
    base = torch.frombuffer(payload, dtype=torch.uint8, count=length)
    done: dict[int, torch.Tensor] = {}

    def materialize(index: int) -> torch.Tensor:
        if index in done:
            return done[index]
        entry = contents.entries[index]
        source = entry_tensor(base, contents, index)
        target = targets.get(entry.path) if entry.path is not None else None
        if isinstance(target, torch.Tensor) and target.dtype == source.dtype and tuple(target.shape) == entry.shape:
            with torch.no_grad():
                target.copy_(source)
            result = target
        else:
            result = source.clone()
            if entry.requires_grad:
                result.requires_grad_(True)
        done[index] = result
        return result

    return _SkeletonUnpickler(contents.skeleton, materialize).load()
