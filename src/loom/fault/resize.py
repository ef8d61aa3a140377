"""Resizing a data-parallel job on resume: the linear learning-rate scaling rule of
``fit(..., scale_lr_with_world_size=True)``, every learning rate times M / N (N as the checkpoint records it). When
to use it, what is rescaled and its limits: docs/fault-tolerance.md#resizing-on-resume.
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
