"""`reduce_scatter` and `all_gather` of a flat tensor cut into one contiguous piece per rank: the two halves of
an all-reduce, which sharded data parallelism uses apart (gradients reduce-scattered to the rank that owns their
piece, parameters all-gathered before they are used).

Pieces are balanced to within one element (`piece_bounds`, the same cut as `loom.data.sampler.share_bounds`
makes of a batch), so a tensor of any length works on any number of ranks; a rank's piece may be empty. Both run
on the backend (``torch.distributed``, gloo or NCCL) over an explicit group, padded to equal pieces because the
backends' collectives need them; bytes are recorded in `loom.comm.counters` as the bandwidth-optimal ring would
move them. Limit: gloo's reduce-scatter is an all-reduce per rank underneath (N times the optimal traffic).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from loom.comm._reduce import check_tensor, group_rank_and_size
from loom.comm.counters import counters

__all__ = ["all_gather", "piece_bounds", "reduce_scatter"]

# The ``*_tensor`` names are deprecated from torch 2.13 (a FutureWarning at every call) in favour of ``*_single``
# (the same arguments); torch 2.4-2.12 have only the former.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def piece_bounds(numel: int, rank: int, size: int) -> tuple[int, int]:
    """``[lo, hi)`` of rank ``rank``'s piece of ``numel`` elements cut into ``size`` pieces within one element."""
    return rank * numel // size, (rank + 1) * numel // size


def _padded(flat: torch.Tensor, size: int) -> tuple[torch.Tensor, int]:
    """``flat`` laid out as ``size`` pieces of equal width, each zero-padded at its end: ``flat`` itself where its
    pieces are already equal (no copy, which would cost a large part of the reduce-scatter)."""
    width = -(-flat.numel() // size)
    if width * size == flat.numel() and flat.is_contiguous():
        return flat, width
    padded = torch.zeros(width * size, dtype=flat.dtype, device=flat.device)
    for r in range(size):
        lo, hi = piece_bounds(flat.numel(), r, size)
        padded[r * width : r * width + hi - lo] = flat[lo:hi]
    return padded, width


def reduce_scatter(
    flat: torch.Tensor, op: str = "sum", group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """This rank's piece of ``flat`` summed (``op="sum"``) or averaged (``"avg"``) over ``group``.

    ``flat`` is 1-D and the same length on every rank of the group; the result is a new tensor of
    ``hi - lo`` elements for this rank's `piece_bounds`. Collective: every rank of ``group`` calls it."""
    if op not in ("sum", "avg"):
        raise ValueError(f"reduce_scatter supports op='sum' or 'avg', got {op!r}")
    check_tensor(flat, op)
    if flat.dim() != 1:
        raise ValueError(
            f"reduce_scatter takes a 1-D tensor, got shape {tuple(flat.shape)}. HINT: .reshape(-1)"
        )
    rank, size = group_rank_and_size(group)
    lo, hi = piece_bounds(flat.numel(), rank, size)
    if size == 1:
        return flat[lo:hi].clone()
    padded, width = _padded(flat, size)
    out = torch.empty(width, dtype=flat.dtype, device=flat.device)
    _reduce_scatter(out, padded, op=dist.ReduceOp.SUM, group=group)
    if op == "avg":
        out /= size
    moved = (size - 1) * width * flat.element_size()
    counters().record("reduce_scatter", moved, moved)
    return out[: hi - lo]


def all_gather(piece: torch.Tensor, numel: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The whole tensor of ``numel`` elements from every rank's piece (this rank's is ``piece``, of its
    `piece_bounds`). Collective: every rank of ``group`` calls it."""
    rank, size = group_rank_and_size(group)
    lo, hi = piece_bounds(numel, rank, size)
    if piece.dim() != 1 or piece.numel() != hi - lo:
        raise ValueError(
            f"all_gather: rank {rank}'s piece of a {numel}-element tensor over {size} ranks has {hi - lo} "
            f"elements, got a tensor of shape {tuple(piece.shape)}"
        )
    if size == 1:
        return piece.clone()
    width = -(-numel // size)
    out = torch.empty(numel, dtype=piece.dtype, device=piece.device)
    if width * size == numel:  # equal pieces: gathered in place, no copy in or out
        _all_gather(out, piece.contiguous(), group=group)
    else:
        mine = torch.zeros(width, dtype=piece.dtype, device=piece.device)
        mine[: hi - lo] = piece
        gathered = torch.empty(width * size, dtype=piece.dtype, device=piece.device)
        _all_gather(gathered, mine, group=group)
        for r in range(size):
            a, b = piece_bounds(numel, r, size)
            out[a:b] = gathered[r * width : r * width + b - a]
    moved = (size - 1) * width * piece.element_size()
    counters().record("all_gather", moved, moved)
    return out
