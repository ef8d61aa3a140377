"""`compressed_sum`: the sum over a group of every rank's flat tensor, through a ``compression=`` spec.

What DiLoCo's outer exchange needs (`loom.parallel.replica.diloco`): each rank's pseudo-gradient, already
weighted by its share of the samples, summed over the replicas. A gradient codec (`make_codec`) computes a *mean*
inside DDP's hook; this is the plain sum of values the caller weighted, with the stateless specs:

- None: an all-reduce with ``algorithm`` (`loom.comm.all_reduce`) in the tensor's dtype;
- ``fp16`` / ``bf16``: each rank's share cast to 16 bits (a tensor already that narrow goes as it is), summed
  with ``algorithm``, cast back (the shares are weighted, so the sum cannot overflow where the mean fits);
- ``int8``: codes and chunk scales all-gathered with the backend and summed in rank order on every rank
  (`loom.comm.compression.int8`), bitwise the same result everywhere.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from loom.comm.all_reduce import all_reduce
from loom.comm.compression.cast import CAST_DTYPES
from loom.comm.compression.int8 import int8_payload, int8_sum
from loom.comm.counters import counters

__all__ = ["SUM_SPECS", "compressed_sum"]

SUM_SPECS = ("fp16", "bf16", "int8")
"""The specs `compressed_sum` takes (besides None)."""


def compressed_sum(flat: torch.Tensor, compression: str | None, algorithm: str, group: Any) -> torch.Tensor:
    """The sum over ``group`` of ``flat`` (each rank's weighted share), through ``compression`` (None or one of
    `SUM_SPECS`, canonical); collective: every rank of ``group`` calls it with the same spec and size."""
    if compression is None:
        return all_reduce(flat, op="sum", algorithm=algorithm, group=group)
    if compression in CAST_DTYPES:
        wire_dtype = CAST_DTYPES[compression]
        wire = flat if flat.element_size() <= wire_dtype.itemsize else flat.to(wire_dtype)
        return all_reduce(wire, op="sum", algorithm=algorithm, group=group).to(flat.dtype)
    if compression != "int8":
        raise ValueError(
            f"compressed_sum takes compression None or one of {list(SUM_SPECS)}, got {compression!r}"
        )
    payload, ncodes = int8_payload(flat)
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    messages = [payload]
    if world > 1:
        messages = [torch.empty_like(payload) for _ in range(world)]
        dist.all_gather(messages, payload, group=group)
        counters().record("int8 all_gather", (world - 1) * payload.nbytes, (world - 1) * payload.nbytes)
    return int8_sum(messages, ncodes, flat.numel(), flat.dtype)
