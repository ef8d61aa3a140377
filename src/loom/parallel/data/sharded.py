"""Sharded data parallelism: ZeRO stages 1, 2 and 3 (Rajbhandari et al., 2020), the training state divided
among the replicas instead of copied into each.

Usage, how each stage works, the memory table and limits: docs/strategies/sharded.md. Stage 1 is loom's own
`FlatShards` (`sharded_flat`), because FSDP2 cannot shard the optimizer state alone; stages 2 and 3 are FSDP2
(`sharded_fsdp`), whose bucketed reduce-scatter overlaps backward.

The job is a `DataParallelJob` (the same step: global-batch weighting, ``accumulate``, the guards, step
records) with the hooks a sharded layout needs; the non-finite verdict, each rank holding a different piece of
the gradient, rides on a collective the step already makes. In one process every stage is the plain model with
the stage-1 layout, so its checkpoints reshard like the others. Each rank's state is its pieces under the
original names with their bounds (`loom.checkpoint.sharded_state`): a checkpoint resumes at any world size
(`load_resharded`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from loom.checkpoint.sharded_state import ShardLayout, load_pieces, rank_state
from loom.config_docs import document_options
from loom.devices import place_model, refuse_shared_gpu
from loom.errors import check_choice
from loom.fault.desync import GRADIENT_FLAG
from loom.job import MetricFn
from loom.mesh import Mesh
from loom.observe.metrics import StepMetrics
from loom.observe.phases import FLAGS_AT, StepObserver
from loom.parallel._setup import LossFn, Strategy, check_setup_arguments, step_metrics
from loom.parallel.consistency import check_same_model
from loom.parallel.data.data_parallel import DataParallelConfig, DataParallelJob
from loom.parallel.data.sharded_flat import FlatShards, check_elementwise
from loom.parallel.data.sharded_fsdp import FsdpLayout, shard_model
from loom.parallel.data.sharded_selftest import run_self_test
from loom.parallel.pipeline.pipeline_stages import broadcast_module
from loom.train.batch import LossCall, batch_len, forward_loss, to_device

__all__ = ["ShardedDataParallel", "ShardedDataParallelConfig", "ShardedDataParallelJob"]


_REFUSED = {
    "compression": "gradient compression is DataParallel's (its codecs need the whole gradient on every rank)",
    "find_unused_parameters": "DDP's option; FSDP2 and stage 1 reduce every parameter's gradient",
    "overlap": "DataParallel's communication thread; FSDP2 overlaps its own reduce-scatter",
}


@dataclass(frozen=True)
class ShardedDataParallelConfig(DataParallelConfig):
    """`ShardedDataParallel`'s options: the stage, the units, and `DataParallelConfig`'s step options
    (``accumulate``, the guard's); the options that only DataParallel's gradient paths have are refused
    (``compression``, ``find_unused_parameters``, ``overlap``, ``allreduce`` other than auto/native), and
    ``bucket_cap_mb`` and ``broadcast_buffers`` do not apply (buffers are broadcast from rank 0 at setup only)."""

    stage: int = 3
    """ZeRO stage: 1 shards the optimizer state, 2 also the gradients, 3 also the parameters (see the table)."""
    wrap: Any = None
    """FSDP2's units (stages 2 and 3): None picks them (children of a Sequential, modules in ModuleLists),
    or module classes, or ``fn(model) -> [modules]``."""
    mixed_precision: str | None = None
    """Stages 2 and 3: ``"bf16"`` or ``"fp16"`` parameters for the forward and backward (FSDP2 casts each unit's
    gathered parameters), gradients reduced and master weights, optimizer state and outputs kept in float32.
    None: everything in the parameters' own dtype. Stage 1 and one-process jobs refuse it (no FSDP2 unit to
    cast around)."""
    gradient_reduce: str = "auto"
    """Stage 1's gradient average: ``reduce_scatter`` (`loom.comm.reduce_scatter`), ``all_reduce`` (loom's
    all-reduce with the ``allreduce`` algorithm, then this rank's slice), or ``auto``: all_reduce on CPU (gloo's
    reduce-scatter is an all-reduce per rank), reduce_scatter on GPUs."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("stage", self.stage, (1, 2, 3))
        for name, why in _REFUSED.items():  # refused when set away from DataParallelConfig's default
            if getattr(self, name) != getattr(DataParallelConfig, name):
                raise ValueError(f"ShardedDataParallel does not take {name}=: {why}")
        hint = "'bf16' computes in bfloat16 and reduces and steps in float32."
        check_choice("mixed_precision", self.mixed_precision, (None, "bf16", "fp16"), hint)
        if self.mixed_precision is not None and self.stage == 1:
            raise ValueError(
                f"ShardedDataParallel(stage=1) does not take mixed_precision={self.mixed_precision!r}: stage 1 "
                "keeps whole parameters in their own dtype and shards only the optimizer state. HINT: stage=2 "
                "casts each unit's parameters for compute and keeps float32 master weights."
            )
        check_choice("gradient_reduce", self.gradient_reduce, ("auto", "reduce_scatter", "all_reduce"))
        if self.allreduce not in ("auto", "native"):
            raise ValueError(
                f"ShardedDataParallel does not take allreduce={self.allreduce!r}: its gradients are "
                "reduce-scattered, not all-reduced. HINT: leave allreduce at its default."
            )


class ShardedDataParallel(Strategy):
    """Strategy: shard the data and the training state (ZeRO ``stage`` 1, 2 or 3) over the replicas (options
    below)."""

    config_type = ShardedDataParallelConfig
    config: ShardedDataParallelConfig

    def setup(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn | LossCall | None = None
    ) -> ShardedDataParallelJob:
        """Check the replicas agree, broadcast rank 0's model, self-test the backend, shard; the optimizer is
        rebound in place to the pieces (keep using the same object, and schedulers built on it)."""
        topo = self._topology()
        call = check_setup_arguments(
            model, optimizer, loss_fn, strategy="ShardedDataParallel", conventions=True, backend=topo.backend
        )
        check_elementwise(optimizer)
        refuse_shared_gpu("ShardedDataParallel", topo, "its shards travel by reduce-scatter and all-gather")
        stage, world = self.config.stage, topo.world_size
        place_model(model, topo.device, optimizer, topo.rank)
        metrics = step_metrics(topo, self.metrics_path)
        observer = StepObserver.for_process(metrics, world, enabled=self.observe)
        fsdp = topo.is_distributed and stage >= 2
        if self.config.mixed_precision is not None and not fsdp:
            raise ValueError(
                f"rank {topo.rank}: ShardedDataParallel(mixed_precision={self.config.mixed_precision!r}) needs "
                "FSDP2 units sharded over 2 or more processes; this job has one. HINT: start it with loom run -n "
                "2 or more, or train this process without mixed_precision."
            )
        reduce = self.config.gradient_reduce
        if reduce == "auto":
            reduce = "all_reduce" if topo.device.type == "cpu" else "reduce_scatter"
        collective = "reduce_scatter" if reduce == "reduce_scatter" else self.config.allreduce
        if topo.is_distributed:
            check_same_model(model, topo.rank, world, topo.group, optimizer=optimizer)
            broadcast_module(model, topo.group)
            run_self_test(topo.rank, world, topo.backend, topo.device, fsdp, topo.group, collective)
        layout: ShardLayout
        flat: FlatShards | None = None
        if fsdp:
            root, units = shard_model(
                model, optimizer, stage, world, self.config.wrap, self.config.mixed_precision
            )
            layout = FsdpLayout(root, optimizer, stage)
            how = f"FSDP2 over {units + 1} unit(s), reshard_after_forward={stage == 3}"
            if self.config.mixed_precision:
                how += f", {self.config.mixed_precision} compute with float32 reduction and master weights"
        else:
            flat = layout = FlatShards(model, optimizer, topo.rank, world, topo.group, collective)
            how = f"loom's flat optimizer shards ({reduce} of the gradient, all-gather of the parameters)"
        if topo.is_main and topo.is_distributed:
            print(f"loom: ShardedDataParallel stage {stage}: {how}", file=sys.stderr, flush=True)
        job = ShardedDataParallelJob(
            model, optimizer, call, Mesh(dp=world, topology=topo), self.config, metrics
        )
        job.observer = observer
        job.layout = layout
        job.shared_gradients = flat  # type: ignore[assignment]  # averaged after backward, as DataParallel's shm
        job.replicas_agree = not fsdp  # FSDP2's replicas hold different shards: no bitwise desync check
        return job


document_options(ShardedDataParallelConfig, ShardedDataParallelConfig)
document_options(ShardedDataParallel, ShardedDataParallelConfig)


class ShardedDataParallelJob(DataParallelJob):
    """A model set up for sharded data-parallel training; each rank's `state_dict` is its own part."""

    replicated_state = False
    reshards = True

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn | LossCall | None,
        mesh: Mesh,
        config: ShardedDataParallelConfig,
        metrics: StepMetrics,
    ) -> None:
        super().__init__(module, module, optimizer, loss_fn, mesh, config, metrics)
        self.stage = config.stage
        self._loss_algorithm = "native"  # the loss buffer goes through the backend (FSDP2's path)
        self.layout: ShardLayout = None  # type: ignore[assignment]  # set by ShardedDataParallel.setup

    @property
    def _fsdp(self) -> FsdpLayout | None:
        return self.layout if isinstance(self.layout, FsdpLayout) else None

    # -- the step's hooks -------------------------------------------------------------------------------------
    def _no_sync(self):
        fsdp = self._fsdp
        return fsdp.no_sync() if fsdp is not None else nullcontext()

    def _flag_local_loss(self, loss_sum: torch.Tensor) -> None:
        """This rank's flag: its loss, and with FSDP2 its shards of the averaged gradient (``GRADIENT_FLAG``),
        so that the verdict rides on the loss all-reduce instead of a collective of its own."""
        super()._flag_local_loss(loss_sum)
        fsdp = self._fsdp
        if fsdp is not None and not fsdp.local_gradients_finite():
            slot = FLAGS_AT + self.topology.rank
            loss_sum[slot] = float(int(loss_sum[slot].item()) | GRADIENT_FLAG)

    def _gradients_finite(self) -> bool:
        """Stage 1: the verdict `FlatShards.average` reduced; FSDP2: True here, the ranks' flags carry it."""
        return self.layout.finite if isinstance(self.layout, FlatShards) else True

    def _apply(self, state: Any) -> None:
        """The optimizer step (only for an applied step), then stage 1's all-gather of the updated pieces."""
        super()._apply(state)
        self._gather_after_step()

    def _gather_after_step(self) -> None:
        """Stage 1: every rank's updated piece into every rank's whole parameters (FSDP2 needs nothing)."""
        if isinstance(self.layout, FlatShards):
            with self.collective("parameter all-gather"):
                self.layout.gather_parameters()

    def own_loop(self, loader: Any = None) -> Any:
        raise NotImplementedError(
            "ShardedDataParallel has no own_loop yet: its gradients are reduce-scattered by the step. HINT: "
            "use job.train_step, or loom.DataParallel(...).setup(...).own_loop()."
        )

    @torch.no_grad()
    def _evaluate(self, batch: Any, metrics: dict[str, MetricFn] | None) -> tuple[list[str], torch.Tensor]:
        """The engine's evaluation (`loom.train.engine.Engine._evaluate`); with FSDP2 a rank with an empty share
        still runs the forward (a zero-size batch), since the forward gathers parameters with every other rank."""
        if self._fsdp is not None:
            batch_here = to_device(batch, self.topology.device)
            if batch_len(self.loss_call.inputs_of(batch_here)) == 0:
                with self._eval_mode():
                    forward_loss(self.loss_call, self.module, batch_here)
        return super()._evaluate(batch, metrics)

    # -- state ------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's part: its pieces with their bounds (`loom.checkpoint.sharded_state`)."""
        topo = self.topology
        return rank_state(
            self.layout,
            self.module,
            self.optimizer,
            stage=self.stage,
            world_size=topo.world_size,
            rank=topo.rank,
            step=self.step,
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load this rank's own part, written at this world size (another: `load_resharded`)."""
        self._load_parts([state])

    def load_resharded(self, read_part: Callable[[int], Any], written_by: int) -> None:
        """Load a checkpoint written by ``written_by`` ranks: every part is read in turn (one at a time in
        memory) and the overlapping ranges of each are copied into this rank's pieces."""
        self._load_parts(read_part(r) for r in range(written_by))

    def _load_parts(self, parts: Any) -> None:
        self.step = load_pieces(parts, self.layout, self.module, self.optimizer, self.topology.rank)
        self._gather_after_step()  # the whole parameters from every rank's loaded piece
