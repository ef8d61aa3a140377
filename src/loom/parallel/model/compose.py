"""Model parallelism by composition: transforms over the named axes of one `Mesh`, in one documented order.

`Pipeline`, `TensorParallel` and `Hybrid` all build their job here, so a ``Hybrid(dp, pp, tp)`` job is exactly
the composition of the other two with a data axis, and no strategy patches another's job. The order is the one
of Megatron-LM and torchtitan (innermost first):

1. **pipeline** (``pp``, `pipeline_stages.split_into_stages`): the model's chain is cut into stages; this process
   keeps its own (with one stage the whole model is the stage, and need not be a chain);
2. **tensor parallel** (``tp``, `tensor_parallel_shard.shard_stage`): the stage's MLP, attention and embedding
   blocks are split over the tp group;
3. **data** (``dp``): `DataParallel`'s averaging of the stage's gradients after the schedule (`GradientAveraging`,
   with the job's `DataAxisConfig`); they are already weighted by each replica's share, so N replicas equal one
   process. ``zero=1`` shards it instead (`ShardedDataAxis`: docs/strategies/hybrid.md#a-sharded-data-axis-zero1).

Every process starts from rank 0's weights (broadcast before the cut, as DDP does). The data is sharded over
``dp`` only: `Job.loader` builds the loader for it, and the job refuses a batch cut for another layout.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from loom.devices import place_model, refuse_shared_gpu
from loom.mesh import Mesh
from loom.parallel._setup import LossFn, Strategy, check_setup_arguments, step_metrics
from loom.parallel.data.data_parallel_config import DataAxisConfig, data_axis_options
from loom.parallel.data.data_parallel_sync import GradientAveraging
from loom.parallel.data.sharded_axis import ShardedDataAxis
from loom.parallel.data.sharded_flat import check_elementwise
from loom.parallel.model.model_parallel import ModelParallelJob
from loom.parallel.pipeline.pipeline_stages import PipelineConfig, broadcast_module, split_into_stages
from loom.parallel.tensor.tensor_parallel_shard import shard_stage
from loom.topology import Topology
from loom.train.options import NO_OBSERVER, refuse_options

__all__ = ["ModelParallelStrategy", "compose"]


class ModelParallelStrategy(Strategy):
    """The constructor `Pipeline`, `TensorParallel` and `Hybrid` share: `Strategy`'s, once the data axis's options
    (`DataAxisConfig`) are taken out of the keyword arguments (no config object: the data axis has its own)."""

    def __init__(self, *, topology: Topology | None = None, metrics_path: str | None = None, **config: Any):
        self.data = data_axis_options(config, type(self).__name__)
        refuse_options(config, NO_OBSERVER, type(self).__name__)
        super().__init__(topology=topology, metrics_path=metrics_path, **config)

    def _mesh(self, option: str, pp: int = 1, tp: int = 1) -> Mesh:
        """The ``pp × tp`` mesh with the rest of the world as the data axis (refused unless they divide it)."""
        topo = self._topology()
        if topo.world_size % (pp * tp):
            raise ValueError(
                f"{type(self).__name__}({option}={pp * tp}) does not divide the world size {topo.world_size}. "
                f"HINT: set {option} to a divisor of {topo.world_size} (the rest of the processes is the data "
                "axis), or use loom.Hybrid(dp=..., pp=..., tp=...)."
            )
        return Mesh(topo.world_size // (pp * tp), pp, tp, topology=topo)


def compose(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    mesh: Mesh,
    *,
    pipeline: PipelineConfig | None = None,
    tp_plan: Any = "auto",
    data: DataAxisConfig,
    sample_input: Any = None,
    metrics_path: str | None = None,
) -> ModelParallelJob:
    """Apply the transforms of the module docstring to ``model`` for this process's place on ``mesh``, whose
    ``pp`` is ``pipeline``'s stages (the strategies check it; None: a pipeline of ``pp`` stages)."""
    call = check_setup_arguments(
        model,
        optimizer,
        loss_fn,
        strategy="a model-parallel job (Pipeline, TensorParallel, Hybrid)",
        backend=mesh.topology.backend,
    )  # the plain convention only: the loss is called on the last stage, the model with one inputs argument
    loss_fn = call.fn if call.fn is not None else loss_fn
    pipeline = pipeline if pipeline is not None else PipelineConfig(stages=mesh.size("pp"))
    if data.zero == 1:  # refused before any collective, on every rank alike
        check_elementwise(optimizer, strategy="a data axis with zero=1", instead="zero=0")
        refuse_shared_gpu("A data axis with zero=1", mesh.topology, "its shards travel by reduce-scatter")
    topo = mesh.topology
    if mesh.size("pp") > 1:
        refuse_shared_gpu("Pipeline", topo)
    if topo.is_distributed:  # every process starts from rank 0's weights, as DDP does
        broadcast_module(model, topo.group)
    stages = split_into_stages(model, mesh, pipeline, sample_input)
    place_model(model, topo.device, optimizer, topo.rank)
    shards = shard_stage(stages.stage, mesh, tp_plan)
    averaging: GradientAveraging | ShardedDataAxis
    if data.zero == 1:
        averaging = ShardedDataAxis.for_stage(data, mesh.group("dp"), stages.stage, optimizer, topo)
    else:
        averaging = GradientAveraging.for_stage(data, mesh.group("dp"), stages.stage, topo)
    metrics = step_metrics(topo, metrics_path)
    return ModelParallelJob(stages, optimizer, loss_fn, mesh, pipeline, shards, averaging, metrics)
