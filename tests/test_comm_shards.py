"""loom.comm.reduce_scatter / all_gather: pieces within one element, equal to all_reduce's (issue 21, item 5)."""

import pytest
import torch

from loom.comm import all_gather, piece_bounds, reduce_scatter


@pytest.mark.unit
def test_pieces_cover_the_tensor_once_and_differ_by_at_most_one():
    for numel in (0, 1, 5, 8, 1001):
        for size in (1, 2, 3, 4):
            bounds = [piece_bounds(numel, r, size) for r in range(size)]
            assert bounds[0][0] == 0 and bounds[-1][1] == numel
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
            assert max(hi - lo for lo, hi in bounds) - min(hi - lo for lo, hi in bounds) <= 1


@pytest.mark.unit
def test_one_process_keeps_the_whole_tensor_and_refuses_bad_input():
    flat = torch.arange(5.0)
    assert torch.equal(reduce_scatter(flat), flat) and torch.equal(all_gather(flat, 5), flat)
    with pytest.raises(ValueError, match="1-D"):
        reduce_scatter(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="op='sum' or 'avg'"):
        reduce_scatter(flat, "max")
    with pytest.raises(ValueError, match="has 5 elements"):
        all_gather(torch.zeros(3), 5)


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [2, 3])
def test_reduce_scatter_and_all_gather_equal_all_reduce(workers, world_size):
    assert all(out.strip().endswith("OK") for out in workers("comm_shards.py", world_size, timeout=80))
