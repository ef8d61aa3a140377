"""loom.data.loader collates exactly as DataLoader(collate_fn=default_collate) does, and refuses datasets that
differ between processes (tests/workers/loader_same_data.py)."""

from __future__ import annotations

import json
from collections import namedtuple

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset, default_collate

import loom
from loom.data import GlobalBatchSampler, ShardBatch, ShardDict
from loom.data.same_data import probe_indices, sample_fingerprint
from loom.topology import Topology
from loom.train.batch import split_batch

SIZE = 11
Pair = namedtuple("Pair", ["image", "label"])


class Samples(Dataset):
    """SIZE samples of a given structure, built from the index (the same in every process)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __len__(self) -> int:
        return SIZE

    def __getitem__(self, i: int):
        x = torch.arange(6, dtype=torch.float32).reshape(2, 3) + i
        if self.kind == "tensor":
            return x
        if self.kind == "tuple":
            return x, i % 3
        if self.kind == "dict":
            return {"x": x, "y": torch.tensor(i, dtype=torch.int16), "w": float(i) / 2}
        if self.kind == "namedtuple":
            return Pair(x, i)
        if self.kind == "nested":
            return {"a": (x, [x.double(), i]), "b": {"c": torch.tensor([i, -i])}, "name": f"s{i}"}
        if self.kind == "ragged":  # sequences of different lengths: only a custom collate_fn can batch them
            return torch.arange(i % 4 + 1), i
        raise ValueError(self.kind)


def pad_collate(samples):
    """A typical custom collate_fn: pad variable-length sequences, keep their lengths."""
    seqs, labels = zip(*samples, strict=True)
    padded = nn.utils.rnn.pad_sequence(list(seqs), batch_first=True)
    return padded, torch.tensor([len(s) for s in seqs]), torch.tensor(labels)


def assert_same(got, want, top: bool = True) -> None:
    """Same nesting, types, dtypes, shapes and values. At the top, loom's tuple stands for DataLoader's list."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), type(got)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want)
        for key in want:
            assert_same(got[key], want[key], top=False)
    elif isinstance(want, (list, tuple)):
        if hasattr(want, "_fields"):
            assert isinstance(got, type(want)) and got._fields == want._fields
        elif top:
            assert isinstance(got, (list, tuple)), type(got)
        else:
            assert type(got) is type(want), (type(got), type(want))
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert_same(a, b, top=False)
    else:
        assert got == want and type(got) is type(want)


def batches_and_reference(dataset, batch, world, rank, collate_fn=None, **kw):
    """loom's batches for one rank, the DataLoader batches on the same indices, and the shares."""
    topo = Topology(rank, world, rank, world, "gloo")
    ours = list(loom.data.loader(dataset, batch, topology=topo, collate_fn=collate_fn, **kw))
    sampler = GlobalBatchSampler(len(dataset), batch, rank=rank, world_size=world, **kw)
    shares = [b.share.tolist() for b in sampler]
    nonempty = [s for s in shares if s]
    reference = DataLoader(dataset, batch_sampler=nonempty, collate_fn=collate_fn or default_collate)
    return ours, list(reference), shares


CASES = [("tensor", None), ("tuple", None), ("dict", None), ("namedtuple", None), ("nested", None)]


@pytest.mark.unit
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("kind", "collate_fn"), [*CASES, ("ragged", pad_collate)])
@pytest.mark.parametrize(("world", "shuffle"), [(1, True), (3, True), (3, False)])
def test_batches_equal_dataloader_default_collate_on_the_same_indices(kind, collate_fn, world, shuffle):
    dataset = Samples(kind)
    for rank in range(world):
        ours, reference, shares = batches_and_reference(dataset, 4, world, rank, collate_fn, shuffle=shuffle)
        assert len(ours) == len(shares) == 3
        for got, want in zip(ours, reference, strict=True):
            assert_same(got, want)


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_one_tensor_per_sample_is_one_stacked_tensor():
    (x, *_), _, _ = batches_and_reference(Samples("tensor"), 4, 1, 0, shuffle=False)
    assert isinstance(x, torch.Tensor) and x.shape == (4, 2, 3)
    assert x[:, 0, 0].tolist() == [0, 1, 2, 3]  # indexing like a tensor works (it raised TypeError before)


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_layout_reaches_tuple_dict_and_namedtuple_batches_not_tensor_batches():
    topo = Topology(1, 2, 1, 2, "gloo")
    for kind, kind_type in (("tuple", ShardBatch), ("dict", ShardDict), ("namedtuple", Pair)):
        batches = list(loom.data.loader(Samples(kind), 4, seed=3, topology=topo))
        for step, batch in enumerate(batches):
            assert isinstance(batch, kind_type), kind
            assert (batch.global_size, batch.epoch, batch.step) == ([4, 4, 3][step], 0, step)
            assert (batch.shard_index, batch.shard_count) == (1, 2)
            assert isinstance(batch.fingerprint, int)
    pairs = list(loom.data.loader(Samples("namedtuple"), 4, topology=topo))
    assert pairs[0].image.shape == (2, 2, 3) and pairs[0].label.dtype == torch.int64
    tensor_batch = next(iter(loom.data.loader(Samples("tensor"), 4, topology=topo)))
    assert type(tensor_batch) is torch.Tensor and not hasattr(tensor_batch, "global_size")


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_strategies_refuse_a_batch_that_is_not_an_inputs_targets_pair_clearly():
    single = Topology(0, 1, 0, 1, "none")
    for kind in ("tensor", "dict"):
        batch = next(iter(loom.data.loader(Samples(kind), 4, topology=single)))
        with pytest.raises(TypeError, match=r"\(inputs, targets\)"):
            split_batch(batch)
    inputs, targets = split_batch(next(iter(loom.data.loader(Samples("tuple"), 4, topology=single))))
    assert inputs.shape == (4, 2, 3) and targets.shape == (4,)


@pytest.mark.unit
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("kind", "collate_fn"), [*CASES, ("ragged", pad_collate), ("tensordataset", None)])
def test_an_empty_share_is_a_zero_sample_batch_of_the_same_structure(kind, collate_fn):
    # A global batch of 2 over 4 replicas: replicas 2 and 3 get no sample.
    dataset = (
        TensorDataset(torch.randn(SIZE, 3), torch.arange(SIZE)) if kind == "tensordataset" else Samples(kind)
    )
    full = next(iter(DataLoader(dataset, batch_size=2, collate_fn=collate_fn or default_collate)))

    def cut(value):  # what a zero-sample DataLoader batch would be
        if isinstance(value, torch.Tensor):
            return value[:0]
        if hasattr(value, "_fields"):
            return type(value)(*map(cut, value))
        if isinstance(value, (list, tuple)):
            strings = all(isinstance(v, str) for v in value)
            return type(value)() if strings else type(value)(map(cut, value))
        if isinstance(value, dict):
            return {k: cut(v) for k, v in value.items()}
        return value

    for shuffle in (True, False):
        topo = Topology(3, 4, 3, 4, "gloo")
        empty = next(
            iter(loom.data.loader(dataset, 2, shuffle=shuffle, topology=topo, collate_fn=collate_fn))
        )
        if kind == "ragged":  # a padded width depends on the samples: compare all but the trailing sizes
            assert [(t.dtype, t.shape[0]) for t in empty] == [(t.dtype, 0) for t in full]
            assert empty[0].dim() == 2
        else:
            assert_same(empty, cut(full))
        if not isinstance(empty, torch.Tensor):
            assert empty.global_size == 2 and empty.shard_index == 3


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_tensordataset_fast_path_is_a_view_without_shuffle_and_equals_dataloader():
    dataset = TensorDataset(torch.randn(SIZE, 3), torch.arange(SIZE))
    for shuffle in (False, True):
        ours, reference, _ = batches_and_reference(dataset, 4, 3, 1, shuffle=shuffle)
        for got, want in zip(ours, reference, strict=True):
            assert_same(got, want)
        shares_storage = (
            ours[0][0].untyped_storage().data_ptr() == dataset.tensors[0].untyped_storage().data_ptr()
        )
        assert shares_storage == (not shuffle)
    # With a custom collate_fn the samples go through it, as DataLoader does.
    ours, reference, _ = batches_and_reference(
        dataset, 4, 1, 0, collate_fn=lambda s: torch.stack([x for x, _ in s])
    )
    for got, want in zip(ours, reference, strict=True):
        assert_same(got, want)


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_job_loader_forwards_collate_fn():
    single = Topology(0, 1, 0, 1, "none")
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    job = loom.DataParallel(topology=single).setup(
        model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss()
    )
    calls = []

    def collate(samples):
        calls.append(len(samples))
        x, _ = default_collate(samples)
        return x, x.sum(dim=1, keepdim=True)

    data = TensorDataset(torch.randn(SIZE, 3), torch.zeros(SIZE))
    loader = job.loader(data, 4, seed=0, collate_fn=collate, same_data_check=False)
    losses = [job.train_step(batch) for batch in loader]
    assert calls == [4, 4, 3] and len(losses) == 3


@pytest.mark.unit
def test_probe_indices_and_sample_fingerprint():
    assert probe_indices(0) == []
    assert probe_indices(1) == [0]
    probes = probe_indices(1000)
    assert probes[:2] == [0, 999] and len(probes) == 5 and probes == probe_indices(1000)
    x = torch.arange(6.0)
    assert sample_fingerprint((x, 1)) == sample_fingerprint((x.clone(), 1))
    for other in ((x + 1, 1), (x, 2), (x.double(), 1), (x.reshape(2, 3), 1), ({"a": x}, 1)):
        assert sample_fingerprint(other) != sample_fingerprint((x, 1)), other
    assert sample_fingerprint(torch.ones(2, dtype=torch.bfloat16)) != sample_fingerprint(torch.ones(2))


def run_same_data(workers, *cases: str) -> dict[str, list[dict]]:
    outputs = workers("loader_same_data.py", 2, *cases, timeout=150)
    records: dict[str, list[dict]] = {}
    for out in outputs:
        for line in out.splitlines():
            if line.startswith("{"):
                record = json.loads(line)
                records.setdefault(record["case"], []).append(record)
    return records


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_processes_with_different_datasets_are_refused_on_every_rank_unless_intended(workers):
    cases = ("same", "seed", "length", "optout", "augment", "job_dp", "job_pipeline")
    records = run_same_data(workers, *cases)
    for case in cases:
        assert [r["rank"] for r in records[case]] == [0, 1], case
    for case in ("same", "optout", "augment"):
        for r in records[case]:
            assert r["raised"] == "" and r["steps"] == 3, (case, r)
    for r in records["augment"]:
        assert r["rng_untouched"], "the check must leave the global random generators as it found them"
    for case in ("seed", "job_dp", "job_pipeline"):
        for r in records[case]:
            message = r["raised"]
            assert f"rank {r['rank']}:" in message and "hold different datasets" in message, (case, message)
            assert "sample 0 (of 20) differs: rank(s) [0] vs rank(s) [1]" in message, message
            assert "same_data_check=False" in message and "HINT" in message
    for r in records["length"]:
        assert "dataset length 20 on rank(s) [0], 21 on rank(s) [1]" in r["raised"], r["raised"]


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_batches_survive_copy_and_pickle_with_their_layout():
    import copy
    import pickle

    topo = Topology(1, 2, 1, 2, "gloo")
    for kind in ("tuple", "dict", "namedtuple"):
        batch = next(iter(loom.data.loader(Samples(kind), 4, seed=3, topology=topo)))
        for clone in (copy.copy(batch), copy.deepcopy(batch), pickle.loads(pickle.dumps(batch))):
            assert type(clone) is type(batch), kind
            assert_same(clone, batch)
            assert [getattr(clone, a) for a in ("global_size", "step", "shard_index", "fingerprint")] == [
                getattr(batch, a) for a in ("global_size", "step", "shard_index", "fingerprint")
            ]
