"""Horovod's helpers over the collectives: `broadcast_parameters`, `broadcast_optimizer_state`,
`broadcast_object`, `allgather_object` (objects as JSON plus tensors, `loom.horovod._objects`; never pickle)."""

from __future__ import annotations

import collections.abc
import itertools

import torch

from loom.horovod import basics
from loom.horovod._objects import from_bytes, to_bytes
from loom.horovod.collectives import allgather, broadcast_, broadcast_async_, synchronize

__all__ = ["allgather_object", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters"]


def broadcast_parameters(params, root_rank: int, process_set=basics.global_process_set) -> None:
    """Overwrite ``params`` in place with the root's: a ``state_dict()`` (taken in sorted key order) or a
    sequence of ``(name, tensor)`` such as ``named_parameters()``."""
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, collections.abc.Iterable):
        items = list(params)
    else:
        raise ValueError(
            f"invalid params of type {type(params).__name__}: pass a dict or (name, tensor) pairs"
        )
    handles = [broadcast_async_(p.data, root_rank, name=f"broadcast_parameters.{name}", process_set=process_set)
               for name, p in items if isinstance(p, torch.Tensor)]  # fmt: skip
    for handle in handles:
        synchronize(handle)


def broadcast_optimizer_state(optimizer, root_rank: int, model=None, process_set=basics.global_process_set):
    """Give every rank the root's optimizer state and hyperparameters (``param_groups``), in place. Where
    Horovod runs a dummy ``step()`` on ranks without state (which moves parameters under weight decay), loom
    loads the root's state (parameters untouched); parameters that require grad and have none get a zero
    gradient, as in Horovod."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    state = broadcast_object(optimizer.state_dict(), root_rank, name="broadcast_optimizer_state",
                             process_set=process_set)  # fmt: skip
    if basics.rank() != root_rank:
        optimizer.load_state_dict(state)


def broadcast_object(obj, root_rank: int = 0, name=None, process_set=basics.global_process_set):
    """The root's ``obj`` on every rank (sent as JSON plus tensors; `TypeError` for what that cannot hold)."""
    basics.check_process_set(process_set)
    name = name or "broadcast_object"
    data = to_bytes(obj) if basics.rank() == root_rank else b""  # never empty on the root (a header)
    length = torch.tensor([len(data)], dtype=torch.int64)
    broadcast_(length, root_rank, name=f"{name}.len", process_set=process_set)
    buf = torch.frombuffer(bytearray(data or int(length.item())), dtype=torch.uint8)  # zeros off the root
    broadcast_(buf, root_rank, name=f"{name}.data", process_set=process_set)
    return obj if basics.rank() == root_rank else from_bytes(buf.numpy().tobytes())


def allgather_object(obj, name=None, process_set=basics.global_process_set) -> list:
    """Every rank's ``obj``, as a list in rank order (JSON plus tensors, never pickle)."""
    basics.check_process_set(process_set)
    name = name or "allgather_object"
    data = to_bytes(obj)
    lengths = allgather(torch.tensor([len(data)], dtype=torch.int64), name=f"{name}.len").tolist()
    gathered = allgather(torch.frombuffer(bytearray(data), dtype=torch.uint8), name=f"{name}.data")
    raw = gathered.numpy().tobytes()
    ends = itertools.accumulate(lengths)
    return [from_bytes(raw[end - n : end]) for n, end in zip(lengths, ends, strict=True)]
