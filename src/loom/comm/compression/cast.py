"""``fp16`` and ``bf16``: all-reduce gradients in a 16-bit floating-point format, half the bytes of float32.

As PyTorch's ``fp16_compress_hook`` (mixed-precision training, Micikevicius et al. 2018, made 16-bit gradients
routine): each rank divides its gradient by the world size *before* casting, so the sum cannot overflow where
the mean would fit, all-reduces the 16-bit tensor, and casts the result back.

Limits: float16 keeps 11 significant bits but only the range ~6e-8..65504, so tiny gradients flush to zero and
huge ones become inf; bfloat16 keeps float32's range but only 8 significant bits. The sum is rounded in 16 bits
at each addition, so the error grows with the number of processes. No error feedback: the rounding error is
lost, harmless at these precisions. Gradients already 16-bit (or narrower) go through in their own dtype.

On gloo: DDP refuses PyTorch's ``bf16_compress_hook`` unless NCCL is present (a name check in
``DistributedDataParallel._check_comm_hook``), but gloo itself all-reduces bfloat16, so this codec does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from loom.comm.compression.base import Collective, Exchange, check_codec_state

__all__ = ["CAST_DTYPES", "CastCodec"]

CAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
"""The wire dtype of each cast spec."""


class CastCodec:
    """Send gradients as float16 (``"fp16"``) or bfloat16 (``"bf16"``); stateless."""

    def __init__(self, spec: str) -> None:
        if spec not in CAST_DTYPES:
            raise ValueError(f"CastCodec spec must be one of {sorted(CAST_DTYPES)}, got {spec!r}")
        self.spec = spec
        self.wire_dtype = CAST_DTYPES[spec]

    def exchange(
        self, params: Sequence[int], flat: torch.Tensor, shapes: Sequence[torch.Size], world_size: int
    ) -> Exchange:
        share = flat / world_size  # this rank's share of the mean; summed in the wire dtype, cast back
        wire = share if flat.element_size() <= self.wire_dtype.itemsize else share.to(self.wire_dtype)
        summed = yield Collective("sum", wire, final=True)
        return summed.to(flat.dtype)

    def state_dict(self) -> dict[str, Any]:
        return {"codec": self.spec}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_codec_state(state, self.spec)

    def __repr__(self) -> str:
        return f"CastCodec({self.spec!r})"
