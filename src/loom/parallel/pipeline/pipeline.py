"""Pipeline parallelism: the model's layers split into stages on different processes, fed in micro-batches.

``Pipeline(stages=p, microbatches=m, schedule=, split=)`` keeps stage ``i`` of the model's chain (`pipeline_split`)
on pipeline rank ``i``, runs the schedule's instruction stream (`pipeline_schedule`) over ``m`` micro-batches per
step and returns the global-batch loss on every process. Usage and limits: docs/strategies/pipeline.md.

Exactness: micro-batch ``j`` of ``n_j`` samples contributes ``loss_j * n_j / N`` to the backward (``N`` the global
batch, ``loss_j`` its mean loss), so the accumulated gradient is the global-batch mean's however uneven the
micro-batches (their sizes differ by at most one; a batch of ``n < m`` samples runs ``n`` micro-batches of one).

The runtime is loom's own, not ``torch.distributed.pipelining``, so that it takes any chain passing tensors or
tuples of tensors and uneven micro-batches, and measures what the schedules promise: each stage's bubble and live
activations (`StageStats`). With fewer stages than processes the rest is a data axis (`loom.parallel.model.compose`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from loom.config_docs import document_options
from loom.mesh import Mesh
from loom.parallel._setup import LossFn
from loom.parallel.data.data_parallel_config import DataAxisConfig
from loom.parallel.model.compose import ModelParallelStrategy, compose
from loom.parallel.model.model_parallel import ModelParallelJob
from loom.parallel.pipeline.pipeline_split import chain_layers
from loom.parallel.pipeline.pipeline_stages import PipelineConfig, Stages, broadcast_module, split_into_stages
from loom.topology import Topology

__all__ = ["Pipeline", "PipelineConfig", "Stages", "broadcast_module", "split_into_stages"]


class Pipeline(ModelParallelStrategy):
    """Strategy: split the layers into stages, run a micro-batch schedule (`PipelineConfig`).

    With fewer ``stages`` than processes the rest is the data axis (``dp = world / stages``), its `DataAxisConfig`
    options (``allreduce``, ``compression``, ``zero``, ...) taken as keywords; ``mesh`` places the pipeline on the
    ``pp`` axis of a mesh of your own instead.
    """

    config_type = PipelineConfig
    config: PipelineConfig

    def __init__(self, *, topology: Topology | None = None, mesh: Mesh | None = None, sample_input: Any = None,
                 metrics_path: str | None = None, **config: Any) -> None:  # fmt: skip
        super().__init__(topology=topology, metrics_path=metrics_path, **config)
        self.mesh = mesh
        self.sample_input = sample_input
        if self.config.balance_by == "time" and sample_input is None:
            raise ValueError('balance_by="time" needs sample_input=<a batch of inputs> to time the layers on')

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn) -> ModelParallelJob:
        """Keep this process's stage of ``model`` (the other stages' parameters are emptied), return the job."""
        if self.config.stages > 1:
            chain_layers(model)  # a model that is not a chain is refused here, before any collective
        mesh = self.mesh if self.mesh is not None else self._mesh("stages", pp=self.config.stages)
        if mesh.size("pp") != self.config.stages:
            raise ValueError(f"Pipeline(stages={self.config.stages}) on a mesh with pp={mesh.size('pp')}")
        return compose(
            model, optimizer, loss_fn, mesh, pipeline=self.config, sample_input=self.sample_input,
            data=self.data, metrics_path=self.metrics_path,
        )  # fmt: skip


document_options(Pipeline, PipelineConfig, DataAxisConfig)
