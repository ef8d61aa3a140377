"""Desync detection: a cheap periodic check that every replica holds the same parameters.

Data parallelism keeps replicas identical only by construction: the same start, the same all-reduced gradient,
the same optimizer arithmetic. A bug (a rank skipping a step, a comm hook returning different values on
different ranks, a stray in-place edit, a bit flip) breaks that silently, and training goes on with replicas
that disagree. The check makes it loud: each rank computes a 64-bit fingerprint per parameter tensor, the ranks
all-gather these (8 bytes per tensor, one collective), and any rank whose fingerprints differ from the
majority's is named, with the first tensors that differ, on every rank alike (so nobody is left waiting).

The fingerprint is exact, not a float sum: the tensor's bits, read as integers, times position weights, summed
with 64-bit wrap-around on the device that holds the tensor. It changes when any single element changes, or
when two elements swap, and costs one pass over the parameters (no copy to the host). Replicas of a correct
data-parallel job are bitwise equal (every rank applies the same reduced gradient), so exact comparison gives
no false alarm.

Limits: two different tensors can share a fingerprint (a 2**-64 chance per tensor for unrelated changes); the
check compares parameters only (buffers such as BatchNorm statistics may legitimately differ between ranks when
buffers are not broadcast); it is meant for replicated strategies, not sharded ones.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from loom.fault import watchdog

__all__ = ["ReplicaDesyncError", "check_replicas_agree", "fingerprints"]

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64: spreads position weights over 64 bits


class ReplicaDesyncError(RuntimeError):
    """Replicas that should be identical hold different parameters."""


def _fingerprint(tensor: torch.Tensor, chunk: int = 1 << 20) -> torch.Tensor:
    """sum_i bits_i * w_i (mod 2**64), in chunks so the temporaries stay small (8 MB per chunk)."""
    flat = tensor.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    bits = flat.view(_INT_OF_SIZE[flat.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=bits.device)
    for start in range(0, bits.numel(), chunk):
        piece = bits[start : start + chunk].to(torch.int64)
        positions = torch.arange(start + 1, start + piece.numel() + 1, dtype=torch.int64, device=bits.device)
        total += (piece * (positions * _GOLDEN + 1)).sum()
    return total


def fingerprints(module: nn.Module) -> tuple[list[str], torch.Tensor]:
    """Names of ``module``'s parameters and a 64-bit fingerprint of each (an int64 tensor on their device)."""
    named = list(module.named_parameters())
    if not named:
        return [], torch.zeros(0, dtype=torch.int64)
    return [n for n, _ in named], torch.stack([_fingerprint(p) for _, p in named])


def check_replicas_agree(module: nn.Module, group: Any = None, *, step: int | None = None) -> None:
    """Raise `ReplicaDesyncError` on every rank of ``group`` unless all replicas of ``module`` are bitwise equal.

    A collective: every rank of ``group`` (default: the whole job) must call it at the same point. A no-op
    without a process group. The ranks that differ from the majority are named (on a tie, the side holding the
    lowest rank counts as the majority); ``step`` only goes into the message.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    names, mine = fingerprints(module)
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    with watchdog.collective("desync check"):
        dist.all_gather(gathered, mine, group=group)
    rows = [tuple(t.tolist()) for t in gathered]
    if len(set(rows)) == 1:
        return
    counts = Counter(rows)
    majority = max(counts, key=lambda row: (counts[row], -rows.index(row)))
    ranks = [_global_rank(i, group) for i in range(world)]
    differing = [ranks[i] for i, row in enumerate(rows) if row != majority]
    agreeing = [ranks[i] for i, row in enumerate(rows) if row == majority]
    first_bad = rows[ranks.index(differing[0])]
    tensors = [n for n, a, b in zip(names, majority, first_bad, strict=True) if a != b]
    shown = ", ".join(tensors[:5]) + (f" and {len(tensors) - 5} more" if len(tensors) > 5 else "")
    at = f" at step {step}" if step is not None else ""
    raise ReplicaDesyncError(
        f"replicas disagree{at}: ranks {differing} hold parameters different from ranks {agreeing} "
        f"(rank {differing[0]} differs in {shown}). HINT: every rank must apply the same update; look for "
        "rank-dependent code that touches the parameters, or a comm hook that returns different values per rank."
    )


def _global_rank(group_rank: int, group: Any) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)
