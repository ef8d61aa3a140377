"""The step engine: the one `train_step` and the one `eval_step` of every strategy.

Before this module five jobs had a step loop each, and every guarantee was wired into each by hand (the hang
watchdog ran in two of them, the non-finite guard in four). Here the order of a step is written once, and a
strategy supplies only what differs, as the hooks of `Engine`:

=====  ===========================================  ==========================================================
 #      the engine does                               the strategy's hook says how
=====  ===========================================  ==========================================================
 1      refuse a batch cut for another layout         (`loom.job.check_batch_layout`, for every strategy)
 2      prepare: batch to the device, its size,       `_prepare`: e.g. the global count's all-reduce, a parameter
        the global count where it is known first      server's pull, the replica's sample check
 3      train mode, gradients cleared                 (every strategy)
 4      forward and backward through the schedule     `_forward_backward`: micro-batches weighted by their share
                                                      of the global batch, or a pipeline's instruction stream;
                                                      this rank's loss sum and its non-finite flag
 5      synchronize                                   `_synchronize`: gradients averaged (or pushed), the loss,
                                                      the global count and every rank's flag reduced
 6      the verdict: `StepGuard.judge` on every       (one call, here: the same flags give the same verdict on
        flag (skip, or stop past the limit)           every rank; a skipped step's gradients are cleared)
 7      the step, unless skipped                      `_apply`: the optimizer's step (after a data axis's
                                                      gradient sum), or nothing where a server applied it
 8      count the step; the after-step exchange       `_after_step`: LocalSGD, DiLoCo, Gossip
 9      the step record                               `_record`: the strategy's own fields (phases, bubble,
                                                      staleness, bytes)
=====  ===========================================  ==========================================================

What `train_step` returns is ``StepState.loss`` as `_synchronize` sets it: the global-batch mean loss where
``loss_scope`` is ``"global"``, this replica's mean loss on its share where it is ``"replica"`` (`loom.job.Job`).
A global batch of 0 samples is refused on every rank (every rank knows the same total).

`eval_step`: `_evaluate` gives the names and this rank's ``[sum per name..., samples]`` (`share_sums`), the
engine adds them up over the data axis (`_eval_group`, under the watchdog) and divides (`share_means`).
"""

from __future__ import annotations

import abc
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from loom.job import Job, MetricFn, check_batch_layout
from loom.train.batch import share_means

if TYPE_CHECKING:
    from loom.train.guard import StepGuard

__all__ = ["Engine", "StepState"]


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
    loss: float = 0.0
    """What `train_step` returns (set by `_synchronize`, see ``loss_scope``)."""
    skipped: bool = False
    """The verdict: the step's update was not applied."""
    work: dict[str, Any] = field(default_factory=dict)
    """What a strategy's hooks hand each other within the step (its loss buffer, micro-batches, replies)."""


class Engine(Job):
    """A `loom.job.Job` whose `train_step` and `eval_step` are the engine's (see the module docstring).

    A strategy's job subclasses it, sets ``guard`` (a `loom.train.guard.StepGuard`) and implements the hooks."""

    guard: StepGuard

    @property
    def skipped_steps(self) -> int:
        """Steps whose update was not applied because their loss or gradient was non-finite on some rank."""
        return self.guard.skipped

    # -- the step ------------------------------------------------------------------------------------------------
    def train_step(self, batch: Any) -> float:
        """One step on the global batch ``batch`` is this rank's share of; returns ``loss_scope``'s loss."""
        self._check_can_train()
        check_batch_layout(batch, self)
        state = StepState(self.step + 1, batch)
        with self._step_context():
            self._prepare(state)
            self._refuse_empty(state)
            self.module.train()
            self.optimizer.zero_grad(set_to_none=True)
            self._forward_backward(state)
            self._synchronize(state)
            self._refuse_empty(state)
            state.skipped = self.guard.judge(state.number, state.flags, state.ranks, state.gradient_finite)
            if state.skipped:
                self.optimizer.zero_grad(set_to_none=True)
            else:
                self._apply(state)
            self.step = state.number
            self.last_step_skipped = state.skipped
            self._after_step(state)
            self._record(state)
        return state.loss

    def _refuse_empty(self, state: StepState) -> None:
        if state.total == 0:
            raise ValueError(
                f"rank {self.topology.rank}: train_step got a global batch of 0 samples (every share is empty) "
                f"at step {state.number}. HINT: check the dataset's length and global_batch_size."
            )

    # -- the hooks -----------------------------------------------------------------------------------------------
    def _check_can_train(self) -> None:
        """Raise when `train_step` must not run now (e.g. the job's model is driven by the user's own loop)."""

    def _step_context(self) -> contextlib.AbstractContextManager[Any]:
        """Held around the whole step (e.g. Gossip: no peer changes the parameters meanwhile)."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def _prepare(self, state: StepState) -> None:
        """Set ``state.local`` (and ``state.total`` where known now); anything the forward needs first."""

    @abc.abstractmethod
    def _forward_backward(self, state: StepState) -> None:
        """Forward and backward on this rank's share; set ``state.loss_sum`` and ``state.flag``."""

    @abc.abstractmethod
    def _synchronize(self, state: StepState) -> None:
        """Exchange what the step needs; set ``total``, ``flags``, ``ranks``, ``gradient_finite``, ``loss``."""

    def _apply(self, state: StepState) -> None:
        """Apply the update (not called for a skipped step)."""
        self.optimizer.step()

    def _after_step(self, state: StepState) -> None:
        """Called on every rank after the step is counted (``self.step`` is ``state.number``)."""

    def _record(self, state: StepState) -> None:
        """Write the step record."""
        extra = {"skipped": True} if state.skipped else {}
        self.metrics.record(
            state.number,
            time.perf_counter() - state.started,
            state.local,
            state.total or 0,
            state.loss,
            **extra,
        )

    # -- evaluation ----------------------------------------------------------------------------------------------
    def eval_step(self, batch: Any, metrics: dict[str, MetricFn] | None = None) -> dict[str, float]:
        """The global-batch mean loss and any extra mean-reduced ``metrics``, in eval mode, without gradients.
        Collective over the data axis: every rank calls it, and the result is the same everywhere."""
        check_batch_layout(batch, self)
        names, sums = self._evaluate(batch, metrics)
        group = self._eval_group()
        if group is not None:
            with self.guard.collective("evaluation all-reduce"):
                dist.all_reduce(sums, group=group)
        return share_means(names, sums, self.topology.rank)

    @abc.abstractmethod
    def _evaluate(self, batch: Any, metrics: dict[str, MetricFn] | None) -> tuple[list[str], torch.Tensor]:
        """``names`` and this rank's ``[sum per name..., samples]`` in eval mode (see `share_sums`)."""

    def _eval_group(self) -> Any:
        """The group the evaluation sums are added up over; None: they are global already (one process, or a
        strategy whose `_evaluate` reduced them)."""
        return self.mesh.group(self.data_axis)
