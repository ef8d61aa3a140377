"""Tensor parallelism: single layers split across the ``tp`` processes, Megatron-style (Shoeybi et al. 2019).

``TensorParallel(size=t, plan="auto" | {module name: kind})`` rewrites the model's MLP, attention and embedding
blocks in place (`tensor_parallel_shard`, `tensor_parallel_layers`); the patterns each kind must match, and the
limits: docs/strategies/tensor-parallel.md. Everything not in the plan stays replicated and gets identical
gradients on every tp rank. Each process sees the whole batch (data is sharded across ``dp`` only); the loss is
the same on every tp rank. The job is a one-stage composition (`loom.parallel.model.compose`), so training,
evaluation, state (this process's shards; ``full_state_dict()`` gathers the whole model) and the data axis are
the pipeline's.
"""

from __future__ import annotations

import torch
from torch import nn

from loom.config_docs import document_options
from loom.parallel._setup import LossFn
from loom.parallel.data.data_parallel_config import DataAxisConfig
from loom.parallel.model.compose import ModelParallelStrategy, compose
from loom.parallel.model.model_parallel import ModelParallelJob
from loom.parallel.tensor.tensor_parallel_shard import TensorParallelConfig

__all__ = ["TensorParallel", "TensorParallelConfig"]


class TensorParallel(ModelParallelStrategy):
    """Strategy: split MLP, attention and embedding layers over ``size`` processes (`TensorParallelConfig`); with
    ``size`` below the world size the rest is the data axis, its `DataAxisConfig` options taken as keywords."""

    config_type = TensorParallelConfig
    config: TensorParallelConfig

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn) -> ModelParallelJob:
        mesh = self._mesh("size", tp=self.config.size)
        return compose(
            model, optimizer, loss_fn, mesh, tp_plan=self.config.plan, data=self.data,
            metrics_path=self.metrics_path,
        )  # fmt: skip


document_options(TensorParallel, TensorParallelConfig, DataAxisConfig)
