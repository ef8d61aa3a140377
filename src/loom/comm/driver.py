"""Centralized ("driver") all-reduce: every rank sends to a root, the root reduces and sends the result back.

The baseline the ring is measured against, as in a parameter server with one shard: the root (rank 0 of the
group) sends (N-1) * D and receives (N-1) * D bytes for D bytes of data, so its link is the bottleneck and the
time grows linearly with N; every other rank sends and receives D. See `loom.comm.ring` for the
bandwidth-optimal alternative.

Limits: the root holds N-1 receive buffers at once ((N-1) * D extra memory) so that all receives proceed in
parallel; it reduces them in group-rank order, so the result is deterministic and identical on every rank.
Float16/bfloat16 are reduced in their own dtype, one rounding per add; ``avg`` sums then divides, so a float16
sum that overflows gives inf even when the mean would fit (divide first yourself if that matters).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from loom.comm._reduce import combine_into, group_rank_and_size

__all__ = ["all_reduce_driver"]


def all_reduce_driver(flat: torch.Tensor, op: str, group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """Centralized all-reduce of a contiguous 1-D tensor in place; returns (bytes sent, bytes received).
    Arguments are not checked: `loom.comm.all_reduce(t, algorithm="driver")` is the entry point."""
    rank, n = group_rank_and_size(group)
    if flat.numel() == 0:
        return 0, 0
    if rank != 0:  # ranks in ``group`` throughout, so an explicit group needs no default group behind it
        _wait_all([dist.isend(flat, group=group, group_dst=0)])
        _wait_all([dist.irecv(flat, group=group, group_src=0)])
        return flat.nbytes, flat.nbytes

    peers = range(1, n)
    incoming = [torch.empty_like(flat) for _ in peers]
    receives = [dist.irecv(buf, group=group, group_src=p) for buf, p in zip(incoming, peers, strict=True)]
    _wait_all(receives)
    for buf in incoming:
        combine_into(flat, buf, op)
    if op == "avg":
        flat.div_(n)
    _wait_all([dist.isend(flat, group=group, group_dst=peer) for peer in peers])
    return (n - 1) * flat.nbytes, (n - 1) * flat.nbytes


def _wait_all(works: list[dist.Work | None]) -> None:
    for work in works:
        if work is not None:  # None only for a process outside ``group``, which group_rank_and_size refuses
            work.wait()
