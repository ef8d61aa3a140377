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

from loom.horovod import basics, collectives, elastic, functions, optimizer, scatter
from loom.horovod.basics import *
from loom.horovod.collectives import *
from loom.horovod.compression import Compression
from loom.horovod.functions import *
from loom.horovod.optimizer import *
from loom.horovod.scatter import *


class SyncBatchNorm:
    """Refused: loom has no cross-process batch norm for Horovod scripts yet."""

    def __init__(self, *args, **kwargs) -> None:
        raise basics.refuse("SyncBatchNorm", "use torch.nn.BatchNorm (per-process statistics)")


__all__ = [
    "Compression",
    "SyncBatchNorm",
    "elastic",
    *basics.__all__,
    *collectives.__all__,
    *functions.__all__,
    *optimizer.__all__,
    *scatter.__all__,
]
