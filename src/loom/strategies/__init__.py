"""Strategies: how the work of training is divided among processes."""

from loom.strategies.data_parallel import DataParallel, DataParallelConfig, DataParallelJob

__all__ = ["DataParallel", "DataParallelConfig", "DataParallelJob"]
