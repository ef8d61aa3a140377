"""`make_codec`: a codec from its spec string, the form configs and command lines use."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeVar

from loom.comm.compression.base import Codec
from loom.comm.compression.cast import CastCodec
from loom.comm.compression.powersgd import PowerSGDCodec
from loom.comm.compression.topk import TopKCodec

__all__ = ["CODEC_FORMS", "make_codec"]

T = TypeVar("T")

CODEC_FORMS = ("fp16", "bf16", "topk:<fraction in (0, 1]>", "powersgd:<rank >= 1>")
"""The spec forms `make_codec` accepts, for help texts and error messages."""


def make_codec(spec: str) -> Codec:
    """``"fp16"``, ``"bf16"``, ``"topk:0.01"`` or ``"powersgd:4"`` -> a new codec with empty state.

    Raises ValueError naming the bad spec and the valid forms.
    """
    if not isinstance(spec, str):
        raise TypeError(f"a codec spec must be a string such as 'topk:0.01', got {type(spec).__name__}")
    name, _, argument = spec.strip().lower().partition(":")
    if name in ("fp16", "bf16") and not argument:
        return CastCodec(name)
    if name == "topk" and argument:
        fraction = _parse(argument, float)
        if fraction is not None and math.isfinite(fraction) and 0.0 < fraction <= 1.0:
            return TopKCodec(fraction)
    if name == "powersgd" and argument:
        rank = _parse(argument, int)
        if rank is not None and rank >= 1:
            return PowerSGDCodec(rank)
    raise ValueError(
        f"unknown or invalid gradient codec spec {spec!r}; valid forms are {', '.join(CODEC_FORMS)} "
        "(e.g. 'fp16', 'topk:0.01', 'powersgd:4')"
    )


def _parse(text: str, kind: Callable[[str], T]) -> T | None:
    try:
        return kind(text)
    except ValueError:
        return None
