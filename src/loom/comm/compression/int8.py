"""``int8``: symmetric 8-bit codes with one float32 scale per chunk, all-gathered and summed in rank order.

As OpenDiLoCo / INTELLECT-1 (Jaghouar et al., 2024) ran their outer all-reduce over gloo: each rank quantizes its
share in chunks of `INT8_CHUNK` values (scale = the chunk's largest magnitude / 127, round to nearest), the codes
and scales are all-gathered, and every rank dequantizes every message and adds them up in rank order, so the
result is bitwise the same everywhere. Each rank sends ``(W - 1)`` messages of a quarter of the float32 size (a
ring all-reduce of float32 sends ``2 (W - 1) / W`` full ones): fewer bytes than float32 for ``W <= 8``.

`int8_payload` encodes one rank's message and `int8_sum` adds up every rank's: DiLoCo's outer exchange sums its
pre-weighted pseudo-gradients with them (`loom.comm.compression.replicas`), and `Int8Codec` is the same exchange
as a gradient codec (`loom.comm.compression.base`) for DDP's hook: each rank sends its share of the mean (its gradient divided by the world size, as the ``fp16``
codec does). No error feedback: the rounding error (at most half a step, ``scale / 2``, per value) is lost.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from loom.comm.compression.base import Collective, Exchange, check_codec_state

__all__ = ["INT8_CHUNK", "Int8Codec", "dequantize_int8", "int8_payload", "int8_sum", "quantize_int8"]

INT8_CHUNK = 1024
"""Values per int8 scale (`quantize_int8`): the scales add 4 bytes per chunk (0.4 % of the codes)."""


def quantize_int8(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes of ``flat`` (zero-padded to whole chunks) and one float32 scale per chunk."""
    padded = torch.zeros(-(-flat.numel() // INT8_CHUNK) * INT8_CHUNK, dtype=torch.float32, device=flat.device)
    padded[: flat.numel()] = flat
    chunks = padded.view(-1, INT8_CHUNK)
    scales = chunks.abs().amax(dim=1) / 127
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(chunks / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes.view(-1), scales


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 values of `quantize_int8`'s codes (padding included)."""
    return (codes.view(-1, INT8_CHUNK).to(torch.float32) * scales[:, None]).view(-1)


def int8_payload(flat: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``flat``'s codes and scales as one uint8 message, and how many of its bytes are codes."""
    codes, scales = quantize_int8(flat)
    return torch.cat([codes.view(torch.uint8), scales.view(torch.uint8)]), codes.numel()


def int8_sum(messages: Sequence[torch.Tensor], ncodes: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The sum of every rank's dequantized message (`int8_payload`), in rank order, as ``numel`` values of
    ``dtype``: bitwise the same on every rank that holds the same messages."""
    total = torch.zeros(ncodes, dtype=torch.float32, device=messages[0].device)
    for message in messages:
        total += dequantize_int8(message[:ncodes].view(torch.int8), message[ncodes:].view(torch.float32))
    return total[:numel].to(dtype)


class Int8Codec:
    """Send each rank's share of the mean gradient as int8 codes with chunk scales (all-gathered); stateless."""

    spec = "int8"

    def exchange(
        self, params: Sequence[int], flat: torch.Tensor, shapes: Sequence[torch.Size], world_size: int
    ) -> Exchange:
        payload, ncodes = int8_payload(flat / world_size)
        gathered = yield Collective("gather", payload, final=True)
        return int8_sum(list(gathered), ncodes, flat.numel(), flat.dtype)

    def state_dict(self) -> dict[str, Any]:
        return {"codec": self.spec}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_codec_state(state, self.spec)

    def __repr__(self) -> str:
        return "Int8Codec()"
