"""Horovod's gradient compression: ``Compression.none`` and ``Compression.fp16``.

A compressor has ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx) -> tensor``. ``fp16``
sends floating-point tensors as float16 (half the bytes; the reduction then runs in float16, so sums lose
precision past 11 significant bits) and leaves other dtypes alone, as Horovod does.
"""

from __future__ import annotations

import torch

__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]


class Compressor:
    @staticmethod
    def compress(tensor: torch.Tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    @staticmethod
    def compress(tensor):
        return (tensor.type(torch.float16) if tensor.dtype.is_floating_point else tensor), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor.type(ctx) if ctx is not None and ctx.is_floating_point else tensor


class Compression:
    """The choices for ``compression=``: ``Compression.none`` and ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
