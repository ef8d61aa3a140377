"""`all_reduce`: one entry point for every all-reduce algorithm, with the checks they share.

``native`` is the backend's own ``torch.distributed.all_reduce``; ``ring`` and ``driver`` are written over
point-to-point messages so that their traffic can be counted exactly (`loom.comm.counters`); the package
docstring names the module that explains each algorithm.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from loom.comm._reduce import OPS, check_algorithm, check_tensor, group_rank_and_size
from loom.comm.auto import choose_algorithm
from loom.comm.counters import Traffic, counters
from loom.comm.driver import all_reduce_driver
from loom.comm.hierarchical import all_reduce_hierarchical
from loom.comm.ring import all_reduce_ring
from loom.comm.shm import all_reduce_shm

__all__ = ["all_reduce"]


def _all_reduce_native(flat: torch.Tensor, op: str, group: dist.ProcessGroup | None) -> Traffic:
    """The backend's all-reduce; returns the ring-equivalent bus bytes as an estimate of its traffic."""
    n = dist.get_world_size(group)
    # gloo has no AVG reduction, so average as sum-then-divide on every backend for identical behaviour.
    backend_op = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}.get(op, dist.ReduceOp.SUM)
    dist.all_reduce(flat, op=backend_op, group=group)
    if op == "avg":
        flat.div_(n)
    estimate = 2 * (n - 1) * flat.nbytes // n
    return Traffic(estimate, estimate)


_ALGORITHMS: dict[str, Callable[[torch.Tensor, str, dist.ProcessGroup | None], Traffic]] = {
    "native": _all_reduce_native,
    "ring": lambda flat, op, group: Traffic(*all_reduce_ring(flat, op, group)),
    "driver": lambda flat, op, group: Traffic(*all_reduce_driver(flat, op, group)),
    "shm": all_reduce_shm,
    "hierarchical": all_reduce_hierarchical,
}


def all_reduce(
    tensor: torch.Tensor,
    op: str = "sum",
    algorithm: str = "auto",
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Reduce ``tensor`` elementwise over the processes of ``group`` (default: all), in place; return it.

    Args:
        tensor: the same shape and dtype on every rank (not checked: a mismatch hangs or fails in the backend).
            float32, float64, float16, bfloat16 and the integer dtypes are supported; bool and complex are not.
        op: ``"sum"``, ``"avg"`` (sum divided by the group size; floating-point tensors only, integers raise a
            ValueError rather than silently flooring), ``"max"`` or ``"min"``.
        algorithm: ``"auto"`` (default: the fastest of the others for this topology and size, from a
            calibration made on the group's first call), ``"native"`` (the backend's), ``"ring"``, ``"driver"``,
            ``"shm"`` (all processes on one host) or ``"hierarchical"``; all give the same result up to
            floating-point summation order.
        group: a process group from ``torch.distributed.new_group``; this process must belong to it.

    With one process, or no process group at all, this is a no-op. Non-contiguous tensors are reduced through
    a contiguous copy that is copied back. Every call is recorded in `loom.comm.counters()` (``auto`` under
    ``"auto"``). A group's first ``shm``, ``hierarchical`` or ``auto`` call also sets up (hosts, shared memory,
    calibration): like every collective, all processes of the group must make it.
    """
    if op not in OPS:
        raise ValueError(f"unknown all-reduce op={op!r}; valid ops are {', '.join(map(repr, OPS))}")
    check_algorithm(algorithm)
    check_tensor(tensor, op)
    group_rank, n = group_rank_and_size(group)
    if n == 1 or tensor.numel() == 0:
        counters().record(algorithm, 0, 0)
        return tensor
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    chosen = algorithm
    try:
        if algorithm == "auto":  # GPU tensors: the backend's (NCCL) all-reduce is the one to use
            chosen = (
                choose_algorithm(work.nbytes, group, _ALGORITHMS) if work.device.type == "cpu" else "native"
            )
        traffic = _ALGORITHMS[chosen](work.view(-1), op, group)
    except RuntimeError as error:
        picked = f" (auto chose {chosen!r})" if chosen != algorithm else ""
        rank = dist.get_rank() if dist.is_initialized() else group_rank  # the global rank, if any
        raise RuntimeError(
            f"rank {rank}: all_reduce(op={op!r}, algorithm={algorithm!r}){picked} of a "
            f"{tuple(tensor.shape)} {tensor.dtype} tensor over {n} processes failed: {error}"
        ) from error
    if work is not tensor:
        tensor.copy_(work)
    counters().record(algorithm, *traffic)
    return tensor
