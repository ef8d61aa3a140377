"""`DataParallelConfig`: the options of `loom.DataParallel`, each documented and checked on construction;
`DataAxisConfig`: those of a model-parallel job's data axis (the same, and ``zero``). `data_axis_options` takes
them out of a model-parallel strategy's keyword arguments, refusing by name those only `DataParallel` honours.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from loom.comm import ALGORITHMS
from loom.comm.compression import make_codec
from loom.config_docs import document_options
from loom.errors import check_choice, check_int
from loom.train.guard import GuardOptions
from loom.train.options import refuse_options

__all__ = [
    "ONLY_DATA_PARALLEL",
    "DataAxisConfig",
    "DataParallelConfig",
    "data_axis_options",
]


@dataclass(frozen=True)
class DataParallelConfig(GuardOptions):
    """How `DataParallel` synchronizes gradients (and the step guard's options, `loom.train.guard`)."""

    accumulate: int = 1
    """Micro-batches per step: the local share is split in this many pieces, gradients accumulate locally and
    are all-reduced once, on the last piece."""
    bucket_cap_mb: float = 25.0
    """Size of DDP's gradient buckets; smaller buckets start communicating earlier in backward."""
    find_unused_parameters: bool = False
    """Set when some parameters do not take part in every forward (costs a graph traversal per step)."""
    broadcast_buffers: bool = True
    """Copy rank 0's buffers (e.g. BatchNorm statistics) to every replica at each forward."""
    allreduce: str = "auto"
    """Gradient all-reduce algorithm (see `loom.comm`). ``native`` is DDP's own (C++, gloo/NCCL). The others are
    loom's, overlapped with backward or not (see `overlap`): ``shm`` through shared memory on one host,
    ``ring``/``driver`` over sockets, ``hierarchical`` both; ``auto`` picks from a calibration cached per host
    (on GPUs, and on one CPU host with a core to spare, it is ``native``: `data_parallel_sync.native_because`)."""
    overlap: bool | None = None
    """Run loom's all-reduce algorithms on a communication thread that overlaps backward (True) or after (or
    inside) backward, blocking it (False). None: overlap only when this host has a core to spare for the thread
    (usable cores > local processes x torch threads each): with every core busy computing, the thread only
    competes with backward (``benchmarks/reports/dp_allreduce.md``)."""
    compression: str | None = None
    """Gradient compression (`loom.comm.compression`): ``fp16``, ``bf16``, ``int8``, ``topk:<fraction>`` or
    ``powersgd:<rank>``, with error feedback where lossy; its collectives overlap backward. None: exact."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("allreduce", self.allreduce, ALGORITHMS)
        if self.compression is not None:
            make_codec(self.compression)  # refuses a malformed spec now, naming the valid forms
            if self.allreduce not in ("native", "auto"):
                raise ValueError(
                    f"compression={self.compression!r} runs its own collectives; it cannot be combined with "
                    f"allreduce={self.allreduce!r}. HINT: leave allreduce at its default when compressing."
                )
        check_int("accumulate", self.accumulate)
        if not self.bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb!r}")


ONLY_DATA_PARALLEL = {
    "accumulate": "DataParallel only; a model-parallel job accumulates over its micro-batches (microbatches=)",
    "bucket_cap_mb": "DDP's buckets, DataParallel only; a model-parallel data axis reduces after the schedule",
    "find_unused_parameters": "DDP's option, DataParallel only (a model-parallel data axis sums every gradient)",
    "broadcast_buffers": "DDP's option, DataParallel only; model-parallel stages keep their own buffers",
    "overlap": "DataParallel only; a model-parallel data axis reduces after the schedule",
}
"""The `DataParallelConfig` options a model-parallel data axis cannot honour, with what to do instead."""


@dataclass(frozen=True)
class DataAxisConfig(DataParallelConfig):
    """The data axis of a model-parallel job (`Pipeline`, `TensorParallel`, `Hybrid`): the `DataParallelConfig`
    options it honours (``allreduce``, ``compression``, the guard's), and ``zero``."""

    zero: int = 0
    """ZeRO stage of the data axis. 0: every replica keeps the whole optimizer state of its stage's parameters.
    1: each of the ``dp`` replicas steps the optimizer over its 1/dp slice of them and keeps only that slice of
    the averaged gradient (`loom.parallel.data.sharded_axis`: an elementwise optimizer, no ``compression``).
    Stages 2 and 3 are `ShardedDataParallel`'s only."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.zero, bool) or self.zero not in (0, 1):
            more = (
                " Stages 2 and 3 shard the gradients during backward and the parameters, which a "
                "model-parallel stage's schedule does not support yet. HINT: zero=1 (it already keeps only this "
                "replica's slice of the averaged gradient), or loom.ShardedDataParallel(stage=2 or 3) for a "
                "model that needs no pipeline or tensor parallelism."
                if self.zero in (2, 3) and not isinstance(self.zero, bool)
                else " HINT: zero=0 (replicated optimizer state) or zero=1 (sharded over dp)."
            )
            raise ValueError(f"the data axis takes zero=0 or zero=1, got zero={self.zero!r}.{more}")
        if self.zero == 1 and self.compression is not None:
            raise ValueError(
                f"zero=1 does not take compression={self.compression!r}: the gradient is reduced into each "
                "replica's slice, and the codecs need the whole gradient on every rank. HINT: drop one of them."
            )


def data_axis_options(options: dict[str, Any], strategy: str) -> DataAxisConfig:
    """Take the data axis's options out of a model-parallel strategy's keyword ``options`` (in place): the
    `DataAxisConfig` of its data axis. The options only `DataParallel` honours are refused, by name."""
    names = {f.name for f in fields(DataAxisConfig)}
    data = {k: options.pop(k) for k in list(options) if k in names}
    refuse_options(data, ONLY_DATA_PARALLEL, strategy)
    return DataAxisConfig(**data)


document_options(DataParallelConfig, DataParallelConfig)
document_options(DataAxisConfig, DataAxisConfig)
