"""Do the processes of a job hold the same dataset? A cheap comparison when a loader is built.

`loom.data.loader` shards one global order of ``dataset`` across processes, which is only right if every
process holds the same dataset: synthetic data made without a seed, a file read differently per host, or a
filter that depends on the rank would otherwise train silently on mismatched samples. So each process hashes its
dataset's length and a few samples (`probe_indices`, collated as the loader collates them,
`sample_fingerprint`), and the processes all-gather these few integers over the job's group: one small
collective. Any difference is refused on every process, naming the ranks and what differs.

Limits: a handful of samples is compared, so datasets differing elsewhere pass (unseeded or rank-dependent data
differs everywhere). Samples are read under a fixed seed of torch's, Python's and NumPy's global generators
(restored afterwards), so random augmentation drawn from them agrees; a dataset that draws from its own unseeded
generator differs by design and needs ``same_data_check=False``.
"""

from __future__ import annotations

import contextlib
import random
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["RANDOM_PROBES", "batch_fingerprint", "check_same_data", "probe_indices", "sample_fingerprint"]

RANDOM_PROBES = 3
"""Samples drawn at random (fixed seed) besides the first and the last."""
_PROBE_SEED = 20_240_516


def probe_indices(size: int) -> list[int]:
    """The dataset indices compared: first, last, then `RANDOM_PROBES` drawn with a fixed seed (no repeats)."""
    if size == 0:
        return []
    generator = torch.Generator().manual_seed(_PROBE_SEED)
    drawn = torch.randint(size, (RANDOM_PROBES,), generator=generator).tolist()
    return list(dict.fromkeys([0, size - 1, *drawn]))


def _leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from _leaves(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _leaves(item)
    else:
        yield value


def sample_fingerprint(batch: Any, limit: int | None = None, off_cpu: bool = True) -> int:
    """CRC-32 of a collated batch: every tensor's shape, dtype and bytes (its first ``limit`` bytes; None: all),
    numbers and strings by value, other objects by type; without ``off_cpu`` a tensor off the CPU counts by shape
    and dtype only."""
    crc = 0
    for leaf in _leaves(batch):
        if isinstance(leaf, torch.Tensor):
            crc = zlib.crc32(repr((tuple(leaf.shape), str(leaf.dtype))).encode(), crc)
            if leaf.layout == torch.strided and leaf.numel() and (off_cpu or leaf.is_cpu):
                raw = leaf.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)
                crc = zlib.crc32(raw[:limit].cpu().numpy().tobytes(), crc)
        elif isinstance(leaf, (bool, int, float, str, bytes)) or leaf is None:
            crc = zlib.crc32(repr(leaf).encode(), crc)
        else:
            crc = zlib.crc32(type(leaf).__qualname__.encode(), crc)  # a repr may hold an address
    return crc


def batch_fingerprint(batch: Any, limit: int, off_cpu: bool) -> int:
    """A 32-bit fingerprint of the samples in a training ``batch``, equal on processes given the same samples:
    the loader's (`loom.data.loader`: from the dataset indices, nothing loaded) when the batch carries one, else
    `sample_fingerprint` of the first ``limit`` bytes of each tensor (``off_cpu``: of CUDA ones too)."""
    known = getattr(batch, "fingerprint", None)
    return int(known) if known is not None else sample_fingerprint(batch, limit, off_cpu)


@contextlib.contextmanager
def _fixed_global_rngs(seed: int) -> Iterator[None]:
    """Seed torch's (CPU), Python's and NumPy's global generators for the block, then restore them."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % 2**32)
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


def _summary(dataset: Any, fetch: Callable[[torch.Tensor], Any]) -> list[int]:
    """``[length, fingerprint of each probe]``, padded with -1 to a fixed width."""
    size = len(dataset)
    probes = probe_indices(size)
    with _fixed_global_rngs(_PROBE_SEED):
        prints = [sample_fingerprint(fetch(torch.tensor([i]))) for i in probes]
    return [size, *prints] + [-1] * (2 + RANDOM_PROBES - len(prints))


def _by_value(rows: list[list[int]], column: int) -> dict[int, list[int]]:
    """The ranks holding each value of ``column``, in order of first appearance."""
    groups: dict[int, list[int]] = {}
    for rank, row in enumerate(rows):
        groups.setdefault(row[column], []).append(rank)
    return groups


def _difference(rows: list[list[int]]) -> str | None:
    """What differs between the processes' summaries (None: nothing)."""
    lengths = _by_value(rows, 0)
    if len(lengths) > 1:
        return "dataset length " + ", ".join(f"{n} on rank(s) {r}" for n, r in lengths.items())
    for column, index in enumerate(probe_indices(rows[0][0]), start=1):
        prints = _by_value(rows, column)
        if len(prints) > 1:
            holders = " vs ".join(f"rank(s) {r}" for r in prints.values())
            return f"sample {index} (of {rows[0][0]}) differs: {holders} hold different contents"
    return None


def check_same_data(dataset: Any, fetch: Callable[[torch.Tensor], Any], group: Any = None) -> None:
    """Refuse, on every process of the job, a dataset that differs between them. ``fetch(indices)``: the
    collated samples at ``indices``, as the loader batches them. Collective over ``group`` (the whole job's,
    whatever axis the loader shards over; None: torch's default group), so every process must call it; a no-op
    without a group of two or more."""
    if group is None and dist.is_available():
        group = dist.group.WORLD
    if group is None or group.size() < 2:
        return
    local = torch.tensor(_summary(dataset, fetch), dtype=torch.int64)
    if group is dist.group.WORLD and dist.get_backend() == "nccl":
        local = local.to(torch.device("cuda", torch.cuda.current_device()))
    gathered = [torch.empty_like(local) for _ in range(group.size())]
    dist.all_gather(gathered, local, group=group)
    problem = _difference([row.tolist() for row in gathered])
    if problem is not None:
        raise ValueError(
            f"rank {group.rank()}: the processes building this loader hold different datasets: {problem}. "
            "Each would shard its own data, so replicas would train on mismatched samples. "
            "HINT: build the dataset identically on every process (seed the generator that makes synthetic "
            "data, e.g. torch.Generator().manual_seed(0)); if the difference is intended, pass "
            "same_data_check=False to loom.data.loader(...) or job.loader(...)."
        )
