"""Global-batch sharding: one global order, consumed a global batch at a time, split contiguously (the user's
view: docs/concepts.md#global-batch-semantics).

The order of an epoch depends only on ``(seed, epoch)``, never on the number of workers. Step k consumes
``order[k*G : (k+1)*G]`` (the last batch shorter unless ``drop_last``); replica r of W takes a contiguous share
(`share_bounds`: the first ``n % W`` get one sample more, so shares may be empty when ``n < W``). Nothing is
duplicated or dropped to pad shards, unlike ``DistributedSampler``. The position (epoch, samples consumed)
counts *global* samples, so a position saved at one world size resumes at another exactly where it stopped.

Iteration follows `DataLoader`: every ``iter()`` starts the current epoch from its beginning (a probe such as
``next(iter(loader))`` costs the epoch nothing), except the first one after `load_state_dict`, which starts at
the saved sample; an iteration run to the end moves to the next epoch. ``len(sampler)`` is
`DistributedSampler`'s (this replica's samples per epoch); `steps_per_epoch` is ``len(loader)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from loom.errors import check_int

__all__ = ["GlobalBatchSampler", "GlobalBatch", "share_bounds"]


def share_bounds(batch_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """Start and end (exclusive) of replica ``rank``'s contiguous share of a batch of ``batch_size``."""
    base, extra = divmod(batch_size, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


@dataclass(frozen=True)
class GlobalBatch:
    """The indices of one step: the whole global batch and this replica's share of it."""

    epoch: int
    step: int
    """Step number within the epoch."""
    start: int
    """Position of the global batch's first sample in the epoch's order."""
    indices: torch.Tensor
    """Dataset indices of the whole global batch, in order."""
    share: torch.Tensor
    """Dataset indices of this replica's share (possibly empty)."""

    @property
    def global_size(self) -> int:
        return int(self.indices.numel())


class GlobalBatchSampler:
    """Yields a `GlobalBatch` per step of the current epoch, for one replica of ``world_size``; iteration,
    ``len()`` and the position as the module docstring says (a loop that never calls `set_epoch` still sees a
    fresh order every epoch)."""

    def __init__(
        self,
        dataset_size: int,
        global_batch_size: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        check_int("dataset_size", dataset_size, 0)
        check_int("global_batch_size", global_batch_size)
        check_int("world_size", world_size)
        self.dataset_size = dataset_size
        self.global_batch_size = global_batch_size
        self.world_size = world_size
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
        self.rank = rank
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self.consumed = 0
        """Samples of the current epoch already handed out (a multiple of the global batch size, or the end)."""
        self._resume_at: int | None = None
        """Set by `load_state_dict`: where the next iteration starts (once); None: at the epoch's beginning."""

    # -- the order -------------------------------------------------------------------------------------------
    def epoch_samples(self) -> int:
        """Samples one epoch consumes (the dataset size, less the ragged tail with ``drop_last``)."""
        return self.dataset_size - (self.dataset_size % self.global_batch_size if self.drop_last else 0)

    def steps_per_epoch(self) -> int:
        """Global batches (steps) per epoch, the last one possibly short; ``len(loader)``."""
        return -(-self.epoch_samples() // self.global_batch_size)

    def __len__(self) -> int:
        """Samples this replica gets per epoch (without padding: replicas may differ by one sample per step)."""
        full, tail = divmod(self.epoch_samples(), self.global_batch_size)
        lo, hi = share_bounds(self.global_batch_size, self.rank, self.world_size)
        tail_lo, tail_hi = share_bounds(tail, self.rank, self.world_size)
        return full * (hi - lo) + (tail_hi - tail_lo)

    def order(self, epoch: int) -> torch.Tensor:
        """The global order of ``epoch``: a permutation of the dataset indices (identity without shuffle)."""
        if not self.shuffle:
            return torch.arange(self.dataset_size)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.dataset_size, generator=generator)

    # -- position --------------------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Move to the start of ``epoch``; a no-op if the position is already inside that epoch (resume)."""
        check_int("epoch", epoch, 0)
        if epoch != self.epoch:
            self.epoch = epoch
            self.consumed = 0
            self._resume_at = None

    def __iter__(self) -> Iterator[GlobalBatch]:
        # The start is decided here, at iter(), not at the first next(): what DataLoader's iterators do.
        start, self._resume_at = (self._resume_at or 0), None
        self.consumed = start
        return self._batches(self.epoch, start)

    def _batches(self, epoch: int, start: int) -> Iterator[GlobalBatch]:
        order = self.order(epoch)
        end = self.epoch_samples()
        while start < end:
            indices = order[start : min(start + self.global_batch_size, end)]
            lo, hi = share_bounds(indices.numel(), self.rank, self.world_size)
            step = start // self.global_batch_size
            # Advance before yielding: a state_dict taken while the caller works on this batch counts it as
            # consumed, which is what a checkpoint written after the step must record. An iterator left behind
            # by set_epoch (or by a newer one's finishing the epoch) no longer moves the position.
            if self.epoch == epoch:
                self.consumed = start + indices.numel()
            yield GlobalBatch(epoch, step, start, indices, indices[lo:hi])
            start += indices.numel()
        if self.epoch == epoch:  # not moved meanwhile by set_epoch or a newer iterator's finish
            self.epoch, self.consumed = epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        keys = ("epoch", "consumed", "seed", "shuffle", "drop_last", "global_batch_size", "dataset_size")
        return {key: getattr(self, key) for key in keys}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved at any world size. The order must be the same one: same dataset size, seed,
        shuffle and drop_last. The global batch size may differ: the next batch then starts at the saved sample."""
        for key in ("dataset_size", "seed", "shuffle", "drop_last"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"cannot resume the data position: saved {key}={state[key]!r} but this loader has "
                    f"{key}={getattr(self, key)!r}. HINT: build the loader with the same {key} as the saved run."
                )
        consumed = int(state["consumed"])
        if not 0 <= consumed <= self.epoch_samples():
            raise ValueError(
                f"saved position {consumed} is outside this epoch of {self.epoch_samples()} samples"
            )
        self.epoch = int(state["epoch"])
        self.consumed = consumed
        self._resume_at = consumed
