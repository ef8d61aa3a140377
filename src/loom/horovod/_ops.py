"""The data movement of each collective, run by the engine once every rank has announced it.

Every function here receives the metadata of *all* ranks (`loom.horovod._request.Request.meta`), so `check`
gives the same verdict on every rank, and variable sizes (allgather's first dimensions, alltoall's splits) are
known without another exchange. Data that is only moved travels as raw bytes, so every dtype works alike;
reductions run in the tensor's dtype on gloo (int16, which gloo cannot reduce, through int32), float sums on
the loom all-reduce ``LOOM_HOROVOD_ALLREDUCE`` names (default ``native``: gloo's). Scaling follows Horovod:
``prescale_factor`` before the reduction, ``postscale_factor`` (divided by the size for ``Average``) after it;
integer tensors are scaled in float64 and truncated back, half precision in float32.
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist

from loom.horovod._request import HorovodInternalError, Request
from loom.settings import setting

__all__ = ["check", "run", "run_ready", "scale"]

AVERAGE, SUM, ADASUM, MIN, MAX, PRODUCT = range(6)
_BACKEND_OPS = {SUM: "SUM", AVERAGE: "SUM", MIN: "MIN", MAX: "MAX", PRODUCT: "PRODUCT"}
_FUSION_BYTES = int(os.environ.get("HOROVOD_FUSION_THRESHOLD", str(64 * 1024 * 1024)))


def run_ready(engine, ready: list[tuple[str, dict[int, dict], Request | None]]) -> None:
    """Run the operations of one cycle in order; consecutive allreduces with the same op and scaling (every
    rank present, checks passed) are fused into one reduction per dtype, up to ``HOROVOD_FUSION_THRESHOLD``
    bytes (64 MiB), as Horovod's tensor fusion does. Every rank forms the same batches: they depend only on
    the metadata, which all ranks share."""
    batch: list[tuple[str, dict[int, dict], Request | None]] = []
    batch_bytes = 0
    for item in ready:
        name, metas, local = item
        ref = next(iter(metas.values()))
        fusable = (
            ref["kind"] == "allreduce" and len(metas) == engine.size and check(engine, name, metas) is None
        )
        size = sum(math.prod(s) * _itemsize(d) for s, d in zip(ref["shapes"], ref["dtypes"], strict=True))
        if batch and (not fusable or _key(item) != _key(batch[0]) or batch_bytes + size > _FUSION_BYTES):
            _run_fused(engine, batch)
            batch, batch_bytes = [], 0
        if fusable:
            batch.append(item)
            batch_bytes += size
        else:
            run(engine, name, metas, local)
    if batch:
        _run_fused(engine, batch)


def _key(item) -> tuple:
    ref = next(iter(item[1].values()))
    return (ref.get("op"), ref.get("prescale"), ref.get("postscale"))


def _itemsize(dtype_name: str) -> int:
    return torch.empty(0, dtype=getattr(torch, dtype_name.removeprefix("torch."))).element_size()


def _run_fused(engine, batch) -> None:
    if len(batch) == 1:
        run(engine, *batch[0])
        return
    tensors = [t for _, _, local in batch for t in local.tensors]
    try:
        results = _allreduce_all(engine, batch[0][1], tensors)
    except Exception as error:  # noqa: BLE001 - handed to every waiting caller
        for _, _, local in batch:
            local.finish(error=error)
        return
    pending = iter(results)  # in batch order: each request takes as many as it gave
    for _, _, local in batch:
        local.finish(_finish(local, [next(pending) for _ in local.tensors]))


def run(engine, name: str, metas: dict[int, dict], local: Request | None) -> None:
    """Check, then run the collective ``name``; finish this rank's request with the result or the error."""
    try:
        problem = check(engine, name, metas)
        if problem is not None:
            raise HorovodInternalError(problem)
        kind = next(iter(metas.values()))["kind"]
        result, failure = _KERNELS[kind](engine, metas, local), None
    except Exception as error:  # noqa: BLE001 - handed to the waiting caller
        result, failure = None, error
    if local is not None:
        local.finish(result, failure)


def check(engine, name: str, metas: dict[int, dict]) -> str | None:
    """The reason the ranks' requests for ``name`` cannot run together, or None (same verdict on every rank)."""
    ranks = sorted(metas)
    first, ref = ranks[0], metas[ranks[0]]
    kind = ref["kind"]

    def differ(key: str) -> str | None:
        for r in ranks[1:]:
            if metas[r].get(key) != ref.get(key):
                return (
                    f"{kind} {name!r}: ranks disagree on {key}: rank {first} has {ref.get(key)}, "
                    f"rank {r} has {metas[r].get(key)}"
                )
        return None

    for r in ranks[1:]:
        if metas[r]["kind"] != kind:
            return f"operation {name!r}: rank {first} called {kind}, rank {r} called {metas[r]['kind']}"
    joined = sorted(set(range(engine.size)) - set(ranks))
    if joined and kind not in ("allreduce", "barrier"):
        return (
            f"{kind} {name!r} cannot run while ranks {joined} have joined: like Horovod, loom supports only "
            "allreduce (with zeros from the joined ranks) after hvd.join()"
        )
    ragged = len({len(m["shapes"]) for m in metas.values()}) > 1
    same_shapes = ragged or kind in ("allreduce", "broadcast", "reducescatter")
    for key in ("dtypes", "op", "root", "prescale", "postscale", *(("shapes",) if same_shapes else ())):
        if problem := differ(key):
            return problem
    if kind in ("allgather", "alltoall"):
        for i, shape in enumerate(ref["shapes"]):
            for r in ranks[1:]:
                other = metas[r]["shapes"][i]
                if len(other) != len(shape) or other[1:] != shape[1:]:
                    return (
                        f"{kind} {name!r}: tensors must agree in all but the first dimension: rank {first} has "
                        f"shape {shape}, rank {r} has {other}"
                    )
    return None


def scale(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """``tensor * factor`` in Horovod's arithmetic (ints in float64, half in float32), in ``tensor``'s dtype."""
    if factor == 1.0:
        return tensor
    floating = tensor.is_floating_point()  # half precision computes in float32, the wider floats in their own
    compute = torch.promote_types(tensor.dtype, torch.float32) if floating else torch.float64
    return (tensor.to(compute) * factor).to(tensor.dtype)


def _reduce(flat: torch.Tensor, op: int, engine) -> torch.Tensor:
    """Reduce a flat CPU tensor over all ranks, in place where the dtype allows; return the result."""
    if engine.size == 1:
        return flat
    if flat.dtype == torch.int16:  # gloo cannot reduce int16
        return _reduce(flat.to(torch.int32), op, engine).to(torch.int16)
    algorithm = str(setting("LOOM_HOROVOD_ALLREDUCE"))
    if op in (SUM, AVERAGE) and algorithm != "native" and flat.dtype in (torch.float32, torch.float64):
        from loom.comm import all_reduce

        return all_reduce(flat, op="sum", algorithm=algorithm, group=engine.group)
    dist.all_reduce(flat, op=getattr(dist.ReduceOp, _BACKEND_OPS[op]), group=engine.group)
    return flat


def _inputs(metas: dict[int, dict], local: Request | None) -> list[torch.Tensor]:
    """This rank's tensors, or zeros shaped like the others' when this rank has joined."""
    if local is not None:
        return local.tensors
    ref = next(iter(metas.values()))
    return [
        torch.zeros(shape, dtype=getattr(torch, dtype.removeprefix("torch.")))
        for dtype, shape in zip(ref["dtypes"], ref["shapes"], strict=True)
    ]


def _allreduce_all(engine, metas: dict[int, dict], tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Reduce each tensor (fused per dtype into one flat buffer); pre/post scaling as Horovod does it."""
    ref = next(iter(metas.values()))
    op, pre, post = ref["op"], ref["prescale"], ref["postscale"]
    if op == AVERAGE:
        post = post / engine.size
    results: list[torch.Tensor | None] = [None] * len(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    for indices in by_dtype.values():
        parts = [scale(tensors[i].detach().to("cpu"), pre).reshape(-1) for i in indices]
        flat = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
        pieces = _reduce(flat, op, engine).split([tensors[i].numel() for i in indices])
        for i, piece in zip(indices, pieces, strict=True):
            results[i] = scale(piece.view(tensors[i].shape), post).to(tensors[i].device)
    return results  # type: ignore[return-value]


def _finish(local: Request | None, results: list[torch.Tensor]):
    """Copy into the in-place outputs when there are some; a single tensor comes back bare."""
    if local is None:
        return None
    if local.outputs is not None:
        for out, res in zip(local.outputs, results, strict=True):
            if out.data_ptr() != res.data_ptr():
                out.data.copy_(res)
        results = local.outputs
    return results if local.args.get("grouped") else results[0]


def _allreduce(engine, metas, local):
    return _finish(local, _allreduce_all(engine, metas, _inputs(metas, local)))


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


def _allgather(engine, metas, local):
    results = []
    for i, t in enumerate(local.tensors):
        shapes = [metas[r]["shapes"][i] or [1] for r in range(engine.size)]
        rows = [s[0] for s in shapes]
        rest = shapes[0][1:]
        row_bytes = math.prod(rest) * t.element_size()
        mine = _as_bytes(t)
        if engine.size == 1:
            gathered = mine.clone()
        else:
            padded = torch.zeros(max(max(rows) * row_bytes, 1), dtype=torch.uint8)
            padded[: mine.numel()] = mine
            bufs = [torch.empty_like(padded) for _ in range(engine.size)]
            dist.all_gather(bufs, padded, group=engine.group)
            gathered = torch.cat([b[: n * row_bytes] for b, n in zip(bufs, rows, strict=True)])
        results.append(gathered.view(t.dtype).reshape(sum(rows), *rest).to(t.device))
    return _finish(local, results)


def _broadcast(engine, metas, local):
    results = []
    for t in local.tensors:
        buf = _as_bytes(t).clone()
        if engine.size > 1:
            dist.broadcast(buf, src=local.args["root"], group=engine.group)
        results.append(buf.view(t.dtype).reshape(t.shape).to(t.device))
    return _finish(local, results)


def _alltoall(engine, metas, local):
    t = local.tensors[0]
    me = engine.rank
    rest = list(t.shape[1:])
    row_bytes = math.prod(rest) * t.element_size()
    send = metas[me]["splits"]
    recv = [metas[r]["splits"][me] for r in range(engine.size)]
    mine = _as_bytes(t)
    out = torch.empty(sum(recv) * row_bytes, dtype=torch.uint8)
    if engine.size == 1:
        out.copy_(mine[: out.numel()])
    else:
        dist.all_to_all_single(
            out, mine[: sum(send) * row_bytes].contiguous(),
            output_split_sizes=[n * row_bytes for n in recv],
            input_split_sizes=[n * row_bytes for n in send],
            group=engine.group,
        )  # fmt: skip
    return out.view(t.dtype).reshape(sum(recv), *rest).to(t.device), torch.tensor(recv, dtype=torch.int32)


def _reducescatter(engine, metas, local):
    reduced = _allreduce_all(engine, metas, local.tensors)
    # tensor_split gives the first ``rows % size`` ranks one row more, as Horovod does
    results = [r.tensor_split(engine.size)[engine.rank].clone() for r in reduced]
    return results if local.args.get("grouped") else results[0]


_KERNELS = {
    "allreduce": _allreduce,
    "allgather": _allgather,
    "broadcast": _broadcast,
    "alltoall": _alltoall,
    "reducescatter": _reducescatter,
    "barrier": lambda engine, metas, local: None,
}
