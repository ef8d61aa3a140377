"""ZeRO stage 1 (P_os, Rajbhandari et al., 2020), loom's own: every rank keeps the whole model and its gradients,
and steps the optimizer over one contiguous piece of all parameters, flattened and concatenated (the user's
view: docs/strategies/sharded.md#how-each-stage-works).

The optimizer holds flat *views* of this rank's piece of each parameter (``nn.Parameter`` over the parameter's
own storage), so its step updates the model in place and its state exists for the piece only. ``collective``:
``reduce_scatter`` and all-gather (`loom.comm.shards`), or on CPU one of `loom.comm.all_reduce`'s algorithms
(gloo's reduce-scatter is one all-reduce per rank underneath): the average then a slice, and for the parameters
the sum of this rank's piece among zeros, which is exact (``x + 0 = x``).

The optimizer must be elementwise (`ELEMENTWISE`): one that reads whole tensors (LAMB's trust ratio,
Adafactor's factored moments) would see pieces. The same class shards the data axis of model-parallel jobs
(``Hybrid(..., zero=1)``, `sharded_axis`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from loom.checkpoint.sharded_state import Piece
from loom.comm import all_reduce
from loom.comm._reduce import group_rank_and_size
from loom.comm.shards import all_gather, piece_bounds, reduce_scatter
from loom.fault.desync import gradients_finite

__all__ = ["ELEMENTWISE", "FlatShards", "check_elementwise", "flat_gradients"]

ELEMENTWISE = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.Adadelta,
)
"""Optimizers whose update is elementwise, so that stepping pieces equals stepping whole tensors."""


def check_elementwise(
    optimizer: torch.optim.Optimizer,
    strategy: str = "ShardedDataParallel",
    instead: str = "loom.DataParallel",
) -> None:
    """Refuse an optimizer that is not known to be elementwise (its pieces would not step as the whole);
    the error names ``strategy`` and suggests ``instead``."""
    if type(optimizer) not in ELEMENTWISE:
        names = ", ".join(cls.__name__ for cls in ELEMENTWISE)
        raise ValueError(
            f"{strategy} steps the optimizer over pieces of the parameters, which equals stepping whole "
            f"tensors only for elementwise optimizers; got {type(optimizer).__name__}. HINT: use one of {names}, "
            f"or {instead}."
        )


def flat_gradients(params: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """Every parameter's gradient (a missing one as zeros), flattened and concatenated, in ``dtype`` (None: the
    gradients' own)."""
    if not params:
        return torch.zeros(0, dtype=dtype or torch.float32)
    grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
    return torch.cat([g.to(dtype) for g in grads] if dtype is not None else grads)


class FlatShards:
    """This rank's piece of every trainable parameter, flattened and concatenated; the optimizer steps it.

    Rebinds ``optimizer``'s parameter groups in place (a scheduler built on it keeps working) to flat views of
    this rank's piece of each parameter of ``module`` (a model, or a model-parallel stage); parameters with no
    element in the piece, or not in ``module``, leave the groups. One process: the piece is everything (the
    layout stays, so its checkpoints reshard to any world size).
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        rank: int,
        world_size: int,
        group: dist.ProcessGroup | None = None,
        collective: str = "reduce_scatter",
    ) -> None:
        self.rank, self.world_size, self.group = rank, world_size, group
        self.collective = collective
        """``reduce_scatter``, or the `loom.comm.all_reduce` algorithm that averages the whole gradient."""
        in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
        named = [(n, p) for n, p in module.named_parameters() if id(p) in in_optimizer]
        self.params = [p for _, p in named]
        ends = list(itertools.accumulate((p.numel() for p in self.params), initial=0))
        self.spans = list(itertools.pairwise(ends))
        self.numel = ends[-1]
        self.lo, self.hi = piece_bounds(self.numel, rank, world_size)
        self.pieces: list[Piece] = []
        view_of: dict[int, nn.Parameter] = {}
        for (name, p), (start, end) in zip(named, self.spans, strict=True):
            if not p.is_contiguous():  # before its view; the optimizer is rebound only after every check
                raise ValueError(
                    f"parameter {name!r} is not contiguous. HINT: call .contiguous() on it at build"
                )
            a, b = max(start, self.lo), min(end, self.hi)
            if a < b:
                view = nn.Parameter(p.data.view(-1)[a - start : b - start])
                view_of[id(p)] = view
                self.pieces.append(Piece(name, tuple(p.shape), a - start, b - start, view))
        for g in optimizer.param_groups:
            g["params"] = [view_of[id(p)] for p in g["params"] if id(p) in view_of]
        self.finite = True
        """The verdict of the last `average`: every rank's piece of the averaged gradient is finite."""
        self.nbytes = self.numel * (self.params[0].element_size() if self.params else 4)
        """Bytes of the whole flat gradient (what the step records count for this collective)."""

    @classmethod
    def over_group(
        cls,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        group: dist.ProcessGroup | None,
        collective: str = "reduce_scatter",
    ) -> FlatShards:
        """The pieces of ``module``'s parameters over the ranks of ``group`` (None: this process alone; an
        explicit group answers for itself, so one built directly on a store works too)."""
        rank, size = group_rank_and_size(group) if group is not None else (0, 1)
        return cls(module, optimizer, rank, size, group, collective)

    # -- ShardLayout ------------------------------------------------------------------------------------------
    def flat(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view(-1)

    def zeros_like(self, param: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(param, memory_format=torch.preserve_format)

    # -- the step ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def average(self, loss_sum: torch.Tensor | None = None) -> None:
        """Reduce-scatter the averaged gradient to the pieces' ``.grad`` and free the full gradients; sum
        ``loss_sum`` (the step's float64 loss buffer) over the ranks with a non-finite flag for the pieces,
        whose verdict (any rank's piece non-finite) is left in `finite`. Without ``loss_sum`` (a caller that
        judged the step before averaging, as model-parallel jobs do) there is no second collective and
        `finite` is this rank's piece's own. Collective."""
        flat = flat_gradients(self.params, self.params[0].dtype if self.params else None)
        for p in self.params:
            p.grad = None
        if self.world_size == 1:
            piece = flat
        elif self.collective == "reduce_scatter":
            piece = reduce_scatter(flat, op="avg", group=self.group)
        else:  # a copy of the slice, so that the whole flat gradient is freed
            piece = all_reduce(flat, op="avg", algorithm=self.collective, group=self.group)[
                self.lo : self.hi
            ].clone()
        del flat
        sizes = [view_piece.hi - view_piece.lo for view_piece in self.pieces]
        for view_piece, grad in zip(self.pieces, piece.split(sizes), strict=True):
            view_piece.param.grad = grad
        nonfinite = 0.0 if gradients_finite([], flat=piece) else 1.0  # one sum, not a check per element
        if self.world_size > 1 and loss_sum is not None:
            buffer = torch.cat(
                [loss_sum, torch.tensor([nonfinite], dtype=torch.float64, device=loss_sum.device)]
            )
            dist.all_reduce(buffer, group=self.group)
            loss_sum.copy_(buffer[:-1])
            nonfinite = float(buffer[-1].item())
        self.finite = nonfinite == 0.0

    @torch.no_grad()
    def gather_parameters(self) -> None:
        """All-gather every rank's updated piece into every rank's whole parameters. Collective."""
        if self.world_size == 1:
            return
        mine = torch.cat([p.param.detach().reshape(-1) for p in self.pieces]) if self.pieces else None
        if mine is None:
            mine = torch.zeros(0, dtype=self.params[0].dtype if self.params else torch.float32)
        if self.collective == "reduce_scatter":
            full = all_gather(mine, self.numel, group=self.group)
        else:  # every other rank contributes zeros there: the sum is each piece, bitwise
            full = torch.zeros(self.numel, dtype=mine.dtype, device=mine.device)
            full[self.lo : self.hi] = mine
            all_reduce(full, op="sum", algorithm=self.collective, group=self.group)
        for p, (start, end) in zip(self.params, self.spans, strict=True):
            p.data.view(-1).copy_(full[start:end])
