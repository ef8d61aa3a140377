"""Hybrid parallelism: data × pipeline × tensor parallel on one named mesh (usage: docs/strategies/hybrid.md).

``Hybrid(dp=a, pp=b, tp=c, ...)`` builds one `Mesh` (``a · b · c`` must equal the world size) and composes on it
the transforms of `loom.parallel.model.compose`, in its order; the job is `ModelParallelJob`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from loom.config_docs import document_options
from loom.mesh import Mesh
from loom.parallel._setup import LossFn
from loom.parallel.data.data_parallel_config import DataAxisConfig
from loom.parallel.model.compose import ModelParallelStrategy, compose
from loom.parallel.model.model_parallel import ModelParallelJob
from loom.parallel.pipeline.pipeline_stages import PipelineConfig
from loom.parallel.tensor.tensor_parallel_shard import TensorParallelConfig

__all__ = ["Hybrid", "HybridConfig"]


@dataclass(frozen=True)
class HybridConfig:
    """Degrees of the mesh and the settings of the pipeline and tensor-parallel parts."""

    dp: int = 1
    """Data-parallel replicas (the global batch is sharded across them)."""
    pp: int = 1
    """Pipeline stages."""
    tp: int = 1
    """Tensor-parallel shards per layer."""
    microbatches: int = 1
    """Micro-batches per step of each pipeline (see `PipelineConfig`)."""
    schedule: str = "1f1b"
    """Pipeline schedule, ``"gpipe"`` or ``"1f1b"``."""
    split: Any = "balanced"
    """Pipeline cut: ``"balanced"`` or the names of the layers where stages 1..pp-1 begin."""
    tp_plan: Any = "auto"
    """Tensor-parallel plan: ``"auto"`` or ``{module name: "mlp" | "attention" | "embedding"}``."""

    def __post_init__(self) -> None:
        if isinstance(self.split, list):
            object.__setattr__(self, "split", tuple(self.split))
        TensorParallelConfig(size=self.tp, plan=self.tp_plan)  # validates tp and the plan
        self.pipeline()  # validates pp, microbatches, schedule and split

    def pipeline(self) -> PipelineConfig:
        return PipelineConfig(
            stages=self.pp, microbatches=self.microbatches, schedule=self.schedule, split=self.split
        )


class Hybrid(ModelParallelStrategy):
    """Strategy: pipeline, then tensor parallel, then data parallel on a ``dp × pp × tp`` mesh; its keyword
    options are `HybridConfig`'s and the data axis's `DataAxisConfig` (``zero=1`` shards its optimizer state)."""

    config_type = HybridConfig
    config: HybridConfig

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn) -> ModelParallelJob:
        cfg = self.config
        mesh = Mesh(dp=cfg.dp, pp=cfg.pp, tp=cfg.tp, topology=self._topology())
        return compose(
            model, optimizer, loss_fn, mesh, pipeline=cfg.pipeline(), tp_plan=cfg.tp_plan, data=self.data,
            metrics_path=self.metrics_path,
        )  # fmt: skip


document_options(HybridConfig, HybridConfig)
document_options(Hybrid, HybridConfig, DataAxisConfig)
