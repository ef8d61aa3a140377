"""`loom.data.loader.LazyBatch` (issue 39, item 1): under heal `job.loader` yields a global batch's indices, and
each member fetches only its share of it at the step (`loom.parallel.data.data_axis.member_share`)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import loom
from loom.data.loader import LazyBatch, loader
from loom.parallel.data.data_axis import FixedAxis, batch_fingerprint, member_share
from loom.topology import Topology

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

ONE = Topology(0, 1, 0, 1, "none")


class Counted(Dataset):
    """A map-style dataset that logs every index it serves."""

    def __init__(self, n: int = 23) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 3, generator=g), torch.randn(n, 1, generator=g)
        self.served: list[int] = []

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.served.append(i)
        return self.x[i], self.y[i]


def lazy_batches(data: Dataset, global_batch: int = 10) -> list[LazyBatch]:
    shards = loader(data, global_batch, seed=3, topology=ONE)
    shards.lazy = True
    return list(shards)


@pytest.mark.parametrize("count", [1, 2, 3, 4, 12])  # 12 > a batch of 10 or of 3: empty shares
def test_a_share_fetches_only_its_samples_and_equals_the_eager_loaders_share(count):
    data = Counted()
    batches = lazy_batches(data)
    assert data.served == [] and [b.global_size for b in batches] == [10, 10, 3]
    for index in range(count):
        eager = list(loader(Counted(), 10, seed=3, topology=Topology(index, count, 0, 1, "none")))
        for lazy, want in zip(batches, eager, strict=True):
            data.served.clear()
            got = lazy.share(index, count)
            share = sorted(int(i) for i in got_indices(lazy, index, count))
            # an empty share is a zero-sample batch whose structure sample 0 gave (once per loader)
            assert sorted(data.served) == share or (not share and data.served in ([], [0]))
            assert len(data.served) <= -(-lazy.global_size // count)  # this share's samples only
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
            assert (got.global_size, got.shard_index, got.shard_count) == (lazy.global_size, index, count)


def got_indices(lazy: LazyBatch, index: int, count: int) -> torch.Tensor:
    from loom.data.sampler import share_bounds

    lo, hi = share_bounds(lazy.global_size, index, count)
    return lazy.indices[lo:hi]


def test_the_fingerprint_names_the_indices_and_the_dataset_without_loading_it():
    data = Counted()
    first, again = lazy_batches(data), lazy_batches(Counted())
    assert data.served == []
    assert [b.fingerprint for b in first] == [b.fingerprint for b in again]
    assert len({b.fingerprint for b in first}) == 3  # each step's batch its own
    longer = lazy_batches(Counted(24))  # the same first indices? the length is in the print anyway
    assert first[0].fingerprint != longer[0].fingerprint
    assert all(1 <= batch_fingerprint(b) <= 251 for b in first) and data.served == []


def test_member_share_cuts_a_lazy_batch_and_a_whole_batch_alike():
    data = TensorDataset(*Counted().x.split(2, dim=1))
    lazy = lazy_batches(data)[0]
    whole = lazy.load()
    inputs_of = loom.LossCall().inputs_of
    for index in range(3):
        axis = FixedAxis(index, 3, [0, 1, 2])
        (a, total_a, _), (b, total_b, _) = (
            member_share(lazy, axis, inputs_of),
            member_share(whole, axis, inputs_of),
        )
        assert total_a == total_b == 10
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_a_job_that_does_not_fetch_shares_refuses_a_lazy_batch_and_one_that_does_evaluates_it_whole():
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    job = loom.DataParallel(topology=ONE).setup(
        model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss()
    )
    lazy = lazy_batches(Counted())[0]
    for call in (job.train_step, job.eval_step):
        with pytest.raises(
            TypeError, match=r"rank 0: DataParallelJob was given a LazyBatch .* HINT: iterate"
        ):
            call(lazy)
    assert job.step == 0
    job.fetches_shares = (
        True  # as under heal, where its data axis is one replica too: eval loads the batch whole
    )
    assert job.eval_step(lazy) == job.eval_step(lazy.load())
