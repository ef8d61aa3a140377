"""Memory measured, not assumed: this process's bytes by category, and its peak during a step.

**Which bytes are the training state** (`state_bytes`, `live_tensor_bytes`): tensors counted by *storage* (views
and shards that share memory once; a storage whole, padding included), each in the first category that claims
it: ``parameters`` (the model's parameters, FSDP2's local shards, the optimizer's pieces), ``gradients`` (their
``.grad``), ``optimizer`` (the optimizer's state). `state_bytes` counts those three from the model and the
optimizer (cheap enough for the step records); `live_tensor_bytes` also walks every tensor the garbage collector
tracks and counts the rest as ``other``: a walk of the heap, so ``job.memory()``'s, never the step's.

**How high the step went** (`StepMemory`): the process's RSS high-water mark, reset at a sampled step's start
(``5`` written to ``/proc/self/clear_refs`` sets ``VmHWM`` to the current RSS) and read at its end. RSS because a
memory limit kills a process for it and it counts allocations made in C++ (gloo's buffers, FSDP2's all-gather
outputs, autograd's saved tensors); a ``TorchDispatchMode`` tracker would see only tensors dispatched through
Python and interpose on every operation of the step (observing must not change the observed path); ``ru_maxrss``
cannot be reset. Limits: RSS includes what is not tensors (the interpreter and libraries) and memory the allocator
freed but kept; ranks run as threads of one process share one figure; without ``/proc/self/clear_refs`` (not
Linux) the peak is left out of the records. User-facing description: docs/strategies/sharded.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

__all__ = [
    "CATEGORIES",
    "MEMORY_EVERY",
    "StepMemory",
    "live_tensor_bytes",
    "peak_rss_bytes",
    "reset_peak_rss",
    "rss_bytes",
    "state_bytes",
]

CATEGORIES = ("parameters", "gradients", "optimizer", "other")
MEMORY_EVERY = 50
"""Steps between two memory samples in the step records (besides steps 1 and 2); a job's ``memory_every``."""


def _local(t: torch.Tensor) -> torch.Tensor:
    try:
        from torch.distributed.tensor import DTensor

        if isinstance(t, DTensor):
            return t._local_tensor
    except ImportError:  # pragma: no cover - torch without DTensor
        pass
    return t


def _storage(t: torch.Tensor) -> tuple[tuple[str, int], int] | None:
    """The storage behind ``t`` (its device and address) and its bytes; None without one, or an empty one."""
    t = _local(t)
    if t.device.type == "meta":
        return None
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without storage
        return None
    nbytes = int(storage.nbytes())
    return ((str(t.device), storage.data_ptr()), nbytes) if nbytes else None


def _storages(tensors: Iterable[torch.Tensor | None]) -> dict[tuple[str, int], int]:
    return dict(s for t in tensors if isinstance(t, torch.Tensor) and (s := _storage(t)) is not None)


def _claims(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[dict[tuple[str, int], int]]:
    groups = optimizer.param_groups if optimizer is not None else []
    params = [*module.parameters(), *(p for g in groups for p in g["params"])]
    states = optimizer.state.values() if optimizer is not None else []
    tensors = [v for s in states for v in s.values() if isinstance(v, torch.Tensor)]
    return [_storages(params), _storages(p.grad for p in params), _storages(tensors)]


def _count_claimed(counted: dict[str, int], seen: set, claims: list[dict[tuple[str, int], int]]) -> None:
    """Add each claimed storage not ``seen`` yet to the first category that claims it."""
    for category, claim in zip(CATEGORIES, claims, strict=False):
        for key, nbytes in claim.items():
            if key not in seen:
                seen.add(key)
                counted[category] += nbytes


def state_bytes(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """The training state's bytes: ``parameters``, ``gradients``, ``optimizer`` and their sum ``state``, each
    storage counted once, in the first category that claims it (no walk of the heap: cheap)."""
    counted: dict[str, int] = dict.fromkeys(CATEGORIES[:3], 0)
    _count_claimed(counted, set(), _claims(module, optimizer))
    counted["state"] = sum(counted.values())
    return counted


def live_tensor_bytes(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """This process's tensor bytes by category (the module docstring), plus ``state`` and ``total``: every
    tensor the garbage collector tracks, after a collection (a walk of the heap: not for every step)."""
    claims = _claims(module, optimizer)
    counted: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
    seen: set[tuple[str, int]] = set()
    gc.collect()
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor):  # type(): a proxy (torch.distributed.reduce_op) warns
            continue
        found = _storage(obj)
        if found is None or found[0] in seen:
            continue
        key, nbytes = found
        seen.add(key)
        category = next((c for c, claim in zip(CATEGORIES, claims, strict=False) if key in claim), "other")
        counted[category] += nbytes
    _count_claimed(counted, seen, claims)  # tensors reachable only from C++
    counted["state"] = counted["parameters"] + counted["gradients"] + counted["optimizer"]
    counted["total"] = counted["state"] + counted["other"]
    return counted


def rss_bytes() -> int | None:
    """This process's resident set size now (``/proc/self/statm``), or None where there is no ``/proc``."""
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return None


def reset_peak_rss() -> bool:
    """Reset the RSS high-water mark to the current RSS; False where the kernel does not offer it. First the
    allocator hands its free blocks back to the kernel (glibc's ``malloc_trim``), so that the next peak is of what
    is allocated from now on, not hidden in blocks that earlier work freed and the allocator kept."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")
        return True  # unless closing (the write's flush) fails: then False, below
    return False


def peak_rss_bytes() -> int | None:
    """The RSS high-water mark since the last `reset_peak_rss` (``VmHWM``), or None where unavailable."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return None


class StepMemory:
    """One sampled step: made as the step starts (it resets the peak), `fields` reads what the step's record
    carries after it. Which steps are sampled is the engine's rule (`loom.train.engine.Engine.memory_every`)."""

    def __init__(self) -> None:
        self.peak_reset = reset_peak_rss()
        self.start = rss_bytes()

    def fields(self, module: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        """``memory`` (the training state by category), ``rss_bytes`` and ``peak_rss_bytes`` where known."""
        found: dict[str, Any] = {"memory": state_bytes(module, optimizer)}
        if self.start is not None:
            found["rss_bytes"] = self.start
        peak = peak_rss_bytes() if self.peak_reset else None
        if peak is not None:
            found["peak_rss_bytes"] = peak
        return found
