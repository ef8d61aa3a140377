"""A safe, typed encoding of Python objects for `broadcast_object`, `allgather_object` and elastic commits.

Horovod pickles these objects (cloudpickle), so a peer that can send bytes can run code on every rank. loom
never unpickles: an object becomes JSON (a tagged tree that keeps tuples, sets, non-string dict keys, bytes,
dtypes and non-finite floats apart) plus the raw bytes of the tensors and NumPy arrays it holds.

Supported: None, bool, int, float, complex, str, bytes, list, tuple, set, frozenset, dict (keys of any of
these types), torch.Tensor (dense), torch.dtype, torch.device, torch.Size, numpy arrays and numpy scalars.
Anything else raises `TypeError` naming its type and where it sits in the object, before anything is sent.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import torch

__all__ = ["decode", "encode", "from_bytes", "to_bytes"]


def encode(obj: Any) -> tuple[Any, list[torch.Tensor]]:
    """``(tree, tensors)``: a JSON-able tree, and the tensors it refers to by index."""
    tensors: list[torch.Tensor] = []
    return _enc(obj, tensors, "obj"), tensors


def _enc(obj: Any, tensors: list[torch.Tensor], path: str) -> Any:
    if obj is None or isinstance(obj, bool | str):
        return obj
    if isinstance(obj, int) and type(obj) is int:
        return obj
    if isinstance(obj, float) and type(obj) is float:
        return obj if math.isfinite(obj) else {"$": "float", "v": repr(obj)}
    if isinstance(obj, complex):
        return {"$": "complex", "v": [obj.real, obj.imag]}
    if isinstance(obj, bytes):
        return {"$": "bytes", "v": obj.hex()}
    if isinstance(obj, torch.Size):
        return {"$": "size", "v": list(obj)}
    if isinstance(obj, tuple) and type(obj) is tuple:
        return {"$": "tuple", "v": [_enc(x, tensors, f"{path}[{i}]") for i, x in enumerate(obj)]}
    if isinstance(obj, list) and type(obj) is list:
        return [_enc(x, tensors, f"{path}[{i}]") for i, x in enumerate(obj)]
    if isinstance(obj, set | frozenset) and type(obj) in (set, frozenset):
        items = [_enc(x, tensors, f"{path}{{}}") for x in obj]
        items.sort(key=lambda x: json.dumps(x, sort_keys=True))  # the same bytes whatever the hash order
        return {"$": type(obj).__name__, "v": items}
    if isinstance(obj, dict) and type(obj) is dict:
        if all(type(k) is str for k in obj) and "$" not in obj:
            return {k: _enc(v, tensors, f"{path}[{k!r}]") for k, v in obj.items()}
        pairs = [
            [_enc(k, tensors, f"{path}.key"), _enc(v, tensors, f"{path}[{k!r}]")] for k, v in obj.items()
        ]
        return {"$": "dict", "v": pairs}
    if isinstance(obj, torch.dtype):
        return {"$": "dtype", "v": str(obj).removeprefix("torch.")}
    if isinstance(obj, torch.device):
        return {"$": "device", "v": str(obj)}
    if isinstance(obj, torch.Tensor):
        if obj.layout != torch.strided:
            raise TypeError(f"{path}: only dense tensors can be sent, got a {obj.layout} tensor")
        tensors.append(obj.detach().to("cpu").contiguous())
        return {"$": "tensor", "i": len(tensors) - 1, "dtype": str(obj.dtype).removeprefix("torch."),
                "shape": list(obj.shape), "rg": bool(obj.requires_grad)}  # fmt: skip
    if isinstance(obj, np.ndarray) and obj.dtype.kind in "biufc":
        tensors.append(torch.from_numpy(np.ascontiguousarray(obj)).clone())
        return {"$": "ndarray", "i": len(tensors) - 1}
    if isinstance(obj, np.generic) and obj.dtype.kind in "biufc":
        return {"$": "npscalar", "dtype": obj.dtype.str, "v": _enc(obj.item(), tensors, path)}
    raise TypeError(
        f"{path}: an object of type {type(obj).__module__}.{type(obj).__qualname__} cannot be sent: loom sends "
        "objects as JSON plus tensors, never pickle. HINT: send its state as dicts, lists, numbers, strings "
        "and tensors"
    )


_FROM_VALUE: dict[str, Any] = {  # the tags whose "v" alone gives the object back
    "float": float, "complex": lambda v: complex(v[0], v[1]), "bytes": bytes.fromhex, "size": torch.Size,
    "dtype": lambda v: getattr(torch, v), "device": torch.device,
}  # fmt: skip


def decode(tree: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(tree, list):
        return [decode(x, tensors) for x in tree]
    if not isinstance(tree, dict):
        return tree
    tag = tree.get("$")
    if tag is None:
        return {k: decode(v, tensors) for k, v in tree.items()}
    v: Any = tree.get("v")
    if tag in _FROM_VALUE:
        return _FROM_VALUE[tag](v)
    if tag in ("tuple", "set", "frozenset"):
        return {"tuple": tuple, "set": set, "frozenset": frozenset}[tag](decode(x, tensors) for x in v)
    if tag == "dict":
        return {decode(k, tensors): decode(x, tensors) for k, x in v}
    if tag == "tensor":
        t = tensors[tree["i"]]
        return t.requires_grad_(True) if tree.get("rg") and t.is_floating_point() else t
    if tag == "ndarray":
        return tensors[tree["i"]].numpy()
    if tag == "npscalar":
        return np.dtype(tree["dtype"]).type(decode(v, tensors))
    raise ValueError(f"unknown tag {tag!r} in an encoded object")


def to_bytes(obj: Any) -> bytes:
    """One self-describing byte string: 8-byte header length, JSON header, then each tensor's raw bytes."""
    tree, tensors = encode(obj)
    layout = [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]
    header = json.dumps({"tree": tree, "tensors": layout}, separators=(",", ":")).encode()
    parts = [len(header).to_bytes(8, "little"), header]
    parts += [t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"" for t in tensors]
    return b"".join(parts)


def from_bytes(data: bytes) -> Any:
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    offset = 8 + n
    tensors: list[torch.Tensor] = []
    for dtype_name, shape in header["tensors"]:
        dtype: Any = getattr(torch, str(dtype_name), None)
        valid = isinstance(dtype, torch.dtype) and all(isinstance(d, int) and d >= 0 for d in shape)
        if not valid or math.prod(shape) * dtype.itemsize > len(data) - offset:
            raise ValueError(f"an encoded object's tensor {len(tensors)} ({dtype_name}, shape {shape}) is not "
                             f"within the {len(data)} bytes received")  # fmt: skip
        tensor = torch.empty(shape, dtype=dtype)
        flat = tensor.reshape(-1).view(torch.uint8).numpy()
        flat[:] = np.frombuffer(data, np.uint8, flat.size, offset)
        offset += flat.size
        tensors.append(tensor)
    return decode(header["tree"], tensors)
