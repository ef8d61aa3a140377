"""Read a safetensors file piece by piece, checking its header against the file's size before allocating.

`read_tensor_file` checks the header's length against the file and `ReadLimits.max_header_bytes`, parses it
with `parse_json`, and checks that every dtype is known, every shape's bytes equal its offsets' span and the
spans tile the data exactly, *before* allocating anything; a header that lies fails with a ``ValueError``
naming the entry, after reading at most the header. Then each tensor is read straight into its own memory
(not the whole file into one buffer first, as ``safetensors.torch.load`` on bytes would), every byte hashed on
the way, so the caller compares the file's sha256 without a second read.
"""

from __future__ import annotations

import gc
import hashlib
import math
from typing import Any, BinaryIO

import torch

from loom.checkpoint.bounded_json import parse_json
from loom.checkpoint.confined import read_exact
from loom.checkpoint.limits import ReadLimits

__all__ = ["DTYPE_CODES", "read_header", "read_tensor_file"]

_DTYPE_NAMES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "C64": "complex64",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "BOOL": "bool",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8",
    "F8_E4M3": "float8_e4m3fn", "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2": "float8_e5m2", "F8_E5M2FNUZ": "float8_e5m2fnuz",
}  # fmt: skip
_DTYPES: dict[str, torch.dtype] = {
    code: getattr(torch, name) for code, name in _DTYPE_NAMES.items() if hasattr(torch, name)
}
DTYPE_CODES: dict[torch.dtype, str] = {dtype: code for code, dtype in _DTYPES.items()}
"""The safetensors code of each dtype it can hold (what `tree.PackedState` writes)."""
_MAX_DIM = 2**63 - 1
_MAX_RANK = 64


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_DIM


def _entry(name: str, entry: Any) -> tuple[torch.dtype, list[int], int, int]:
    """``(dtype, shape, begin, end)`` of one header entry, or ``ValueError`` naming what is off."""
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise ValueError(f"tensor {name!r}: the entry must hold exactly dtype, shape and data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise ValueError(f"tensor {name!r}: unknown dtype {str(dtype)[:40]!r}")
    if not isinstance(shape, list) or len(shape) > _MAX_RANK or not all(_is_count(d) for d in shape):
        raise ValueError(f"tensor {name!r}: shape {str(shape)[:80]} is not a list of sizes")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        raise ValueError(f"tensor {name!r}: data_offsets {str(offsets)[:80]} is not [begin, end]")
    begin, end = offsets
    nbytes = math.prod(shape) * _DTYPES[dtype].itemsize
    if end - begin != nbytes:
        raise ValueError(
            f"tensor {name!r}: {dtype} {shape} is {nbytes} bytes but its offsets [{begin}, {end}] span "
            f"{end - begin}"
        )
    return _DTYPES[dtype], shape, begin, end


def _layout(
    header: Any, data_size: int
) -> tuple[dict[str, str], list[tuple[str, torch.dtype, list[int], int]]]:
    """The metadata and the tensors in file order, checked to tile exactly ``data_size`` bytes."""
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError("__metadata__ must map strings to strings")
    checked = [(_entry(name, entry), name) for name, entry in header.items() if name != "__metadata__"]
    layout, position = [], 0
    for (dtype, shape, begin, end), name in sorted(checked, key=lambda item: item[0][2:]):
        if begin != position:
            raise ValueError(f"tensor {name!r} starts at {begin}, expected {position} (a gap or an overlap)")
        layout.append((name, dtype, shape, end - begin))
        position = end
    if position != data_size:
        raise ValueError(f"the tensors cover {position} bytes of data, but the file holds {data_size}")
    return metadata, layout


def read_header(file: BinaryIO, size: int, limit: int) -> bytes:
    """The first bytes of the safetensors file ``file`` of ``size`` bytes (read from its start): the header's
    8-byte length and the header; ``ValueError`` when it claims more than the file or ``limit`` holds."""
    if size < 8:
        raise ValueError(f"{size} bytes, too short for a safetensors header")
    prefix = read_exact(file, 8)
    length = int.from_bytes(prefix, "little")
    if length > min(size - 8, limit):
        raise ValueError(
            f"the header claims {length} bytes, but the file has {size - 8} after the length and the limit "
            f"is {limit}"
        )
    return prefix + read_exact(file, length)


def read_tensor_file(
    file: BinaryIO, size: int, limits: ReadLimits
) -> tuple[dict[str, str], dict[str, torch.Tensor], str]:
    """``(metadata, tensors, sha256)`` of the safetensors file ``file`` of ``size`` bytes (read from its
    start), or ``ValueError`` saying what is wrong before anything beyond the header is allocated.

    The cyclic garbage collector is paused meanwhile: the header's entries and the tensors are acyclic, and a
    header of the most entries the limits admit otherwise triggers collections over every object of the
    process."""
    paused = gc.isenabled()
    gc.disable()
    try:
        head = read_header(file, size, limits.max_header_bytes)
        digest = hashlib.sha256(head)
        try:
            header = parse_json(head[8:], limits, "max_header_bytes")
        except ValueError as err:
            raise ValueError(f"the header: {err}") from None
        metadata, layout = _layout(header, size - len(head))
        tensors = {}
        for name, dtype, shape, nbytes in layout:
            try:  # one tensor object each, not bytes, a view and a reshape: a header may list ~14k tensors
                tensor = torch.empty(shape, dtype=dtype)
            except RuntimeError as err:  # e.g. a shape of zero elements whose strides overflow
                raise ValueError(f"tensor {name!r}: cannot be shaped {shape} ({err})") from None
            if nbytes:
                view = tensor.reshape(-1).view(torch.uint8).numpy().data
                filled = 0
                while filled < nbytes:
                    count = file.readinto(view[filled:])  # type: ignore[attr-defined]
                    if not count:
                        raise ValueError(f"ended inside tensor {name!r} (changed while being read)")
                    filled += count
                digest.update(view)
            tensors[name] = tensor
        return metadata, tensors, digest.hexdigest()
    finally:
        if paused:
            gc.enable()
