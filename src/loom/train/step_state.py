"""What one step of the engine knows (`StepState`), and the options of the strategies whose replicas each step on
their own share (`ShareOptions`): the data the step engine (`loom.train.engine`) and a strategy's hooks hand each
other, apart from the engine's code."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from loom.errors import check_int
from loom.train.guard import GuardOptions

__all__ = ["ShareOptions", "StepState"]


@dataclass(frozen=True, kw_only=True)
class ShareOptions(GuardOptions):
    """The guard's options and ``accumulate``: the config base of the strategies whose replicas each step on
    their own share (LocalSGD, DiLoCo, Gossip, ParameterServer); `DataParallelConfig` has its own field."""

    accumulate: int = 1
    """Micro-batches per step: the local share is split in this many pieces, each weighted by its share of the
    samples, and their gradients accumulate before the step (the same gradient as one piece, in less memory)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("accumulate", self.accumulate)


@dataclass
class StepState:
    """What one step knows, filled in by the engine and the hooks in order (see the module docstring)."""

    number: int
    """The step being taken (``job.step + 1``)."""
    batch: Any
    """This rank's share, as `train_step` was given it (the hooks move what they use to the device)."""
    started: float = field(default_factory=time.perf_counter)
    local: int = 0
    """Samples in this rank's share (set by `_prepare`)."""
    total: int | None = None
    """Samples in the global batch: set by `_prepare` where it is known before the forward, else by
    `_synchronize`."""
    loss_sum: float = 0.0
    """This rank's loss summed over its samples (set by `_forward_backward`)."""
    flag: float = 0.0
    """1.0 when this rank's loss or gradient is NaN or infinite (set by `_forward_backward`)."""
    flags: Sequence[float] = ()
    """Every judged rank's flag, in the order of ``ranks`` (set by `_synchronize`)."""
    ranks: Sequence[int] = ()
    gradient_finite: bool = True
    """Whether the synchronized gradient is finite (the same on every rank where it is averaged)."""
    phases: tuple[float, float, float, float] | None = None
    """Seconds of data (the gap since the previous step and `_prepare`), compute (`_forward_backward`), comm
    (`_synchronize` and `_after_step`) and optimizer (the verdict and `_apply`), set before `_record`."""
    loss: float = 0.0
    """What `train_step` returns (set by `_synchronize`, see ``loss_scope``)."""
    skipped: bool = False
    """The verdict: the step's update was not applied."""
    work: dict[str, Any] = field(default_factory=dict)
    """What a strategy's hooks hand each other within the step (its loss buffer, micro-batches, replies)."""
