"""The job of every model-parallel strategy: one stage of the model, maybe tensor-sharded, on a data axis.

`loom.parallel.model.compose` builds it for `Pipeline`, `TensorParallel` and `Hybrid` alike. Each `train_step`
checks that the ranks of this model replica (its stages and tensor shards) hold the same samples
(`_check_replica_samples`: a loader sharded over the wrong axis raises instead of training on mismatched inputs
and targets), runs the schedule's instructions for this stage over the share's micro-batches (`pipeline_runtime`,
weighted as `loom.parallel.pipeline.pipeline` says), then averages the gradients over the data axis (`compose`'s
last transform) and steps the optimizer.

Before the average, the loss (non-zero on the last stage only), each stage's busy time and span, and each rank's
non-finite flag ride on one all-gather over the pipeline, then one reduction over the job (a slot per replica's
loss, a flag per rank), so every rank reaches the same verdict (`loom.fault.desync.NonFiniteGuard`); a skipped
step runs neither the data axis nor the optimizer. State is sharded (`state_dict`, `full_state_dict`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from loom.comm.shm_small import SmallAllReduce
from loom.data.same_data import batch_fingerprint
from loom.fault.desync import local_flag
from loom.job import MetricFn
from loom.mesh import REPLICA, Mesh
from loom.observe.metrics import StepMetrics
from loom.parallel.data.data_parallel_sync import GradientAveraging
from loom.parallel.data.sharded_axis import ShardedDataAxis
from loom.parallel.pipeline.pipeline_communications import recv_tensors, send_tensors
from loom.parallel.pipeline.pipeline_runtime import PipelineStage, StageStats, run_instructions
from loom.parallel.pipeline.pipeline_schedule import stage_instructions
from loom.parallel.pipeline.pipeline_stages import PipelineConfig, Stages
from loom.parallel.tensor.tensor_parallel_shard import TensorShards
from loom.train.batch import batch_len, micro_batches, split_batch, to_device
from loom.train.engine import Engine, StepState

__all__ = ["ModelParallelJob"]


class ModelParallelJob(Engine):
    """This process's stage (and tensor shards) of a model split over a ``dp × pp × tp`` mesh."""

    replicated_state = False
    module: PipelineStage

    def __init__(
        self,
        stages: Stages,
        optimizer: torch.optim.Optimizer,
        loss_fn: Any,
        mesh: Mesh,
        schedule: PipelineConfig,
        shards: TensorShards | None,
        data_axis: GradientAveraging | ShardedDataAxis,
        metrics: StepMetrics,
    ) -> None:
        # `module`: this process's stage (its layers, keeping the full model's names in `state_dict`)
        super().__init__(stages.stage, optimizer, loss_fn, mesh, data_axis.config, metrics)
        self.schedule = schedule
        """How a step runs through the stages: the pipeline's config."""
        self.shards = shards
        """The tensor-parallel layout of the stage (None without a ``tp`` axis)."""
        self.gradient_averaging = data_axis
        self.stage_keys = stages.keys
        self.layer_names = stages.layer_names
        self.stage_stats: list[StageStats] = []
        """One `StageStats` per step: this stage's busy time, span, idle fraction, activations alive."""
        self.bubble: list[float] = []
        """Per step, the measured idle fraction of the whole pipeline, ``1 - Σ busy / (p · max span)``; each
        stage's share of it, in seconds, is `StageStats.bubble_s`, also in its step record (``bubble_s``)."""
        pp = mesh.index("pp")
        self._prev = mesh.peer("pp", pp - 1) if pp > 0 else None
        self._next = mesh.peer("pp", pp + 1) if pp < schedule.stages - 1 else None

    # -- one step ---------------------------------------------------------------------------------------------
    def _check_replica_samples(self, batch: Any, local: int) -> None:
        """Raise on every rank of this model replica (the mesh's ``replica`` group) unless all of its ranks hold
        the same samples: one small all-gather of the batch's fingerprint and size."""
        group = self.mesh.group(REPLICA)
        if group is None:
            return
        mine = torch.tensor(
            [batch_fingerprint(batch, 1 << 20, off_cpu=False), local], dtype=torch.int64
        )  # no sync
        with self.collective("replica sample check all-gather"):
            rows = _all_gather(mine, group)
        seen = [tuple(r.tolist()) for r in rows]
        if len(set(seen)) == 1:
            return
        ranks = self.mesh.ranks(REPLICA)
        held = ", ".join(
            f"rank {r}: {n} samples, fingerprint {f:08x}" for r, (f, n) in zip(ranks, seen, strict=True)
        )
        raise ValueError(
            f"rank {self.topology.rank}: the ranks {ranks} of one model replica (its pipeline stages and tensor "
            f"shards) hold different samples at step {self.step + 1} ({held}); they would train on mismatched "
            "inputs and targets. HINT: shard the data over the job's data axis: "
            "loader = job.loader(dataset, global_batch_size, ...)."
        )

    def _global_count(self, batch: Any, local: int) -> int:
        known = getattr(batch, "global_size", None)
        if known is not None:
            return int(known)
        group = self.mesh.group("dp")
        if group is None:
            return local
        count = torch.tensor([local], dtype=torch.int64)
        with self.collective("sample-count all-reduce"):
            dist.all_reduce(count, group=group)
        return int(count.item())

    # -- the engine's hooks (`loom.train.engine`) ----------------------------------------------------------------
    def _prepare(self, state: StepState) -> None:
        """Check that the replica's ranks hold the same samples, split them into micro-batches, count them."""
        inputs, targets = split_batch(state.batch)
        state.local = local = batch_len(inputs)
        self._check_replica_samples(state.batch, local)
        inputs, targets = to_device((inputs, targets), self.topology.device)
        state.total = self._global_count(state.batch, local)
        # ``[((inputs, targets), size), ...]``: at most ``microbatches``, sizes differing by at most one
        pieces = min(self.schedule.microbatches, local)
        state.work["micro"] = micro_batches((inputs, targets), local, pieces) if local else []

    def _forward_backward(self, state: StepState, train: bool = True) -> None:
        """The pipeline's instruction stream for this stage (forwards only in evaluation)."""
        sched, micro, total = self.schedule, state.work["micro"], state.total
        inputs, targets, sizes = [x for (x, _), _ in micro], [y for (_, y), _ in micro], [n for _, n in micro]
        if train:  # the optimizer may hold slices of the parameters (zero=1), so its zero_grad misses theirs
            self.module.zero_grad(set_to_none=True)
        assert total is not None
        where = (sched.schedule, self.mesh.index("pp"), sched.stages, len(micro))
        stream = stage_instructions(*where, forward_only=not train) if micro else []
        with self.collective("pipeline schedule (sends and receives between stages)"):
            state.loss_sum, stats = run_instructions(
                stream, self.module, self.loss_fn, inputs, targets, sizes, total,
                prev=self._prev, next_=self._next, train=train, device=self.topology.device,
                replicas=self.mesh.size("dp"), group=self.topology.group,
            )  # fmt: skip
        grads = [p.grad for p in self.module.parameters() if p.requires_grad] if train else []
        state.flag = local_flag(state.loss_sum, grads)
        state.work["stats"] = stats

    def _synchronize(self, state: StepState) -> None:
        """The gather over the pipeline and the reduction over the job of the module docstring; the gradients
        are averaged in `_apply`, once the step is judged."""
        stats, sched = state.work["stats"], self.schedule
        row = torch.tensor([state.loss_sum, stats.busy_s, stats.span_s, state.flag], dtype=torch.float64)
        rows = [row]
        if self.mesh.group("pp") is not None:
            with self.collective("loss all-gather over the pipeline"):
                rows = _all_gather(row, self.mesh.group("pp"))
        table = torch.stack(rows)
        loss, state.flags, state.ranks = self._reduce_loss_and_flags(table, state.flag)
        span = float(table[:, 2].max())
        self.bubble.append(1.0 - float(table[:, 1].sum()) / (sched.stages * span) if span > 0 else 0.0)
        stats.bubble_s = max(span - stats.busy_s, 0.0)  # so Σ bubble_s / (p · span) is the fraction above
        assert state.total is not None
        state.work["loss_sum"] = loss
        state.loss = loss / state.total

    def _apply(self, state: StepState) -> None:
        data_axis = self.gradient_averaging
        with self.collective("gradient all-reduce over the data axis"):
            data_axis.average([p for p in self.module.parameters() if p.requires_grad])
        self.optimizer.step()
        if data_axis.zero:
            with self.collective("parameter all-gather over the data axis"):
                data_axis.gather_parameters()

    def _straggler_peers(self) -> list[list[int]]:
        """The replicas of each stage and tensor shard (stages differ in work by design)."""
        return self.mesh.shape.groups("dp")

    def _record(self, state: StepState, **fields: Any) -> None:
        stats = state.work["stats"]
        self.stage_stats.append(stats)
        super()._record(state, bubble_s=stats.bubble_s, **fields)

    def _reduce_loss_and_flags(
        self, table: torch.Tensor, flag: float
    ) -> tuple[float, list[float], list[int]]:
        """The global loss sum, and every rank's flag with its global rank (see the module docstring)."""
        mesh, rank = self.mesh, self.topology.rank
        replica_loss = table[:, 0].sum()
        if not self.topology.is_distributed:
            return float(replica_loss), [flag], [rank]
        if mesh.size("dp") == 1 and mesh.size("tp") == 1:  # the pipeline is the job: its gather said it all
            return float(replica_loss), table[:, 3].tolist(), mesh.ranks("pp")
        dp, world = mesh.size("dp"), self.topology.world_size
        buffer = torch.zeros(dp + world, dtype=torch.float64)
        if mesh.index("pp") == 0 and mesh.index("tp") == 0:  # one writer per replica: its loss counted once
            buffer[mesh.index("dp")] = replica_loss
        buffer[dp + rank] = flag
        with self.collective("loss and flag all-reduce"):
            small = SmallAllReduce.for_group(self.topology.group)
            if small is not None:
                small.all_reduce(buffer)
            else:
                dist.all_reduce(buffer, group=self.topology.group)
        return float(buffer[:dp].sum()), buffer[dp:].tolist(), list(range(world))

    @torch.no_grad()
    def _evaluate(self, batch: Any, metrics: dict[str, MetricFn] | None) -> tuple[list[str], torch.Tensor]:
        """The global loss through the pipeline (forwards only), in eval mode; already reduced (see
        `_eval_group`). Extra ``metrics`` need the model's outputs, which only the last stage holds: refused
        (evaluate ``full_state_dict()`` instead)."""
        if metrics:
            raise ValueError(
                f"eval_step(metrics={sorted(metrics)}) is not supported by model-parallel jobs: the outputs "
                "exist on the last stage only. HINT: evaluate the loss here, or load job.full_state_dict() "
                "into an unsplit model on rank 0 for other metrics."
            )
        state = StepState(self.step + 1, batch)
        with self._eval_mode():
            self._prepare(state)
            self._refuse_empty(state)
            self._forward_backward(state, train=False)
            self._synchronize(state)
        return ["loss"], torch.tensor([state.work["loss_sum"], float(state.total or 0)], dtype=torch.float64)

    def _eval_group(self) -> Any:
        return None  # `_synchronize` reduced the loss over the pipeline and the data axis

    # -- state -----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This process's shard: its stage's tensors (under the full model's names), optimizer, step, layout."""
        layout: dict[str, Any] = {
            "strategy": "model_parallel",
            "stage": self.mesh.index("pp"),
            "stages": self.schedule.stages,
            "layers": self.module.layer_names,
            "all_layers": self.layer_names,
            "mesh": {a: self.mesh.size(a) for a in ("dp", "pp", "tp")},
            "coordinates": dict(self.mesh.coordinates),
            "zero": self.gradient_averaging.zero,
        }
        if self.shards is not None:
            layout["tensor_parallel"] = self.shards.layout(self.module)
        return {
            "model": self.module.named_state(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "data_axis": self.gradient_averaging.state_dict(),
            "shard": layout,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        shard = state.get("shard", {})
        here = dict(self.mesh.coordinates)
        if shard.get("coordinates", here) != here:
            raise ValueError(
                f"rank {self.topology.rank}: state of mesh coordinates {shard['coordinates']} loaded into "
                f"{here}. HINT: load each rank's own state_dict()."
            )
        zero = self.gradient_averaging.zero
        if shard.get("zero", 0) != zero:
            raise ValueError(
                f"rank {self.topology.rank}: the checkpoint was written with zero={shard.get('zero', 0)} on the "
                f"data axis (optimizer state {'sliced over dp' if shard.get('zero') else 'whole'}), this job has "
                f"zero={zero}. HINT: resume with zero={shard.get('zero', 0)}."
            )
        self.gradient_averaging.load_state_dict(state.get("data_axis", {}))  # refuses another cut, first
        self.module.load_named_state(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's state on global rank 0 (``None`` elsewhere). Collective: call it on every process."""
        mine = self.module.named_state() if self.shards is None else self.shards.gather(self.module)
        if self.mesh.index("dp") != 0 or self.mesh.index("tp") != 0:
            return None
        stage, group = self.mesh.index("pp"), self.topology.group
        if stage != 0:
            for key in self.stage_keys[stage]:  # one message per tensor: shapes travel in the header
                for handle, _ in send_tensors([mine[key]], self.mesh.peer("pp", 0), group=group):
                    handle.wait()
            return None
        full = dict(mine)
        for s in range(1, self.schedule.stages):
            for key in self.stage_keys[s]:
                (full[key],) = recv_tensors(self.mesh.peer("pp", s), self.topology.device, group)
        return full


def _all_gather(row: torch.Tensor, group: Any) -> list[torch.Tensor]:
    """Every rank's ``row`` of ``group``, in rank order: through shared memory when the group is on one host
    (`loom.comm.shm_small`: one barrier, far cheaper than gloo's all-gather, paid two or three times a step),
    else the backend's all-gather."""
    small = SmallAllReduce.for_group(group)
    if small is not None:
        return small.all_gather(row)
    rows = [torch.zeros_like(row) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, row, group=group)
    return rows
