"""DDP communication hooks that all-reduce gradient buckets with a `loom.comm` algorithm.

`allreduce_hook` makes DistributedDataParallel average its buckets with loom's ring, driver or native
all-reduce, so the traffic shows up in `loom.comm.counters()` and algorithms can be compared inside real
training; DDP passes back the process group as state (``None``: all processes). As PyTorch's ``allreduce_hook``,
each bucket is divided by the group size *before* the sum, so float16 gradients do not overflow.

Limits: the hook runs synchronously, so ``ring`` and ``driver`` do not overlap the rest of backward as the
backend's asynchronous all-reduce does: use them to measure and compare, ``native`` (or no hook) for speed, and
`loom.comm.ddp_async` to overlap them.
"""

# No `from __future__ import annotations` here: DDP inspects the hook's annotations at registration and
# rejects them unless they are the real `dist.GradBucket` and `torch.futures.Future[torch.Tensor]` objects.

from collections.abc import Callable

import torch
import torch.distributed as dist

from loom.comm._reduce import check_algorithm, group_rank_and_size
from loom.comm.all_reduce import all_reduce

__all__ = ["allreduce_hook"]

CommHook = Callable[[dist.ProcessGroup | None, dist.GradBucket], torch.futures.Future[torch.Tensor]]


def allreduce_hook(algorithm: str = "ring") -> CommHook:
    """A DDP communication hook averaging each gradient bucket with `loom.comm.all_reduce(algorithm=...)`.

    Use as ``ddp_model.register_comm_hook(group_or_None, allreduce_hook("ring"))``; the result matches DDP
    without a hook up to floating-point summation order.
    """
    check_algorithm(algorithm)

    def hook(state: dist.ProcessGroup | None, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        _, n = group_rank_and_size(state)
        buffer.div_(n)
        all_reduce(buffer, op="sum", algorithm=algorithm, group=state)
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(buffer)
        return done

    hook.__qualname__ = f"allreduce_hook({algorithm!r})"
    return hook
