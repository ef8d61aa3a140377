"""Global-batch sharding: every sample exactly once, order independent of workers, resumable across sizes."""

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

import loom
from loom.data import GlobalBatchSampler, share_bounds
from loom.topology import Topology

pytestmark = pytest.mark.unit


def shares(dataset_size, batch, world, epoch=0, **kw):
    """Per step, the list of each rank's share (as python lists)."""
    samplers = [GlobalBatchSampler(dataset_size, batch, rank=r, world_size=world, **kw) for r in range(world)]
    for s in samplers:
        s.set_epoch(epoch)
    return [[b.share.tolist() for b in step] for step in zip(*samplers, strict=True)]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize(("size", "batch"), [(37, 10), (10, 3), (7, 8), (100, 7)])
def test_every_sample_exactly_once_per_epoch(world, size, batch):
    for epoch in (0, 1):
        steps = shares(size, batch, world, epoch=epoch, seed=5)
        seen = [i for step in steps for share in step for i in share]
        assert sorted(seen) == list(range(size)), f"world {world}: duplicated or dropped samples"
        # The concatenation of the shares of a step is exactly the global batch, in the global order.
        reference = shares(size, batch, 1, epoch=epoch, seed=5)
        assert [sum(step, []) for step in steps] == [step[0] for step in reference]


def test_shares_are_contiguous_and_uneven_by_at_most_one():
    assert [share_bounds(10, r, 4) for r in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert [share_bounds(2, r, 4) for r in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]  # empty shares


def test_order_depends_on_seed_and_epoch_only():
    a = GlobalBatchSampler(50, 8, seed=1)
    assert torch.equal(a.order(0), GlobalBatchSampler(50, 8, seed=1, world_size=3, rank=2).order(0))
    assert not torch.equal(a.order(0), a.order(1))
    assert not torch.equal(a.order(0), GlobalBatchSampler(50, 8, seed=2).order(0))
    assert GlobalBatchSampler(5, 2, shuffle=False).order(0).tolist() == [0, 1, 2, 3, 4]


def test_drop_last_drops_only_the_ragged_tail():
    s = GlobalBatchSampler(37, 10, drop_last=True)
    assert s.steps_per_epoch() == 3 and len(s) == 30
    assert sum(b.global_size for b in s) == 30


def test_epochs_advance_without_set_epoch():
    s = GlobalBatchSampler(20, 10, seed=3)
    first = [b.indices.tolist() for b in s]
    second = [b.indices.tolist() for b in s]
    assert s.epoch == 2
    assert first != second


def test_resume_at_world_4_then_world_2_continues_with_exactly_the_remaining_samples():
    size, batch = 53, 8
    saved_state = None
    done = []  # global indices trained before the "crash", at world 4
    at4 = [GlobalBatchSampler(size, batch, rank=r, world_size=4, seed=9) for r in range(4)]
    for s in at4:
        s.set_epoch(2)
    for step, batches in enumerate(zip(*at4, strict=True)):
        done += [i for b in batches for i in b.share.tolist()]
        if step == 2:
            saved_state = at4[0].state_dict()
            break
    at2 = [GlobalBatchSampler(size, batch, rank=r, world_size=2, seed=9) for r in range(2)]
    for s in at2:
        s.load_state_dict(saved_state)
        s.set_epoch(2)  # the usual loop calls set_epoch: it must not rewind a resumed position
    rest = [i for batches in zip(*at2, strict=True) for b in batches for i in b.share.tolist()]
    full = GlobalBatchSampler(size, batch, seed=9).order(2).tolist()
    assert done + rest == full
    assert len(rest) == size - 3 * batch


def test_resume_refuses_a_different_order():
    state = GlobalBatchSampler(50, 8, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed"):
        GlobalBatchSampler(50, 8, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="dataset_size"):
        GlobalBatchSampler(51, 8, seed=1).load_state_dict(state)


@pytest.mark.parametrize("bad", [0, -3, 2.5, "8", True, None])
def test_bad_batch_size_is_refused(bad):
    with pytest.raises((TypeError, ValueError), match="global_batch_size"):
        loom.data.loader(TensorDataset(torch.zeros(4)), bad, topology=Topology(0, 1, 0, 1, "none"))


class Squares(Dataset):
    def __len__(self):
        return 5

    def __getitem__(self, i):
        return torch.tensor([float(i)]), i * i


def test_loader_yields_tensors_with_the_global_size_and_handles_empty_shares():
    topo = Topology(3, 4, 3, 4, "gloo")  # rank 3 of 4: a global batch of 2 leaves it empty
    loader = loom.data.loader(Squares(), 2, shuffle=False, topology=topo)
    batches = list(loader)
    assert len(batches) == len(loader) == 3
    inputs, targets = batches[0]
    assert inputs.shape == (0, 1) and targets.shape == (0,)
    assert batches[0].global_size == 2 and batches[-1].global_size == 1
    first = loom.data.loader(Squares(), 4, shuffle=False, topology=Topology(0, 2, 0, 2, "gloo"))
    x, y = next(iter(first))
    assert x.tolist() == [[0.0], [1.0]] and y.tolist() == [0, 1]


def test_loader_refuses_a_dataset_without_length():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield 1

    with pytest.raises(TypeError, match="map-style dataset"):
        loom.data.loader(Stream(), 4, topology=Topology(0, 1, 0, 1, "none"))
