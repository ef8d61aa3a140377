"""Pipeline parallelism: the model's layers split into stages on different processes, fed in micro-batches.

``Pipeline(stages=p, microbatches=m, schedule="1f1b" | "gpipe", split="balanced" | [names])`` cuts the model's
chain of layers (see `pipeline_split`) into ``p`` stages and keeps stage ``i`` on pipeline rank ``i``. Each
``train_step`` splits the batch into ``m`` micro-batches, runs the schedule's instruction stream for this stage
(`pipeline_schedule`): inputs enter the first stage, activations go forward and gradients backward between
neighbours, targets meet the outputs at the last stage. The returned loss is the global-batch loss, on every
process. GPipe is Huang et al. 2019, 1F1B is PipeDream-Flush (Narayanan et al. 2021).

Exactness: micro-batch ``j`` of ``n_j`` samples contributes ``loss_j * n_j / N`` to the backward (``N`` the global
batch, ``loss_j`` the mean loss of the micro-batch), so the accumulated gradient is that of the global-batch mean,
as one process computes it. A batch not divisible by ``m`` is cut into micro-batches whose sizes differ by at
most one (correct thanks to the weighting); a batch of fewer than ``m`` samples runs ``n`` micro-batches of one.

The runtime is loom's own (blocking receives, non-blocking sends, one message stream per direction), not
``torch.distributed.pipelining``: it supports any chain whose stages pass tensors or tuples of tensors, uneven
micro-batches, and it instruments what the schedules promise: per-stage busy time and span (the bubble) and the
micro-batches and bytes of activations alive (`StageStats`). Each step's record (`loom.observe.metrics`) carries
the seconds this stage sat idle in the bubble as ``bubble_s``.

Limits: the loss must be mean-reduced over the batch; parameters shared between stages (tied embeddings across
stages) are refused; the optimizer keeps every parameter of the full model, but those of other stages are emptied
(size 0) and never get a gradient, so optimizers skip them. With a data axis (fewer stages than processes, or
`Hybrid`) each stage's gradients are summed across its replicas after the schedule, by `DataParallel`'s
algorithms (`loom.strategies.compose`). The job is a `loom.strategies.model_parallel.ModelParallelJob`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from loom.config_docs import document_options
from loom.mesh import Mesh
from loom.strategies.data_parallel import DataParallelConfig, LossFn, data_axis_options
from loom.strategies.pipeline_runtime import PipelineStage
from loom.strategies.pipeline_schedule import SCHEDULES
from loom.strategies.pipeline_split import (
    balanced_cuts,
    chain_layers,
    cuts_from_names,
    layer_times,
    refuse_shared_parameters,
    stage_ranges,
)
from loom.topology import Topology, current

if TYPE_CHECKING:
    from loom.strategies.model_parallel import ModelParallelJob

__all__ = ["Pipeline", "PipelineConfig", "Stages", "broadcast_module", "split_into_stages"]


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
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} is not one of {SCHEDULES}")
        if isinstance(self.split, str) and self.split != "balanced":
            raise ValueError(f'split must be "balanced" or a list of layer names, got {self.split!r}')
        if not isinstance(self.split, str):
            object.__setattr__(self, "split", tuple(self.split))
        if self.balance_by not in ("params", "time"):
            raise ValueError(f'balance_by must be "params" or "time", got {self.balance_by!r}')


class Pipeline:
    """Strategy: split the layers into stages, run a micro-batch schedule. See `PipelineConfig` for fields.

    ``Pipeline(stages=p, ..., **data)``: by default the stages span the world when ``p`` equals the world size;
    with fewer stages the remaining factor is the data axis (``dp = world / p``), configured by the
    `DataParallelConfig` fields in ``data`` (``allreduce``, ``compression``, ...). ``mesh`` places the pipeline
    on the ``pp`` axis of a mesh of your own instead.
    """

    def __init__(
        self,
        *,
        topology: Topology | None = None,
        mesh: Mesh | None = None,
        sample_input: Any = None,
        metrics_path: str | None = None,
        **config: Any,
    ) -> None:
        if "split" in config and isinstance(config["split"], list):
            config["split"] = tuple(config["split"])
        self.data = data_axis_options(config, "Pipeline")
        self.config = PipelineConfig(**config)
        self.topology = topology
        self.mesh = mesh
        self.sample_input = sample_input
        self.metrics_path = metrics_path
        if self.config.balance_by == "time" and sample_input is None:
            raise ValueError('balance_by="time" needs sample_input=<a batch of inputs> to time the layers on')

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn) -> ModelParallelJob:
        """Keep this process's stage of ``model`` (the other stages' parameters are emptied), return the job."""
        from loom.strategies.compose import compose  # here: compose imports this module's transform

        if self.config.stages > 1:
            chain_layers(model)  # a model that is not a chain is refused here, before any collective
        topo = self.topology if self.topology is not None else current()
        mesh = self.mesh
        if mesh is None:
            if topo.world_size % self.config.stages:
                raise ValueError(
                    f"Pipeline(stages={self.config.stages}) does not divide the world size {topo.world_size}. "
                    "HINT: choose a number of stages that divides the number of processes (the rest is the "
                    "data axis), or use loom.Hybrid(dp=..., pp=..., tp=...)."
                )
            mesh = Mesh(dp=topo.world_size // self.config.stages, pp=self.config.stages, topology=topo)
        if mesh.size("pp") != self.config.stages:
            raise ValueError(f"Pipeline(stages={self.config.stages}) on a mesh with pp={mesh.size('pp')}")
        return compose(
            model, optimizer, loss_fn, mesh, pipeline=self.config, sample_input=self.sample_input,
            data=self.data, metrics_path=self.metrics_path,
        )  # fmt: skip


document_options(PipelineConfig, PipelineConfig)
document_options(Pipeline, PipelineConfig, DataParallelConfig)


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
    stage_index = mesh.index("pp")
    start, end = ranges[stage_index]
    stage = PipelineStage(layers[start:end], stage_index, config.stages)
    keys = [PipelineStage(layers[a:b], s, config.stages).state_keys() for s, (a, b) in enumerate(ranges)]
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
        dist.broadcast(cuts, src=0)
    return cuts.tolist()


def broadcast_module(model: nn.Module) -> None:
    """Give every process rank 0's parameters and buffers, as DDP does at construction."""
    tensors = [t for t in list(model.parameters()) + list(model.buffers()) if t.numel()]
    if not tensors:
        return
    flat = torch.cat([t.detach().reshape(-1).double() for t in tensors])
    dist.broadcast(flat, src=0)
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
