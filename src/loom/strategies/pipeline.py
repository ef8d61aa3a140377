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
(size 0) and never get a gradient, so optimizers skip them. With a data-parallel axis (`Hybrid`) stage gradients
are all-reduced across replicas after the schedule.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from loom.mesh import Mesh
from loom.observe.metrics import StepMetrics
from loom.strategies._batch import batch_len, slice_batch, split_batch, to_device
from loom.strategies._setup import check_setup_arguments
from loom.strategies.data_parallel import LossFn
from loom.strategies.pipeline_runtime import PipelineStage, StageStats, run_instructions
from loom.strategies.pipeline_schedule import SCHEDULES, stage_instructions
from loom.strategies.pipeline_split import (
    balanced_cuts,
    chain_layers,
    cuts_from_names,
    layer_times,
    refuse_shared_parameters,
    stage_ranges,
)
from loom.topology import Topology, current

__all__ = ["Pipeline", "PipelineConfig", "PipelineJob"]


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

    ``mesh`` (from `Hybrid`) places the pipeline on the ``pp`` axis of a larger mesh; by default the whole world
    is one pipeline and ``stages`` must equal the world size.
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
        self.config = PipelineConfig(**config)
        self.topology = topology
        self.mesh = mesh
        self.sample_input = sample_input
        self.metrics_path = metrics_path
        if self.config.balance_by == "time" and sample_input is None:
            raise ValueError('balance_by="time" needs sample_input=<a batch of inputs> to time the layers on')

    def setup(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        *,
        stage_transform: Callable[[PipelineStage], None] | None = None,
    ) -> PipelineJob:
        """Keep this process's stage of ``model`` (the other stages' parameters are emptied), return the job.

        ``stage_transform`` lets `Hybrid` shard the stage (tensor parallelism) before training starts.
        """
        check_setup_arguments(model, optimizer, loss_fn)
        topo = self.topology if self.topology is not None else current()
        mesh = self.mesh if self.mesh is not None else Mesh(pp=self.config.stages, topology=topo)
        if mesh.size("pp") != self.config.stages:
            raise ValueError(f"Pipeline(stages={self.config.stages}) on a mesh with pp={mesh.size('pp')}")
        # One stage needs no chain: the whole model is the stage (tensor/data parallelism of any model).
        layers = [("", model)] if self.config.stages == 1 else chain_layers(model)
        cuts = self._cuts(layers, topo)
        ranges = stage_ranges(cuts, len(layers))
        refuse_shared_parameters(layers, ranges)
        if topo.is_distributed:  # every process starts from rank 0's weights, as DDP does
            _broadcast_module(model)
        stage_index = mesh.index("pp")
        start, end = ranges[stage_index]
        stage = PipelineStage(layers[start:end], stage_index, self.config.stages)
        stage_keys = [
            PipelineStage(layers[a:b], s, self.config.stages).state_keys() for s, (a, b) in enumerate(ranges)
        ]
        mine = {id(p) for p in stage.parameters()}
        for p in model.parameters():
            if id(p) not in mine:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)  # other stages' weights: not here
        model.to(topo.device)
        if stage_transform is not None:
            stage_transform(stage)
        metrics = StepMetrics(topo.rank, self.metrics_path)
        return PipelineJob(
            stage, optimizer, loss_fn, mesh, self.config, metrics, stage_keys, [n for n, _ in layers]
        )

    def _cuts(self, layers: list[tuple[str, nn.Module]], topo: Topology) -> list[int]:
        cfg = self.config
        if not isinstance(cfg.split, str):
            return cuts_from_names(layers, cfg.split, cfg.stages)
        if cfg.balance_by == "params":
            weights = [float(sum(p.numel() for p in m.parameters())) or 1.0 for _, m in layers]
            return balanced_cuts(weights, cfg.stages)
        cuts = torch.tensor(
            balanced_cuts(layer_times(layers, self.sample_input), cfg.stages), dtype=torch.int64
        )
        if topo.is_distributed:  # timings differ between processes; rank 0's cut is everyone's
            dist.broadcast(cuts, src=0)
        return cuts.tolist()


def _broadcast_module(model: nn.Module) -> None:
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


@dataclass
class _Micro:
    inputs: list[Any] = field(default_factory=list)
    targets: list[Any] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)


def _micro_split(inputs: Any, targets: Any, n: int, m: int) -> _Micro:
    pieces = min(m, n)
    bounds = (torch.arange(pieces + 1) * n // pieces).tolist()
    out = _Micro()
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        out.inputs.append(slice_batch(inputs, lo, hi))
        out.targets.append(slice_batch(targets, lo, hi))
        out.sizes.append(hi - lo)
    return out


class PipelineJob:
    """One process's stage of a pipelined model: `train_step`, `eval_step`, its state and its stage metrics."""

    def __init__(
        self,
        stage: PipelineStage,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        mesh: Mesh,
        config: PipelineConfig,
        metrics: StepMetrics,
        stage_keys: list[list[str]],
        layer_names: list[str],
    ) -> None:
        self.module = stage
        """This process's stage (its layers, keeping the full model's names in `state_dict`)."""
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.mesh = mesh
        self.config = config
        self.metrics = metrics
        self.stage_stats: list[StageStats] = []
        """One `StageStats` per step: this stage's busy time, span, idle fraction, activations alive."""
        self.bubble: list[float] = []
        """Per step, the measured idle fraction of the whole pipeline, ``1 - Σ busy / (p · max span)``; each
        stage's share of it, in seconds, is `StageStats.bubble_s`, also in its step record (``bubble_s``)."""
        self.stage_keys = stage_keys
        self.layer_names = layer_names
        self.step = 0
        self.gather_shards: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None
        """Set by `Hybrid` to reassemble tensor-parallel shards in `full_state_dict`."""
        self.shard_metadata: dict[str, Any] = {}
        """Extra layout recorded in `state_dict` (e.g. tensor-parallel shard dims by name)."""
        pp = mesh.index("pp")
        self._prev = mesh.peer("pp", pp - 1) if pp > 0 else None
        self._next = mesh.peer("pp", pp + 1) if pp < config.stages - 1 else None

    @property
    def data_topology(self) -> Topology:
        """Pass to ``loom.data.loader(topology=...)``: every stage of a replica loads the same share."""
        return self.mesh.data_topology()

    def _global_count(self, batch: Any, local: int) -> int:
        known = getattr(batch, "global_size", None)
        if known is not None:
            return int(known)
        group = self.mesh.group("dp")
        if group is None:
            return local
        count = torch.tensor([local], dtype=torch.int64)
        dist.all_reduce(count, group=group)
        return int(count.item())

    def _run(self, batch: Any, train: bool) -> tuple[float, int, int, StageStats]:
        inputs, targets = split_batch(batch)
        device = self.mesh.topology.device
        inputs, targets = to_device(inputs, device), to_device(targets, device)
        local = batch_len(inputs)
        total = self._global_count(batch, local)
        if total == 0:
            raise ValueError("the global batch has 0 samples (every share is empty)")
        micro = _micro_split(inputs, targets, local, self.config.microbatches) if local else _Micro()
        stream = (
            stage_instructions(
                self.config.schedule,
                self.mesh.index("pp"),
                self.config.stages,
                len(micro.sizes),
                forward_only=not train,
            )
            if micro.sizes
            else []
        )
        loss_sum, stats = run_instructions(
            stream, self.module, self.loss_fn, micro.inputs, micro.targets, micro.sizes, total,
            prev=self._prev, next_=self._next, train=train, device=device,
        )  # fmt: skip
        # One gather gives the loss (non-zero on the last stage only) and every stage's busy time and span.
        row = torch.tensor([loss_sum, stats.busy_s, stats.span_s], dtype=torch.float64)
        rows = [row]
        if self.mesh.group("pp") is not None:
            rows = [torch.zeros_like(row) for _ in range(self.config.stages)]
            dist.all_gather(rows, row, group=self.mesh.group("pp"))
        table = torch.stack(rows)
        loss = table[:, 0].sum().reshape(1)
        if self.mesh.group("dp") is not None:
            dist.all_reduce(loss, group=self.mesh.group("dp"))
        span = float(table[:, 2].max())
        self.bubble.append(1.0 - float(table[:, 1].sum()) / (self.config.stages * span) if span > 0 else 0.0)
        stats.bubble_s = max(span - stats.busy_s, 0.0)  # so Σ bubble_s / (p · span) is the fraction above
        return float(loss.item()) / total, local, total, stats

    def train_step(self, batch: Any) -> float:
        """One optimizer step on the global batch; returns its loss (the same on every process)."""
        started = time.perf_counter()
        self.module.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss, local, total, stats = self._run(batch, train=True)
        self._all_reduce_gradients()
        self.optimizer.step()
        self.step += 1
        self.stage_stats.append(stats)
        self.metrics.record(
            self.step, time.perf_counter() - started, local, total, loss, bubble_s=stats.bubble_s
        )
        return loss

    def _all_reduce_gradients(self) -> None:
        """Sum each stage's gradients over the data-parallel replicas (they are already weighted by 1/N)."""
        group = self.mesh.group("dp")
        if group is None:
            return
        params = [p for p in self.module.parameters() if p.requires_grad]
        flat = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
        )
        dist.all_reduce(flat, group=group)
        offset = 0
        for p in params:
            p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()

    @torch.no_grad()
    def eval_step(self, batch: Any) -> dict[str, float]:
        """Global-batch loss in eval mode, through the pipeline (forwards only)."""
        was_training = self.module.training
        self.module.eval()
        try:
            loss, _, _, _ = self._run(batch, train=False)
        finally:
            self.module.train(was_training)
        return {"loss": loss}

    # -- state -----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This process's shard: its stage's tensors (under the full model's names), optimizer, step, layout."""
        return {
            "model": self.module.named_state(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "shard": {
                "strategy": "pipeline",
                "stage": self.mesh.index("pp"),
                "stages": self.config.stages,
                "layers": self.module.layer_names,
                "all_layers": self.layer_names,
                "mesh": {a: self.mesh.size(a) for a in ("dp", "pp", "tp")},
                "coordinates": dict(self.mesh.coordinates),
                **self.shard_metadata,
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        shard = state.get("shard", {})
        if shard.get("stage", self.mesh.index("pp")) != self.mesh.index("pp"):
            raise ValueError(f"state of stage {shard['stage']} loaded into stage {self.mesh.index('pp')}")
        self.module.load_named_state(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's state on global rank 0 (``None`` elsewhere). Collective: call it on every process."""
        mine = self.module.named_state()
        if self.gather_shards is not None:
            mine = self.gather_shards(mine)
        if self.mesh.index("dp") != 0 or self.mesh.index("tp") != 0:
            return None
        from loom.strategies.pipeline_communications import recv_tensors, send_tensors

        stage = self.mesh.index("pp")
        if stage != 0:
            for key in self.stage_keys[stage]:  # one message per tensor: shapes travel in the header
                for handle, _ in send_tensors([mine[key]], self.mesh.peer("pp", 0)):
                    handle.wait()
            return None
        full = dict(mine)
        for s in range(1, self.config.stages):
            for key in self.stage_keys[s]:
                (full[key],) = recv_tensors(self.mesh.peer("pp", s), self.mesh.topology.device)
        return full
