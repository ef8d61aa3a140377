"""Horovod's PyTorch API on loom: change ``import horovod.torch as hvd`` to ``import loom.horovod as hvd`` and
``horovodrun -np N python train.py`` to ``loom run -n N train.py``.

Names and semantics follow ``horovod.torch`` (see docs/horovod.md for every name and its status): `init`
and the rank queries (`loom.horovod.basics`), the collectives with their ``_async``/in-place/grouped forms
(`loom.horovod.collectives`), `broadcast_parameters`/`broadcast_optimizer_state`/`broadcast_object`/
`allgather_object` (`loom.horovod.functions`, no pickle), `DistributedOptimizer` (`loom.horovod.optimizer`),
``elastic`` (`loom.horovod.elastic`, on loom's restarts). Collectives are matched across ranks by name by a
negotiation thread (`loom.horovod._engine`), as Horovod's controller does. Process sets other than the global
one, Adasum, the timeline, SyncBatchNorm and the MPI/NCCL/CCL/DDL controllers raise `NotImplementedError`
naming the feature (never a silent difference).

Importing this module does nothing to the process; `init()` does what a job needs.
"""

from loom.horovod import basics, elastic
from loom.horovod.basics import (
    Adasum,
    Average,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    add_process_set,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from loom.horovod.collectives import (
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    join,
    poll,
    sparse_allreduce_async,
    synchronize,
)
from loom.horovod.compression import Compression
from loom.horovod.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from loom.horovod.optimizer import DistributedOptimizer
from loom.horovod.scatter import (
    alltoall,
    alltoall_async,
    grouped_reducescatter,
    grouped_reducescatter_async,
    reducescatter,
    reducescatter_async,
)


class SyncBatchNorm:
    """Refused: loom has no cross-process batch norm for Horovod scripts yet."""

    def __init__(self, *args, **kwargs) -> None:
        raise basics.refuse("SyncBatchNorm", "use torch.nn.BatchNorm (per-process statistics)")


__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "HorovodInternalError",
    "HostsUpdatedInterrupt", "Max", "Min", "ProcessSet", "Product", "Sum", "SyncBatchNorm",
    "add_process_set", "allgather", "allgather_async", "allgather_object", "allreduce", "allreduce_",
    "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async", "barrier", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "broadcast_object", "broadcast_optimizer_state",
    "broadcast_parameters", "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built", "elastic",
    "global_process_set", "gloo_built", "gloo_enabled", "grouped_allgather", "grouped_allgather_async",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "grouped_reducescatter", "grouped_reducescatter_async", "init", "is_homogeneous", "is_initialized", "join",
    "local_rank", "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "poll",
    "rank", "reducescatter", "reducescatter_async", "remove_process_set", "rocm_built", "shutdown", "size",
    "sparse_allreduce_async", "start_timeline", "stop_timeline", "synchronize",
]  # fmt: skip
