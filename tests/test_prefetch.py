"""A loader that fetches the next share ahead (`loom.data.prefetch`, a CUDA job's TensorDataset loader) hands out
the same batches as one that does not, and reports the consumer's position, not the prefetcher's.

The CUDA copy itself runs in the GPU lane (tests/test_gpu.py); here the prefetcher's thread only gathers (a CPU
`Prefetcher`), which is all the position logic depends on."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

import loom
from loom.data.loader import loader
from loom.data.prefetch import Prefetcher, usable

pytestmark = pytest.mark.unit


def _pair(rank: int = 1, world: int = 2, samples: int = 23, **options):
    """(plain, prefetching) loaders over the same data, in batches of 6; rank ``rank`` of ``world``."""
    g = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(samples, 3, generator=g), torch.arange(samples))
    topo = loom.Topology(rank, world, rank, world, "none")
    plain, ahead = (loader(data, 6, seed=4, topology=topo, **options) for _ in range(2))
    ahead._prefetcher = Prefetcher(torch.device("cpu"))
    return plain, ahead


def _same(a, b) -> None:
    assert type(a) is type(b) and len(a) == len(b)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    for name in ("global_size", "epoch", "step", "shard_index", "shard_count", "fingerprint"):
        assert getattr(a, name) == getattr(b, name), name


@pytest.mark.timeout(60)
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [True, False])
def test_the_same_batches_and_positions_over_epochs(shuffle, drop_last):
    plain, ahead = _pair(shuffle=shuffle, drop_last=drop_last)
    for epoch in range(3):
        plain.set_epoch(epoch)
        ahead.set_epoch(epoch)
        pairs = zip(plain, ahead, strict=True)
        for a, b in pairs:
            _same(a, b)
            assert ahead.state_dict() == plain.state_dict() and ahead.epoch == plain.epoch
        assert ahead.state_dict() == plain.state_dict() and ahead.epoch == plain.epoch


@pytest.mark.timeout(60)
def test_an_abandoned_iteration_saves_the_consumers_position_and_resumes_from_it():
    plain, ahead = _pair()
    for loader_ in (plain, ahead):
        it = iter(loader_)
        next(it), next(it)
    assert ahead.state_dict() == plain.state_dict()  # 2 batches consumed, though the prefetcher took a third
    saved = ahead.state_dict()
    again_plain, again_ahead = _pair()
    again_plain.load_state_dict(saved)
    again_ahead.load_state_dict(saved)
    for a, b in zip(again_plain, again_ahead, strict=True):
        _same(a, b)
    assert again_ahead.state_dict() == again_plain.state_dict()
    ahead.set_epoch(1)  # another epoch: the prefetcher's lead is dropped with the old iteration
    plain.set_epoch(1)
    assert ahead.state_dict() == plain.state_dict()
    _same(next(iter(plain)), next(iter(ahead)))


@pytest.mark.timeout(60)
def test_on_the_last_batch_the_epoch_is_still_the_consumers():
    plain, ahead = _pair()
    steps = len(plain)
    for loader_ in (plain, ahead):
        it = iter(loader_)
        for _ in range(steps):
            next(it)
        loader_.set_epoch(0)  # the epoch being finished: a no-op for both, though the prefetcher is past it
    assert ahead.epoch == plain.epoch == 0 and ahead.state_dict() == plain.state_dict()


@pytest.mark.timeout(60)
def test_empty_shares_come_through_the_prefetcher():
    plain, ahead = _pair(rank=3, world=4, samples=21)  # the last batch of 3 leaves rank 3 none
    shares = list(zip(plain, ahead, strict=True))
    for a, b in shares:
        _same(a, b)
    assert len(shares[-1][1][0]) == 0


def test_only_cpu_tensors_for_a_cuda_device_are_prefetched():
    cpu = [torch.zeros(2)]
    assert not usable(cpu, torch.device("cpu"))
    assert usable(cpu, torch.device("cuda:0")) == torch.cuda.is_available()


def test_a_job_loader_aims_at_its_models_device_and_a_cpu_one_does_not_prefetch():
    data = TensorDataset(torch.zeros(8, 2), torch.zeros(8, 2))
    standalone = loader(data, 4, topology=loom.Topology(0, 1, 0, 1, "none"))
    assert standalone.device is None  # no device asked for
    model = torch.nn.Linear(2, 2)
    job = loom.DataParallel(topology=loom.Topology(0, 1, 0, 1, "none")).setup(
        model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss
    )
    shards = job.loader(data, 4)
    next(iter(shards))
    assert shards.device == next(model.parameters()).device and shards._prefetcher is None
