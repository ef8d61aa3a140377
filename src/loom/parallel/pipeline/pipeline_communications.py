"""Point-to-point messages between neighbouring pipeline stages: activations forward, gradients backward.

An activation message is a fixed-size int64 header (tensor count, then each tensor's dtype code, rank and shape)
followed by the raw tensors, so a stage receives shapes it has never seen (an uneven micro-batch, another sequence
length) without pickle on the wire. A gradient message has no header: its shapes are the activations' it answers.

Sends are non-blocking (the runtime waits for their handles at the end of the step), so a stage never waits for
its neighbour to post the receive; receives block; messages between two stages in one direction arrive in the
order sent. Stages are named by their ranks in the job's ``group`` (None: torch's default group). Two stages on one
host use shared memory instead (`loom.comm.shm_channel`), decided per pair and direction on the first message;
those messages always carry the header, so a gradient of the wrong shape is refused by name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from loom.comm.shm_channel import DTYPES, ShmReceiver, channel_from, channel_to

__all__ = [
    "MAX_DIMS", "MAX_TENSORS", "backend_messages", "recv_gradients", "recv_tensors", "send_tensors",
]  # fmt: skip

MAX_TENSORS = 8
MAX_DIMS = 6
_CODE = {dtype: i for i, dtype in enumerate(DTYPES)}
"""Dtype codes: shared memory's (`loom.comm.shm_channel.DTYPES`), so both paths carry the same dtypes."""
_SLOT = 2 + MAX_DIMS
_OFF: list[bool] = []
"""Non-empty inside `backend_messages`."""


@contextlib.contextmanager
def backend_messages() -> Iterator[None]:
    """Inside this block, messages take the backend even between stages of one host (benchmarks compare the
    two paths). Both ends of every message must be inside it, or both outside."""
    _OFF.append(True)
    try:
        yield
    finally:
        _OFF.pop()


def _receiver(src: int) -> ShmReceiver | None:
    return None if _OFF or not dist.is_initialized() else channel_from(src)


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
        slot = [_CODE[t.dtype], t.dim(), *t.shape]
        header[1 + i * _SLOT : 1 + i * _SLOT + len(slot)] = torch.tensor(slot, dtype=torch.int64)
    return header


def _job_group(group: Any) -> Any:
    return group if group is not None else dist.group.WORLD


def _recv(tensor: torch.Tensor, src: int, group: Any) -> None:
    """``dist.recv`` from ``src``, through ``irecv``: ``recv`` looks up the sender's global rank to return it,
    which a group built on a store (ranks as threads) does not know."""
    work = dist.irecv(tensor, group=group, group_src=src)
    if work is not None:  # None: this process is not in the group (never the job's)
        work.wait()


def send_tensors(
    tensors: list[torch.Tensor], dst: int, *, with_header: bool = True, group: Any = None
) -> list[Any]:
    """Start sending ``tensors`` to global rank ``dst``; returns the handles to wait for."""
    sender = None if _OFF or not dist.is_initialized() else channel_to(dst)
    if sender is not None:
        return sender.send(tensors)
    tensors = [t.detach().contiguous() for t in tensors]
    group = _job_group(group)
    sent = [_header(tensors), *tensors] if with_header else tensors  # each kept with its handle until waited
    return [(dist.isend(t, group=group, group_dst=dst), t) for t in sent]


def recv_tensors(src: int, device: torch.device, group: Any = None) -> list[torch.Tensor]:
    """Receive one activation message (header, then tensors) from global rank ``src``."""
    receiver = _receiver(src)
    if receiver is not None:
        return receiver.recv(device, "an activation message")
    group = _job_group(group)
    header = torch.empty(1 + MAX_TENSORS * _SLOT, dtype=torch.int64)
    _recv(header, src, group)
    out = []
    for i in range(int(header[0])):
        code, dims, *shape = header[1 + i * _SLOT : 1 + (i + 1) * _SLOT].tolist()
        t = torch.empty(shape[:dims], dtype=DTYPES[code], device=device)
        _recv(t, src, group)
        out.append(t)
    return out


def recv_gradients(like: list[torch.Tensor], src: int, group: Any = None) -> list[torch.Tensor]:
    """Receive one gradient per tensor of ``like`` (same shapes and dtypes) from global rank ``src``."""
    receiver = _receiver(src)
    if receiver is not None:
        got = receiver.recv(like[0].device if like else None, "a gradient message")
        if [(g.shape, g.dtype) for g in got] != [(t.shape, t.dtype) for t in like]:
            raise RuntimeError(
                f"rank {dist.get_rank()}: the gradients from rank {src} have shapes "
                f"{[(tuple(g.shape), g.dtype) for g in got]}, the activations sent to it "
                f"{[(tuple(t.shape), t.dtype) for t in like]}. HINT: a stage must return one gradient per "
                "floating-point tensor it received, of its shape (a bug in the pipeline runtime)."
            )
        return got
    out, group = [torch.empty_like(t) for t in like], _job_group(group)
    for g in out:
        _recv(g, src, group)
    return out
