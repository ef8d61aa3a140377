"""How `DataParallel` averages gradients: DistributedDataParallel, with or without a loom all-reduce hook
(overlapped with backward or not), or `loom.strategies.shared_gradients` without DDP; and the choice between them.

Every input of the choice is the same on all ranks (the configuration, the topology, the model), and the
shared-memory path is taken only if every rank agrees, so all processes of a job run the same collectives.
"""

from __future__ import annotations

import inspect
import os
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from loom.comm import all_reduce as comm_all_reduce
from loom.comm.compression import compression_hook, make_codec
from loom.comm.compression.base import Exchange
from loom.comm.counters import counters
from loom.comm.ddp_async import overlapped_allreduce_hook
from loom.comm.ddp_hooks import allreduce_hook
from loom.observe.phases import loss_buffer_size
from loom.strategies.shared_gradients import SharedGradients, shared_gradients_unusable
from loom.topology import Topology

if TYPE_CHECKING:
    from loom.strategies.data_parallel import DataParallelConfig

__all__ = [
    "GradientAveraging",
    "buffer_sync_option",
    "gradient_hook",
    "has_spare_core",
    "overlap_wanted",
    "shared_gradients_for",
]


def shared_gradients_for(
    config: DataParallelConfig, topo: Topology, model: nn.Module
) -> SharedGradients | None:
    """`SharedGradients` for ``model`` when its gradients can be averaged in shared memory, else None (DDP).

    That is: loom's shared-memory algorithms (``auto``, ``shm``, ``hierarchical``) on CPU, every process on
    one host, no compression and no overlap wanted; every input of this decision is the same on all ranks. Like
    DDP, it starts every process from rank 0's parameters and buffers.
    """
    if topo.device.type != "cpu":
        return None
    wanted = (
        config.allreduce in ("auto", "shm", "hierarchical")
        and config.compression is None
        and topo.world_size == topo.local_world_size
        and not overlap_wanted(config, topo)
        and shared_gradients_unusable(model, config.broadcast_buffers) is None
    )
    everyone = torch.tensor([int(wanted)])
    dist.all_reduce(everyone, op=dist.ReduceOp.MIN)  # e.g. thread counts may differ: all take the same path
    if not everyone.item():
        return None
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor, src=0)
    try:  # the loss and the straggler rows ride along with the gradients
        return SharedGradients(model, extra_values=loss_buffer_size(topo.world_size))
    except (RuntimeError, ValueError) as error:  # raised on every rank alike (/dev/shm too small, hosts)
        warnings.warn(f"rank {topo.rank}: gradients go through DDP: {error}", stacklevel=3)
        return None


def overlap_wanted(config: DataParallelConfig, topo: Topology) -> bool:
    """``config.overlap``, or when None whether this host has a core to spare for a communication thread."""
    return config.overlap if config.overlap is not None else has_spare_core(topo.local_world_size)


def gradient_hook(config: DataParallelConfig, topo: Topology) -> Callable | None:
    """The DDP communication hook for ``config``; None keeps DDP's built-in (C++) all-reduce."""
    if config.compression is not None:
        return compression_hook(make_codec(config.compression))
    if config.allreduce == "native" or (config.allreduce == "auto" and topo.device.type == "cuda"):
        return None
    return (
        overlapped_allreduce_hook(config.allreduce)
        if overlap_wanted(config, topo)
        else allreduce_hook(config.allreduce)
    )


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
    """`DataParallel`'s gradient averaging for a data axis whose gradients are computed outside DDP.

    Model-parallel jobs (`loom.strategies.model_parallel`) run their own schedule, so their data axis cannot wrap
    the stage in DDP; after the schedule, this sums each gradient over the data axis's group with the algorithm
    and compression of the job's `DataParallelConfig`, exactly as `DataParallel` would: ``allreduce`` picks the
    `loom.comm.all_reduce` algorithm, ``compression`` a codec whose collectives run here, one after another,
    on the whole flattened gradient (one "bucket", parameters numbered in order, so its error-feedback state is
    the same at every step and in a resumed run). Gradients arrive already weighted by each replica's share of
    the global batch, so the exact paths *sum*; codecs *average*, so their result is scaled back by the
    number of replicas.
    """

    def __init__(self, config: DataParallelConfig, group: dist.ProcessGroup | None) -> None:
        self.config = config
        self.group = group
        self.codec = make_codec(config.compression) if config.compression is not None else None

    def sum_gradients(self, params: list[torch.Tensor]) -> None:
        """Replace each parameter's gradient by its sum over the group (a missing gradient counts as zeros)."""
        if self.group is None or not params:
            return
        flat = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
        )
        if self.codec is None:
            comm_all_reduce(flat, op="sum", algorithm=self.config.allreduce, group=self.group)
        else:
            n = dist.get_world_size(self.group)
            exchange = self.codec.exchange(list(range(len(params))), flat, [p.shape for p in params], n)
            flat = _run_exchange(exchange, self.group, n).mul_(n)
        offset = 0
        for p in params:
            p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()

    def state_dict(self) -> dict[str, Any]:
        return {"compression": self.codec.state_dict() if self.codec is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("compression") is not None and self.codec is not None:
            self.codec.load_state_dict(state["compression"])


def _run_exchange(exchange: Exchange, group: dist.ProcessGroup, n: int) -> torch.Tensor:
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
