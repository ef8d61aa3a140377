"""Small all-reduces through shared memory in one step: publish, one barrier, every process reduces everything.

Why: `loom.comm.shm`'s chunked all-reduce needs three barriers per call, right for megabytes (each process
reduces only its share) but wasteful for a tensor-parallel layer's few KiB, where each barrier (a wake-up of
every peer) costs more than the arithmetic. Here each of the ``L`` processes copies its whole input into its slot
and raises its counter (`Segment.barrier`); once all counters are up every process reduces all ``L`` slots
itself, in rank order, so all compute bit for bit the same result. Each reads ``(L-1) D`` bytes instead of
``2 (L-1)/L D``, nothing at these sizes.

Two slots per process, used alternately: call ``k`` writes slot ``k mod 2``, and a process raises its counter for
call ``k+1`` only after reading everything of call ``k``; so when call ``k+2`` overwrites slot ``k mod 2``,
everybody has finished reading it. One barrier per call, no other waits.
"""

from __future__ import annotations

import ctypes

import torch
import torch.distributed as dist

from loom.comm._reduce import combine_into
from loom.comm.shm import ShmContext

__all__ = ["MAX_BYTES", "SmallAllReduce"]

MAX_BYTES = 256 << 10
"""Largest tensor (bytes) reduced this way; larger ones take the backend's or `loom.comm.shm`'s all-reduce."""

_GROUPS: dict[object, SmallAllReduce | None] = {}


class SmallAllReduce:
    """The one-barrier all-reduce of one process group on one host (see the module docstring)."""

    def __init__(self, ctx: ShmContext) -> None:
        self.ctx = ctx
        ctx.map_slots(2 * MAX_BYTES)
        segment = ctx.segment
        if segment is None:
            raise RuntimeError("a one-process group has no shared-memory segment")
        self.segment = segment
        self._base = segment.data.data_ptr()

    @staticmethod
    def for_group(group: dist.ProcessGroup | None) -> SmallAllReduce | None:
        """The group's small all-reduce, or None, the same on every process, when it cannot have one (several
        hosts, a CPU other than x86-64, no /dev/shm). Collective on the first call (every process of the group
        makes it at the same point, as the first all-reduce of a group does)."""
        key = group if group is not None else dist.group.WORLD
        if key not in _GROUPS:
            ctx = ShmContext(group)  # its own segment: shm's all-reduce keeps its layout in context_for's
            usable = ctx.unsupported is None and len(ctx.host_sizes) == 1 and ctx.size > 1
            _GROUPS[key] = SmallAllReduce(ctx) if usable else None
        return _GROUPS[key]

    def _publish(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Steps 1-2: this process's input into its slot, the barrier; every process's input, as tensors."""
        seg = self.segment
        parity = (seg.sequence + 1) & 1  # the barrier below is call number sequence + 1
        ctypes.memmove(self._base + seg.offset(seg.rank) + parity * MAX_BYTES, flat.data_ptr(), flat.nbytes)
        seg.barrier()
        return self.ctx.slots(flat.dtype, flat.numel(), parity * MAX_BYTES)

    def all_reduce(self, flat: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce the contiguous CPU tensor ``flat`` (at most `MAX_BYTES`) over the group, in place."""
        slots = self._publish(flat)
        view = flat.view(-1)
        view.copy_(slots[0])
        for j in range(1, len(slots)):
            combine_into(view, slots[j], op)
        if op == "avg":
            view.div_(len(slots))
        return flat

    def all_gather(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Every process's contiguous CPU tensor ``flat`` (at most `MAX_BYTES`), in the group's rank order, as new
        tensors (copied out of the slots, which call ``k + 2`` overwrites)."""
        return [slot.clone().view(flat.shape) for slot in self._publish(flat)]

    def reduced(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the group of the contiguous CPU tensor ``x`` (at most `MAX_BYTES`), as a new tensor;
        ``x`` is left as it is (what an autograd function needs, without the copy an in-place one would cost)."""
        slots = self._publish(x)
        out = torch.add(slots[0], slots[1])
        for j in range(2, len(slots)):
            out.add_(slots[j])
        return out.view(x.shape)
