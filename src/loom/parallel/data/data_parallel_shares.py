"""What uneven shares ask of a data-parallel step besides the weighting: BatchNorm and empty shares.

A share too small for BatchNorm in training mode (1 sample in a forward, where PyTorch would raise on one rank
only) is refused on every rank alike, naming the fix (`refuse_small_batchnorm_shares`); an empty share still
joins DDP's all-reduce through a forward whose loss is exactly zero (`zero_loss`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from loom.train.batch import tensors_in

__all__ = ["batchnorm_layers", "refuse_small_batchnorm_shares", "zero_loss"]


def batchnorm_layers(module: nn.Module) -> list[str]:
    """Names of the BatchNorm layers that compute statistics over this process's batch alone (not SyncBatchNorm,
    whose statistics span the processes)."""
    return [
        name or type(m).__name__
        for name, m in module.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, nn.SyncBatchNorm)
    ]


def zero_loss(outputs: Any) -> torch.Tensor:
    """A loss of exactly zero that still reaches every parameter the forward used (for empty shares).

    Built from the batch-shaped outputs (empty: their sums are 0); a scalar output (a model's own loss, NaN as
    the mean of nothing) is used only when there is none, through `nan_to_num`, whose gradient is 0 there."""
    floating = [t for t in tensors_in(outputs) if t.is_floating_point()]
    if not floating:
        raise TypeError("the model's outputs hold no floating-point tensor to build a zero loss from")
    shaped = [t.sum() for t in floating if t.dim() > 0]
    terms = shaped or [torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0) for t in floating]
    return torch.stack(terms).sum() * 0.0


def refuse_small_batchnorm_shares(
    rank: int, step: int, world: int, accumulate: int, batchnorm: list[str], small: dict[int, int], total: int
) -> None:
    """Raise, on every rank alike, for the ``small`` shares (rank: samples) of the global batch of ``total``
    at ``step``: the ``batchnorm`` layers need at least 2 samples per forward in training mode."""
    pieces = f" in {accumulate} micro-batches (accumulate)" if accumulate > 1 else ""
    need = f"2 x {world} replicas" + (f" x {accumulate} micro-batches" if accumulate > 1 else "")
    described = ", ".join(f"rank {r}: {n}" for r, n in small.items())
    layers = ", ".join(repr(n) for n in batchnorm[:3]) + (" ..." if len(batchnorm) > 3 else "")
    raise ValueError(
        f"rank {rank}: at step {step} the global batch of {total} sample(s) gives "
        f"shares too small for BatchNorm in training mode ({described}{pieces}); BatchNorm layers "
        f"({layers}) need at least 2 samples per forward to compute batch statistics. HINT: pass "
        "drop_last=True to job.loader(...) so the ragged last batch is dropped, and use a global batch of "
        f"at least {need} = {2 * world * accumulate} samples."
    )
