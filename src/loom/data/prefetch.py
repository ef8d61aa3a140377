"""The next share gathered and copied to the GPU while the current step runs (a CUDA job's TensorDataset loader).

Why: docs/gpu.md#batches-on-the-gpu-ahead-of-the-step (every step ends in one GPU -> CPU sync, so a share
gathered only when asked for would leave the GPU waiting). Only where nothing of the user's runs off the main
thread: a `TensorDataset` collated by default, of CPU tensors (`usable`), for a CUDA job. `ShardedLoader` keeps
reporting the consumer's position, not the one fetched ahead.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

Ready = tuple[list[torch.Tensor], Any]
"""Tensors on the target device, and what the consumer waits on before using them (a CUDA event, or None)."""


def usable(tensors: Sequence[torch.Tensor], device: torch.device) -> bool:
    """Whether shares of ``tensors`` are worth prefetching to ``device``: CPU tensors for a CUDA device."""
    return (
        device.type == "cuda" and torch.cuda.is_available() and all(t.device.type == "cpu" for t in tensors)
    )


def _gather(tensors: Sequence[torch.Tensor], indices: torch.Tensor, pin: bool) -> list[torch.Tensor]:
    """Rows ``indices`` of each tensor, gathered in one copy (into pinned memory when ``pin``)."""
    out = []
    for t in tensors:
        buffer = torch.empty((indices.numel(), *t.shape[1:]), dtype=t.dtype, pin_memory=pin)
        out.append(torch.index_select(t, 0, indices, out=buffer))
    return out


class Prefetcher:
    """One background thread that gathers shares and, for a CUDA ``device``, copies them there on its own stream.

    ``start(tensors, indices)`` returns a future of `Ready`; ``take(ready)`` (on the consumer's thread) makes the
    consumer's current stream wait for the copy and returns the tensors. With a CPU ``device`` (the tests' dry
    run) the thread only gathers."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="loom-prefetch")
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def start(self, tensors: Sequence[torch.Tensor], indices: torch.Tensor) -> Future[Ready]:
        return self._pool.submit(self._fetch, tensors, indices)

    def _fetch(self, tensors: Sequence[torch.Tensor], indices: torch.Tensor) -> Ready:
        if self._stream is None:
            return _gather(tensors, indices, pin=False), None
        host = _gather(tensors, indices, pin=True)
        with torch.cuda.stream(self._stream):
            moved = [t.to(self.device, non_blocking=True) for t in host]
            done = torch.cuda.Event()
            done.record(self._stream)
        return moved, done

    def take(self, ready: Ready) -> list[torch.Tensor]:
        tensors, done = ready
        if done is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(done)
            for t in tensors:  # allocated on the side stream, used on this one: keep it from early reuse
                t.record_stream(current)
        return tensors
