"""Ring all-reduce: bandwidth-optimal, over point-to-point messages.

The idea (Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations", JPDC 2009;
popularized for deep learning by Baidu's ``baidu-allreduce``, 2017, and used by Horovod and NCCL): arrange the N
processes in a ring, each sending only to its right neighbour and receiving only from its left one, and split
the data into N chunks.

1. *Reduce-scatter*, N-1 steps: at step s, rank r sends chunk (r - s) and receives chunk (r - s - 1), which it
   reduces into its own copy. A chunk travels once round the ring picking up every contribution, so after N-1
   steps rank r holds chunk (r + 1) fully reduced.
2. *All-gather*, N-1 steps: the same rotation, but a received chunk overwrites the local one, so every rank ends
   with every reduced chunk.

Each process sends (and receives) 2 (N-1)/N * D bytes for D bytes of data, which is optimal: independent of N
for large N, against (N-1) * D at the root of a centralized reduce (`loom.comm.driver`).

Limits: 2 (N-1) latency-bound steps, so small tensors are faster with a tree or the backend's own algorithm;
chunks are balanced to within one element, so when D is not divisible by N ranks send slightly different amounts
(and with fewer elements than processes some chunks are empty and their messages skipped). Reductions run in the
tensor's dtype; for float16/bfloat16 each add rounds once, as the backends do. Each chunk is summed starting
from a different rank, so floating-point results can differ from `native` in the last bits; they are identical
on all ranks, since the all-gather copies one result everywhere. Synchronous: it returns when done.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from loom.comm._reduce import combine_into, exchange, global_rank, group_rank_and_size

__all__ = ["all_reduce_ring"]


def all_reduce_ring(flat: torch.Tensor, op: str, group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """Ring all-reduce of a contiguous 1-D tensor in place; returns (bytes sent, bytes received).

    Low level: arguments are not checked. Use `loom.comm.all_reduce(t, algorithm="ring")` as the entry point.
    """
    rank, n = group_rank_and_size(group)
    right = global_rank(group, (rank + 1) % n)
    left = global_rank(group, (rank - 1) % n)
    bounds = [i * flat.numel() // n for i in range(n + 1)]
    chunks = [flat[bounds[i] : bounds[i + 1]] for i in range(n)]
    scratch = torch.empty(max(c.numel() for c in chunks), dtype=flat.dtype, device=flat.device)
    sent = received = 0

    for step in range(n - 1):  # reduce-scatter
        outgoing = chunks[(rank - step) % n]
        target = chunks[(rank - step - 1) % n]
        incoming = scratch[: target.numel()]
        exchange(outgoing, right, incoming, left, group)
        combine_into(target, incoming, op)
        sent += outgoing.nbytes
        received += incoming.nbytes

    if op == "avg":  # divide the one chunk this rank owns, once, before it is copied everywhere
        chunks[(rank + 1) % n].div_(n)

    for step in range(n - 1):  # all-gather
        outgoing = chunks[(rank + 1 - step) % n]
        target = chunks[(rank - step) % n]
        exchange(outgoing, right, target, left, group)
        sent += outgoing.nbytes
        received += target.nbytes
    return sent, received
