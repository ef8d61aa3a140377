"""Refuse a model or optimizer that differs across processes before any gradient is exchanged.

Each rank describes its model and optimizer as ``[kind, name, description]`` entries and all-gathers a 64-bit
digest of them. The description covers what replicas must share to stay replicas:

- every parameter and buffer: shape and dtype;
- every module: its type and hyperparameters, as its ``extra_repr`` shows them (``Dropout(p=0.1, inplace=False)``,
  ``Tanh()`` vs ``ReLU()``): models with equal shapes but another activation or dropout compute other things;
- the optimizer: its type, and every param group's hyperparameters and size (SGD on one rank and Adam on another
  apply different updates to the same gradient).

Only when digests differ are the descriptions exchanged (JSON bytes, never pickle), so that every rank raises,
naming the first difference and the ranks, and none is left waiting. Limits: hyperparameters a module keeps
outside its ``extra_repr`` and the ``forward`` code itself are not compared; `loom.fault.desync`'s periodic
parameter check under `loom.fit` catches what they change.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from loom.comm._reduce import all_gather_sized_bytes
from loom.errors import ModelMismatchError  # noqa: F401 - raised here, defined there

__all__ = ["model_signature", "optimizer_signature", "check_same_model", "ModelMismatchError"]


def model_signature(model: nn.Module) -> list[list[str]]:
    """``[kind, name, description]`` of every parameter and buffer (shape, dtype), then of every module."""
    entries = [
        ["parameter", n, f"shape {list(p.shape)} dtype {p.dtype}"] for n, p in model.named_parameters()
    ]
    entries += [["buffer", n, f"shape {list(b.shape)} dtype {b.dtype}"] for n, b in model.named_buffers()]
    entries += [
        ["module", n or "(the model)", f"{type(m).__qualname__}({m.extra_repr()})"]
        for n, m in model.named_modules()
    ]
    return entries


def optimizer_signature(optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """``[kind, name, description]`` of the optimizer's type and of every param group's hyperparameters."""
    entries = [["optimizer", "type", type(optimizer).__qualname__]]
    for i, group in enumerate(optimizer.param_groups):
        entries.append(["optimizer", f"param_groups[{i}] parameters", str(len(group["params"]))])
        for key in sorted(k for k in group if k != "params"):
            entries.append(["optimizer", f"param_groups[{i}].{key}", _value(group[key])])
    return entries


def _value(value: Any) -> str:
    if isinstance(value, torch.Tensor):  # a tensor lr (capturable optimizers)
        value = value.tolist()
    if isinstance(value, tuple):
        value = list(value)
    return repr(value)


def _first_difference(reference: list[list[str]], other: list[list[str]], rank: int) -> tuple[str, str]:
    """What differs first (``"optimizer"`` when both entries are the optimizer's, else ``"model"``) and how."""
    for (kind, name, described), (kind2, name2, described2) in zip(reference, other, strict=False):
        what = "optimizer" if kind == kind2 == "optimizer" else "model"
        if (kind, name) != (kind2, name2):
            return what, f"{kind} {name!r} on rank 0 vs {kind2} {name2!r} on rank {rank} at the same position"
        if described != described2:
            return what, f"{kind} {name!r}: {described} on rank 0 vs {described2} on rank {rank}"
    if len(reference) != len(other):
        extra = reference[len(other)] if len(reference) > len(other) else other[len(reference)]
        return "model", f"{len(reference)} vs {len(other)} entries; first unmatched: {extra[0]} {extra[1]!r}"
    return "model", "unknown difference"


def check_same_model(
    model: nn.Module,
    rank: int,
    world_size: int,
    group: Any = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> None:
    """Raise `ModelMismatchError` on every rank if any rank's model (or ``optimizer``) differs from rank 0's.

    One all-gather of an 8-byte digest when all agree; a second one, of the descriptions, when not."""
    signature = model_signature(model)
    if optimizer is not None:
        signature += optimizer_signature(optimizer)
    encoded = json.dumps(signature).encode()
    digest = int.from_bytes(hashlib.sha256(encoded).digest()[:8], "little", signed=True)
    mine = torch.tensor([digest], dtype=torch.int64)
    digests = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(digests, mine, group=group)
    if all(int(d.item()) == int(digests[0].item()) for d in digests):
        return
    described = all_gather_sized_bytes(encoded, group)
    signatures = [json.loads(b) for b in described]
    differing = [r for r in range(world_size) if signatures[r] != signatures[0]]
    first = differing[0]
    what, difference = _first_difference(signatures[0], signatures[first], first)
    raise ModelMismatchError(
        f"the {what} differs across processes (seen on rank {rank}): rank 0 vs rank {first}: "
        f"{difference}; ranks that differ from rank 0: "
        f"{differing}. HINT: build the same model and optimizer on every process (same constructor arguments "
        "and hyperparameters, independent of rank)."
    )
