"""`loader()`: this process's share of every global batch, as ready-to-use tensors.

Each yielded batch is a `ShardBatch`, a tuple ``(inputs, targets)`` that also knows the size of the whole global
batch, the replica it was cut for (``shard_index`` of ``shard_count``) and a fingerprint of its samples' dataset
indices. Strategies read the size to weight gradients by sample count without an extra collective, the layout
to refuse a batch cut for another data axis (`loom.job.check_batch_layout`), and the fingerprint to check that
the ranks of one model replica hold the same samples. A plain tuple works too (the strategy then counts samples
with an all-reduce and fingerprints the tensors themselves).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, TensorDataset, default_collate

from loom.data.sampler import GlobalBatchSampler
from loom.topology import Topology, current

__all__ = ["ShardBatch", "ShardedLoader", "loader"]


class ShardBatch(tuple):
    """A tuple ``(inputs, targets, ...)`` plus the global batch it was cut from."""

    global_size: int
    """Samples in the whole global batch (all replicas)."""
    epoch: int
    step: int
    shard_index: int | None
    """The replica this share was cut for (None: unknown)."""
    shard_count: int | None
    """The number of replicas the global batch was cut into (None: unknown)."""
    fingerprint: int | None
    """CRC-32 of the share's dataset indices (None: unknown): equal on ranks that hold the same samples."""

    def __new__(
        cls,
        items: tuple,
        global_size: int,
        epoch: int,
        step: int,
        shard_index: int | None = None,
        shard_count: int | None = None,
        fingerprint: int | None = None,
    ) -> ShardBatch:
        batch = super().__new__(cls, items)
        batch.global_size = global_size
        batch.epoch = epoch
        batch.step = step
        batch.shard_index = shard_index
        batch.shard_count = shard_count
        batch.fingerprint = fingerprint
        return batch


class ShardedLoader:
    """Iterable over this replica's shares for one epoch; see `loader()`."""

    def __init__(self, dataset: Dataset, sampler: GlobalBatchSampler) -> None:
        self.dataset = dataset
        self.sampler = sampler
        self._empty: tuple | None = None

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)

    def __iter__(self) -> Iterator[ShardBatch]:
        sampler = self.sampler
        for batch in sampler:
            items = self._fetch(batch.share)
            fingerprint = zlib.crc32(batch.share.to(torch.int64).numpy().tobytes())
            yield ShardBatch(
                tuple(items), batch.global_size, batch.epoch, batch.step,
                sampler.rank, sampler.world_size, fingerprint,
            )  # fmt: skip

    def _fetch(self, indices: torch.Tensor) -> tuple:
        if isinstance(self.dataset, TensorDataset):
            if not self.sampler.shuffle and indices.numel():
                # Without shuffling a share is a contiguous range: a view, no copy.
                lo = int(indices[0])
                return tuple(t[lo : lo + indices.numel()] for t in self.dataset.tensors)
            return tuple(t[indices] for t in self.dataset.tensors)
        if indices.numel() == 0:
            return self._empty_batch()
        return tuple(default_collate([self.dataset[int(i)] for i in indices]))

    def _empty_batch(self) -> tuple:
        """A batch of zero samples with the right shapes and dtypes (for an empty share)."""
        if self._empty is None:
            one = default_collate([self.dataset[0]])
            self._empty = tuple(t[:0] if isinstance(t, torch.Tensor) else t for t in one)
        return self._empty


def _dataset_size(dataset: Any) -> int:
    try:
        return len(dataset)
    except TypeError:
        raise TypeError(
            f"loom.data.loader needs a map-style dataset with __len__, got {type(dataset).__name__}. "
            "HINT: wrap your tensors in torch.utils.data.TensorDataset."
        ) from None


def loader(
    dataset: Dataset,
    global_batch_size: int,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
    *,
    topology: Topology | None = None,
) -> ShardedLoader:
    """This process's share of each global batch of ``dataset``.

    Every step consumes the next ``global_batch_size`` samples of one global order fixed by ``(seed, epoch)``;
    replica r takes a contiguous share (sizes differ by at most one; a share may be empty on a ragged last
    batch). ``set_epoch(e)`` selects the epoch; ``state_dict()`` records the position in global samples, so a
    job resumed with a different number of workers continues at exactly the same sample.
    """
    topo = topology if topology is not None else current()
    sampler = GlobalBatchSampler(
        _dataset_size(dataset),
        global_batch_size,
        rank=topo.rank,
        world_size=topo.world_size,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
    )
    return ShardedLoader(dataset, sampler)
