"""`ErrorFeedback`: a codec's residuals kept per parameter, so they survive any change of DDP's buckets.

A lossy codec keeps, per rank, what it did not send (the residual) and adds it to the next gradient. DDP's
buckets change: a fresh DDP's first step has its parameters in one bucket in model order, then DDP rebuilds
them in the order gradients became ready, and a resumed job starts from the initial buckets again. A residual
kept per *bucket* would be added to the wrong tensors or dropped at each rebuild. So residuals are kept per
*parameter*, named by a stable integer (`loom.comm.compression.hook` numbers DDP's parameters; simulated ranks
pass their own), and each bucket maps onto them by offset: its flat gradient is its tensors concatenated in the
order given, with no gaps (checked by `loom.comm.compression.base.check_layout`).

In a checkpoint the residuals are grouped by the bucket they were last exchanged in: ``state_dict()`` returns
``{"0": {"params": [...], "shapes": [[...], ...], "residual": tensor}, ...}`` with the parameters' numbers and
shapes, so it loads into a codec that will see another bucketing, and a parameter whose shape differs from the
saved one is refused (the state came from another model). Limit: the numbers are the only link between a
residual and its parameter; a resumed job must number its parameters the same way (same model and DDP
settings), which the shape check catches only where the shapes differ.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["ErrorFeedback", "split_by_shapes"]


def split_by_shapes(flat: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    """1-D views of ``flat``, one per tensor of ``shapes``, in order."""
    sizes = [int(torch.Size(s).numel()) for s in shapes]
    return list(torch.split(flat, sizes))


class ErrorFeedback:
    """Residuals by parameter number, with each parameter's shape and the bucket it was last exchanged in."""

    def __init__(self) -> None:
        self._residuals: dict[int, torch.Tensor] = {}
        """1-D, usually views into the tensor a codec kept for the whole bucket (no copy per step)."""
        self._shapes: dict[int, torch.Size] = {}
        self._buckets: dict[int, tuple[int, ...]] = {}
        """Parameter -> the parameters it was last exchanged with (grouping for `state_dict`)."""

    def bind(self, params: Sequence[int], shapes: Sequence[torch.Size]) -> None:
        """Record that ``params`` (of ``shapes``) form one bucket now; refuse a parameter that changed shape."""
        for param, shape in zip(params, shapes, strict=True):
            known = self._shapes.get(param)
            if known is not None and known != torch.Size(shape):
                raise ValueError(
                    f"codec state for parameter {param} has shape {tuple(known)}, but the gradient for it has "
                    f"shape {tuple(shape)}: the state was saved for another model or parameter order. HINT: "
                    "resume with the same model and DataParallel settings, or start the codec from empty state."
                )
            self._shapes[param] = torch.Size(shape)
        self._buckets.update(dict.fromkeys(params, tuple(params)))

    def add_to(self, accumulated: torch.Tensor, params: Sequence[int], shapes: Sequence[torch.Size]) -> None:
        """Add each parameter's residual, if any, into its slice of the bucket ``accumulated`` (in place)."""
        for param, piece in zip(params, split_by_shapes(accumulated, shapes), strict=True):
            residual = self._residuals.get(param)
            if residual is not None:
                piece += residual.to(piece.dtype)

    def keep(self, residual: torch.Tensor, params: Sequence[int], shapes: Sequence[torch.Size]) -> None:
        """Keep the bucket ``residual`` as each parameter's own (views: ``residual`` must not change later)."""
        self._residuals.update(zip(params, split_by_shapes(residual, shapes), strict=True))

    def residual(self, param: int) -> torch.Tensor | None:
        """Parameter ``param``'s residual, 1-D (None before its first step)."""
        return self._residuals.get(param)

    def buckets(self) -> list[tuple[int, ...]]:
        """The parameters grouped as last exchanged (a parameter since moved is left out of its old group)."""
        groups = dict.fromkeys(tuple(p for p in g if self._buckets[p] == g) for g in self._buckets.values())
        return [group for group in groups if group]

    def state_dict(self) -> dict[str, dict[str, Any]]:
        """``{"0": {"params", "shapes", "residual"}, ...}``: copies, one tensor per bucket."""
        state = {}
        for i, group in enumerate(self.buckets()):
            entry: dict[str, Any] = {"params": list(group), "shapes": [list(self._shapes[p]) for p in group]}
            residuals = [self._residuals.get(p) for p in group]
            present = [r for r in residuals if r is not None]
            if present:
                dtype = present[0].dtype
                entry["residual"] = torch.cat(
                    [
                        r.to(dtype) if r is not None else present[0].new_zeros(self._shapes[p].numel())
                        for p, r in zip(group, residuals, strict=True)
                    ]
                )
            state[str(i)] = entry
        return state

    def load_state_dict(self, buckets: dict[str, dict[str, Any]]) -> None:
        """Replace everything with the state `state_dict` returned (a bucket without "residual" has none)."""
        self._residuals, self._shapes, self._buckets = {}, {}, {}
        for entry in buckets.values():
            params = [int(p) for p in entry["params"]]
            shapes = [torch.Size(int(d) for d in s) for s in entry["shapes"]]
            self.bind(params, shapes)
            if "residual" in entry:
                residual = entry["residual"].detach().clone().reshape(-1)
                if residual.numel() != sum(s.numel() for s in shapes):
                    raise ValueError(
                        f"a saved residual of {residual.numel()} elements cannot hold parameters {params} of "
                        f"shapes {[tuple(s) for s in shapes]}. HINT: load the state_dict() of the same codec."
                    )
                self.keep(residual, params, shapes)
