"""Gradients averaged in shared memory (`loom.comm.shared_gradients`): values, views, bytes, when used."""

import json

import pytest
import torch
from torch import nn

from loom.comm.shared_gradients import shared_gradients_unusable
from loom.comm.shm import shm_unsupported_reason

pytestmark = pytest.mark.skipif(shm_unsupported_reason() is not None, reason=str(shm_unsupported_reason()))


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_average_equals_the_mean_of_every_ranks_gradient(workers, world_size):
    for rank, out in enumerate(workers("shared_grads.py", world_size, timeout=100)):
        got = json.loads(out.splitlines()[-1])
        assert got["worst"] <= 1e-6, (rank, got)
        assert got["worst_extra"] == 0.0, (rank, got)  # float64 sums of exactly representable values
        assert "1-D float64 tensor of at most 3 values" in got["refused"], (rank, got)
        assert got["views"], f"rank {rank}: a .grad is not a view of its shared slot"
        # the owner writes its averaged chunk into the L - 1 other slots
        assert got["sent_per_step"] == (world_size - 1) * got["chunk_bytes"] > 0, (rank, got)
        assert not got["buffers_shared"], (
            f"rank {rank}: a model with buffers to broadcast must go through DDP"
        )
        # no room in /dev/shm: every rank falls back to DDP, says why (the creator, rank 0, names the cause), trains
        assert not got["fallback_shared"] and got["fallback_loss"] > 0, (rank, got)
        why = "/dev/shm full" if rank == 0 else "first process could not create the segment"
        warned = got["fallback_warnings"]
        assert any("gradients go through DDP" in w and why in w for w in warned), (rank, warned)


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_models_it_cannot_serve_are_named():
    assert "dtype" in shared_gradients_unusable(
        nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double()), True
    )
    assert "buffers" in shared_gradients_unusable(nn.BatchNorm1d(3), True)
    assert shared_gradients_unusable(nn.BatchNorm1d(3), False) is None
    frozen = nn.Linear(2, 2).requires_grad_(False)
    assert "no trainable" in shared_gradients_unusable(frozen, True)
    assert shared_gradients_unusable(nn.Linear(2, 2).to(torch.float16), True) is None
