"""The transport measured by loom's own code, inside a ``loom run -n N`` job of `loom.plan.trial`.

`measure_transport` times the very calls the strategies make: every all-reduce algorithm `loom.comm.auto` would
choose between, `loom.comm.reduce_scatter`, `loom.comm.all_gather`, point-to-point ``send``/``recv`` between rank
pairs, and one authenticated parameter-server frame (`loom.ps.wire`, `loom.ps.gate`) over a ZeroMQ TCP loopback
pair, ``ps_encode`` (the sender's work and the transfer) apart from ``ps_decode`` (the receiver's): a server
decodes every worker's frame in turn while the workers encode theirs at once. Each operation is measured only up
to the largest message the plan needs of it (``limits``; ``inf`` above, which `Transport.time` refuses). As
`loom.comm.auto` calibrates: each call after a barrier, each entry the slowest rank's time (an all-reduce MAX),
the median of the repetitions kept (how many: `REPS_BUDGET_S`; in which order: `INTERLEAVED_BYTES`).
"""

from __future__ import annotations

import functools
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from loom.plan.profile import budgeted
from loom.plan.transport import Transport, envelope

__all__ = ["REPS", "agreed_reps", "measure_transport", "rank_max"]


REPS_BUDGET_S = 0.1
"""Timed repetitions of one operation stop at about this much time (at least one): a large message is timed once
after its warm-up, a small one `REPS` times. Large messages are bandwidth-bound and vary little; a spike at one
size is capped by a larger size's time (`envelope`)."""


REPS = 15
"""Repetitions of a short measurement (a transport operation at one size, the overlap's backward): their median is
the figure (latency-bound sizes are the noisy ones on a busy host); a long one stops at its time budget first, so a
large model costs no more."""


def rank_max(values: list, group: Any) -> list:
    """Each of ``values`` (numbers, or equal rows of them) at its largest over the group's ranks, as float64 (a
    collective: every rank calls it)."""
    largest = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
    return largest.tolist()


def agreed_reps(first_s: float, most: int, group: Any, budget_s: float, least: int = 1) -> int:
    """`loom.plan.profile.budgeted` on the slowest rank's ``first_s``: the same count on every rank (the loops
    it sizes run collectives)."""
    return budgeted(rank_max([first_s], group)[0], most, budget_s, least)


def _call(fn: Callable[[], object], group: Any) -> float:
    """Seconds of one call of the collective ``fn`` on this rank, started after a barrier (a late rank would be
    charged to the others)."""
    dist.barrier(group=group)
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


@dataclass
class _Timing:
    """One operation at one size: this rank's seconds of each timed call, and how many it gets."""

    name: str
    index: int
    fn: Callable[[], object]
    reps: int
    seconds: list[float] = field(default_factory=list)


INTERLEAVED_BYTES = 4 << 20
"""Collectives up to this many bytes have their timed calls made in rounds over every operation and size, one
call each a round (`_complete`), rather than one after the other (`measure_transport`): what disturbs a busy host
(another process scheduled, a late wake-up) comes in phases longer than one size's calls, and would raise one
size's median for every operation at once. Larger messages are timed at once (a call long enough to span such a
phase; their buffers are not all kept for the rounds), and so are the parameter servers' frames, after the
collectives of their size (a frame's decode is of the frame its encode just delivered; its fresh buffers come
from the allocator in the state many calls leave it, as a training loop does), the smaller sizes' after every
collective."""


def _p2p(data: torch.Tensor, rank: int, world: int, group: Any) -> None:
    """Each even rank exchanges one message each way with the odd rank after it (a pipeline boundary)."""
    peer = rank + 1 if rank % 2 == 0 else rank - 1
    if peer >= world:
        return
    recv = torch.empty_like(data)
    if rank % 2 == 0:
        dist.send(data, peer, group=group)
        dist.recv(recv, peer, group=group)
    else:
        dist.recv(recv, peer, group=group)
        dist.send(data, peer, group=group)


class _FrameRig:
    """A ZeroMQ PAIR over TCP loopback inside this process, and the parameter servers' frame code around it."""

    def __init__(self) -> None:
        import zmq

        from loom.ps.gate import Inbox, InboxLimits, chunk_key
        from loom.ps.wire import WireLimits

        self.secret = os.urandom(32)
        self.key = chunk_key(self.secret)
        self.limits = WireLimits()
        self.context = zmq.Context()
        self.send, self.receive = self.context.socket(zmq.PAIR), self.context.socket(zmq.PAIR)
        port = self.send.bind_to_random_port("tcp://127.0.0.1")
        self.receive.connect(f"tcp://127.0.0.1:{port}")
        whole = InboxLimits(total_bytes=self.limits.max_frame)
        self.inbox = Inbox(self.key, self.limits, whole, lambda _: None)
        self.seq = 0
        self.arrived: bytes | memoryview = b""

    def encode(self, data: torch.Tensor) -> None:
        from loom.ps.gate import split_frame
        from loom.ps.wire import MessageType, encode

        if data.nbytes > self.limits.max_payload:  # its receiver would drop it: the loop below would not end
            raise ValueError(f"a frame of {data.nbytes} bytes is above the wire's {self.limits.max_payload}")
        self.seq += 1
        frame = encode(self.secret, MessageType.PUSH, epoch=1, session=1, seq=self.seq, tensors={"g0": data})
        for chunk in split_frame(self.key, frame):
            self.send.send(chunk, copy=False)
        whole = None
        while whole is None:
            whole = self.inbox.receive(b"", self.receive.recv(copy=False).buffer, time.monotonic())
        self.arrived = whole

    def decode(self) -> None:
        from loom.ps.wire import decode

        decode(self.secret, self.arrived, self.limits)

    def close(self) -> None:
        self.context.destroy(linger=0)


def _operations(
    size: int,
    algorithms: tuple[str, ...],
    rank: int,
    world: int,
    group: Any,
    rig: _FrameRig | None,
    small: Any,
) -> dict[str, Callable[[], object]]:
    """Each timed operation on a float32 message of ``size`` bytes (frames only with a ``rig``; the one-barrier
    shared-memory all-reduce of tensor-parallel layers, ``small_allreduce``, with ``small``, up to its size)."""
    from loom.comm import all_gather, all_reduce, piece_bounds, reduce_scatter

    data = torch.zeros(size // 4, dtype=torch.float32)
    lo, hi = piece_bounds(data.numel(), rank, world)
    ops: dict[str, Callable[[], object]] = {}
    for a in algorithms:
        ops[f"allreduce:{a}"] = functools.partial(all_reduce, data, "sum", algorithm=a, group=group)
    if small is not None:
        ops["small_allreduce"] = functools.partial(small.all_reduce, data)
    ops["reduce_scatter"] = lambda: reduce_scatter(data, "sum", group=group)
    ops["all_gather"] = lambda: all_gather(data[lo:hi].clone(), data.numel(), group=group)
    ops["p2p"] = lambda: _p2p(data, rank, world, group)
    if rig is not None:
        ops["ps_encode"] = lambda: rig.encode(data)
        ops["ps_decode"] = rig.decode  # the frame ps_encode just delivered (timed right after it)
    return ops


def _words(nbytes: int) -> int:
    """``nbytes`` rounded up to whole float32 words (the messages are float32), at least one."""
    return max(4, -(-int(nbytes) // 4) * 4)


def measure_transport(sizes: list[int], limits: dict[str, int] | None = None) -> Transport:
    """Time every operation at every size on the job's group (a collective: every rank calls it), each up to
    its family's limit in ``limits`` (``allreduce``, ``reduce_scatter``, ``all_gather``, ``p2p``, ``ps``: bytes;
    ``inf`` above; a family not named is measured at every size, except ``ps``: none measured). On one host
    also ``small_allreduce``, `loom.comm.shm_small`'s, up to its largest message."""
    from loom.comm.auto import candidates
    from loom.comm.shm import context_for
    from loom.comm.shm_small import MAX_BYTES as SMALL_MAX
    from loom.comm.shm_small import SmallAllReduce
    from loom.ps.wire import WireLimits
    from loom.topology import current

    group = current().group
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = sorted({_words(s) for s in sizes})
    algorithms = candidates(context_for(group))
    names = [f"allreduce:{a}" for a in algorithms] + ["reduce_scatter", "all_gather", "p2p"]
    limits = dict(limits or {})
    # a larger frame is dropped by its receiver
    limits["ps"] = min(limits.get("ps", 0), WireLimits().max_payload)
    rig = _FrameRig() if limits["ps"] else None
    names += ["ps_encode", "ps_decode"] if rig else []
    small = SmallAllReduce.for_group(group) if "shm" in algorithms else None
    if small is not None:  # TensorParallelComm's below its size (`loom.plan.cost`'s tensor parallelism)
        names.append("small_allreduce")
        limits["small_allreduce"] = min(limits.get("small_allreduce", SMALL_MAX), SMALL_MAX)
    seconds = {name: [math.inf] * len(sizes) for name in names}  # inf: above its limit, not measured
    timings: list[_Timing] = []
    try:
        calls = _in_order(
            sizes, limits, lambda size: _operations(size, algorithms, rank, world, group, rig, small)
        )
        for call in calls:
            if call is None:
                _complete([t for t in timings if len(t.seconds) < t.reps], group, rounds=True)
                continue
            index, name, fn, at_once = call
            timings.append(_first_call(name, index, fn, REPS, group, timings, not at_once))
            if at_once:
                _complete([timings[-1]], group)
                timings[-1].fn = lambda: None  # its calls are all made: its message's buffer is not kept
    finally:
        if rig is not None:
            rig.close()
    # each call lasts as long as its slowest rank
    width = max((t.reps for t in timings), default=1)
    table = rank_max([t.seconds + [0.0] * (width - t.reps) for t in timings], group)
    for row, t in zip(table, timings, strict=True):
        seconds[t.name][t.index] = statistics.median(row[: t.reps])
    return Transport(world, tuple(sizes), {k: envelope(v) for k, v in seconds.items()})


_Call = tuple[int, str, Callable[[], object], bool]
"""One operation at one size, in measuring order: the size's index, the operation's name, the call, and whether
it is timed at once (else its first call now, its timed calls in the rounds)."""


def _in_order(
    sizes: list[int], limits: dict[str, int], operations: Callable[[int], dict[str, Callable[[], object]]]
) -> Iterator[_Call | None]:
    """Every operation at every size up to its family's limit, in the order they are measured (`INTERLEAVED_BYTES`),
    None where the rounds are made."""

    def measured(name: str, size: int) -> bool:
        family = "ps" if name.startswith("ps_") else name.split(":")[0]
        return size <= _words(limits.get(family, size))

    for index, size in enumerate(sizes):
        above = size > INTERLEAVED_BYTES
        for name, fn in operations(size).items():
            frame = name.startswith("ps_")
            if measured(name, size) and (above or not frame):
                yield index, name, fn, above or frame
    yield None
    for index, size in enumerate(sizes):
        if size > INTERLEAVED_BYTES:
            break
        for name, fn in operations(size).items():
            if name.startswith("ps_") and measured(name, size):
                yield index, name, fn, True


def _first_call(
    name: str,
    index: int,
    fn: Callable[[], object],
    most: int,
    group: Any,
    earlier: list[_Timing],
    rounds: bool,
) -> _Timing:
    """The first call of ``name`` at size ``index``: a warm-up (set-up: shared memory, links) that sizes the
    timed calls to come (as many as fit in `REPS_BUDGET_S`, at least one, at most ``most``; timed in ``rounds``,
    each counts with the untimed call before it); for a parameter server's frames past the first size, a timed
    call itself (their code is warm, their buffers are new at every call: a warm-up would be the same work again)."""
    warm = not (name.startswith("ps_") and any(t.name == name for t in earlier))
    first = _call(fn, group)
    reps = agreed_reps(first * (2 if rounds else 1), most, group, REPS_BUDGET_S)
    return _Timing(name, index, fn, reps, [] if warm else [first])


def _complete(timings: list[_Timing], group: Any, rounds: bool = False) -> None:
    """Each of ``timings``' remaining calls (every rank makes the same: their counts were agreed); with
    ``rounds``, one call of each that still needs one a round, each timed call right after an untimed one of the
    same operation, which leaves its buffers and caches as the call before it would have (a call timed right after
    other sizes' calls is slower than one after its own)."""
    for _ in range(max((t.reps - len(t.seconds) for t in timings), default=0)):
        for t in timings:
            if len(t.seconds) < t.reps:
                if rounds:
                    t.fn()
                t.seconds.append(_call(t.fn, group))
