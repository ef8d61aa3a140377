"""ZeRO stages 2 and 3 on FSDP2 (``torch.distributed.fsdp.fully_shard``): its units, its pieces, its switches.

FSDP2 shards each parameter on its first dimension and reduce-scatters (averaged) the gradients during
backward, unit by unit; stage 3 reshards each unit's parameters after its forward, stage 2 keeps them gathered
to the end of backward (PyTorch's ``SHARD_GRAD_OP``). The units (`default_units`, or ``wrap=``): see
docs/strategies/sharded.md#how-each-stage-works; the root is always a unit of its own, last.

Accumulation (`FsdpLayout.no_sync`): all but the last micro-batch run without gradient reduction *and* without
resharding, so a rank that runs fewer micro-batches (a share smaller than ``accumulate``, or empty) issues the
same collectives in the same order as the others: one gather per unit in its first forward (stage 3: and one
for backward), the reduce-scatters in its last backward. The parameters then stay gathered during the window
(stage 2's peak memory), as FSDP2 recommends for accumulation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn

from loom.checkpoint.sharded_state import Piece
from loom.fault.desync import gradients_finite

if TYPE_CHECKING:  # imported where used: FSDP2 and DTensor are slow to import, in every process
    from torch.distributed.fsdp import FSDPModule

__all__ = ["FsdpLayout", "WrapPolicy", "default_units", "shard_model"]

WrapPolicy = Sequence[type] | Callable[[nn.Module], list[nn.Module]] | None
"""``wrap=``: None (automatic), module classes to make units of, or ``fn(model) -> [modules]``."""


def default_units(model: nn.Module) -> list[nn.Module]:
    """The automatic units: children of a Sequential, else modules in ModuleLists, else none (the root only)."""
    if isinstance(model, nn.Sequential):
        return [m for m in model.children() if any(True for _ in m.parameters())]
    units = [
        m
        for container in model.modules()
        if isinstance(container, nn.ModuleList)
        for m in container
        if any(True for _ in m.parameters())
    ]
    inner = {id(sub) for u in units for sub in u.modules() if sub is not u}
    return [u for u in units if id(u) not in inner]  # a ModuleList inside a block: the block is the unit


def _units(model: nn.Module, wrap: WrapPolicy) -> list[nn.Module]:
    if wrap is None:
        return default_units(model)
    if callable(wrap) and not isinstance(wrap, type):
        units = list(wrap(model))
    else:
        classes = (wrap,) if isinstance(wrap, type) else tuple(wrap)
        units = [m for m in model.modules() if isinstance(m, classes) and m is not model]
    if any(u is model for u in units):
        raise ValueError(
            "wrap= returned the model itself; it is always the last unit. HINT: return its blocks"
        )
    return units


def shard_model(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    stage: int,
    world_size: int,
    wrap: WrapPolicy,
    mixed_precision: str | None = None,
) -> tuple[FSDPModule, int]:
    """``fully_shard`` each unit then the root over a CPU/GPU mesh of the whole world, and rebind
    ``optimizer``'s groups, in place, to the sharded parameters (same names); returns the root and the number
    of units below it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device = "cuda" if next(model.parameters()).is_cuda else "cpu"
    mesh = init_device_mesh(device, (world_size,))
    names = {id(p): n for n, p in model.named_parameters()}
    reshard = stage == 3
    policy = MixedPrecisionPolicy()  # FSDP2's default: no cast
    if mixed_precision is not None:
        compute = torch.bfloat16 if mixed_precision == "bf16" else torch.float16
        policy = MixedPrecisionPolicy(
            param_dtype=compute, reduce_dtype=torch.float32, output_dtype=torch.float32
        )
    units = _units(model, wrap)
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    root = fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    # the root too (FSDP2 otherwise special-cases it): same everywhere
    root.set_reshard_after_forward(reshard)
    sharded = dict(model.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [sharded[names[id(p)]] for p in group["params"]]
    return root, len(units)


class FsdpLayout:
    """The pieces of an FSDP2-sharded model (first-dimension shards are contiguous ranges of the flat tensor)."""

    def __init__(self, root: FSDPModule, optimizer: torch.optim.Optimizer, stage: int) -> None:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        self.root, self.stage, self._dtensor = root, stage, DTensor
        in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
        self.pieces: list[Piece] = []
        for name, p in root.named_parameters():  # type: ignore[attr-defined]
            if id(p) not in in_optimizer:
                continue
            if not isinstance(p, DTensor):
                raise TypeError(f"parameter {name!r} was not sharded by FSDP2 (a {type(p).__name__})")
            local = p.to_local()
            _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            row = int(torch.Size(p.shape[1:]).numel()) if p.dim() > 1 else 1
            lo = int(offset[0]) * row if p.dim() > 0 else 0
            lo = min(lo, p.numel())
            self.pieces.append(Piece(name, tuple(p.shape), lo, lo + local.numel(), p))

    def flat(self, tensor: torch.Tensor) -> torch.Tensor:
        local = tensor.to_local() if isinstance(tensor, self._dtensor) else tensor
        return local.view(-1)

    def zeros_like(self, param: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(param)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """One micro-batch without gradient reduction or resharding (the module docstring's accumulation)."""
        root = self.root
        switches = [root.set_requires_gradient_sync, root.set_reshard_after_backward]
        switches += [root.set_reshard_after_forward] if self.stage == 3 else []
        for switch in switches:
            switch(False)
        try:
            yield
        finally:
            for switch in switches:
                switch(True)

    def local_gradients_finite(self) -> bool:
        """Whether this rank's shards of the averaged gradient are finite (after backward: FSDP2 reduced them);
        ranks hold different shards, so `ShardedDataParallelJob._flag_local_loss` carries it to every rank."""
        grads = [p.param.grad for p in self.pieces]
        return gradients_finite([g.to_local() if isinstance(g, self._dtensor) else g for g in grads])
