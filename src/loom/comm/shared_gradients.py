"""Gradients averaged in place in shared memory: DataParallel's path when every process is on one CPU host.

Why: with DDP and a loom all-reduce a gradient crosses memory several times after backward (into DDP's bucket,
published into the segment, reduced, copied back). Here the segment holds the gradients themselves: each of the
L processes has one slot for all its trainable parameters' gradients, flat, and owns one cache-line aligned chunk:

1. after backward, each process copies its gradients *outside its own chunk* into its slot; barrier;
2. process r sums chunk r (its own gradient plus the other slots' copies, in rank order from its own), divides by
   L, and writes the average into chunk r of *every* slot; barrier;
3. every parameter's ``.grad`` becomes a view of this process's slot: the optimizer reads the average in place.

For 2 processes that is about 6 half-gradients of memory traffic against about 13 through DDP's bucket and
`loom.comm.all_reduce(algorithm="shm")`. Slots are reused across steps without more barriers: a process writes
its slot for step k+1 only after step k's second barrier, and the others write into it only after it reaches
step k+1's first barrier, i.e. after its optimizer step k.

Limits: one host, CPU tensors, one floating-point dtype for all trainable parameters; the averaged gradients
live in memory the others write during the next step's reduction (read or copy them before then). No overlap
with backward (see ``DataParallelConfig.overlap``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from loom.comm.counters import Tally, Traffic, counters
from loom.comm.shm import ShmContext, shm_unsupported_reason

__all__ = ["SharedGradients", "shared_gradients_unusable"]

_ALIGN = 64  # bytes: two owners never write into the same cache line


def shared_gradients_unusable(module: nn.Module, broadcast_buffers: bool) -> str | None:
    """None when `SharedGradients` can average ``module``'s gradients, else why not (this process's view)."""
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        return "the model has no trainable parameters"
    dtypes = {p.dtype for p in params}
    if len(dtypes) > 1 or not params[0].dtype.is_floating_point:
        return f"its trainable parameters are not of one floating-point dtype ({sorted(map(str, dtypes))})"
    if any(p.device.type != "cpu" for p in params):
        return "its parameters are not all on the CPU"
    if broadcast_buffers and any(True for _ in module.buffers()):
        return "it has buffers to broadcast from rank 0 at each forward (DDP does that)"
    return shm_unsupported_reason()


class SharedGradients:
    """The trainable parameters of ``module`` and a shared segment holding one flat gradient slot per process;
    construction is a collective over ``group`` (every process of it constructs one, for the same model)."""

    def __init__(
        self, module: nn.Module, group: dist.ProcessGroup | None = None, extra_values: int = 0
    ) -> None:
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.context = ShmContext(group)  # its own segment: the all-reduce's cached one holds pieces of 4 MiB
        ctx = self.context
        if len(ctx.host_sizes) != 1:
            raise ValueError(
                f"shared gradients need every process on one host, got {ctx.host_sizes} per host"
            )
        dtype = self.params[0].dtype
        numel = sum(p.numel() for p in self.params)
        self.nbytes = numel * dtype.itemsize
        extras_at = -(-self.nbytes // _ALIGN) * _ALIGN
        ctx.map_slots(extras_at + 8 * extra_values)
        self.slots = ctx.slots(dtype, numel)
        self.extras = ctx.slots(torch.float64, extra_values, extras_at)
        """Each slot's ``extra_values`` float64 after the gradients: small sums that ride along (the loss)."""
        self.spans: list[tuple[int, int]] = []
        """Each parameter's [start, end) in the flat buffer."""
        for p in self.params:
            start = self.spans[-1][1] if self.spans else 0
            self.spans.append((start, start + p.numel()))
        mine = self.slots[ctx.local_rank]
        self.views = [mine[a:b].view_as(p) for p, (a, b) in zip(self.params, self.spans, strict=True)]
        size, align = ctx.local_size, max(1, _ALIGN // dtype.itemsize)
        bounds = [min(numel, -(-(j * numel // size) // align) * align) for j in range(size)] + [numel]
        lo, hi = self.chunk = (bounds[ctx.local_rank], bounds[ctx.local_rank + 1])
        self.others = ctx.reduce_order
        """The other processes' local ranks, in the order their copies of this process's chunk are added."""
        self.own_pieces = [
            (i, max(a, lo), min(b, hi)) for i, (a, b) in enumerate(self.spans) if max(a, lo) < min(b, hi)
        ]
        """(parameter index, start, end) of the parts of this process's chunk, each within one parameter."""
        self._tallies: dict[int, Tally] = {}
        """The byte counts of `average` by its number of extra values (`loom.comm.counters.Tally`): its traffic
        is fixed by the sizes, so a call counts itself with one addition."""

    @property
    def flat(self) -> torch.Tensor:
        """This process's slot: after `average`, every trainable parameter's averaged gradient, flat, in order
        (bitwise the same in every process, so a check of it reaches the same verdict everywhere)."""
        return self.slots[self.context.local_rank]

    def average(self, extra: torch.Tensor | None = None) -> None:
        """Steps 1-3 of the module docstring: leave every parameter's ``.grad`` the average over processes.

        ``extra``, a float64 tensor of at most ``extra_values`` elements, is summed over the processes on the way
        (in place, in rank order, so equal everywhere): written with step 1, read between the two barriers,
        when every process has written it and none can overwrite it yet. DataParallel sends its loss this way
        instead of in a collective of its own, which would be one more point where processes wait for each other.
        """
        ctx, (lo, hi) = self.context, self.chunk
        mine = self.slots[ctx.local_rank]
        if extra is not None:
            if extra.dtype != torch.float64 or extra.dim() != 1 or extra.numel() > self.extras[0].numel():
                raise ValueError(
                    f"extra must be a 1-D float64 tensor of at most {self.extras[0].numel()} values, got a "
                    f"{tuple(extra.shape)} {extra.dtype} one"
                )
            self.extras[ctx.local_rank][: extra.numel()].copy_(extra)
        grads = [_flat_grad(p) for p in self.params]
        for grad, (start, end) in zip(grads, self.spans, strict=True):
            for a, b in ((start, min(end, lo)), (max(start, hi), end)):  # the parts outside this chunk
                if a < b:
                    if grad is None:  # unused in this forward: contributes zeros, as DDP's buckets do
                        mine[a:b].zero_()
                    else:
                        mine[a:b].copy_(grad[a - start : b - start])
        ctx.barrier()
        # every process wrote its extra values before the barrier; none rewrites them before the next one
        if extra is not None:
            extra.copy_(self.extras[0][: extra.numel()])
            for j in range(1, ctx.local_size):
                extra.add_(self.extras[j][: extra.numel()])
        first, *rest = self.others
        for i, a, b in self.own_pieces:
            grad, result = grads[i], mine[a:b]
            if grad is None:
                result.copy_(self.slots[first][a:b])
            else:
                start = self.spans[i][0]
                torch.add(grad[a - start : b - start], self.slots[first][a:b], out=result)
            for j in rest:
                result.add_(self.slots[j][a:b])
            result.div_(ctx.local_size)
            for j in self.others:
                self.slots[j][a:b].copy_(result)
        ctx.barrier()
        for p, view in zip(self.params, self.views, strict=True):
            p.grad = view
        extras = extra.numel() if extra is not None else 0
        tally = self._tallies.get(extras)
        if tally is None:  # the first call with this many extra values, whose traffic is fixed: this chunk
            # written into (and read from) each other slot, these extra values written once and the others' read
            sent, small = len(self.others) * (hi - lo) * mine.element_size(), 8 * extras
            traffic = Traffic(shm_sent=sent + small, shm_received=sent + len(self.others) * small)
            tally = self._tallies[extras] = counters().tally("shm", traffic)
        tally.calls += 1


def _flat_grad(p: torch.Tensor) -> torch.Tensor | None:
    grad = p.grad
    if grad is None:
        return None
    return (grad.to_dense() if grad.is_sparse else grad).reshape(-1)
