"""Horovod's PyTorch API on loom: change ``import horovod.torch as hvd`` to ``import loom.horovod as hvd`` and
``horovodrun -np N python train.py`` to ``loom run -n N train.py``.

Names and semantics follow ``horovod.torch``, re-exported from `basics`, `collectives`, `scatter`, `functions`,
`optimizer`, with `elastic` on loom's restarts; how it works, and every name with its status: docs/horovod.md.
What loom does not have (process sets other than the global one, Adasum, the timeline, SyncBatchNorm, the
MPI/NCCL/CCL/DDL controllers) raises `NotImplementedError` naming the feature, never a silent difference.
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
