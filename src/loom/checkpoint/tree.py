"""Split a nested state into JSON plus a flat dict of tensors, and join them back, without pickle.

A checkpoint state is a tree of dicts, lists and tuples whose leaves are tensors, ``None``, bools, ints, floats
and strings. `flatten_state` returns a JSON-able *skeleton* in which every tensor is a placeholder naming its
key in the tensor file (its path in the tree, e.g. ``job/optimizer/state/0/exp_avg``); `unflatten_state` puts
the tensors back. What JSON alone would lose (tuples, non-string keys, ``OrderedDict`` with its
``_metadata``, non-finite floats) is tagged with a ``"__loom__"`` key: docs/checkpoints.md#the-states-json.
Finite floats are written with ``repr``, which round-trips every double exactly. `pack_state` puts both parts
in one self-contained safetensors file (the skeleton in the header's metadata): the form a per-rank state
travels and is stored in.

Limits: tensors come back contiguous, on the CPU, without ``requires_grad``, each with its own memory (two
entries that shared a tensor become two tensors). Subclasses of the leaf types come back as the base type
(``numpy.float32`` as ``float``, ``numpy.int64`` as ``int``); any other type is refused with its path.
"""

from __future__ import annotations

import io
import itertools
import json
import math
import numbers
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from loom.checkpoint.bounded_json import json_shape_problem, parse_json
from loom.checkpoint.limits import DEFAULT_LIMITS, ReadLimits
from loom.checkpoint.tensor_file import DTYPE_CODES, read_tensor_file

__all__ = [
    "TAG",
    "PackedState",
    "flatten_state",
    "pack_state",
    "readable_json",
    "unflatten_state",
    "unpack_state",
    "unpack_tensor_file",
]

TAG = "__loom__"
"""The key that marks a JSON object as an encoded tuple, dict, float or tensor placeholder."""


class _Flattener:
    def __init__(self, clone: bool) -> None:
        self.clone = clone
        self.tensors: dict[str, torch.Tensor] = {}
        self._storages: set[int] = set()

    def encode(self, value: Any, path: tuple[str, ...]) -> Any:
        if value is None or isinstance(value, (bool, str)):
            return str(value) if isinstance(value, str) else value
        if isinstance(value, torch.Tensor):
            return self._tensor(value, path)
        if isinstance(value, numbers.Integral):
            return int(value)
        if isinstance(value, numbers.Real):  # float, numpy.float32, ...: stored as the double it converts to
            value = float(value)
            return value if math.isfinite(value) else {TAG: "float", "value": repr(value)}  # 'nan', 'inf'
        if isinstance(value, tuple):
            return {TAG: "tuple", "items": [self.encode(v, (*path, str(i))) for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [self.encode(v, (*path, str(i))) for i, v in enumerate(value)]
        if isinstance(value, Mapping):
            return self._mapping(value, path)
        where = "/".join(path) or "<root>"
        raise TypeError(
            f"cannot checkpoint the value at {where!r}: {type(value).__name__} is not a tensor, None, bool, int, "
            "float, str, list, tuple or dict. HINT: convert it to one of these in the state_dict() that made it."
        )

    def _mapping(self, value: Mapping, path: tuple[str, ...]) -> Any:
        plain = all(isinstance(k, str) for k in value) and TAG not in value
        if plain and type(value) is dict:
            return {k: self.encode(v, (*path, k)) for k, v in value.items()}
        items = []
        for k, v in value.items():
            if isinstance(k, torch.Tensor):
                raise TypeError(
                    f"cannot checkpoint a dict keyed by tensors at {'/'.join(path) or '<root>'!r}"
                )
            items.append([self.encode(k, (*path, "<key>")), self.encode(v, (*path, str(k)))])
        if not isinstance(value, OrderedDict):
            return {TAG: "dict", "items": items}
        encoded: dict[str, Any] = {TAG: "odict", "items": items}
        metadata = getattr(value, "_metadata", None)
        if metadata is not None:
            encoded["metadata"] = self.encode(metadata, (*path, "<metadata>"))
        return encoded

    def _tensor(self, tensor: torch.Tensor, path: tuple[str, ...]) -> dict[str, Any]:
        if tensor.layout != torch.strided:
            raise TypeError(f"cannot checkpoint the {tensor.layout} tensor at {'/'.join(path)!r}: only dense")
        key = "/".join(path) or "<root>"
        if key in self.tensors:  # e.g. {0: t} and {"0": t} give the same path
            key = next(f"{key}~{i}" for i in itertools.count(1) if f"{key}~{i}" not in self.tensors)
        # With clone, a copy made now, so later in-place updates (the next optimizer step) cannot reach it.
        data = tensor.detach().to("cpu", copy=self.clone, memory_format=torch.contiguous_format).contiguous()
        storage = data.untyped_storage().data_ptr()
        if storage and storage in self._storages:  # safetensors refuses tensors that share memory
            data = data.clone()
        self._storages.add(data.untyped_storage().data_ptr())
        self.tensors[key] = data
        return {TAG: "tensor", "key": key, "dtype": str(data.dtype), "shape": list(data.shape)}


def flatten_state(state: Any, *, clone: bool = False) -> tuple[Any, dict[str, torch.Tensor]]:
    """``(skeleton, tensors)``: a JSON-able copy of ``state`` and the tensors it refers to by key. With
    ``clone=True`` every tensor is copied to fresh CPU memory, so the result cannot change afterwards;
    otherwise CPU tensors that are already contiguous are shared with ``state``."""
    flattener = _Flattener(clone)
    return flattener.encode(state, ()), flattener.tensors


class _Unflattener:
    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.used: set[str] = set()

    def decode(self, value: Any) -> Any:
        if isinstance(value, list):
            return [self.decode(v) for v in value]
        if not isinstance(value, dict):
            return value
        kind = value.get(TAG)
        if kind is None:
            return {k: self.decode(v) for k, v in value.items()}
        if kind == "tuple":
            return tuple(self.decode(v) for v in value["items"])
        if kind in ("dict", "odict"):
            pairs = [(self.decode(k), self.decode(v)) for k, v in value["items"]]
            if kind == "dict":
                return dict(pairs)
            ordered: OrderedDict = OrderedDict(pairs)
            if "metadata" in value:
                ordered._metadata = self.decode(value["metadata"])  # type: ignore[attr-defined]
            return ordered
        if kind == "float":
            return float(value["value"])
        if kind == "tensor":
            return self._tensor(value)
        raise ValueError(f"unknown tag {TAG}={kind!r} in the checkpoint's JSON")

    def _tensor(self, placeholder: dict[str, Any]) -> torch.Tensor:
        key = placeholder["key"]
        if key not in self.tensors:
            raise ValueError(f"the JSON refers to tensor {key!r}, which the tensor file does not hold")
        tensor = self.tensors[key]
        if str(tensor.dtype) != placeholder["dtype"] or list(tensor.shape) != placeholder["shape"]:
            raise ValueError(
                f"tensor {key!r} is {tensor.dtype} {list(tensor.shape)} in the tensor file but the JSON says "
                f"{placeholder['dtype']} {placeholder['shape']}"
            )
        self.used.add(key)
        return tensor


def unflatten_state(skeleton: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Inverse of `flatten_state`. Raises ``ValueError`` if the two parts do not belong together."""
    unflattener = _Unflattener(tensors)
    state = unflattener.decode(skeleton)
    unused = set(tensors) - unflattener.used
    if unused:
        raise ValueError(
            f"the tensor file holds {len(unused)} tensor(s) the JSON never refers to, e.g. "
            f"{sorted(unused)[0]!r}"
        )
    return state


def pack_state(state: Any) -> bytes:
    """``state`` as the bytes of one safetensors file (`PackedState`'s, joined): a snapshot. Raises
    ``ValueError`` when the skeleton's JSON breaks the default `ReadLimits` (`unpack_state` would refuse it)."""
    return b"".join(PackedState(state).chunks())


def readable_json(document: Any, what: str) -> bytes:
    """``document`` as JSON; ``ValueError`` naming ``what`` when reading it back would break the default
    `ReadLimits`, so that nothing loom writes is refused when read."""
    data = json.dumps(document, allow_nan=False).encode()
    problem = json_shape_problem(data, DEFAULT_LIMITS, "max_state_bytes")
    if problem is not None:
        raise ValueError(
            f"{what} holds {problem}, so reading it back would be refused. HINT: keep bulky data in tensors, "
            "which go to the tensor file, rather than in lists and dicts."
        )
    return data


class PackedState:
    """``state`` as one safetensors file, without the bytes: the header (its tensors, and its skeleton as JSON
    in the metadata) built now, the tensors kept by reference and streamed by `chunks`, so writing a rank's file
    costs the header's memory, not a serialized copy. The tensors are *not* a snapshot: write before anything
    updates them (`loom.fit` saves between steps). Raises like `pack_state`."""

    def __init__(self, state: Any) -> None:
        skeleton, tensors = flatten_state(state)
        text = readable_json(skeleton, "the packed state's JSON").decode()
        unknown = sorted({str(t.dtype) for t in tensors.values() if t.dtype not in DTYPE_CODES})
        if unknown:
            raise TypeError(f"cannot checkpoint tensors of dtype {', '.join(unknown)}")
        header: dict[str, Any] = {"__metadata__": {TAG: text}}
        self._tensors = dict(sorted(tensors.items()))  # in the file's order
        offset = 0
        for key, t in self._tensors.items():
            header[key] = {
                "dtype": DTYPE_CODES[t.dtype],
                "shape": list(t.shape),
                "data_offsets": [offset, offset + t.nbytes],
            }
            offset += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors aligns the data to 8 bytes with spaces
        self.header = len(raw).to_bytes(8, "little") + raw
        """The file's first bytes: the header's length and the header."""
        self.size = len(self.header) + offset
        """The file's size in bytes."""

    def chunks(self) -> Iterator[memoryview]:
        """The file's bytes in order: the header, then each tensor's memory (no copy)."""
        yield memoryview(self.header)
        for t in self._tensors.values():
            if t.numel():
                yield t.reshape(-1).view(torch.uint8).numpy().data


def unpack_tensor_file(metadata: dict[str, str], tensors: dict[str, torch.Tensor], limits: ReadLimits) -> Any:
    """The state a `pack_state` file holds, from its metadata and tensors (as `read_tensor_file` returns
    them); ``ValueError`` naming what is wrong with a file `pack_state` did not make."""
    if TAG not in metadata:
        raise ValueError(f"not a state made by pack_state (its metadata has no {TAG!r} entry)")
    try:
        return unflatten_state(parse_json(metadata[TAG].encode(), limits, "max_state_bytes"), tensors)
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"not a state made by pack_state ({type(err).__name__}: {err!s:.300})") from None


def unpack_state(data: bytes, limits: ReadLimits = DEFAULT_LIMITS) -> Any:
    """Inverse of `pack_state`. Raises ``ValueError`` naming what is wrong with bytes it did not make; reads
    within ``limits`` (see `loom.checkpoint.tensor_file`), whatever the bytes claim."""
    try:
        metadata, tensors, _ = read_tensor_file(io.BytesIO(data), len(data), limits)
    except ValueError as err:
        raise ValueError(f"not a state made by pack_state ({err})") from None
    return unpack_tensor_file(metadata, tensors, limits)
