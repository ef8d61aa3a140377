"""DDP communication hooks that average gradient buckets with a `loom.comm` algorithm, so its traffic shows up
in `loom.comm.counters()`: `overlapped_allreduce_hook` overlaps backward as DDP's own all-reduce does,
`allreduce_hook` runs inline (to measure and compare). DDP passes back the process group as state (``None``: all
processes); as PyTorch's ``allreduce_hook``, each bucket is divided by the group size *before* the sum, so float16
gradients do not overflow.

Why overlap (DDP's own design, Li et al., "PyTorch Distributed", VLDB 2020, section 3.2.3): a bucket's
all-reduce should run *while* the remaining layers compute their gradients, as ``native`` does with
``async_op=True``; loom's other algorithms are blocking Python calls, for each of which `allreduce_hook`
stalls backward. `overlapped_allreduce_hook` reduces each bucket on the process's communication thread
(`loom.comm.thread`: the same order on every rank), and DDP waits for the futures at the end of backward.

Why this is safe: one thread uses shm and the backend at a time (`loom.comm.shm` keeps per-process state without
a lock, and the ring's links are sockets no two threads may share). While buckets are in flight the main thread
is inside backward, which issues no collective, and DDP's wait drains the queue before the caller can issue any.
A caller that issues collectives from autograd hooks *during* backward breaks this; don't. First calls (shm's
segment set-up, ``auto``'s calibration) are collectives too: same thread, same order.

Errors: an all-reduce that raises settles its bucket's future with a RuntimeError naming the rank, the
algorithm, the bucket and its size, so backward raises instead of waiting forever. Later buckets are still
attempted (their peers may be waiting for them); the first error is the one reported.

Limits: overlap needs spare CPU: the thread shares the process's cores with backward (the gain is only what
waiting left idle), and Python-level algorithms hold the GIL between torch calls.
"""

# No `from __future__ import annotations` here: DDP inspects the hook's annotations at registration and
# rejects them unless they are the real `dist.GradBucket` and `torch.futures.Future[torch.Tensor]` objects.

from collections.abc import Callable

import torch
import torch.distributed as dist

from loom.comm._reduce import check_algorithm, group_rank_and_size
from loom.comm.all_reduce import all_reduce
from loom.comm.thread import comm_thread, torch_future

__all__ = ["allreduce_hook", "overlapped_allreduce_hook"]

CommHook = Callable[[dist.ProcessGroup | None, dist.GradBucket], torch.futures.Future[torch.Tensor]]


def allreduce_hook(algorithm: str = "ring") -> CommHook:
    """A DDP communication hook averaging each gradient bucket with `loom.comm.all_reduce(algorithm=...)`, inline.

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


def overlapped_allreduce_hook(algorithm: str = "auto") -> CommHook:
    """A DDP communication hook averaging each bucket with `loom.comm.all_reduce` on the communication thread.

    Use as ``ddp_model.register_comm_hook(group_or_None, overlapped_allreduce_hook("shm"))``. The result matches
    DDP without a hook up to floating-point summation order; traffic is counted in `loom.comm.counters()`.
    """
    check_algorithm(algorithm)

    def hook(state: dist.ProcessGroup | None, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer, index = bucket.buffer(), bucket.index()
        _, n = group_rank_and_size(state)

        def reduce() -> torch.Tensor:
            buffer.div_(n)  # here, not in the hook: one pass over the bucket less on the backward thread
            return all_reduce(buffer, op="sum", algorithm=algorithm, group=state)

        def describe() -> str:
            return (
                f"rank {dist.get_rank()}: overlapped all_reduce(algorithm={algorithm!r}) of DDP bucket {index} "
                f"({buffer.numel()} {buffer.dtype} elements) over {n} processes"
            )

        # Chained rather than returned: an exception set on a Python-made future reaches DDP's C++ side as an
        # uncastable value; raised inside a callback it becomes a real error (see loom.comm.compression.hook).
        # comm_thread() restarts a stopped thread; submit refuses one stopped since (interpreter exiting).
        return torch_future(comm_thread().submit(reduce), describe).then(lambda done: done.value())

    hook.__qualname__ = f"overlapped_allreduce_hook({algorithm!r})"
    return hook
