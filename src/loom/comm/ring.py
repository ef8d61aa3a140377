"""Ring all-reduce: bandwidth-optimal, over point-to-point messages, pipelined in segments.

Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations", JPDC 2009 (as in
Horovod and NCCL): the N processes form a ring, each sending only to its right neighbour, and the data is split
into N chunks. N-1 *reduce-scatter* steps (at step s rank r sends chunk r - s and reduces the chunk it receives
into its own) leave rank r holding chunk r + 1 fully reduced; N-1 *all-gather* steps pass the reduced chunks
around. Each process sends 2 (N-1)/N * D bytes for D bytes of data, against (N-1) * D at the root of a
centralized reduce (`loom.comm.driver`).

*Pipelining* (as gloo's ``allreduce_ring_chunked`` and NCCL): chunks are cut into segments and up to `WINDOW`
transfers are in flight, so transfer overlaps reduction. The schedule is data (`ring_schedule`, tested without
processes); `run_ring` runs it over `TRANSPORT`. Two processes and a tensor under `EXCHANGE_BELOW_BYTES`: one
exchange instead (`exchange_schedule`).

Limits: 2 (N-1) latency-bound steps, so small tensors are faster with a tree or the backend's own algorithm.
Reductions run in the tensor's dtype (float16/bfloat16 round once per add, as the backends do). Each chunk is
summed from a different rank, so results can differ from `native` in the last bits, but are identical on all
ranks (the all-gather copies one result everywhere). Synchronous.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from loom.comm._reduce import combine_into, group_rank_and_size, scratch_buffer
from loom.comm.links import RingLink, ring_link

__all__ = [
    "EXCHANGE_BELOW_BYTES",
    "LINK_SEGMENT_BYTES",
    "SEGMENT_BYTES",
    "TRANSPORT",
    "WINDOW",
    "Transfer",
    "all_reduce_ring",
    "exchange_schedule",
    "reduce_around",
    "ring_schedule",
    "run_ring",
]

SEGMENT_BYTES = 8 << 20
"""Largest message of the pipelined ring over gloo, large because every gloo message has a fixed cost
(``benchmarks/reports/allreduce.md``); a chunk of half of it or more is cut in at least two segments, so that
every reduction has a transfer to hide behind."""
WINDOW = 2
"""Transfers in flight at once: the one being reduced and the next one arriving."""
TRANSPORT = "links"
"""How ring messages travel: ``"links"``, loom's authenticated TCP links between neighbours when the whole ring
can have them (`loom.comm.links`; else gloo), or ``"gloo"``, gloo's point-to-point calls only."""
LINK_SEGMENT_BYTES = 1 << 20
"""`SEGMENT_BYTES` over loom's links, where a message costs little, so a segment's reduction overlaps the next's
arrival."""
EXCHANGE_BELOW_BYTES = 1 << 20
"""With two processes, tensors smaller than this are reduced by one exchange (`exchange_schedule`)."""


class Transfer(NamedTuple):
    """One step of one segment: send ``send`` right while receiving ``recv`` from the left."""

    send: torch.Tensor
    recv: torch.Tensor
    reduce_into: torch.Tensor | None
    """Reduce-scatter: where ``recv`` is combined (then ``recv`` is scratch). All-gather: None (``recv`` is the
    result itself)."""
    divide: bool
    """The last reduction of this segment: divide it by the ``divide_by`` of `run_ring` (for ``avg``)."""


def _segment(t: torch.Tensor, j: int, segments: int) -> torch.Tensor:
    m = t.numel()
    return t[j * m // segments : (j + 1) * m // segments]


def ring_schedule(
    flat: torch.Tensor,
    position: int,
    size: int,
    scratch: torch.Tensor | None = None,
    segment_bytes: int = SEGMENT_BYTES,
    window: int = WINDOW,
) -> tuple[list[Transfer], int]:
    """The transfers of rank ``position`` of a ring of ``size`` for ``flat``, and the window to run them with.

    Every rank cuts chunk c into the same segments, so transfer k of rank r sends exactly what transfer k of rank
    r+1 receives. The window is at most the segments per chunk S: segment j of step s depends on segment j of step
    s-1, S transfers earlier. ``scratch`` (``window`` longest segments) receives the reduce-scatter's segments in
    rotation; None allocates it.
    """
    bounds = [i * flat.numel() // size for i in range(size + 1)]
    chunks = [flat[bounds[i] : bounds[i + 1]] for i in range(size)]
    segments, window, longest = _shape(flat, size, segment_bytes, window)
    if scratch is None:
        scratch = torch.empty(window * longest, dtype=flat.dtype, device=flat.device)
    transfers: list[Transfer] = []
    for step in range(size - 1):  # reduce-scatter
        outgoing, target = chunks[(position - step) % size], chunks[(position - step - 1) % size]
        for j in range(segments):
            into = _segment(target, j, segments)
            slot = len(transfers) % window * longest
            incoming = scratch[slot : slot + into.numel()]
            transfers.append(Transfer(_segment(outgoing, j, segments), incoming, into, step == size - 2))
    for step in range(size - 1):  # all-gather
        outgoing, target = chunks[(position + 1 - step) % size], chunks[(position - step) % size]
        for j in range(segments):
            transfers.append(
                Transfer(_segment(outgoing, j, segments), _segment(target, j, segments), None, False)
            )
    return transfers, window


def exchange_schedule(flat: torch.Tensor, scratch: torch.Tensor | None = None) -> tuple[list[Transfer], int]:
    """The one transfer of either process of a ring of two, for a small tensor: send all of ``flat`` while
    receiving the other's into ``scratch`` (``flat.numel()`` elements; None allocates), then combine into ``flat``.

    Why: with two processes the ring sends the same bytes as one exchange, in two dependent rounds instead of
    one; reducing the whole tensor costs little next to a message while it is small (`EXCHANGE_BELOW_BYTES`).
    Results are identical on both (IEEE addition, max and min commute).
    """
    if scratch is None:
        scratch = torch.empty_like(flat)
    return [Transfer(flat, scratch[: flat.numel()], flat, True)], 1


def _shape(flat: torch.Tensor, size: int, segment_bytes: int, window: int) -> tuple[int, int, int]:
    """(segments per chunk, window, elements of the longest segment)."""
    longest_chunk = -(-flat.numel() // size)
    chunk_bytes = longest_chunk * flat.element_size()
    segments = max(-(-chunk_bytes // segment_bytes), 2 if 2 * chunk_bytes >= segment_bytes else 1)
    return segments, max(1, min(window, segments)), -(-longest_chunk // segments)


def run_ring(
    transfers: list[Transfer],
    window: int,
    op: str,
    right: int,
    left: int,
    group: dist.ProcessGroup | None,
    divide_by: int = 1,
    link: RingLink | None = None,
) -> tuple[int, int]:
    """Run a `ring_schedule` with up to ``window`` transfers in flight; return (bytes sent, bytes received).

    With a ``link`` (`loom.comm.links`) the transfers run one after the other (the next segment arrives into the
    socket buffer while one is reduced). Over gloo, transfer k+window is sent once transfer k is done; receives
    are posted ahead (saving a round of gloo's matching), in transfer order (gloo matches one pair's messages in
    posting order, so one tag serves the call): a reduce-scatter receive waits for its scratch slot, an
    all-gather one is posted at once (its data can only arrive once the segment is fully reduced). Empty buffers
    are skipped on both ends.
    ``right``/``left`` are ranks in ``group`` (global ranks when it is None).
    """
    moved = sum(t.send.nbytes for t in transfers), sum(t.recv.nbytes for t in transfers)
    if link is not None:
        for transfer in transfers:
            link.exchange(transfer.send, transfer.recv)
            _reduce_received(transfer, op, divide_by)
        return moved
    count = len(transfers)
    receiving: list[dist.Work | None] = [None] * count
    sending: list[dist.Work | None] = [None] * count
    next_recv = next_send = 0
    for k, transfer in enumerate(transfers):
        while next_recv < count and (transfers[next_recv].reduce_into is None or next_recv < k + window):
            recv = transfers[next_recv].recv
            if recv.numel():  # a None work happens only outside ``group``, which the entry point refuses
                receiving[next_recv] = dist.irecv(recv, group=group, group_src=left)
            next_recv += 1
        while next_send < min(count, k + window):
            send = transfers[next_send].send
            if send.numel():
                sending[next_send] = dist.isend(send, group=group, group_dst=right)
            next_send += 1
        for work in (receiving[k], sending[k]):
            if work is not None:
                work.wait()
        receiving[k] = sending[k] = None
        _reduce_received(transfer, op, divide_by)
    return moved


def _reduce_received(transfer: Transfer, op: str, divide_by: int) -> None:
    if transfer.reduce_into is not None and transfer.recv.numel():
        combine_into(transfer.reduce_into, transfer.recv, op)
        if transfer.divide and divide_by != 1:
            transfer.reduce_into.div_(divide_by)


def all_reduce_ring(flat: torch.Tensor, op: str, group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """Ring all-reduce of a contiguous 1-D tensor in place; returns (bytes sent, bytes received). Arguments are
    not checked: `loom.comm.all_reduce(t, algorithm="ring")` is the entry point."""
    rank, n = group_rank_and_size(group)
    # avg: each segment is divided once, by its owner after its last reduction, before it is copied everywhere
    local_op, divide_by = ("sum", n) if op == "avg" else (op, 1)
    return reduce_around(flat, local_op, tuple(range(n)), rank, group, divide_by)


def reduce_around(
    flat: torch.Tensor,
    op: str,
    members: tuple[int, ...],
    position: int,
    group: dist.ProcessGroup | None,
    divide_by: int = 1,
) -> tuple[int, int]:
    """`run_ring` for ring member ``position`` of ``members`` (ranks in ``group``, in ring order), in this thread's
    scratch buffer: over loom's links when `TRANSPORT` allows and the ring can have them (made on first use, a
    collective of the ring; everywhere or nowhere), else over gloo; ``op`` is not avg. Returns (bytes sent,
    bytes received)."""
    size = len(members)
    link = ring_link(group, members, position, flat) if TRANSPORT == "links" else None
    if size == 2 and flat.nbytes < EXCHANGE_BELOW_BYTES:
        transfers, window = exchange_schedule(flat, scratch_buffer(flat.numel(), flat.dtype, flat.device))
    else:
        segment_bytes = LINK_SEGMENT_BYTES if link else SEGMENT_BYTES
        _, window, longest = _shape(flat, size, segment_bytes, WINDOW)
        scratch = scratch_buffer(window * longest, flat.dtype, flat.device)
        transfers, window = ring_schedule(flat, position, size, scratch, segment_bytes)
    right, left = members[(position + 1) % size], members[(position - 1) % size]
    return run_ring(transfers, window, op, right, left, group, divide_by, link)
