"""``int8``: symmetric 8-bit codes with one float32 scale per chunk, all-gathered and summed in rank order.

As OpenDiLoCo / INTELLECT-1 (Jaghouar et al., 2024) ran their outer all-reduce over gloo: each rank quantizes its
share in chunks of `INT8_CHUNK` values (scale = the chunk's largest magnitude / 127, round to nearest), the codes
and scales are all-gathered, and every rank dequantizes every message and adds them up in rank order, so the
result is bitwise the same everywhere. Each rank sends ``(W - 1)`` messages of a quarter of the float32 size (a
ring all-reduce of float32 sends ``2 (W - 1) / W`` full ones): fewer bytes than float32 for ``W <= 8``.

`int8_payload` encodes one rank's message and `int8_sum` adds up every rank's, for DiLoCo's outer exchange
(`loom.comm.compression.replicas`) and for `Int8Codec`, the same exchange as a gradient codec of DDP's hook. No
error feedback: the rounding error (at most ``scale / 2`` per value) is lost.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from loom.comm.compression.base import Collective, Exchange, check_codec_state

__all__ = ["INT8_CHUNK", "Int8Codec", "dequantize_int8", "int8_payload", "int8_sum", "quantize_int8"]

INT8_CHUNK = 1024
"""Values per int8 scale (`quantize_int8`): the scales add 4 bytes per chunk (0.4 % of the codes)."""


def _quantize_rows(chunks: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """Write the codes and scales of ``chunks`` (float32 rows of `INT8_CHUNK`, overwritten) into ``codes``
    (int8) and ``scales``. One pass finds each row's range (``aminmax``: no ``abs`` copy); the division, rounding
    and clamping run in place: at 100 M values each copy is 400 MB written and faulted in."""
    low, high = torch.aminmax(chunks, dim=1)
    torch.maximum(high, low.neg_(), out=scales)  # the largest magnitude, as abs().amax() gives it
    scales.div_(127)
    scales.masked_fill_(~(scales > 0), 1.0)  # 0 (a chunk of zeros) and NaN scale by 1
    chunks.div_(scales[:, None]).round_().clamp_(-127, 127)
    codes.view(-1, INT8_CHUNK).copy_(chunks)


def _quantize(flat: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, owned: bool) -> None:
    """`_quantize_rows` over ``flat``'s whole chunks, then its last, zero-padded one. ``owned``: ``flat`` is the
    caller's float32 temporary and its whole chunks are quantized in place, without a copy."""
    full = flat.numel() // INT8_CHUNK * INT8_CHUNK
    head = flat[:full]
    if not (owned and flat.dtype == torch.float32 and flat.is_contiguous()):
        head = head.to(torch.float32, copy=True)
    _quantize_rows(head.view(-1, INT8_CHUNK), codes[:full], scales[: full // INT8_CHUNK])
    if full < flat.numel():
        tail = torch.zeros(INT8_CHUNK, dtype=torch.float32, device=flat.device)
        tail[: flat.numel() - full] = flat[full:]
        _quantize_rows(tail.view(1, -1), codes[full:], scales[full // INT8_CHUNK :])


def _sizes(numel: int) -> tuple[int, int]:
    """Codes (``numel`` rounded up to whole chunks) and scales of a message of ``numel`` values."""
    chunks = -(-numel // INT8_CHUNK)
    return chunks * INT8_CHUNK, chunks


def quantize_int8(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes of ``flat`` (zero-padded to whole chunks) and one float32 scale per chunk."""
    ncodes, nchunks = _sizes(flat.numel())
    codes = torch.empty(ncodes, dtype=torch.int8, device=flat.device)
    scales = torch.empty(nchunks, dtype=torch.float32, device=flat.device)
    _quantize(flat, codes, scales, owned=False)
    return codes, scales


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 values of `quantize_int8`'s codes (padding included)."""
    return (codes.view(-1, INT8_CHUNK).to(torch.float32) * scales[:, None]).view(-1)


def int8_payload(flat: torch.Tensor, owned: bool = False) -> tuple[torch.Tensor, int]:
    """``flat``'s codes and scales as one uint8 message, and how many of its bytes are codes. With ``owned``,
    ``flat`` is the caller's temporary and is overwritten (no copy of it is made)."""
    ncodes, nchunks = _sizes(flat.numel())
    payload = torch.empty(ncodes + 4 * nchunks, dtype=torch.uint8, device=flat.device)
    _quantize(flat, payload[:ncodes].view(torch.int8), payload[ncodes:].view(torch.float32), owned)
    return payload, ncodes


def int8_sum(messages: Sequence[torch.Tensor], ncodes: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The sum of every rank's dequantized message (`int8_payload`), in rank order, as ``numel`` values of
    ``dtype``: bitwise the same on every rank that holds the same messages. The first message is dequantized
    into the sum itself (``0 + x`` is ``x``: a scale is positive, so no value is ``-0.0``), the others into one
    reused buffer: the values `dequantize_int8` gives, without a new tensor per message."""
    total = torch.empty(ncodes, dtype=torch.float32, device=messages[0].device)
    values = torch.empty_like(total) if len(messages) > 1 else total
    for i, message in enumerate(messages):
        into = total if i == 0 else values
        into.copy_(message[:ncodes].view(torch.int8))
        into.view(-1, INT8_CHUNK).mul_(message[ncodes:].view(torch.float32)[:, None])
        if i:
            total += values
    return total[:numel].to(dtype)


class Int8Codec:
    """Send each rank's share of the mean gradient as int8 codes with chunk scales (all-gathered); stateless."""

    spec = "int8"

    def exchange(
        self, params: Sequence[int], flat: torch.Tensor, shapes: Sequence[torch.Size], world_size: int
    ) -> Exchange:
        payload, ncodes = int8_payload(flat / world_size, owned=True)
        gathered = yield Collective("gather", payload, final=True)
        return int8_sum(list(gathered), ncodes, flat.numel(), flat.dtype)

    def state_dict(self) -> dict[str, Any]:
        return {"codec": self.spec}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_codec_state(state, self.spec)

    def __repr__(self) -> str:
        return "Int8Codec()"
