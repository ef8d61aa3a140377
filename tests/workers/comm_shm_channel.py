"""Pipeline messages and small all-reduces through shared memory, checked bit for bit. Usage: comm_shm_channel.py.

Every rank prints one JSON line: whether each pair used shared memory, the messages' checks, and the small
all-reduce checks (the result identical on every rank, and equal to the sum in rank order). Run by
tests/test_comm_shm_channel.py, on one host or, with LOOM_HOST_ID set per rank, on pretended hosts.
"""

import json
import os

import torch
import torch.distributed as dist

import loom
from loom.comm import shm_channel
from loom.comm.shm_small import MAX_BYTES, SmallAllReduce
from loom.parallel.pipeline.pipeline_communications import recv_gradients, recv_tensors, send_tensors
from loom.parallel.tensor.tensor_parallel_layers import TensorParallelComm

topo = loom.init()
rank, world = topo.rank, topo.world_size
cpu = torch.device("cpu")


def message(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(3, 5, generator=g),
        torch.randn(7, generator=g).to(torch.bfloat16),
        torch.randint(-9, 9, (2, 2, 2), generator=g),
        torch.tensor(True),
        torch.empty(0, 4),
        torch.randn(4, 3, generator=g).t(),  # not contiguous
    ]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype and torch.equal(x, y.contiguous()) for x, y in zip(a, b, strict=True)
    )


checks: dict[str, bool] = {}
nxt, prv = (rank + 1) % world, (rank - 1) % world
# A ring of neighbours, as a pipeline: rank 0 starts, everyone else receives before it sends (no rendezvous wait).
for k in range(3):
    if rank == 0:
        handles = send_tensors(message(100 * k), nxt)
        got = recv_tensors(prv, cpu)
    else:
        got = recv_tensors(prv, cpu)
        handles = send_tensors(message(100 * k), nxt)
    for handle, _ in handles:
        handle.wait()
    checks[f"activation {k}"] = same(got, message(100 * k))
# Gradients back: the shapes the receiver knows.
like = [torch.zeros(3, 5), torch.zeros(6, dtype=torch.float64)]
grads = [torch.full((3, 5), float(rank)), torch.arange(6, dtype=torch.float64) * rank]
if rank == 0:
    handles = send_tensors(grads, prv, with_header=False)
    back = recv_gradients(like, nxt)
else:
    back = recv_gradients(like, nxt)
    handles = send_tensors(grads, prv, with_header=False)
for handle, _ in handles:
    handle.wait()
checks["gradients"] = same(back, [torch.full((3, 5), float(nxt)), torch.arange(6, dtype=torch.float64) * nxt])
# Messages larger than the ring, sent by every rank at once before anyone receives: queued sends must progress
# while their senders wait in a receive, or this deadlocks.
big = torch.arange(3 * shm_channel.CAPACITY // 4 + 77, dtype=torch.float32) + rank
handles = send_tensors([big, big[:1000] * 2], nxt)
got = recv_tensors(prv, cpu)
for handle, _ in handles:
    handle.wait()
expected_big = torch.arange(big.numel(), dtype=torch.float32) + prv
checks["larger than the ring, all at once"] = same(got, [expected_big, expected_big[:1000] * 2])
paths = {
    "to_next": shm_channel.channel_to(nxt) is not None,
    "from_prev": shm_channel.channel_from(prv) is not None,
}

# Small all-reduce through TensorParallelComm (the layers' entry point) and directly; many calls, so both slots
# are reused, sizes changing from call to call, and the fallback above MAX_BYTES.
comm = TensorParallelComm(dist.group.WORLD, rank, world)
reduce_ok = True
for call in range(40):
    numel = [1, 1024, 7, 300, MAX_BYTES // 4 + 10][call % 5]
    dtype = [torch.float32, torch.float64, torch.bfloat16, torch.int64][call % 4]

    def mine(r: int, call: int = call, numel: int = numel, dtype: torch.dtype = dtype) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * call + r)
        return (torch.randn(numel, generator=g) * 100).to(dtype)

    t = mine(rank)
    comm.all_reduce(t, "forward")
    expected = mine(0)
    for r in range(1, world):
        expected = expected + mine(r)
    gathered = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(gathered, t)
    identical = all(torch.equal(g, t) for g in gathered)
    small = t.nbytes <= MAX_BYTES
    close = (
        torch.equal(t, expected)
        if small or not dtype.is_floating_point
        else torch.allclose(t.double(), expected.double(), rtol=1e-2, atol=1e-2)
    )
    reduce_ok = reduce_ok and identical and close
checks["tensor-parallel all-reduces"] = reduce_ok
small = SmallAllReduce.for_group(None)
ops_ok = True
if small is not None:
    for op in ("sum", "avg", "max", "min"):
        t = torch.arange(10.0) * (rank + 1)
        small.all_reduce(t, op)
        parts = [torch.arange(10.0) * (r + 1) for r in range(world)]
        want = {
            "sum": sum(parts[1:], parts[0].clone()),
            "avg": sum(parts[1:], parts[0].clone()) / world,
            "max": parts[-1],
            "min": parts[0],
        }[op]
        ops_ok = ops_ok and torch.equal(t, want)
checks["ops"] = ops_ok
dist.barrier()
print(
    json.dumps(
        {
            "rank": rank,
            "pid": os.getpid(),
            "paths": paths,
            "small": small is not None,
            "checks": checks,
            "tp_local": comm._local is not None,
        }
    )
)
