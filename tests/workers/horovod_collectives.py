"""Every loom.horovod collective on 2+ processes, checked against torch.distributed on loom's own process
group and against results computed by hand. Prints ``CHECKED <n>`` when all passed (raises otherwise).

Run by tests/test_horovod.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import loom.horovod as hvd

checked = 0


def same(actual: torch.Tensor, expected: torch.Tensor, what: str, atol: float = 0.0) -> None:
    global checked
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        raise AssertionError(
            f"{what}: got {actual.dtype}{list(actual.shape)}, want {expected.dtype}{list(expected.shape)}"
        )
    if not torch.allclose(actual.double(), expected.double(), rtol=0, atol=atol):
        raise AssertionError(f"{what}: got {actual}, want {expected}")
    checked += 1


def rank_tensor(rank: int, dtype: torch.dtype, shape=(3, 4)) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randint(-50, 50, shape, generator=g).to(dtype)


def torch_reduce(t: torch.Tensor, op) -> torch.Tensor:
    out = t.clone()
    dist.all_reduce(out, op=op)
    return out


hvd.init()
rank, size = hvd.rank(), hvd.size()
assert (rank, size) == (dist.get_rank(), dist.get_world_size())

# allreduce: every op and dtype against torch.distributed; Average against the sum divided by hand.
for dtype in (
    torch.float32,
    torch.float64,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.uint8,
    torch.int16,
):
    t = rank_tensor(rank, dtype) if dtype != torch.uint8 else rank_tensor(rank, torch.int64).abs().to(dtype)
    wide = t.to(torch.float64) if dtype in (torch.float16, torch.int16) else t
    for op, dist_op in ((hvd.Sum, dist.ReduceOp.SUM), (hvd.Min, dist.ReduceOp.MIN), (hvd.Max, dist.ReduceOp.MAX),
                        (hvd.Product, dist.ReduceOp.PRODUCT)):  # fmt: skip
        if dtype == torch.uint8 and op in (hvd.Sum, hvd.Product):
            continue  # wraps around; not comparable through float64
        expected = torch_reduce(wide, dist_op).to(dtype)
        same(hvd.allreduce(t, op=op), expected, f"allreduce {dtype} op={op}")
    if dtype.is_floating_point:
        total = torch_reduce(t.double(), dist.ReduceOp.SUM)
        same(hvd.allreduce(t), (total / size).to(dtype), f"allreduce average {dtype}", atol=1e-3)
        same(hvd.allreduce(t, average=False), total.to(dtype), f"allreduce average=False {dtype}", atol=1e-3)

# integer average truncates toward zero, in float64, as Horovod does
ints = torch.tensor([3 + rank, -3 - rank, 7], dtype=torch.int64)
s = sum(3 + r for r in range(size))
same(hvd.allreduce(ints, op=hvd.Average), torch.tensor([int(s / size), -int(s / size), 7]), "int average")

# pre/post scaling
x = torch.full((5,), float(rank + 1))
total = sum(r + 1 for r in range(size))
same(hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5), torch.full((5,), 0.5 * total), "prescale")
same(hvd.allreduce(x, op=hvd.Sum, postscale_factor=3.0), torch.full((5,), 3.0 * total), "postscale")
same(hvd.allreduce(x, op=hvd.Average, prescale_factor=2.0, postscale_factor=0.25),
     torch.full((5,), 2.0 * total * 0.25 / size), "average with both factors")  # fmt: skip

# in place, grouped, async
y = x.clone()
out = hvd.allreduce_(y, op=hvd.Sum)
assert out is y
same(y, torch.full((5,), float(total)), "allreduce_ in place")
group = [
    torch.full((2,), float(rank)),
    torch.full((3, 1), 2.0 * rank, dtype=torch.float64),
    torch.tensor([rank]),
]
reduced = hvd.grouped_allreduce(group, op=hvd.Sum)
for g, r in zip(group, reduced, strict=True):
    same(r, torch_reduce(g, dist.ReduceOp.SUM), "grouped_allreduce")
handles = [
    hvd.allreduce_async(torch.full((4,), float(rank + i)), name=f"async{i}", op=hvd.Sum) for i in range(5)
]
for i, h in enumerate(handles):
    same(hvd.synchronize(h), torch.full((4,), float(sum(r + i for r in range(size)))), f"async {i}")
h = hvd.allreduce_async(torch.ones(3), op=hvd.Sum)
while not hvd.poll(h):
    pass
same(hvd.synchronize(h), torch.full((3,), float(size)), "poll then synchronize")

# names match across ranks in any order: rank 0 submits b then a, the others a then b
order = ["a", "b"] if rank else ["b", "a"]
hs = {n: hvd.allreduce_async(torch.full((2,), 10.0 if n == "a" else 1.0), name=n, op=hvd.Sum) for n in order}
same(hvd.synchronize(hs["a"]), torch.full((2,), 10.0 * size), "named out of order a")
same(hvd.synchronize(hs["b"]), torch.full((2,), 1.0 * size), "named out of order b")

# fp16 compression: sent as float16, given back in the input's dtype
v = torch.tensor([1.0 + rank / 3, 1e-4, 2048.0 + rank])
got = hvd.allreduce(v, op=hvd.Sum, compression=hvd.Compression.fp16)
expected = torch_reduce(v.half(), dist.ReduceOp.SUM).float()
same(got, expected, "fp16 compression")

# allgather with different first dimensions, every dtype
for dtype in (torch.float32, torch.int8, torch.uint8, torch.int16, torch.float16, torch.bool, torch.float64):
    mine = torch.full((rank + 2, 3), rank % 2 if dtype == torch.bool else rank + 1).to(dtype)
    expected = torch.cat(
        [torch.full((r + 2, 3), r % 2 if dtype == torch.bool else r + 1).to(dtype) for r in range(size)]
    )
    same(hvd.allgather(mine), expected, f"allgather {dtype}")
gathered = hvd.synchronize(hvd.allgather_async(torch.full((rank + 1, 2), float(rank))))
same(gathered, torch.cat([torch.full((r + 1, 2), float(r)) for r in range(size)]), "allgather_async uneven")

# broadcast from every root, new tensor and in place; against torch.distributed.broadcast
for root in range(size):
    t = rank_tensor(rank, torch.float64)
    ref = t.clone()
    dist.broadcast(ref, src=root)
    same(hvd.broadcast(t, root), ref, f"broadcast root {root}")
    same(t, rank_tensor(rank, torch.float64), "broadcast leaves its input alone")
    hvd.broadcast_(t, root)
    same(t, ref, f"broadcast_ root {root}")

# alltoall with splits: rank r sends (j + 1) rows valued 100 r + j to rank j
splits = torch.tensor([j + 1 for j in range(size)], dtype=torch.int32)
rows = torch.cat([torch.full((j + 1, 2), 100.0 * rank + j) for j in range(size)])
collected, received = hvd.alltoall(rows, splits)
same(received, torch.full((size,), rank + 1, dtype=torch.int32), "alltoall received splits")
same(
    collected, torch.cat([torch.full((rank + 1, 2), 100.0 * r + rank) for r in range(size)]), "alltoall data"
)
equal = torch.arange(2 * size, dtype=torch.int64) + 1000 * rank
ref = torch.empty_like(equal)
dist.all_to_all_single(ref, equal)
same(hvd.alltoall(equal), ref, "alltoall equal splits vs torch.distributed")

# reducescatter: average and sum, against torch.distributed's reduce then this rank's rows
t = rank_tensor(rank, torch.float64, (4 * size, 3))
full = torch_reduce(t, dist.ReduceOp.SUM)
same(hvd.reducescatter(t, op=hvd.Sum), full[4 * rank : 4 * rank + 4], "reducescatter sum")
same(hvd.reducescatter(t), full[4 * rank : 4 * rank + 4] / size, "reducescatter average")

# objects: JSON plus tensors, types kept; what JSON cannot hold is refused before anything is sent
obj = {"a": (1, 2.5, None), 0: [torch.arange(3), {"nested": {1, 2}}], "f": float("inf"), "b": b"\x00\x01"}
got = hvd.broadcast_object(obj if rank == 0 else None, root_rank=0)
assert got.keys() == obj.keys() and got["a"] == (1, 2.5, None) and got[0][1] == {"nested": {1, 2}}
assert torch.equal(got[0][0], torch.arange(3)) and got["f"] == float("inf") and got["b"] == b"\x00\x01"
everyone = hvd.allgather_object({"rank": rank, "t": torch.tensor([rank])})
assert [e["rank"] for e in everyone] == list(range(size)) and [int(e["t"]) for e in everyone] == list(
    range(size)
)
checked += 2
try:
    hvd.broadcast_object(lambda: 0, root_rank=0) if rank == 0 else None
    raise AssertionError("a lambda was sent")
except TypeError as error:
    assert rank == 0 and "never pickle" in str(error)
except AssertionError:
    if rank == 0:
        raise

# Gradients: Horovod's (module docstring of loom.horovod.collectives), against what every rank computes by hand from
# every rank's upstream gradient `upstream(r, shape)` (the loss is sum(y * upstream), so y's gradient is it).


def upstream(r: int, shape) -> torch.Tensor:
    return torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(500 + r))


def gradient_of(fn, *inputs: torch.Tensor) -> list[torch.Tensor]:
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    outs = fn(leaves)
    outs = outs if isinstance(outs, list | tuple) else [outs]
    sum((y * upstream(rank + 10 * i, y.shape)).sum() for i, y in enumerate(outs)).backward()
    return [x.grad for x in leaves]


def every(shape, i: int = 0) -> list[torch.Tensor]:
    return [upstream(r + 10 * i, shape) for r in range(size)]


x = rank_tensor(rank, torch.float64, (4, 2))
mean = torch.stack(every((4, 2))).mean(0)
(g,) = gradient_of(lambda xs: hvd.allreduce(xs[0]), x)
same(g, mean, "gradient of allreduce (average): the averaged gradient")
(g,) = gradient_of(lambda xs: hvd.allreduce(xs[0], op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0), x)
same(g, 1.5 * torch.stack(every((4, 2))).sum(0), "gradient of allreduce (sum, scaled)", atol=1e-12)
g0, g1 = gradient_of(lambda xs: hvd.grouped_allreduce(xs, op=hvd.Sum), x, x[:1, :1])
same(g0, torch.stack(every((4, 2))).sum(0), "gradient of grouped_allreduce [0]")
same(g1, torch.stack(every((1, 1), 1)).sum(0), "gradient of grouped_allreduce [1]")
rows = [1 + r for r in range(size)]  # uneven first dimensions
start = sum(rows[:rank])
(g,) = gradient_of(lambda xs: hvd.allgather(xs[0]), rank_tensor(rank, torch.float64, (rows[rank], 3)))
same(
    g,
    torch.stack(every((sum(rows), 3))).mean(0)[start : start + rows[rank]],
    "gradient of allgather: own rows",
)
g0, g1 = gradient_of(lambda xs: hvd.grouped_allgather(xs), rank_tensor(rank, torch.float64, (rows[rank], 2)),
                     rank_tensor(rank, torch.float64, (2, 1)))  # fmt: skip
same(
    g0,
    torch.stack(every((sum(rows), 2))).mean(0)[start : start + rows[rank]],
    "gradient of grouped_allgather [0]",
)
same(
    g1,
    torch.stack(every((2 * size, 1), 1)).mean(0)[2 * rank : 2 * rank + 2],
    "gradient of grouped_allgather [1]",
)
(g,) = gradient_of(lambda xs: hvd.broadcast(xs[0], 1), x)
same(
    g,
    mean if rank == 1 else torch.zeros_like(mean),
    "gradient of broadcast: averaged on the root, zeros elsewhere",
)
wide = rank_tensor(rank, torch.float64, (2 * size, 3))  # two rows each
(g,) = gradient_of(lambda xs: hvd.reducescatter(xs[0]), wide)
same(g, torch.cat(every((2, 3))), "gradient of reducescatter (average): the gathered gradient")
(g,) = gradient_of(lambda xs: hvd.reducescatter(xs[0], op=hvd.Sum), wide)
same(g, size * torch.cat(every((2, 3))), "gradient of reducescatter (sum): gathered, times the size")
(g,) = gradient_of(lambda xs: hvd.alltoall(xs[0]), wide)
same(
    g,
    torch.cat([w[2 * rank : 2 * rank + 2] for w in every((2 * size, 3))]),
    "gradient of alltoall: sent back",
)
uneven = [j + 1 for j in range(size)]  # rank r sends j + 1 rows to rank j, so receives r + 1 from each
(g,) = gradient_of(
    lambda xs: hvd.alltoall(xs[0], torch.tensor(uneven, dtype=torch.int32))[0],
    rank_tensor(rank, torch.float64, (sum(uneven), 3)),
)
same(
    g,
    torch.cat([upstream(j, (size * (j + 1), 3))[rank * (j + 1) : (rank + 1) * (j + 1)] for j in range(size)]),
    "gradient of alltoall with uneven splits: each block sent back to its sender",
)

# mismatches fail on every rank with a RuntimeError, instead of hanging
try:
    hvd.allreduce(torch.zeros(3 + rank))
    raise AssertionError("mismatched shapes were reduced")
except RuntimeError as error:
    assert "disagree on shapes" in str(error), error

# features loom lacks are refused by name
for call, feature in ((lambda: hvd.allreduce(x, op=hvd.Adasum), "Adasum"),
                      (lambda: hvd.add_process_set([0]), "process set"),
                      (lambda: hvd.start_timeline("/tmp/t.json"), "timeline")):  # fmt: skip
    try:
        call()
        raise AssertionError(f"{feature} was not refused")
    except NotImplementedError as error:
        assert feature in str(error), error

hvd.barrier()
print(f"CHECKED {checked}")
hvd.shutdown()
