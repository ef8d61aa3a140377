"""Exact global-batch data sharding: `loader()` and the `GlobalBatchSampler` behind it."""

from loom.data.loader import CollateFn, LazyBatch, ShardBatch, ShardDict, ShardedLoader, loader
from loom.data.same_data import check_same_data
from loom.data.sampler import GlobalBatch, GlobalBatchSampler, share_bounds

__all__ = [
    "CollateFn",
    "GlobalBatch",
    "GlobalBatchSampler",
    "LazyBatch",
    "ShardBatch",
    "ShardDict",
    "ShardedLoader",
    "check_same_data",
    "loader",
    "share_bounds",
]
