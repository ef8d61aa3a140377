"""Memory measured, not assumed: this process's bytes by category, counted by walking every live tensor.

`live_tensor_bytes` visits every tensor the Python garbage collector tracks (every tensor a Python object
refers to: parameters, gradients, optimizer state, FSDP2's shards and padding, activations kept alive),
counts each *storage* once (views and shards that share memory are not counted twice; a storage counts whole,
padding included) and sorts it into the first category that claims it: ``parameters`` (the model's parameters,
FSDP2's local shards), ``gradients`` (their ``.grad``, and the optimizer's pieces' ``.grad``), ``optimizer``
(the optimizer's state) and ``other`` (everything else alive in the process: data, buffers, the step's
buffers). ``state`` is the first three: the persistent training state that ZeRO shards.

`zero_share` is the issue's prediction: with Adam in fp32, 16 bytes per parameter on one process, of which
stage 1 keeps ``(4 + 4 + 8/N)/16`` per rank, stage 2 ``(4 + 12/N)/16`` and stage 3 ``16/N/16``.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["CATEGORIES", "live_tensor_bytes", "zero_share"]

CATEGORIES = ("parameters", "gradients", "optimizer", "other")


def _storage_key(t: torch.Tensor) -> tuple[str, int] | None:
    try:
        from torch.distributed.tensor import DTensor

        if isinstance(t, DTensor):
            t = t._local_tensor
    except ImportError:  # pragma: no cover - torch without DTensor
        pass
    if t.device.type == "meta":
        return None
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without storage
        return None
    return (str(t.device), storage.data_ptr()) if storage.nbytes() else None


def _storages(tensors: Iterable[torch.Tensor | None]) -> dict[tuple[str, int], int]:
    found = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            key = _storage_key(t)
            if key is not None:
                found[key] = _nbytes(t)
    return found


def _nbytes(t: torch.Tensor) -> int:
    try:
        from torch.distributed.tensor import DTensor

        if isinstance(t, DTensor):
            t = t._local_tensor
    except ImportError:  # pragma: no cover
        pass
    return int(t.untyped_storage().nbytes())


def live_tensor_bytes(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This process's tensor bytes by category (the module docstring), plus ``state`` and ``total``."""
    params = [*module.parameters(), *(p for g in optimizer.param_groups for p in g["params"])]
    grads = [p.grad for p in params]
    states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    claims = [_storages(params), _storages(grads), _storages(states)]
    counted: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
    seen: set[tuple[str, int]] = set()
    gc.collect()
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor):  # type(): a proxy (torch.distributed.reduce_op) warns
            continue
        key = _storage_key(obj)
        if key is None or key in seen:
            continue
        seen.add(key)
        category = next((c for c, claim in zip(CATEGORIES, claims, strict=False) if key in claim), "other")
        counted[category] += _nbytes(obj)
    for claim in claims:  # tensors reachable only from C++ (none expected) still count where they belong
        for key, nbytes in claim.items():
            if key not in seen:
                seen.add(key)
                category = CATEGORIES[claims.index(claim)]
                counted[category] += nbytes
    counted["state"] = counted["parameters"] + counted["gradients"] + counted["optimizer"]
    counted["total"] = counted["state"] + counted["other"]
    return counted


def zero_share(stage: int, world_size: int) -> float:
    """The fraction of the one-process training state (16 bytes per parameter: Adam in fp32) that ZeRO
    ``stage`` keeps per rank on ``world_size`` ranks."""
    n = world_size
    shares = {1: (4 + 4 + 8 / n) / 16, 2: (4 + 12 / n) / 16, 3: 1 / n}
    if stage not in shares:
        raise ValueError(f"stage must be 1, 2 or 3, got {stage!r}")
    return shares[stage]
