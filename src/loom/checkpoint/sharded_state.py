"""The checkpoint format of `ShardedDataParallel`: the whole training state, flat by parameter name, in pieces
with their bounds, so that any number of processes can reassemble it.

Every parameter is flattened (row-major, as ``tensor.reshape(-1)``) and each rank holds a contiguous range
``[lo, hi)`` of it: stage 1 cuts the concatenation of all parameters into one piece per rank (`FlatShards`),
FSDP2 (stages 2 and 3) cuts each parameter on its first dimension. Each rank writes its pieces under the
original parameter names (the layout: docs/checkpoints.md#a-shardeddataparallel-ranks-part). Reading is the
same at any world size (`load_pieces`): each piece this rank holds now copies the overlapping ranges of every
saved piece, and every element must be found. Only optimizers whose state is elementwise per parameter (SGD,
Adam, AdamW, ...) are supported, as sharding itself needs. `full_state_dict` reassembles the whole model from
every rank's part without a process group (``loom export``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

__all__ = [
    "FORMAT",
    "Piece",
    "ShardLayout",
    "full_state_dict",
    "is_sharded_part",
    "load_pieces",
    "rank_state",
]

FORMAT = "loom-zero/1"
"""The ``format`` field of a rank's part."""


@dataclass
class Piece:
    """This rank's range ``[lo, hi)`` of the flattened parameter ``name`` (of ``shape``), and ``param``: the
    tensor the optimizer steps for it (a flat view for stage 1, FSDP2's sharded DTensor for stages 2 and 3)."""

    name: str
    shape: tuple[int, ...]
    lo: int
    hi: int
    param: torch.Tensor


class ShardLayout(Protocol):
    """How a job holds its pieces: stage 1's `FlatShards` or FSDP2's `FsdpLayout`."""

    pieces: list[Piece]

    def flat(self, tensor: torch.Tensor) -> torch.Tensor:
        """A writable flat view of this rank's part of ``tensor`` (a parameter or a state shaped like one)."""
        ...

    def zeros_like(self, param: torch.Tensor) -> torch.Tensor:
        """A zero tensor laid out like ``param`` (for optimizer state created at load)."""
        ...


def _parameter_shaped(value: Any, piece: Piece) -> bool:
    return (
        isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) == tuple(piece.param.shape)
    )


def rank_state(
    layout: ShardLayout,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    stage: int,
    world_size: int,
    rank: int,
    step: int,
) -> dict[str, Any]:
    """This rank's part of the checkpoint (docs/checkpoints.md#a-shardeddataparallel-ranks-part). The pieces
    refer to live tensors (no copy), as `loom.checkpoint.tree.PackedState` expects: write them before the next
    step."""
    by_param = {id(p.param): p for p in layout.pieces}
    params, sharded, whole = {}, {}, {}
    for piece in layout.pieces:
        if piece.hi == piece.lo:
            continue
        params[piece.name] = {
            "shape": list(piece.shape),
            "lo": piece.lo,
            "hi": piece.hi,
            "value": layout.flat(piece.param).detach(),
        }
        state = optimizer.state.get(piece.param, {})
        sharded[piece.name] = {
            k: layout.flat(v).detach() for k, v in state.items() if _parameter_shaped(v, piece)
        }
        whole[piece.name] = {k: v for k, v in state.items() if not _parameter_shaped(v, piece)}
    groups = []
    for group in optimizer.param_groups:
        settings = {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items() if k != "params"}
        names = [by_param[id(p)].name for p in group["params"] if id(p) in by_param]
        groups.append({**settings, "names": names})
    canonical = {id(p): n for n, p in module.named_parameters()}
    entries = module.state_dict(keep_vars=True)
    aliases = {
        k: canonical[id(v)] for k, v in entries.items() if id(v) in canonical and canonical[id(v)] != k
    }
    buffers = {k: v.detach() for k, v in entries.items() if id(v) not in canonical}
    return {
        "format": FORMAT,
        "stage": stage,
        "world_size": world_size,
        "rank": rank,
        "step": step,
        "params": params,
        "optimizer": {"groups": groups, "sharded": sharded, "whole": whole},
        "buffers": buffers,
        "aliases": aliases,
    }


def is_sharded_part(state: Any) -> bool:
    """Whether ``state`` is a rank's part in this format."""
    return isinstance(state, dict) and state.get("format") == FORMAT


def _check_part(part: Any, where: str) -> dict[str, Any]:
    if not is_sharded_part(part):
        raise ValueError(
            f"{where} is not a ShardedDataParallel checkpoint part (format {FORMAT!r}). HINT: resume it with "
            "the strategy that wrote it."
        )
    return part


def _copy_overlap(target: torch.Tensor, lo: int, hi: int, source: torch.Tensor, slo: int, shi: int) -> int:
    a, b = max(lo, slo), min(hi, shi)
    if a >= b:
        return 0
    target[a - lo : b - lo].copy_(source[a - slo : b - slo])
    return b - a


@torch.no_grad()
def load_pieces(
    parts: Iterable[Any], layout: ShardLayout, module: nn.Module, optimizer: torch.optim.Optimizer, rank: int
) -> int:
    """Fill this rank's pieces (parameters and optimizer state), the buffers and the hyperparameters from the
    saved ``parts`` (every rank's part when resharding, or only the own part at the world size that wrote it);
    return the saved step. Raises ValueError naming a parameter whose piece was not fully found."""
    wanted = {p.name: p for p in layout.pieces if p.hi > p.lo}
    known = {n for n, _ in module.named_parameters()}
    covered = dict.fromkeys(wanted, 0)
    step, seen = None, 0
    for index, raw in enumerate(parts):
        part = _check_part(raw, f"checkpoint part {index}")
        seen += 1
        if step is None:
            step = int(part["step"])
            _load_hyperparameters(part["optimizer"]["groups"], optimizer)
            own = dict(module.named_buffers())
            for name, value in part["buffers"].items():
                if name in own:
                    own[name].copy_(value)
        for name, saved in part["params"].items():
            piece = wanted.get(name)
            if piece is None:
                if name not in known:
                    raise ValueError(
                        f"the checkpoint holds parameter {name!r}, which the model does not have"
                    )
                continue
            if tuple(saved["shape"]) != piece.shape:
                raise ValueError(
                    f"parameter {name!r} has shape {tuple(saved['shape'])} in the checkpoint and {piece.shape} in "
                    "the model. HINT: resume with the model that wrote the checkpoint."
                )
            slo, shi = int(saved["lo"]), int(saved["hi"])
            covered[name] += _copy_overlap(
                layout.flat(piece.param), piece.lo, piece.hi, saved["value"], slo, shi
            )
            state = optimizer.state[piece.param]
            for key, value in part["optimizer"]["sharded"].get(name, {}).items():
                if key not in state:
                    state[key] = layout.zeros_like(piece.param)
                _copy_overlap(layout.flat(state[key]), piece.lo, piece.hi, value, slo, shi)
            for key, value in part["optimizer"]["whole"].get(name, {}).items():
                state[key] = value.clone() if isinstance(value, torch.Tensor) else value
    if step is None:
        raise ValueError(f"rank {rank}: no checkpoint part to load")
    missing = [n for n, c in covered.items() if c != wanted[n].hi - wanted[n].lo]
    if missing:
        raise ValueError(
            f"rank {rank}: the {seen} checkpoint part(s) read do not cover this rank's piece of parameter(s) "
            f"{', '.join(missing[:3])}: the checkpoint was written at another world size or stage. HINT: resume "
            "through loom.fit, which reads every rank's part when the world size changed."
        )
    return step


def _load_hyperparameters(groups: list[dict[str, Any]], optimizer: torch.optim.Optimizer) -> None:
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(
            f"the checkpoint's optimizer has {len(groups)} parameter group(s), this one "
            f"{len(optimizer.param_groups)}. HINT: build the optimizer as the run that wrote it did."
        )
    for saved, group in zip(groups, optimizer.param_groups, strict=True):
        for key, value in saved.items():
            if key != "names" and key in group:
                group[key] = tuple(value) if isinstance(group[key], tuple) else value


def full_state_dict(parts: Iterable[Any]) -> dict[str, torch.Tensor]:
    """The whole model's state dict (parameters under their original names, then the buffers) from every rank's
    part; raises ValueError when a parameter is not fully covered (a part missing)."""
    whole: dict[str, torch.Tensor] = {}
    covered: dict[str, int] = {}
    buffers: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for index, raw in enumerate(parts):
        part = _check_part(raw, f"checkpoint part {index}")
        buffers = buffers or dict(part["buffers"])
        aliases = aliases or dict(part.get("aliases", {}))
        for name, saved in part["params"].items():
            if name not in whole:
                whole[name] = torch.empty(tuple(saved["shape"]), dtype=saved["value"].dtype)
            flat = whole[name].view(-1)
            covered[name] = covered.get(name, 0) + _copy_overlap(
                flat, 0, flat.numel(), saved["value"], int(saved["lo"]), int(saved["hi"])
            )
    for name, tensor in whole.items():
        if covered[name] != tensor.numel():
            raise ValueError(
                f"parameter {name!r}: the parts cover {covered[name]} of its {tensor.numel()} elements. "
                "HINT: every rank's file of the checkpoint is needed."
            )
    result = {**whole, **buffers}
    result.update({alias: result[name] for alias, name in aliases.items() if name in result})
    return result
