"""Synchronous data parallelism with global-batch semantics, built on PyTorch's DistributedDataParallel.

Every worker holds the whole model and trains on its share of each global batch; the gradients are averaged by
DDP during backward, or after backward without it: `data_parallel_sync.choose_gradient_path` decides (its
docstring is the table) and rank 0 prints the path at setup. Every process starts from rank 0's parameters and
buffers (under heal: a live member's), after `loom.parallel.consistency` checked that the replicas hold the same
model and optimizer. The job, and its exactness under uneven shares: `data_parallel_job`.
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from loom.comm.compression import CompressionHook
from loom.config_docs import document_options
from loom.devices import place_model
from loom.fault.quorum import Quorum
from loom.mesh import Mesh
from loom.observe.phases import StepObserver
from loom.parallel._setup import LossFn, Strategy, check_setup_arguments, joins_healing, step_metrics
from loom.parallel.consistency import check_same_model
from loom.parallel.data.data_axis import healing_store, join_first_epoch, refuse_heal_options, whole_batches
from loom.parallel.data.data_parallel_config import ONLY_DATA_PARALLEL as ONLY_DATA_PARALLEL  # re-exported
from loom.parallel.data.data_parallel_config import DataParallelConfig
from loom.parallel.data.data_parallel_job import DataParallelJob
from loom.parallel.data.data_parallel_sync import GradientPath, buffer_sync_option, choose_gradient_path
from loom.topology import Topology
from loom.train.batch import LossCall

__all__ = ["DataParallel", "DataParallelConfig", "DataParallelJob"]


class DataParallel(Strategy):
    """Strategy: replicate the model, shard the data, all-reduce gradients every step (options below)."""

    config_type = DataParallelConfig
    config: DataParallelConfig

    def setup(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn | LossCall | None = None
    ) -> DataParallelJob:
        """Broadcast rank 0's parameters, wrap the model for gradient synchronization, return the job.

        ``loss_fn``: ``fn(outputs, targets)``, None when the model returns its own loss, or a `loom.LossCall`
        (the conventions are `LossCall`'s table)."""
        topo = self._topology()
        call = check_setup_arguments(
            model,
            optimizer,
            loss_fn,
            strategy="DataParallel",
            conventions=True,
            heals=True,
            backend=topo.backend,
        )
        if joins_healing(topo.backend):
            return self._setup_healing(model, optimizer, call, topo)
        place_model(model, topo.device, optimizer, topo.rank)
        metrics = step_metrics(topo, self.metrics_path)
        observer = StepObserver.for_process(metrics, topo.world_size, enabled=self.observe)
        path: GradientPath | None = None
        if topo.is_distributed:
            check_same_model(model, topo.rank, topo.world_size, topo.group, optimizer=optimizer)
            path = choose_gradient_path(self.config, topo, model)
        wrapped: nn.Module = model
        if path is not None and path.shared is None:
            wrapped = DistributedDataParallel(
                model,
                device_ids=[topo.device.index] if topo.device.type == "cuda" else None,
                process_group=topo.group,
                bucket_cap_mb=self.config.bucket_cap_mb,
                find_unused_parameters=self.config.find_unused_parameters,
                gradient_as_bucket_view=True,  # no copy between gradients and buckets
                **buffer_sync_option(self.config.broadcast_buffers),  # type: ignore[arg-type]
            )
            observer.register_comm_hook(wrapped, path.hook)
        mesh = Mesh(dp=topo.world_size, topology=topo)
        job = DataParallelJob(model, wrapped, optimizer, call, mesh, self.config, metrics)
        return _with_path(job, observer, path)

    def _setup_healing(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, call: LossCall, topo: Topology
    ) -> DataParallelJob:
        """Under ``--on-worker-failure heal`` the data axis is the quorum (`loom.parallel.data.data_axis`):
        refuse what it cannot honour, join it (a first start and a replacement alike), take a live member's state."""
        refuse_heal_options(self.config)
        store = healing_store()
        place_model(model, topo.device, optimizer, topo.rank)
        quorum = Quorum.from_env(store)
        path = choose_gradient_path(self.config, topo, model, axis=quorum)
        metrics = step_metrics(topo, self.metrics_path)
        mesh = Mesh(dp=1, topology=whole_batches(topo))  # the loader's view: one replica (global batches)
        job = DataParallelJob(
            model, model, optimizer, call, mesh, self.config, metrics, quorum=quorum, topology=topo
        )
        # no straggler watch: the members change
        return join_first_epoch(_with_path(job, StepObserver(metrics, enabled=self.observe), path))


def _with_path(job: DataParallelJob, observer: StepObserver, path: GradientPath | None) -> DataParallelJob:
    """``job`` with its observer and gradient path (None in one process), which rank 0 prints."""
    job.observer, job.gradient_path = observer, path
    job.shared_gradients = path.shared if path is not None else None
    job.compression = path.hook if path is not None and isinstance(path.hook, CompressionHook) else None
    if path is not None and job.topology.is_main:
        print(f"loom: DataParallel gradients: {path.name}: {path.reason}", file=sys.stderr, flush=True)
    return job


document_options(DataParallel, DataParallelConfig)
