"""Point-to-point messages between neighbouring pipeline stages: activations forward, gradients backward.

An activation message is a fixed-size int64 header (tensor count, then dtype code, rank and shape of each tensor)
followed by each tensor's raw data, so a stage can receive activations of a shape it has never seen (an uneven
last micro-batch, a sequence of another length) without pickle on the wire. A gradient message has no header: the
receiving stage knows the shapes, they are those of the activations it sent.

Sends are non-blocking (``isend``) so a stage never waits for its neighbour to post the matching receive; the
runtime keeps the handles and waits for them at the end of the step. Receives block: the stage needs the data.
Messages between two stages in one direction are matched in the order they were sent.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["MAX_DIMS", "MAX_TENSORS", "recv_gradients", "recv_tensors", "send_tensors"]

MAX_TENSORS = 8
MAX_DIMS = 6
_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]
_CODE = {dtype: i for i, dtype in enumerate(_DTYPES)}
_SLOT = 2 + MAX_DIMS


def _header(tensors: list[torch.Tensor]) -> torch.Tensor:
    if len(tensors) > MAX_TENSORS:
        raise ValueError(
            f"a pipeline stage passed {len(tensors)} tensors on; at most {MAX_TENSORS} are supported"
        )
    header = torch.zeros(1 + MAX_TENSORS * _SLOT, dtype=torch.int64)
    header[0] = len(tensors)
    for i, t in enumerate(tensors):
        if t.dtype not in _CODE:
            raise TypeError(f"cannot send a {t.dtype} tensor between pipeline stages")
        if t.dim() > MAX_DIMS:
            raise ValueError(f"cannot send a {t.dim()}-d tensor between pipeline stages (at most {MAX_DIMS})")
        base = 1 + i * _SLOT
        header[base] = _CODE[t.dtype]
        header[base + 1] = t.dim()
        header[base + 2 : base + 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return header


def send_tensors(tensors: list[torch.Tensor], dst: int, *, with_header: bool = True) -> list[Any]:
    """Start sending ``tensors`` to global rank ``dst``; returns the handles to wait for."""
    tensors = [t.detach().contiguous() for t in tensors]
    handles = []
    if with_header:
        header = _header(tensors)
        handles.append((dist.isend(header, dst), header))
    for t in tensors:
        handles.append((dist.isend(t, dst), t))  # the tensor is kept alive with its handle until waited
    return handles


def recv_tensors(src: int, device: torch.device) -> list[torch.Tensor]:
    """Receive one activation message (header, then tensors) from global rank ``src``."""
    header = torch.empty(1 + MAX_TENSORS * _SLOT, dtype=torch.int64)
    dist.recv(header, src)
    out = []
    for i in range(int(header[0])):
        base = 1 + i * _SLOT
        dtype = _DTYPES[int(header[base])]
        shape = header[base + 2 : base + 2 + int(header[base + 1])].tolist()
        t = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(t, src)
        out.append(t)
    return out


def recv_gradients(like: list[torch.Tensor], src: int) -> list[torch.Tensor]:
    """Receive one gradient per tensor of ``like`` (same shapes and dtypes) from global rank ``src``."""
    out = []
    for t in like:
        g = torch.empty_like(t)
        dist.recv(g, src)
        out.append(g)
    return out
