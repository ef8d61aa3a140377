"""The pipeline transform: `PipelineConfig`, and the model's chain cut into stages (`split_into_stages`).

`loom.parallel.model.compose` applies it for `Pipeline` and `Hybrid`, after `broadcast_module`; the chain and
its cut points are `pipeline_split`'s, the runtime and the schedules `pipeline_runtime` and `pipeline_schedule`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from loom.config_docs import document_options
from loom.errors import check_choice, check_int
from loom.mesh import Mesh
from loom.parallel.pipeline.pipeline_runtime import PipelineStage
from loom.parallel.pipeline.pipeline_schedule import SCHEDULES
from loom.parallel.pipeline.pipeline_split import (
    balanced_cuts,
    chain_layers,
    cuts_from_names,
    layer_times,
    refuse_shared_parameters,
    stage_ranges,
)
from loom.topology import Topology

__all__ = ["PipelineConfig", "Stages", "broadcast_module", "split_into_stages"]


@dataclass(frozen=True)
class PipelineConfig:
    """How `Pipeline` splits the model and schedules micro-batches."""

    stages: int
    """Number of pipeline stages ``p``; stage ``i`` runs on pipeline rank ``i``."""
    microbatches: int = 1
    """Micro-batches ``m`` per step; the bubble is ``(p - 1) / (m + p - 1)``."""
    schedule: str = "1f1b"
    """``"gpipe"`` (all forwards, then all backwards) or ``"1f1b"`` (at most ``p`` micro-batches alive)."""
    split: str | tuple[str, ...] = "balanced"
    """``"balanced"``, or the names of the layers where stages 1..p-1 begin (e.g. ``("4", "decoder")``)."""
    balance_by: str = "params"
    """For ``split="balanced"``: weigh layers by ``"params"`` (count) or ``"time"`` (measured forward+backward
    on ``sample_input``, measured by rank 0 and broadcast so every process cuts alike)."""

    def __post_init__(self) -> None:
        for name in ("stages", "microbatches"):
            check_int(name, getattr(self, name))
        check_choice("schedule", self.schedule, SCHEDULES)
        if isinstance(self.split, str) and self.split != "balanced":
            raise ValueError(f'split must be "balanced" or a list of layer names, got {self.split!r}')
        if not isinstance(self.split, str):
            object.__setattr__(self, "split", tuple(self.split))
        check_choice("balance_by", self.balance_by, ("params", "time"))


document_options(PipelineConfig, PipelineConfig)


@dataclass(frozen=True)
class Stages:
    """A model cut into stages: this process's stage, every stage's state keys, and the chain's layer names."""

    stage: PipelineStage
    keys: list[list[str]]
    layer_names: list[str]


def split_into_stages(
    model: nn.Module, mesh: Mesh, config: PipelineConfig, sample_input: Any = None
) -> Stages:
    """Cut ``model``'s chain of layers into the mesh's ``pp`` stages and keep this process's one (the other
    stages' parameters are emptied in place, so the optimizer skips them). With one stage the whole model is
    the stage and need not be a chain."""
    topo = mesh.topology
    layers = [("", model)] if config.stages == 1 else chain_layers(model)
    ranges = stage_ranges(_cuts(layers, topo, config, sample_input), len(layers))
    refuse_shared_parameters(layers, ranges)
    every = [PipelineStage(layers[a:b], s, config.stages) for s, (a, b) in enumerate(ranges)]
    stage, keys = every[mesh.index("pp")], [list(s.named_state(keep_vars=True)) for s in every]
    mine = {id(p) for p in stage.parameters()}
    for p in model.parameters():
        if id(p) not in mine:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)  # other stages' weights: not here
    return Stages(stage, keys, [n for n, _ in layers])


def _cuts(
    layers: list[tuple[str, nn.Module]], topo: Topology, cfg: PipelineConfig, sample_input: Any
) -> list[int]:
    if not isinstance(cfg.split, str):
        return cuts_from_names(layers, cfg.split, cfg.stages)
    if cfg.balance_by == "params":
        weights = [float(sum(p.numel() for p in m.parameters())) or 1.0 for _, m in layers]
        return balanced_cuts(weights, cfg.stages)
    cuts = torch.tensor(balanced_cuts(layer_times(layers, sample_input), cfg.stages), dtype=torch.int64)
    if topo.is_distributed:  # timings differ between processes; rank 0's cut is everyone's
        dist.broadcast(cuts, group=topo.group, group_src=0)
    return cuts.tolist()


BROADCAST_BUCKET_BYTES = 32 << 20
"""`broadcast_module`'s largest packed message: smaller tensors of one dtype travel together, packed into buckets
of at most this size; a larger one travels alone, in place."""


def broadcast_module(model: nn.Module, group: Any) -> None:
    """Give every process of ``group`` its rank 0's parameters and buffers, as DDP does at construction: bitwise,
    each in its own dtype (an int64 buffer above 2**53 stays exact), packed as `BROADCAST_BUCKET_BYTES` says."""
    tensors = [t for t in list(model.parameters()) + list(model.buffers()) if t.numel()]
    with torch.no_grad():
        for dtype in sorted({t.dtype for t in tensors}, key=str):
            bucket: list[torch.Tensor] = []
            size = 0
            for t in (t for t in tensors if t.dtype == dtype):
                if t.is_contiguous() and t.nbytes >= BROADCAST_BUCKET_BYTES:
                    dist.broadcast(t.data, group=group, group_src=0)
                    continue
                if bucket and size + t.nbytes > BROADCAST_BUCKET_BYTES:
                    _broadcast_packed(bucket, group)
                    bucket, size = [], 0
                bucket.append(t)
                size += t.nbytes
            if bucket:
                _broadcast_packed(bucket, group)


def _broadcast_packed(tensors: list[torch.Tensor], group: Any) -> None:
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    dist.broadcast(flat, group=group, group_src=0)
    for t, piece in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
        t.copy_(piece.view_as(t))
