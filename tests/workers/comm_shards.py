"""reduce_scatter and all_gather against all_reduce, at several lengths (tests/test_comm_shards.py).

Every rank builds rank-dependent tensors, reduce-scatters them (sum and avg) and all-gathers the pieces back;
prints OK, or raises naming what differs.
"""

import torch
import torch.distributed as dist

import loom
from loom.comm.shards import all_gather, piece_bounds, reduce_scatter

topo = loom.init()
rank, world = topo.rank, topo.world_size
for numel in (0, 1, 2, 7, 1000):
    for dtype in (torch.float32, torch.float64):
        flat = torch.arange(numel, dtype=dtype) * (rank + 1) + rank
        expected = flat.clone()
        dist.all_reduce(expected)
        lo, hi = piece_bounds(numel, rank, world)
        piece = reduce_scatter(flat, "sum")
        assert torch.equal(piece, expected[lo:hi]), (numel, dtype, piece, expected[lo:hi])
        mean = reduce_scatter(flat, "avg")
        assert torch.allclose(mean, expected[lo:hi] / world), (numel, dtype)
        # equal pieces go to the backend without a copy: the input is left as it was, the result is new
        assert torch.equal(flat, torch.arange(numel, dtype=dtype) * (rank + 1) + rank), (numel, dtype)
        whole = all_gather(piece, numel)
        assert torch.equal(whole, expected), (numel, dtype)
        whole.add_(1)
        assert torch.equal(piece, expected[lo:hi]), (numel, dtype)
print("OK", flush=True)
