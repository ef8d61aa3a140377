"""A compression codec's cost on the user's gradient, measured in this process: encode/decode seconds, the bytes
each rank sends, and the buffers an exchange holds (`loom.plan.cost` adds them to DataParallel's step and peak)."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from loom.observe.memory import peak_rss_bytes, reset_peak_rss, rss_bytes
from loom.plan.profile import PROFILE_BUDGET_S, budgeted

__all__ = ["CodecCost", "gradient_like", "measure_codec"]


@dataclass(frozen=True)
class CodecCost:
    """One gradient exchange through a compression codec, measured in this process with the collectives
    answered at once (their cost is the transport's): encode/decode seconds and the bytes each rank sends."""

    spec: str
    seconds: float
    sum_bytes: int
    """Bytes each rank contributes to summed collectives (all-reduced)."""
    gather_bytes: int
    """Bytes each rank contributes to gathered collectives (each rank receives ``N`` times as much)."""
    transient_bytes: int = 0
    """The growth of this process's peak RSS over one exchange: the codec's buffers and outputs (error feedback,
    low-rank factors, the message and what is gathered), which a step holds on top of the training state."""


def _drive(codec: Any, shapes: list[torch.Size], flat: torch.Tensor, world: int) -> tuple[int, int]:
    sums = gathers = 0
    exchange = codec.exchange(list(range(len(shapes))), flat, shapes, world)
    try:
        collective = next(exchange)
        while True:
            if collective.op == "sum":
                sums += collective.tensor.nbytes
                answer = collective.tensor * world  # every rank sent the same: the sum is N times it
            else:
                gathers += collective.tensor.nbytes
                answer = collective.tensor.unsqueeze(0).expand(world, -1).clone()
            collective = exchange.send(answer)
    except StopIteration:
        return sums, gathers


def gradient_like(model: nn.Module) -> torch.Tensor:
    """A flat gradient of ``model``'s trainable parameters (seeded normal values), one for every codec measured
    (`measure_codec` reads it, no codec writes it): drawing 100 M values takes a third of a second."""
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return torch.randn(numel, generator=torch.Generator().manual_seed(0))


def measure_codec(
    spec: str, model: nn.Module, world: int, repeats: int = 3, gradient: torch.Tensor | None = None
) -> CodecCost:
    """Run ``spec``'s codec (`loom.comm.compression.make_codec`) on a gradient shaped like ``model``'s
    parameters, as one bucket; the first exchange (state set-up, warm starts) is not timed, and fewer than
    ``repeats`` are timed when they would take more than half of `PROFILE_BUDGET_S` (at least one). A first
    exchange longer than that half is the measurement itself (time to plan: a 100 M-parameter gradient takes
    seconds through some codecs, next to which their set-up, a few buffers, is small). ``gradient``: the
    values to compress (`gradient_like`'s, drawn here when not given)."""
    from loom.comm.compression import make_codec

    shapes = [p.shape for p in model.parameters() if p.requires_grad]
    codec = make_codec(spec)
    before = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    try:
        flat = gradient_like(model) if gradient is None else gradient
        reset = reset_peak_rss()  # first: it trims the heap, which lowers the RSS
        held = rss_bytes() or 0
        started = time.perf_counter()
        sizes = _drive(codec, shapes, flat, world)
        times = [time.perf_counter() - started]
        grown = max(0, (peak_rss_bytes() or 0) - held) if reset else 0
        if times[0] <= PROFILE_BUDGET_S / 2:
            first, times = times[0], []
            for _ in range(budgeted(first, repeats, PROFILE_BUDGET_S / 2)):
                started = time.perf_counter()
                sizes = _drive(codec, shapes, flat, world)  # the same values: a codec's time is the size's
                times.append(time.perf_counter() - started)
    finally:
        torch.set_num_threads(before)
    return CodecCost(spec, statistics.median(times), *sizes, transient_bytes=grown)
