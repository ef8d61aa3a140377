"""Ring all-reduce: bandwidth-optimal, over point-to-point messages, pipelined in segments.

Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations", JPDC 2009 (as in
Baidu's ``baidu-allreduce``, Horovod and NCCL): the N processes form a ring, each sending only to its right
neighbour and receiving only from its left one, and the data is split into N chunks.

1. *Reduce-scatter*, N-1 steps: at step s, rank r sends chunk (r - s) and receives chunk (r - s - 1), which it
   reduces into its own copy; after N-1 steps rank r holds chunk (r + 1) fully reduced.
2. *All-gather*, N-1 steps: the same rotation, but a received chunk overwrites the local one.

Each process sends (and receives) 2 (N-1)/N * D bytes for D bytes of data: optimal, and independent of N for
large N, against (N-1) * D at the root of a centralized reduce (`loom.comm.driver`).

*Pipelining* (as gloo's ``allreduce_ring_chunked`` and NCCL): each chunk is cut into S segments of at most
`SEGMENT_BYTES` (at least two for chunks of half of it or more), and the next `WINDOW` - 1 transfers are in
flight while the current segment is reduced, so transfer overlaps reduction and the all-gather starts before
the reduce-scatter ends. The schedule is data (`ring_schedule`, tested without processes); `run_ring` runs it.
Segment j of step s depends only on segment j of step s-1, S transfers earlier, so a window of at most S never
sends a segment before it is reduced. Reduce-scatter segments land in a per-thread scratch buffer
(`loom.comm._reduce.scratch_buffer`) and are added in place; the all-gather receives straight into the result.
Two processes and a tensor under `EXCHANGE_BELOW_BYTES`: one exchange instead (`exchange_schedule`).

*Transport* (`TRANSPORT`): loom's own TCP links between neighbours (`loom.comm.links`), transfer after transfer,
in segments of `LINK_SEGMENT_BYTES`; where a link cannot be made, gloo's point-to-point calls with the window
above, in segments of `SEGMENT_BYTES`, large (MiB) because each gloo message has a fixed cost well above a
link's (``benchmarks/reports/allreduce.md``).

Limits: 2 (N-1) latency-bound steps, so small tensors are faster with a tree or the backend's own algorithm.
Chunks are balanced to within one element (with fewer elements than processes some are empty and their
messages skipped). Reductions run in the tensor's dtype (float16/bfloat16 round once per add, as the
backends do). Each chunk is summed from a different rank, so results can differ from `native` in the last bits,
but are identical on all ranks (the all-gather copies one result everywhere). Synchronous. The segments of one
call share a message tag, relying on gloo delivering one pair's messages in posting order.
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
"""Largest message of the pipelined ring over gloo; a chunk of at least half of it is cut in at least two
segments, so that every reduction has a transfer to hide behind (gloo's own ring always cuts chunks in two).
Smaller segments overlap more, but every gloo message has a fixed cost (``benchmarks/reports/allreduce.md``)."""
WINDOW = 2
"""Transfers in flight at once: the one being reduced and the next one arriving."""
TRANSPORT = "links"
"""How ring messages travel: ``"links"``, loom's authenticated TCP links between neighbours when the whole ring
can have them (`loom.comm.links`; else gloo), or ``"gloo"``, gloo's point-to-point calls only (the benchmark
times both)."""
LINK_SEGMENT_BYTES = 1 << 20
"""`SEGMENT_BYTES` over loom's links, where a message costs little: smaller segments let the reduction of one
overlap the arrival of the next."""
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

    Every rank cuts chunk c into the same segments (they depend only on the chunk's length), so transfer k of
    rank r sends exactly what transfer k of rank r+1 receives. ``scratch`` (``window`` longest segments, as
    `reduce_around` sizes it) receives the reduce-scatter's segments in rotation; None allocates it.
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

    Why: with two processes the reduce-scatter and all-gather each send one half, the same bytes as one exchange
    of the whole tensor, which needs one round of messages instead of two dependent ones; reducing the whole
    tensor instead of half costs little next to a message for a small tensor, while a large one is faster through
    the pipelined ring, hence `EXCHANGE_BELOW_BYTES` (``benchmarks/reports/allreduce.md``). Both processes combine
    the same two values in opposite orders, so results are identical (IEEE addition, max and min commute);
    `run_ring` waits for the send before combining into the tensor it sent.
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

    With a ``link`` (`loom.comm.links`) the transfers run one after the other, the window unused: while a segment
    is reduced the next keeps arriving into the kernel's socket buffer. Without one, through gloo's
    point-to-point calls: transfer k+window is sent only once transfer k is done (received, reduced, sent).
    Receives run ahead, in transfer order (gloo matches one pair's messages in posting order): a reduce-scatter
    receive lands in scratch, so it waits for the same window (its slot must be free); an all-gather receive
    lands in the result and is posted as soon as every earlier receive is, which is safe because its data can
    only arrive once the segment is fully reduced, after this rank's last touch of it. A receive posted before
    its message arrives saves a round of gloo's matching. Empty buffers are skipped on both ends.
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
    """Ring all-reduce of a contiguous 1-D tensor in place; returns (bytes sent, bytes received).

    Low level: arguments are not checked. Use `loom.comm.all_reduce(t, algorithm="ring")` as the entry point.
    """
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
    """`run_ring` for ring member ``position`` of ``members`` (ranks in ``group``, in ring order):
    over loom's links when `TRANSPORT` allows and the ring can have them (made on first use, a collective of
    the ring), else over gloo; ``op`` is not avg. Returns (bytes sent, bytes received).

    The schedule, in this thread's scratch buffer: one exchange for two members and a small tensor, else the
    pipelined ring, in segments sized for the transport (the same on every member: the ring has links
    everywhere or nowhere)."""
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
