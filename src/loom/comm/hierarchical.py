"""Hierarchical all-reduce: shared memory within each host, a ring across hosts, one leader per host.

Two-level, as Horovod's hierarchical all-reduce and NCCL's intra-/inter-node split: memory inside a host is far
faster than the network, so cross the network once per host, not per process. For every piece of the tensor
(pieces and slots: `loom.comm.shm`):

1. within each host, `loom.comm.shm`'s shared-memory reduce-scatter leaves every local chunk reduced in the
   segment; the host's leader (its first process) copies them out, so it holds the host's sum;
2. the leaders all-reduce those sums with `loom.comm.ring`'s schedule among themselves (over loom's links or
   gloo's point-to-point messages: no extra process group);
3. each leader writes the result into the segment; after a barrier the other local processes copy it out.

Network traffic: a ring over H hosts, 2 (H-1)/H * D per leader and none for the others, instead of
2 (N-1)/N * D for every process of a flat ring. One host: it *is* `shm`; one process per host: a ring. Hosts may
hold different numbers of processes. ``avg`` sums and divides once at the end.

Limits: the three phases run one after another (no overlap between pieces); leaders copy more than the others;
shared memory's limits (`loom.comm.shm`) apply. Tests fake several hosts on one machine with ``$LOOM_HOST_ID``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from loom.comm.counters import Traffic
from loom.comm.ring import reduce_around
from loom.comm.shm import ShmContext, all_reduce_local, context_for, reduce_scatter_piece

__all__ = ["all_reduce_hierarchical"]


def _piece(ctx: ShmContext, part: torch.Tensor, op: str) -> Traffic:
    local_op = "sum" if op == "avg" else op
    size, leader = ctx.local_size, ctx.local_rank == 0
    m, esize = part.numel(), part.element_size()
    shm_sent = shm_received = sent = received = 0
    if size > 1:
        slots, bounds, shm_sent, shm_received = reduce_scatter_piece(ctx, part, local_op)
    if leader:
        if size > 1:
            for j in ctx.reduce_order:
                part[bounds[j] : bounds[j + 1]].copy_(slots[j][bounds[j] : bounds[j + 1]])
            shm_received += (m - bounds[1]) * esize
        # `loom.comm.ring`'s ring over the leaders only; for avg it sums, and divides each segment by the number
        # of processes once, after its last add
        leaders, divide_by = tuple(ctx.leaders), ctx.size if op == "avg" else 1
        sent, received = reduce_around(part, local_op, leaders, leaders.index(ctx.rank), ctx.group, divide_by)
        if size > 1:
            # Each chunk goes back to the place its owner reduced it in: nobody else touches those bytes
            # before the next piece's first barrier (see `loom.comm.shm` on why no third barrier is needed).
            for j in range(size):
                slots[j][bounds[j] : bounds[j + 1]].copy_(part[bounds[j] : bounds[j + 1]])
            shm_sent += m * esize
    if size > 1:
        ctx.barrier()
        if not leader:
            for j in range(size):
                part[bounds[j] : bounds[j + 1]].copy_(slots[j][bounds[j] : bounds[j + 1]])
            shm_received += m * esize
    return Traffic(sent, received, shm_sent, shm_received)


def all_reduce_hierarchical(flat: torch.Tensor, op: str, group: dist.ProcessGroup | None = None) -> Traffic:
    """Hierarchical all-reduce of a contiguous 1-D CPU tensor in place; returns its `Traffic`. Arguments are not
    checked: `loom.comm.all_reduce(t, algorithm="hierarchical")` is the entry point."""
    ctx = context_for(group)
    ctx.require_shared_memory("hierarchical", single_host=False, tensor=flat)
    if len(ctx.leaders) == 1:
        return all_reduce_local(ctx, flat, op)
    step = ctx.reserve(flat.nbytes) // flat.element_size()
    total = Traffic()
    for start in range(0, flat.numel(), step):
        total = total.plus(_piece(ctx, flat[start : start + step], op))
    return total
