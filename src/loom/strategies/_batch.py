"""What every strategy does to a batch before its own work: take it apart, size it, slice it, move it.

A batch is ``(inputs, targets)`` as `loom.data.loader` yields it (a `Sequence` whose first two items are those);
``inputs`` may be a tensor or any nesting of lists, tuples and dicts of tensors whose first dimension is the
sample (a model with several inputs). Its size is that first dimension of the first tensor found, so every
tensor in a batch must share it: these helpers do not check that the others agree.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

__all__ = ["batch_len", "slice_batch", "split_batch", "tensors_in", "to_device"]


def split_batch(batch: Any) -> tuple[Any, torch.Tensor]:
    """``(inputs, targets)`` of ``batch``; a clear error for anything that is not such a pair."""
    if not isinstance(batch, Sequence) or isinstance(batch, (str, bytes)) or len(batch) < 2:
        got = type(batch).__name__ + (f" with keys {list(batch)[:8]}" if isinstance(batch, Mapping) else "")
        raise TypeError(
            f"a batch must be a pair (inputs, targets), got {got}. loom.data.loader collates samples as "
            "DataLoader does: a dataset returning a dict gives a dict, one tensor per sample gives a tensor. "
            "HINT: return (inputs, target) from the dataset's __getitem__, or pass a collate_fn=... that builds "
            "(inputs, targets) to job.loader / loom.data.loader."
        )
    return batch[0], batch[1]


def batch_len(inputs: Any) -> int:
    """Samples in ``inputs``: the first dimension of its first tensor (1 for a scalar)."""
    if isinstance(inputs, torch.Tensor):
        return int(inputs.shape[0]) if inputs.dim() else 1
    if isinstance(inputs, (list, tuple)) and inputs:
        return batch_len(inputs[0])
    if isinstance(inputs, dict) and inputs:
        return batch_len(next(iter(inputs.values())))
    raise TypeError(f"cannot tell the batch size of inputs of type {type(inputs).__name__}")


def slice_batch(value: Any, lo: int, hi: int) -> Any:
    """Samples ``lo:hi`` of every tensor in ``value``, keeping its nesting; other leaves are kept whole."""
    if isinstance(value, torch.Tensor):
        return value[lo:hi]
    if isinstance(value, (list, tuple)):
        return type(value)(slice_batch(v, lo, hi) for v in value)
    if isinstance(value, dict):
        return {k: slice_batch(v, lo, hi) for k, v in value.items()}
    return value


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor moved to ``device`` (non-blocking), keeping its nesting."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``value`` (a tensor, or any nesting of lists, tuples and dicts), in order."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from tensors_in(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from tensors_in(v)
