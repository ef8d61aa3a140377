"""How `DataParallel` averages gradients: the paths, and `choose_gradient_path` (its docstring is the table).

Every input of the choice is the same on all ranks (the configuration, the topology, the model), and the
shared-memory path is taken only if every rank agrees, so all processes of a job run the same collectives.
Observing (metrics, tracing) never changes the path. `GradientAveraging` is the same averaging for a data axis
outside DDP (model-parallel jobs).
"""

from __future__ import annotations

import functools
import inspect
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from loom.comm import all_reduce as comm_all_reduce
from loom.comm.compression import compression_hook, make_codec
from loom.comm.compression.base import Codec, Exchange
from loom.comm.counters import counters
from loom.comm.ddp_async import allreduce_hook, overlapped_allreduce_hook
from loom.comm.shared_gradients import SharedGradients, shared_gradients_unusable
from loom.observe.phases import loss_buffer_size
from loom.parallel.data.sharded_flat import flat_gradients
from loom.parallel.pipeline.pipeline_stages import broadcast_module
from loom.topology import Topology

if TYPE_CHECKING:
    from loom.parallel.data.data_axis import DataAxis
    from loom.parallel.data.data_parallel_config import DataParallelConfig

__all__ = [
    "AxisGradients",
    "GradientAveraging",
    "GradientPath",
    "choose_gradient_path",
    "buffer_sync_option",
    "gradient_hook",
]


@dataclass(frozen=True)
class GradientPath:
    """The way `DataParallel`'s gradients go, and why (logged by rank 0 at setup)."""

    name: str
    reason: str
    hook: Callable | None = None
    """DDP's communication hook (None: DDP's built-in all-reduce, or no DDP)."""
    shared: SharedGradients | AxisGradients | None = None
    """Set for the paths that average after backward (shared memory, a replaceable axis): no DDP."""


def choose_gradient_path(
    config: DataParallelConfig, topo: Topology, model: nn.Module, axis: DataAxis | None = None
) -> GradientPath:
    """The gradient path of a distributed `DataParallel` job: the first row whose condition holds.

    ========================================================  ===============================  ====================
    condition                                                 path                             why
    ========================================================  ===============================  ====================
    a data ``axis`` whose group is replaced (heal)            flat gradients over the axis's   DDP is bound to one
                                                              group, no DDP (`AxisGradients`)  group for its life
    ``compression`` set                                       DDP + compression hook           the codec's rounds
                                                                                               overlap backward
    ``allreduce="native"``, or ``"auto"`` on GPUs, or         DDP's built-in all-reduce        C++ buckets overlap
    ``"auto"`` on one CPU host with a core to spare                                            backward; NCCL
    (``overlap`` unset)
    CPU, one host, ``auto``/``shm``/``hierarchical``, no      shared-memory gradients, no DDP  no bucket copies, two
    core to spare (or ``overlap=False``), no buffers to                                        barriers: the fastest
    broadcast, one dtype, every rank agreeing                                                  on a full host
    a core to spare for a communication thread (or            DDP + loom all-reduce on a       overlaps backward
    ``overlap=True``)                                         communication thread
    otherwise (``ring``/``driver``; models the shared path    DDP + loom all-reduce inside     loom's algorithm,
    cannot take)                                              the hook (synchronous)           no thread competing
    ========================================================  ===============================  ====================

    Each loom path pays for itself against DDP's own all-reduce where it is chosen
    (``benchmarks/reports/dp_allreduce.md``). A collective (the agreement on the shared path) runs only when the
    rows above it do not hold, on every rank alike.
    """
    if axis is not None:  # options it cannot honour were refused by `refuse_heal_options`; ``auto``: gloo's
        algorithm = "native" if config.allreduce == "auto" else config.allreduce
        codec = make_codec(config.compression) if config.compression is not None else None
        how = f"compression={config.compression!r}" if codec is not None else f"{algorithm!r} all-reduce"
        return GradientPath(
            f"flat gradients over the data axis's group, no DDP ({how})",
            "--on-worker-failure heal: the axis's group is replaced at every re-form "
            "(DDP is bound to one group)",
            shared=AxisGradients(model, axis, algorithm, codec),
        )
    if config.compression is not None:
        return GradientPath("DDP + compression hook", f"compression={config.compression!r}",
                            hook=gradient_hook(config, topo))  # fmt: skip
    native = native_because(config, topo)
    if native is not None:
        return GradientPath("DDP's built-in all-reduce", native)
    shared = shared_gradients_for(config, topo, model)
    if shared is not None:
        return GradientPath(
            "shared-memory gradients (no DDP)",
            f"allreduce={config.allreduce!r}, one CPU host, no core to spare for overlap, every rank agreed",
            shared=shared,
        )
    if overlap_wanted(config, topo):
        why = "overlap=True" if config.overlap else "a core to spare for a communication thread"
        return GradientPath(f"DDP + loom {config.allreduce!r} all-reduce, overlapped", why,
                            hook=gradient_hook(config, topo))  # fmt: skip
    return GradientPath(
        f"DDP + loom {config.allreduce!r} all-reduce, synchronous",
        _why_not_shared(config, topo, model),
        hook=gradient_hook(config, topo),
    )


class AxisGradients:
    """`SharedGradients`' interface (``average(extra)``, ``flat``, ``nbytes``) over a data axis whose group may
    change between steps (the quorum's under heal): the trainable gradients averaged after backward, flat.

    Without a codec one collective: `loom.comm.all_reduce` of ``[gradients..., extra...]`` (float32 at least, so
    the flags, the fingerprints, at most 251, and the loss sum ride exactly), then the gradients divided by the
    axis's size. With a (stateless) codec: its collectives, then the extra values' all-reduce."""

    def __init__(self, module: nn.Module, axis: DataAxis, algorithm: str, codec: Codec | None) -> None:
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.axis, self.algorithm, self.codec = axis, algorithm, codec
        self.dtype = functools.reduce(torch.promote_types, (p.dtype for p in self.params), torch.float32)
        self.numel = sum(p.numel() for p in self.params)
        self.nbytes = self.numel * self.dtype.itemsize
        self.flat = torch.zeros(self.numel, dtype=self.dtype)
        """Every trainable parameter's averaged gradient, flat, in order, after `average` (the same on every
        member: a check of it reaches the same verdict everywhere)."""

    def average(self, extra: torch.Tensor | None = None) -> None:
        """Leave every parameter's ``.grad`` the average over the axis (a missing gradient counts as zeros) and
        ``extra`` (float64) summed over it. Collective over the axis's group."""
        group, size = self.axis.group, self.axis.size
        values = extra if extra is not None else torch.zeros(0, dtype=torch.float64)
        grads = flat_gradients(self.params, self.dtype)
        if self.codec is None:
            flat = torch.cat([grads, values.to(self.dtype)])
            comm_all_reduce(flat, op="sum", algorithm=self.algorithm, group=group)
            flat[: self.numel].div_(size)
            values.copy_(flat[self.numel :])
        else:
            exchange = self.codec.exchange(
                list(range(len(self.params))), grads, [p.shape for p in self.params], size
            )
            flat = _run_exchange(exchange, group, size) if size > 1 else grads
            if values.numel():
                comm_all_reduce(values, op="sum", algorithm="native", group=group)
        self.flat = flat[: self.numel]
        for p, grad in zip(self.params, self.flat.split([p.numel() for p in self.params]), strict=True):
            p.grad = grad.view_as(p).to(p.dtype)


def _why_not_shared(config: DataParallelConfig, topo: Topology, model: nn.Module) -> str:
    if config.allreduce not in ("auto", "shm", "hierarchical"):
        return f"allreduce={config.allreduce!r} runs over sockets"
    if topo.device.type != "cpu" or topo.world_size != topo.local_world_size:
        return "the processes span hosts or devices, so gradients cannot meet in one shared segment"
    unusable = shared_gradients_unusable(model, config.broadcast_buffers)
    return unusable or "shared memory was refused on some rank (see its warning)"


def shared_gradients_for(
    config: DataParallelConfig, topo: Topology, model: nn.Module
) -> SharedGradients | None:
    """`SharedGradients` for ``model`` when its gradients can be averaged in shared memory (the shared-memory row
    of `choose_gradient_path`), else None (DDP). Like DDP, it starts every process from rank 0's parameters and
    buffers."""
    if topo.device.type != "cpu":
        return None
    wanted = (
        not overlap_wanted(config, topo)
        and shared_gradients_unusable(model, config.broadcast_buffers) is None
    )
    if not _every_rank_wants_shm(config, topo, wanted):
        return None
    broadcast_module(model, topo.group)
    # the loss and the non-finite flags ride along with the gradients
    return _shared_or_warn(
        topo, "gradients go through DDP", model, topo.group, loss_buffer_size(topo.world_size)
    )


def _every_rank_wants_shm(config: DataParallelConfig, topo: Topology, wanted: bool) -> bool:
    """Whether every rank can average in shared memory (a collective over the job: thread counts may differ):
    a shared-memory ``allreduce`` on CPU, one host, no compression, and ``wanted`` on each rank."""
    wanted = (
        wanted
        and topo.device.type == "cpu"
        and config.allreduce in ("auto", "shm", "hierarchical")
        and config.compression is None
        and topo.world_size == topo.local_world_size
    )
    everyone = torch.tensor([int(wanted)])
    dist.all_reduce(everyone, op=dist.ReduceOp.MIN, group=topo.group)
    return bool(everyone.item())


def _shared_or_warn(topo: Topology, instead: str, module: nn.Module, group: Any, extra: int = 0) -> Any:
    """`SharedGradients` over ``group``, or None with a warning naming the path taken ``instead`` (its refusal,
    /dev/shm too small or processes on several hosts, is raised on every rank alike)."""
    try:
        return SharedGradients(module, group, extra_values=extra)
    except (RuntimeError, ValueError) as error:
        warnings.warn(f"rank {topo.rank}: {instead}: {error}", stacklevel=3)
        return None


def overlap_wanted(config: DataParallelConfig, topo: Topology) -> bool:
    """``config.overlap``, or when None whether this host has a core to spare for a communication thread."""
    return config.overlap if config.overlap is not None else has_spare_core(topo.local_world_size)


def native_because(config: DataParallelConfig, topo: Topology) -> str | None:
    """Why DDP's built-in all-reduce serves ``config`` on ``topo``, or None when loom's path does.

    ``auto`` on one CPU host with a core to spare is DDP's: there loom's all-reduce on a communication thread
    measured slower than DDP's own, while without a core to spare the shared-memory path is the faster one
    (``benchmarks/reports/h200_2026-11-28/``)."""
    if config.compression is not None or config.allreduce not in ("native", "auto"):
        return None
    if config.allreduce == "native":
        return "allreduce='native'"
    if topo.device.type == "cuda":
        return "allreduce='auto' on GPUs"
    if (
        config.overlap is None
        and topo.world_size == topo.local_world_size
        and has_spare_core(topo.local_world_size)
    ):
        return "allreduce='auto' on one CPU host with a core to spare: DDP's C++ buckets overlap backward"
    return None


def gradient_hook(config: DataParallelConfig, topo: Topology) -> Callable | None:
    """The DDP communication hook for ``config``; None keeps DDP's built-in (C++) all-reduce."""
    if config.compression is not None:
        return compression_hook(make_codec(config.compression))
    if native_because(config, topo) is not None:
        return None
    hook = overlapped_allreduce_hook if overlap_wanted(config, topo) else allreduce_hook
    return hook(config.allreduce)


def has_spare_core(local_processes: int) -> bool:
    """Whether this host has more usable cores than ``local_processes`` processes running torch's threads."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return cores > local_processes * torch.get_num_threads()


def buffer_sync_option(enabled: bool) -> dict[str, bool]:
    """DDP renamed ``broadcast_buffers`` to ``forward_sync_buffers`` (torch 2.13); pass whichever it knows."""
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": enabled}
    return {"broadcast_buffers": enabled}


class GradientAveraging:
    """`DataParallel`'s gradient averaging for a data axis outside DDP, after the schedule (a model-parallel stage
    runs its own schedule, so it cannot be wrapped in DDP). Gradients arrive weighted as `DataParallel` weights
    them (``n_r * W / N``, `loom.parallel.pipeline.pipeline_runtime.run_instructions`), so every path averages:
    on one CPU host with loom's shared-memory algorithms `SharedGradients` (`DataParallel`'s class, so
    ``Hybrid(dp=N)`` and ``DataParallel()`` end bitwise equal); with ``compression`` the codec's collectives on
    the whole flat gradient (one "bucket", so its error-feedback state is the same at every step and on resume);
    otherwise the ``allreduce`` algorithm of `loom.comm.all_reduce`, divided by the group's size. Every replica
    steps the whole optimizer state (``zero = 0``; sharded, ``zero=1``: `sharded_axis.ShardedDataAxis`)."""

    zero = 0

    def __init__(
        self,
        config: DataParallelConfig,
        group: dist.ProcessGroup | None,
        shared: SharedGradients | None = None,
    ) -> None:
        self.config = config
        self.group = group
        self.shared = shared
        self.codec = make_codec(config.compression) if config.compression is not None else None

    @classmethod
    def for_stage(
        cls, config: DataParallelConfig, group: dist.ProcessGroup | None, module: nn.Module, topo: Topology
    ) -> GradientAveraging:
        """The averaging of ``module``'s gradients over ``group``. Collective over every process of the job
        (each rank says whether shared memory suits it; all take the same kind of path)."""
        if group is None or not topo.is_distributed:
            return cls(config, None)
        wanted = shared_gradients_unusable(module, broadcast_buffers=False) is None
        if not _every_rank_wants_shm(config, topo, wanted):
            return cls(config, group)
        return cls(
            config, group, _shared_or_warn(topo, "the data axis averages through all_reduce", module, group)
        )

    def average(self, params: list[torch.Tensor]) -> None:
        """Replace each parameter's gradient by its average over the group (a missing gradient counts as
        zeros). Collective over the group."""
        if self.group is None or not params:
            return
        if self.shared is not None:
            self.shared.average()
            return
        flat = flat_gradients(params)
        n = dist.get_world_size(self.group)
        if self.codec is None:
            comm_all_reduce(flat, op="sum", algorithm=self.config.allreduce, group=self.group)
            flat.div_(n)
        else:
            exchange = self.codec.exchange(list(range(len(params))), flat, [p.shape for p in params], n)
            flat = _run_exchange(exchange, self.group, n)
        sizes = [p.numel() for p in params]  # a codec's result may be padded past the gradients
        for p, grad in zip(params, flat[: sum(sizes)].split(sizes), strict=True):
            p.grad = grad.view_as(p).clone()

    def gather_parameters(self) -> None:
        """Nothing to gather: every replica stepped its whole parameters."""

    def state_dict(self) -> dict[str, Any]:
        return {"compression": self.codec.state_dict() if self.codec is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("compression") is not None and self.codec is not None:
            self.codec.load_state_dict(state["compression"])


def _run_exchange(exchange: Exchange, group: dist.ProcessGroup | None, n: int) -> torch.Tensor:
    """Run a codec's collectives (`loom.comm.compression.base`) synchronously, in order; return its average."""
    result: torch.Tensor | None = None
    while True:
        try:
            collective = next(exchange) if result is None else exchange.send(result)
        except StopIteration as stop:
            return stop.value
        message = collective.tensor.contiguous()
        if collective.op == "sum":  # bytes counted as `loom.comm.compression.hook` counts them
            dist.all_reduce(message, group=group)
            result = message
            counters().record("native", 2 * (n - 1) * message.nbytes // n, 2 * (n - 1) * message.nbytes // n)
        else:
            gathered = [torch.empty_like(message) for _ in range(n)]
            dist.all_gather(gathered, message, group=group)
            result = torch.stack(gathered)
            counters().record("all_gather", (n - 1) * message.nbytes, (n - 1) * message.nbytes)
