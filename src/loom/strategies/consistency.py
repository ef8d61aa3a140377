"""Refuse a model that differs across processes before any gradient is exchanged.

Each rank describes its model as a list of ``(kind, name, shape, dtype)`` entries and all-gathers a 64-bit digest
of it. Only when digests differ are the full descriptions exchanged (as JSON bytes in a uint8 tensor, never
pickle) so the error can name the first difference and the ranks involved. Every rank raises the same error, so
no rank is left waiting in a collective.
"""

from __future__ import annotations

import hashlib
import json

import torch
import torch.distributed as dist
from torch import nn

from loom.comm._reduce import all_gather_sized_bytes

__all__ = ["model_signature", "check_same_model", "ModelMismatchError"]


class ModelMismatchError(ValueError):
    """The model is not the same on every process."""


def model_signature(model: nn.Module) -> list[list[str]]:
    entries = [["parameter", n, str(list(p.shape)), str(p.dtype)] for n, p in model.named_parameters()]
    entries += [["buffer", n, str(list(b.shape)), str(b.dtype)] for n, b in model.named_buffers()]
    return entries


def _digest(signature: list[list[str]]) -> int:
    raw = hashlib.sha256(json.dumps(signature).encode()).digest()
    return int.from_bytes(raw[:8], "little", signed=True)


def _first_difference(reference: list[list[str]], other: list[list[str]]) -> str:
    for ref_entry, entry in zip(reference, other, strict=False):
        if ref_entry != entry:
            kind, name, shape, dtype = ref_entry
            o_kind, o_name, o_shape, o_dtype = entry
            if (kind, name) != (o_kind, o_name):
                return f"{kind} {name!r} vs {o_kind} {o_name!r} at the same position"
            return f"{kind} {name!r}: shape {shape} dtype {dtype} vs shape {o_shape} dtype {o_dtype}"
    if len(reference) != len(other):
        extra = reference[len(other)] if len(reference) > len(other) else other[len(reference)]
        return f"{len(reference)} vs {len(other)} tensors; first unmatched: {extra[0]} {extra[1]!r}"
    return "unknown difference"


def check_same_model(model: nn.Module, rank: int, world_size: int, group=None) -> None:
    """Raise `ModelMismatchError` on every rank if any rank's model differs from rank 0's."""
    signature = model_signature(model)
    mine = torch.tensor([_digest(signature)], dtype=torch.int64)
    digests = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(digests, mine, group=group)
    if all(int(d.item()) == int(digests[0].item()) for d in digests):
        return
    described = all_gather_sized_bytes(json.dumps(signature).encode(), group)
    signatures = [json.loads(b) for b in described]
    differing = [r for r in range(world_size) if signatures[r] != signatures[0]]
    first = differing[0]
    raise ModelMismatchError(
        f"the model differs across processes (seen on rank {rank}): rank 0 vs rank {first}: "
        f"{_first_difference(signatures[0], signatures[first])}; ranks that differ from rank 0: {differing}. "
        "HINT: build the same model on every process (same constructor arguments, independent of rank)."
    )
