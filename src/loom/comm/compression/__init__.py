"""Gradient compression for data parallelism: send fewer bytes per step, keep what was not sent for later.

    from loom.comm.compression import compression_hook, make_codec
    hook = compression_hook(make_codec("powersgd:4"))       # or "fp16", "bf16", "int8", "topk:0.01"
    ddp.register_comm_hook(None, hook)                       # None: all processes (or a process group)
    checkpoint["codec"] = hook.state_dict()                  # residuals and warm starts: tensors, ints, strings

Five codecs (`Codec`), named by the one spec vocabulary of every strategy that compresses
(`loom.comm.compression.factory`; usage: docs/strategies/data-parallel.md#gradient-compression): ``fp16`` /
``bf16`` and ``int8`` are stateless; ``topk:<fraction>`` and ``powersgd:<rank>`` keep error feedback, per
parameter (`loom.comm.compression.feedback`). How a codec's collectives are run: `loom.comm.compression.base`.

Why not PyTorch's ``fp16_compress_hook``, ``bf16_compress_hook`` and ``powerSGD_hook``: DDP refuses
``bf16_compress_hook`` without NCCL, ``batched_powerSGD_hook`` crashes on CPU, and none of them records its
traffic.
"""

from loom.comm.compression.base import Codec, Collective
from loom.comm.compression.cast import CastCodec
from loom.comm.compression.factory import CODEC_FORMS, accept_compression, make_codec, parse_compression
from loom.comm.compression.hook import CompressionHook, compression_hook
from loom.comm.compression.int8 import INT8_CHUNK, Int8Codec, dequantize_int8, quantize_int8
from loom.comm.compression.local import exchange_locally
from loom.comm.compression.powersgd import PowerSGDCodec
from loom.comm.compression.topk import TopKCodec

__all__ = [
    "CODEC_FORMS",
    "INT8_CHUNK",
    "CastCodec",
    "Codec",
    "Collective",
    "CompressionHook",
    "Int8Codec",
    "PowerSGDCodec",
    "TopKCodec",
    "accept_compression",
    "compression_hook",
    "dequantize_int8",
    "exchange_locally",
    "make_codec",
    "parse_compression",
    "quantize_int8",
]
