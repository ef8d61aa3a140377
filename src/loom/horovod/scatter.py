"""Horovod's alltoall and reducescatter (with ``_async`` and grouped forms), on the engine of
`loom.horovod.collectives`. On gloo, reducescatter runs as an all-reduce and a slice (gloo's reduce-scatter
needs equal pieces): correct for any shape, at twice the traffic of a true reduce-scatter.
"""

from __future__ import annotations

import torch

from loom.horovod import basics
from loom.horovod._ops import ADASUM, AVERAGE, SUM
from loom.horovod.collectives import _Collective, _differentiable, _reduce_args, _submit, grouped_allgather
from loom.horovod.compression import Compression

__all__ = [
    "alltoall",
    "alltoall_async",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "reducescatter",
    "reducescatter_async",
]


# ----------------------------------------------------------------------------------------------- alltoall
def alltoall_async(tensor, splits=None, name=None, process_set=basics.global_process_set) -> int:
    """Send rows ``splits[i]`` of ``tensor`` (consecutive, in rank order) to rank i; equal splits by default."""
    n = basics.size()
    rows = tensor.shape[0] if tensor.dim() else 1
    if splits is None:
        if rows % n:
            raise ValueError(
                f"alltoall: the first dimension ({rows}) is not a multiple of the size ({n}); pass splits"
            )
        counts = [rows // n] * n
    else:
        if isinstance(splits, torch.Tensor):
            if splits.dtype != torch.int32:
                raise ValueError(f"alltoall: splits must be an int32 tensor, got {splits.dtype}")
            splits = splits.reshape(-1).tolist()
        counts = [int(x) for x in splits]
        if len(counts) != n or any(c < 0 for c in counts):
            raise ValueError(f"alltoall: splits={counts} must hold {n} non-negative counts")
        if sum(counts) > rows:
            raise ValueError(f"alltoall: splits={counts} add up to more than the first dimension ({rows})")
    return _submit("alltoall", [tensor], {"splits": counts}, name, process_set)


def alltoall(tensor, splits=None, name=None, process_set=basics.global_process_set):
    """Horovod's alltoall: ``(output, received_splits)`` when ``splits`` is given, else ``output``."""

    def submit(tensors):
        return alltoall_async(tensors[0], splits, name, process_set)

    def grad(grads):  # each row's gradient sent back to the rank it came from
        return [alltoall(grads[0], splits=received, process_set=process_set)[0]]

    output, received = _Collective.apply(submit, grad, tensor)
    return output if splits is None else (output, received)


# ----------------------------------------------------------------------------------------------- reducescatter
def _reducescatter_async(tensors, grouped, name, op, process_set, prescale_factor, postscale_factor) -> int:
    if op == ADASUM:
        raise basics.refuse("Adasum (reducescatter op=hvd.Adasum)", "use op=hvd.Average or hvd.Sum")
    if op not in (AVERAGE, SUM):
        raise ValueError(f"reducescatter supports op=hvd.Average or hvd.Sum, got {op!r}")
    if any(t.dim() == 0 for t in tensors):
        raise ValueError("reducescatter needs tensors of at least one dimension, got a scalar")
    args = _reduce_args(op, prescale_factor, postscale_factor, grouped)
    return _submit("reducescatter", tensors, args, name, process_set)


def reducescatter_async(tensor, name=None, op=AVERAGE, process_set=basics.global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0) -> int:  # fmt: skip
    return _reducescatter_async([tensor], False, name, op, process_set, prescale_factor, postscale_factor)


def grouped_reducescatter_async(tensors, name=None, op=AVERAGE, process_set=basics.global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0) -> int:  # fmt: skip
    return _reducescatter_async(tensors, True, name, op, process_set, prescale_factor, postscale_factor)


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=AVERAGE,
                          process_set=basics.global_process_set, prescale_factor=1.0, postscale_factor=1.0):  # fmt: skip
    """`reducescatter` of a list of tensors in one operation; a list of new tensors."""
    scaling = (process_set, prescale_factor, postscale_factor)

    def submit(tensors):
        return grouped_reducescatter_async(tensors, name, op, *scaling)

    def grad(grads):  # the gathered gradient, times the size for Sum
        factor = (basics.size() if op == SUM else 1) * prescale_factor * postscale_factor
        return grouped_allgather([g * factor for g in grads], process_set=process_set)

    return _differentiable(submit, grad, tensors, compression)


def reducescatter(tensor, name=None, compression=Compression.none, op=AVERAGE,
                  process_set=basics.global_process_set, prescale_factor=1.0, postscale_factor=1.0):  # fmt: skip
    """Reduce over all ranks, then keep this rank's rows of the first dimension (the first ranks get one
    more row when it does not divide evenly); differentiable."""
    scaling = (process_set, prescale_factor, postscale_factor)
    return grouped_reducescatter([tensor], name, compression, op, *scaling)[0]
