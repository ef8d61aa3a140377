"""Exact global-batch data sharding: `loader()` and the `GlobalBatchSampler` behind it."""

from loom.data.loader import ShardBatch, ShardedLoader, loader
from loom.data.sampler import GlobalBatch, GlobalBatchSampler, share_bounds

__all__ = ["GlobalBatch", "GlobalBatchSampler", "ShardBatch", "ShardedLoader", "loader", "share_bounds"]
