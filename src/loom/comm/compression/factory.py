"""The one ``compression=`` vocabulary: `parse_compression` reads a spec, `make_codec` builds its gradient codec,
`accept_compression` is how a strategy takes a spec or refuses it by name.

Every strategy that compresses (DataParallel and a model-parallel job's data axis, DiLoCo) reads the same specs,
listed with what each sends in docs/strategies/data-parallel.md#gradient-compression; each kind's codec is in the
module of its name (``fp16``/``bf16``: `loom.comm.compression.cast`). A strategy that cannot use one refuses it
by name, with the reason and the ones it takes (`accept_compression`), instead of a generic "unknown spec".
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence

from loom.comm.compression.base import Codec
from loom.comm.compression.cast import CastCodec
from loom.comm.compression.int8 import Int8Codec
from loom.comm.compression.powersgd import PowerSGDCodec
from loom.comm.compression.topk import TopKCodec

__all__ = ["CODEC_FORMS", "accept_compression", "make_codec", "parse_compression"]

CODEC_FORMS = ("fp16", "bf16", "int8", "topk:<fraction in (0, 1]>", "powersgd:<rank >= 1>")
"""The spec forms `parse_compression` accepts, for help texts and error messages."""


def parse_compression(spec: str) -> tuple[str, str]:
    """``spec`` as ``(kind, canonical spec)``: ``"fp16"``, ``"bf16"``, ``"int8"``, ``"topk:<fraction>"`` or
    ``"powersgd:<rank>"`` (spaces and case ignored), e.g. ``" TopK:0.01"`` -> ``("topk", "topk:0.01")``.

    Raises TypeError for a non-string, ValueError naming the bad spec and the valid forms."""
    if not isinstance(spec, str):
        raise TypeError(f"a codec spec must be a string such as 'topk:0.01', got {type(spec).__name__}")
    canonical = spec.strip().lower()
    name, _, argument = canonical.partition(":")
    if name in ("fp16", "bf16", "int8") and not argument:
        return name, name
    with contextlib.suppress(ValueError):  # not a number: refused below (NaN and inf fail the comparisons)
        if (name == "topk" and 0.0 < float(argument) <= 1.0) or (name == "powersgd" and int(argument) >= 1):
            return name, canonical
    raise ValueError(
        f"unknown or invalid gradient codec spec {spec!r}; valid forms are {', '.join(CODEC_FORMS)} "
        "(e.g. 'fp16', 'topk:0.01', 'powersgd:4')"
    )


def make_codec(spec: str) -> Codec:
    """``"fp16"``, ``"bf16"``, ``"int8"``, ``"topk:0.01"`` or ``"powersgd:4"`` -> a new codec with empty state;
    raises ValueError naming the bad spec and the valid forms (`parse_compression`)."""
    kind, canonical = parse_compression(spec)
    _, _, argument = canonical.partition(":")
    if kind in ("fp16", "bf16"):
        return CastCodec(kind)
    if kind == "int8":
        return Int8Codec()
    if kind == "topk":
        return TopKCodec(float(argument))
    return PowerSGDCodec(int(argument))


def accept_compression(
    spec: str | None, strategy: str, takes: Sequence[str], why_not: Mapping[str, str]
) -> str | None:
    """``spec`` in its canonical form when ``strategy`` can use it (its kind is in ``takes``; None passes).

    Refuses a malformed spec as `parse_compression` does, and a well-formed one the strategy cannot use with
    ``"<strategy> cannot use <spec> (<why_not[kind]>); it takes <takes>"``."""
    if spec is None:
        return None
    kind, canonical = parse_compression(spec)
    if kind not in takes:
        reason = why_not.get(kind, "not implemented for it")
        raise ValueError(f"{strategy} cannot use {canonical} ({reason}); it takes {', '.join(takes)}")
    return canonical
