"""`loader()`: this process's share of every global batch, collated as PyTorch's `DataLoader` does.

The order, the shares, iteration, ``len`` and the resumable position are `loom.data.sampler`'s (the user's view:
docs/concepts.md#global-batch-semantics). Samples are collated by ``collate_fn`` (default `default_collate`); a
`TensorDataset` collated by default is indexed directly instead (a view when not shuffling).

Every batch carries the global batch it was cut from (`_ShardLayout`): strategies read its size to weight
gradients without a collective, its layout to refuse a batch cut for another data axis
(`loom.job.check_batch_layout`), its fingerprint to check that the ranks of one replica hold the same samples.
Which collated types carry them (`_with_layout`): docs/concepts.md#global-batch-semantics; a tensor or custom
object does not, and a strategy then counts and fingerprints it with a collective.

A lazy loader (``ShardedLoader.lazy``: DataParallel's under ``--on-worker-failure heal``, where the replicas are
known only at the step) yields a `LazyBatch` per step instead: the global batch's indices, nothing loaded.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, TensorDataset, default_collate

from loom.data.prefetch import Prefetcher, usable
from loom.data.same_data import check_same_data
from loom.data.sampler import GlobalBatch, GlobalBatchSampler, share_bounds
from loom.topology import Topology, current

__all__ = ["CollateFn", "LazyBatch", "ShardBatch", "ShardDict", "ShardedLoader", "loader"]

CollateFn = Callable[[list[Any]], Any]
"""``collate_fn(samples)``: one batch from a list of ``dataset[i]``, as `DataLoader`'s ``collate_fn``."""

_LAYOUT = ("global_size", "epoch", "step", "shard_index", "shard_count", "fingerprint")


class _ShardLayout:
    """The attributes a loader batch carries about the global batch it was cut from."""

    __slots__ = ()
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


def _stamp(batch: Any, layout: tuple) -> Any:
    for name, value in zip(_LAYOUT, layout, strict=True):
        setattr(batch, name, value)
    return batch


def _layout(batch: Any) -> tuple:
    return tuple(getattr(batch, name) for name in _LAYOUT)


class ShardBatch(_ShardLayout, tuple):
    """A tuple ``(inputs, targets, ...)`` plus the global batch it was cut from."""

    def __new__(cls, items: tuple, *layout: Any) -> ShardBatch:
        """``layout``: the values of `_ShardLayout`'s attributes, in their order."""
        return _stamp(super().__new__(cls, items), layout)

    def __reduce__(self) -> tuple:
        # tuple's default passes only the items to __new__: copy, deepcopy and pickle would fail.
        return type(self), (tuple(self), *_layout(self))


class ShardDict(_ShardLayout, dict):
    """A dict batch (samples that are dicts) plus the global batch it was cut from."""

    def __init__(self, items: dict, *layout: Any) -> None:
        """``layout``: as `ShardBatch`'s."""
        super().__init__(items)
        _stamp(self, layout)


@functools.cache
def _namedtuple_shard(kind: type) -> type | None:
    """A subclass of namedtuple ``kind`` that carries the layout, or None when a field would shadow it."""
    if set(kind._fields) & set(_LAYOUT):  # type: ignore[attr-defined]
        return None
    shard = type(kind.__name__, (_ShardLayout, kind), {"__module__": kind.__module__})
    shard.__reduce__ = _reduce_namedtuple_shard  # type: ignore[method-assign,assignment]
    return shard


def _reduce_namedtuple_shard(batch: Any) -> tuple:
    # The subclass is made at run time, so pickle cannot find it by name: rebuild it from the namedtuple.
    return _rebuild_namedtuple_shard, (type(batch).__mro__[2], tuple(batch), _layout(batch))


def _rebuild_namedtuple_shard(kind: type, items: tuple, layout: tuple) -> Any:
    return _with_layout(kind(*items), *layout)


def _with_layout(batch: Any, *layout: Any) -> Any:
    """``batch`` as a type that carries ``layout`` (see the module docstring); a tensor or other object as is."""
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        shard = _namedtuple_shard(type(batch))
        return batch if shard is None else _stamp(shard(*batch), layout)
    if isinstance(batch, (tuple, list)):
        return ShardBatch(tuple(batch), *layout)
    if type(batch) is dict:
        return ShardDict(batch, *layout)
    return batch


def _zero_samples(batch: Any) -> Any:
    """``batch`` cut to zero samples, keeping its nesting, shapes, dtypes and devices (a sequence of strings, as
    `default_collate` batches them, becomes empty; other non-tensor leaves are kept)."""
    if isinstance(batch, torch.Tensor):
        return batch[:0]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_zero_samples(v) for v in batch))
    if isinstance(batch, (tuple, list)):
        strings = bool(batch) and all(isinstance(v, (str, bytes)) for v in batch)
        return type(batch)() if strings else type(batch)(_zero_samples(v) for v in batch)
    if isinstance(batch, dict):
        return {k: _zero_samples(v) for k, v in batch.items()}
    return batch


class ShardedLoader:
    """Iterable over this replica's shares for one epoch; see `loader()`."""

    def __init__(
        self, dataset: Dataset, sampler: GlobalBatchSampler, collate_fn: CollateFn | None = None
    ) -> None:
        self.dataset = dataset
        self.sampler = sampler
        self.collate_fn: CollateFn = collate_fn if collate_fn is not None else default_collate
        self._empty: Any = None
        self._sliced = isinstance(dataset, TensorDataset) and self.collate_fn is default_collate
        """A TensorDataset collated by default: index its tensors, no per-sample calls (same result)."""
        self.lazy = False
        """Yield a `LazyBatch` per step instead of this replica's share (see the module docstring)."""
        self.device: torch.device | None = None
        """The job's device, set by `loader` (see its ``device``: a CUDA one may prefetch)."""
        self._prefetcher: Prefetcher | None = None
        self._view: tuple[int, int] | None = None
        """(epoch, consumed) after the share last handed out, while a prefetching iteration has fetched one more
        than that: the position `state_dict` and `epoch` report (the consumer's, not the prefetcher's)."""

    def __len__(self) -> int:
        """Batches (steps) per epoch, as ``len(DataLoader)``."""
        return self.sampler.steps_per_epoch()

    def set_epoch(self, epoch: int) -> None:
        if self._view is not None:
            if epoch == self._view[0]:
                return  # the consumer's own epoch: a no-op, as the sampler's (the prefetcher may be past it)
            self._view = None
        self.sampler.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        return self.sampler.epoch if self._view is None else self._view[0]

    def state_dict(self) -> dict[str, Any]:
        state = self.sampler.state_dict()
        if self._view is not None:
            state["epoch"], state["consumed"] = self._view
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._view = None
        self.sampler.load_state_dict(state)

    def __iter__(self) -> Iterator[Any]:
        """This epoch's shares from its beginning (from the restored position after `load_state_dict`, once)."""
        self._view = None
        return self._shares(iter(self.sampler))  # the start is fixed now, at iter(), as DataLoader's is

    def _shares(self, batches: Iterator[GlobalBatch]) -> Iterator[Any]:
        rank, world_size = self.sampler.rank, self.sampler.world_size
        if self.lazy:
            yield from (LazyBatch(self, batch) for batch in batches)
        elif self._prefetching() is not None:
            yield from self._prefetched(batches)
        else:
            yield from (self.fetch_share(batch, batch.share, rank, world_size) for batch in batches)

    def _prefetching(self) -> Prefetcher | None:
        if (
            self._prefetcher is None
            and self._sliced
            and self.device is not None
            and usable(getattr(self.dataset, "tensors", ()), self.device)
        ):
            self._prefetcher = Prefetcher(self.device)
        return self._prefetcher

    def _prefetched(self, batches: Iterator[GlobalBatch]) -> Iterator[Any]:
        """`_shares` with share k+1 gathered (and copied to the device) while the consumer trains on share k."""
        prefetcher, sampler = self._prefetcher, self.sampler
        assert prefetcher is not None and self._sliced
        tensors = self.dataset.tensors  # type: ignore[attr-defined]

        def pull() -> Any:
            batch = next(batches, None)
            if batch is None:
                return None
            return batch, (sampler.epoch, sampler.consumed), prefetcher.start(tensors, batch.share)

        ahead = pull()
        while ahead is not None:
            batch, position, future = ahead
            ahead = pull()  # before this share is handed out, so that the next one loads while it trains
            shares = prefetcher.take(future.result())
            self._view = position
            yield _with_layout(shares, *self._layout_of(batch, batch.share, sampler.rank, sampler.world_size))
        self._view = None

    @staticmethod
    def _layout_of(batch: GlobalBatch, share: torch.Tensor, index: int, count: int) -> tuple:
        fingerprint = zlib.crc32(share.to(torch.int64).numpy().tobytes())
        return batch.global_size, batch.epoch, batch.step, index, count, fingerprint

    def fetch_share(self, batch: GlobalBatch, share: torch.Tensor, index: int, count: int) -> Any:
        """The samples at ``share`` (replica ``index`` of ``count``'s part of ``batch``), collated, with the
        layout attributes (the module docstring)."""
        return _with_layout(self.fetch(share), *self._layout_of(batch, share, index, count))

    def fetch(self, indices: torch.Tensor) -> Any:
        """The samples at dataset ``indices``, collated (without the layout attributes)."""
        if self._sliced:
            tensors = self.dataset.tensors  # type: ignore[attr-defined]
            if not self.sampler.shuffle and indices.numel():
                # Without shuffling a share is a contiguous range: a view, no copy.
                lo = int(indices[0])
                return [t[lo : lo + indices.numel()] for t in tensors]
            return [t[indices] for t in tensors]
        if indices.numel() == 0:  # a batch of zero samples with the right structure, shapes and dtypes
            if self._empty is None:
                self._empty = _zero_samples(self.collate_fn([self.dataset[0]]))
            return self._empty
        return self.collate_fn([self.dataset[int(i)] for i in indices])


class LazyBatch:
    """A global batch of a lazy loader, not loaded: its dataset ``indices`` (``global_size`` of them; ``epoch``,
    ``step``: where it sits), and `share` to fetch one replica's share once the replicas are known (at the step;
    again, with other replicas, when the step is retried). ``fingerprint``: CRC-32 of the dataset's type and
    length and of the indices, equal on processes given the same global batch of the same data."""

    __slots__ = ("_loader", "_batch", "indices", "global_size", "epoch", "step", "fingerprint")

    def __init__(self, loader: ShardedLoader, batch: GlobalBatch) -> None:
        self._loader, self._batch, self.indices = loader, batch, batch.indices
        self.global_size, self.epoch, self.step = batch.global_size, batch.epoch, batch.step
        data = f"{type(loader.dataset).__qualname__}:{loader.sampler.dataset_size}".encode()
        self.fingerprint = zlib.crc32(batch.indices.to(torch.int64).numpy().tobytes(), zlib.crc32(data))

    def share(self, index: int, count: int) -> Any:
        """Replica ``index`` of ``count``'s contiguous share (`share_bounds`), fetched and collated, with the
        layout attributes (``shard_index=index``, ``shard_count=count``)."""
        lo, hi = share_bounds(self.global_size, index, count)
        return self._loader.fetch_share(self._batch, self._batch.indices[lo:hi], index, count)

    def load(self) -> Any:
        """The whole global batch, fetched and collated (a batch of one replica of one)."""
        return self.share(0, 1)

    def __repr__(self) -> str:
        return f"LazyBatch(epoch={self.epoch}, step={self.step}, global_size={self.global_size})"


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
    collate_fn: CollateFn | None = None,
    same_data_check: bool = True,
    device: torch.device | None = None,
) -> ShardedLoader:
    """This process's share of each global batch of ``dataset``, as the module docstring says (an empty share is
    a zero-sample batch of the usual structure; ``state_dict()`` resumes at any number of workers).

    ``topology``: what the data is sharded over (default: the whole job; `job.loader` passes its data axis).
    ``device``: where the shares are trained on (`job.loader` passes the model's); a CUDA one may prefetch
    (`loom.data.prefetch`), otherwise shares are yielded where the dataset holds them.

    ``same_data_check``: in a job of several processes (not a ``backend="none"`` one), every process must build
    this loader at the same point, and all raise if their datasets differ (`loom.data.same_data`). Pass False
    when the processes hold different data on purpose, or when only some of them build this loader (the
    comparison would wait for the others).
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
    shards = ShardedLoader(dataset, sampler, collate_fn)
    shards.device = device
    if same_data_check and topo.backend != "none":
        check_same_data(dataset, shards.fetch, topo.group)
    return shards
