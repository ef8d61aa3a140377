"""Horovod's tensor collectives: allreduce, allgather, broadcast, their grouped, in-place (``_``) and
``_async`` forms, `poll`, `synchronize`, `join`, `barrier`, `sparse_allreduce_async` (`scatter` has the rest).

Signatures and semantics follow ``horovod.torch``: an ``_async`` call returns an integer handle at once (the
work runs on the engine thread); `synchronize` waits and returns the result; the plain forms are
``synchronize(<form>_async(...))`` and, where a tensor requires grad, are differentiable with Horovod's
gradients (allreduce: the same allreduce of the gradient; allgather: the averaged gradient's own rows;
broadcast: the averaged gradient on the root, zeros elsewhere; alltoall: the gradient sent back;
reducescatter: the gathered gradient, times the size for ``Sum``).
"""

from __future__ import annotations

import threading

import torch

from loom.horovod import basics
from loom.horovod._engine import Engine
from loom.horovod._ops import ADASUM, AVERAGE, SUM
from loom.horovod._request import Request
from loom.horovod.compression import Compression

__all__ = [
    "allgather",
    "allgather_async",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "join",
    "poll",
    "sparse_allreduce_async",
    "synchronize",
]

_handles: dict[int, tuple[Engine, Request]] = {}  # each with the engine that runs it, even after a shutdown
_handles_lock = threading.Lock()
_next_handle = [0]


def _submit(kind: str, tensors, args: dict, name, process_set, outputs=None) -> int:
    basics.check_process_set(process_set)
    engine = basics.engine()
    request = engine.submit(Request(kind, list(tensors), args, outputs), name)
    with _handles_lock:
        handle = _next_handle[0]
        _next_handle[0] += 1
        _handles[handle] = engine, request
    return handle


def poll(handle: int) -> bool:
    """True when the operation behind ``handle`` has finished (`synchronize` will not block)."""
    return _request(handle)[1].done.is_set()


def synchronize(handle: int):
    """Wait for the operation behind ``handle``; return its result or raise its error. A handle is used once."""
    engine, request = _request(handle)
    try:
        return engine.wait(request)  # after hvd.shutdown() too, which finished it
    finally:
        with _handles_lock:
            _handles.pop(handle, None)


def _request(handle: int) -> tuple[Engine, Request]:
    with _handles_lock:
        found = _handles.get(handle)
    if found is None:
        raise ValueError(f"handle {handle!r} is unknown (already synchronized, or from before hvd.init())")
    return found


def _reduce_op(average, op, kind: str = "allreduce") -> int:
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average; pass only one of them.")
    if op is None:
        op = AVERAGE if average is None or average else SUM
    if op == ADASUM:
        raise basics.refuse(f"Adasum ({kind} op=hvd.Adasum)", "use op=hvd.Average")
    if op not in range(6):
        raise ValueError(f"op={op!r} is not a Horovod reduction (Average, Sum, Min, Max, Product)")
    return int(op)


def _reduce_args(op: int, prescale_factor, postscale_factor, grouped=False) -> dict:
    return dict(op=op, prescale=float(prescale_factor), postscale=float(postscale_factor), grouped=grouped)


class _Collective(torch.autograd.Function):
    """One collective made differentiable: ``forward`` waits for ``submit(tensors)`` (a handle whose result is
    a tensor, or a list or tuple of them); ``backward`` gives the output gradients to ``grad``, the form's
    Horovod gradient (see the module docstring), which returns one gradient per input."""

    @staticmethod
    def forward(ctx, submit, grad, *tensors):
        ctx.grad = grad
        result = synchronize(submit(list(tensors)))
        return tuple(result) if isinstance(result, list | tuple) else (result,)

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *ctx.grad(list(grads)))


def _differentiable(submit, grad, tensors, compression=Compression.none) -> list:
    """``submit``'s outputs for ``tensors`` (compressed on the way), differentiable through `_Collective`."""
    pairs = [compression.compress(t) for t in tensors]
    out = _Collective.apply(submit, grad, *[c for c, _ in pairs])
    return [compression.decompress(t, ctx) for t, (_, ctx) in zip(out, pairs, strict=True)]


# ----------------------------------------------------------------------------------------------- allreduce
def _allreduce_async(tensors, grouped, in_place, average, name, op, prescale_factor, postscale_factor,
                     process_set) -> int:  # fmt: skip
    args = _reduce_args(_reduce_op(average, op), prescale_factor, postscale_factor, grouped)
    return _submit("allreduce", tensors, args, name, process_set, outputs=list(tensors) if in_place else None)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=basics.global_process_set) -> int:  # fmt: skip
    return _allreduce_async([tensor], False, False, average, name, op, prescale_factor, postscale_factor,
                            process_set)  # fmt: skip


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=basics.global_process_set) -> int:  # fmt: skip
    return _allreduce_async([tensor], False, True, average, name, op, prescale_factor, postscale_factor,
                            process_set)  # fmt: skip


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=basics.global_process_set) -> int:  # fmt: skip
    return _allreduce_async(tensors, True, False, average, name, op, prescale_factor, postscale_factor,
                            process_set)  # fmt: skip


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=basics.global_process_set) -> int:  # fmt: skip
    return _allreduce_async(tensors, True, True, average, name, op, prescale_factor, postscale_factor,
                            process_set)  # fmt: skip


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=basics.global_process_set):  # fmt: skip
    """`allreduce` of a list of tensors in one operation; a list of new tensors."""
    scaling = (op, prescale_factor, postscale_factor, process_set)

    def submit(tensors):
        return grouped_allreduce_async(tensors, average, name, *scaling)

    def grad(grads):  # the same allreduce of the gradients
        return grouped_allreduce(grads, average, None, Compression.none, *scaling)

    return _differentiable(submit, grad, tensors, compression)


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=basics.global_process_set):  # fmt: skip
    """Reduce ``tensor`` over all ranks (default: average); a new tensor, differentiable."""
    scaling = (op, prescale_factor, postscale_factor, process_set)
    return grouped_allreduce([tensor], average, name, compression, *scaling)[0]


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=basics.global_process_set):  # fmt: skip
    """`allreduce` into ``tensor`` itself; returns it."""
    return synchronize(
        allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set)
    )


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=basics.global_process_set):  # fmt: skip
    return synchronize(
        grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor, process_set)
    )


def sparse_allreduce_async(tensor, name, op, process_set=basics.global_process_set):
    """Reduce a sparse tensor by gathering every rank's indices and values (Horovod's method); returns a
    callable that waits and gives the coalesced sparse result (averaged for ``op=Average``)."""
    op = _reduce_op(None, op, "sparse_allreduce")
    if op not in (AVERAGE, SUM):
        raise ValueError(f"sparse_allreduce_async supports op=Average or Sum, got {op}")
    t = tensor.coalesce()
    indices_handle = allgather_async(
        t.indices().t().contiguous(), name=f"{name}.indices", process_set=process_set
    )
    values_handle = allgather_async(t.values(), name=f"{name}.values", process_set=process_set)

    def handle():
        values = synchronize(values_handle)
        indices = synchronize(indices_handle)
        if op == AVERAGE:
            values = values / basics.size()
        return torch.sparse_coo_tensor(indices.t(), values, size=tensor.size()).coalesce()

    return handle


# ----------------------------------------------------------------------------------------------- allgather
def allgather_async(tensor, name=None, process_set=basics.global_process_set) -> int:
    return _submit("allgather", [tensor], {}, name, process_set)


def grouped_allgather_async(tensors, name=None, process_set=basics.global_process_set) -> int:
    return _submit("allgather", tensors, {"grouped": True}, name, process_set)


def _own_rows(dims: list[int], process_set):
    """The gradient of allgather for inputs with first dimensions ``dims``: each input's rows of the averaged
    output gradients (every rank's ``dims`` gathered to find where this rank's rows start)."""

    def grad(grads):
        grads = grouped_allreduce(grads, average=True, process_set=process_set)
        every = allgather(torch.tensor([dims], dtype=torch.int64), process_set=process_set)
        starts = every[: basics.rank()].sum(0).tolist() if basics.rank() else [0] * len(dims)
        return [g.narrow(0, s, d) for g, s, d in zip(grads, starts, dims, strict=True)]

    return grad


def allgather(tensor, name=None, process_set=basics.global_process_set):
    """Concatenate every rank's ``tensor`` along the first dimension (which may differ); differentiable."""
    grad = _own_rows([tensor.shape[0] if tensor.dim() else 1], process_set)
    return _differentiable(lambda ts: allgather_async(ts[0], name, process_set), grad, [tensor])[0]


def grouped_allgather(tensors, name=None, process_set=basics.global_process_set):
    grad = _own_rows([t.shape[0] for t in tensors], process_set)
    return _differentiable(lambda ts: grouped_allgather_async(ts, name, process_set), grad, tensors)


# ----------------------------------------------------------------------------------------------- broadcast
def _root(root_rank) -> int:
    root = int(root_rank)
    if not 0 <= root < basics.size():
        raise ValueError(f"root_rank={root_rank} is out of range for a job of {basics.size()} processes")
    return root


def broadcast_async(tensor, root_rank, name=None, process_set=basics.global_process_set) -> int:
    return _submit("broadcast", [tensor], {"root": _root(root_rank)}, name, process_set)


def broadcast_async_(tensor, root_rank, name=None, process_set=basics.global_process_set) -> int:
    return _submit("broadcast", [tensor], {"root": _root(root_rank)}, name, process_set, outputs=[tensor])


def broadcast(tensor, root_rank, name=None, process_set=basics.global_process_set):
    """The root's ``tensor`` on every rank, as a new tensor (``tensor`` is not modified); differentiable."""

    def grad(grads):  # the averaged gradient on the root, zeros elsewhere
        grad = allreduce(grads[0], average=True, process_set=process_set)
        return [grad if basics.rank() == root_rank else grad * 0]

    return _differentiable(lambda ts: broadcast_async(ts[0], root_rank, name, process_set), grad, [tensor])[0]


def broadcast_(tensor, root_rank, name=None, process_set=basics.global_process_set):
    """`broadcast` into ``tensor`` itself; returns it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# ----------------------------------------------------------------------------------------------- join, barrier
def join(device=-1) -> int:
    """This rank has no more batches: it adds zeros to the others' allreduces until every rank has joined.
    Returns the rank that joined last (the same on every rank)."""
    return basics.engine().join()


def barrier(process_set=basics.global_process_set) -> None:
    """Return when every rank has reached the barrier (and everything submitted before it was announced)."""
    synchronize(_submit("barrier", [], {}, None, process_set))
