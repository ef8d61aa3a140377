"""Hybrid parallelism: data × pipeline × tensor parallel on one named mesh.

``Hybrid(dp=a, pp=b, tp=c, microbatches=m, schedule=..., split=..., tp_plan=...)`` builds one `Mesh` (validated
once: ``a · b · c`` must equal the world size, the error names the degrees and the world size) and composes the
strategies in this order, as torchtitan and Megatron-LM do:

1. **pipeline** (``pp``): the model's chain is cut into ``b`` stages; this process keeps stage ``pp_index``
   (with ``pp=1`` the whole model is the stage, and need not be a chain);
2. **tensor parallel** (``tp``): the stage's MLP, attention and embedding blocks are split over its ``c``
   processes (Megatron-style, one all-reduce forward and one backward per block);
3. **data parallel** (``dp``): after the schedule, each stage's gradients (each tp shard's) are summed over the
   ``a`` replicas, already weighted by their share of the global batch.

Data is sharded across ``dp`` only: load with ``loom.data.loader(..., topology=job.data_topology)`` so every
stage and tensor shard of a replica sees the same share. Each axis has its own process group. ``train_step``
returns the global-batch loss on every process; ``state_dict()`` is this process's shard with its mesh
coordinates, stage layers and tensor-parallel shard dims; ``full_state_dict()`` (called on every process)
returns the whole model on rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from loom.mesh import Mesh
from loom.strategies.data_parallel import LossFn
from loom.strategies.pipeline import Pipeline, PipelineJob
from loom.strategies.tensor_parallel import (
    TensorParallelConfig,
    attach_tensor_parallel,
    tensor_parallel_transform,
)
from loom.topology import Topology, current

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
        TensorParallelConfig(size=self.tp, plan=self.tp_plan)  # validates tp and the plan


class Hybrid:
    """Strategy: pipeline, then tensor parallel, then data parallel on a ``dp × pp × tp`` mesh."""

    def __init__(self, *, topology: Topology | None = None, metrics_path: str | None = None, **config: Any):
        self.config = HybridConfig(**config)
        self.topology = topology
        self.metrics_path = metrics_path

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn) -> PipelineJob:
        cfg = self.config
        topo = self.topology if self.topology is not None else current()
        mesh = Mesh(dp=cfg.dp, pp=cfg.pp, tp=cfg.tp, topology=topo)
        pipeline = Pipeline(
            stages=cfg.pp,
            microbatches=cfg.microbatches,
            schedule=cfg.schedule,
            split=cfg.split,
            mesh=mesh,
            metrics_path=self.metrics_path,
        )
        if cfg.tp == 1:
            return pipeline.setup(model, optimizer, loss_fn)
        comm, transform = tensor_parallel_transform(mesh, cfg.tp_plan)
        dims: dict[int, int] = {}
        job = pipeline.setup(
            model, optimizer, loss_fn, stage_transform=lambda stage: dims.update(transform(stage))
        )
        attach_tensor_parallel(job, comm, dims)
        return job
