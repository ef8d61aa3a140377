"""Resizing a data-parallel job on resume, and the linear learning-rate scaling rule that may go with it.

A checkpoint written by `loom.fit` with N workers resumes with M at the same global sample (the loader counts
global samples). With loom's global-batch semantics the global batch, hence the learning rate, does not change
with the world size: that is the default. A job that keeps the *per-worker* batch fixed changes its global batch
when it resizes; ``fit(..., scale_lr_with_world_size=True)`` then applies the linear scaling rule of Goyal et al.,
"Accurate, Large Minibatch SGD" (2017): every learning rate times M / N, N as recorded in the checkpoint (so
repeated resizes compose).

Limits: the rule is a heuristic for SGD-like optimizers (adaptive ones such as Adam often want square-root
scaling, or none); warm-up after a large jump is the schedule's business. Rescaled are each parameter group's
``lr`` and ``initial_lr`` and a scheduler's ``base_lrs`` and last rates (torch's schedulers that derive the rate
from those); schedulers with absolute rates of their own (OneCycleLR's ``max_lr``, CyclicLR's bounds) are refused.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["scale_learning_rate", "resize_factor"]

_ABSOLUTE_RATE_SCHEDULERS = ("OneCycleLR", "CyclicLR")


def resize_factor(saved_world_size: Any, world_size: int) -> float:
    """M / N for the linear scaling rule, or an error naming what the checkpoint lacks."""
    if isinstance(saved_world_size, bool) or not isinstance(saved_world_size, int) or saved_world_size < 1:
        raise ValueError(
            f"scale_lr_with_world_size=True needs the world size the checkpoint was written with, and it "
            f"records {saved_world_size!r}. HINT: resume without scale_lr_with_world_size, and set the rate "
            "yourself."
        )
    return world_size / saved_world_size


def scale_learning_rate(optimizer: torch.optim.Optimizer, scheduler: Any, factor: float) -> None:
    """Multiply every learning rate of ``optimizer`` (and of ``scheduler``, if given) by ``factor``."""
    if not factor > 0:
        raise ValueError(f"the learning-rate factor must be > 0, got {factor!r}")
    if scheduler is not None and type(scheduler).__name__ in _ABSOLUTE_RATE_SCHEDULERS:
        raise ValueError(
            f"cannot rescale {type(scheduler).__name__}: it holds absolute rates of its own. HINT: build it "
            "with rates for the new world size and resume without scale_lr_with_world_size."
        )
    if factor == 1:
        return
    for group in optimizer.param_groups:
        for key in ("lr", "initial_lr"):
            if key in group:
                group[key] = group[key] * factor  # a tensor rate (capturable optimizers) stays a tensor
    if scheduler is not None:
        for attr in ("base_lrs", "_last_lr"):
            values = getattr(scheduler, attr, None)
            if isinstance(values, list):
                setattr(scheduler, attr, [v * factor for v in values])
