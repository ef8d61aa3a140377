"""What ``loom run --on-worker-failure heal`` adds to LocalSGD and DiLoCo: the sync round as the unit of commit.

Why, what a failure costs, the options and the limits (one host: `loom.launch.heal`): docs/fault-tolerance.md,
"LocalSGD and DiLoCo: the sync round is the unit of commit". A round is the ``H = sync_every`` inner steps and the
synchronization that ends them. A failure anywhere in it makes every member restore its round-start snapshot (the
job's ``state_dict`` and the RNG), re-form (`loom.fault.quorum`), make themselves equal
(`loom.parallel.data.data_axis.take_live_state`) and redo the round's global batches among the members present.
`RoundCommit` does it from the hooks of `loom.parallel.replica._replica_sync.ReplicaJob`: the vote follows the
round's synchronization (`end_step`); the replay (`adopt_epoch`) runs the round's earlier batches from the
snapshot, then the engine retries the `train_step` that met the failure, so members that failed at different inner
steps replay the same collectives in the same order; a replacement joins at a round boundary (`joiner_ready`) or
in the epoch that re-forms after a failure. Step records are written when the round commits.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from loom.errors import StepDropped
from loom.fault.inject import fault_point
from loom.parallel._setup import HEALS
from loom.parallel.data.data_axis import heal_allreduce_refusal, refuse_under_heal, take_live_state
from loom.train.engine import StepState
from loom.train.heal_step import reform

__all__ = ["RoundCommit", "refuse_round_options"]


def refuse_round_options(config: Any, strategy: str) -> None:
    """The options of LocalSGD and DiLoCo that a healing round cannot honour, refused by name with why."""
    why = heal_allreduce_refusal(config)
    if strategy == "DiLoCo" and config.fragments != 1:
        why[f"fragments={config.fragments}"] = "a round synchronizes the whole model at its end, once"
    if strategy == "DiLoCo" and config.overlap != 0:
        why[f"overlap_steps={config.overlap}"] = (
            "an exchange still in flight at a round's end cannot be voted on"
        )
    refuse_under_heal(strategy, why, f" (the strategies that heal: {HEALS})")


@dataclass
class RoundCommit:
    """A replica job's round under heal (see the module docstring): its batches, its start, its held records."""

    sync_every: int
    batches: list[Any] = field(default_factory=list)
    """The round's global batches so far, the one being trained last."""
    snapshot: tuple[dict[str, Any], torch.Tensor] | None = None
    """The job's ``state_dict`` and the RNG state at the round's start (when the previous round committed)."""
    held: list[tuple[tuple, dict[str, Any]]] = field(default_factory=list)
    """The records (arguments, fields) of the round's inner steps, written when the round commits."""
    batch_step: int = 0
    batch_loss: float = 0.0
    join_after: bool = False
    """The round committed while a replacement was ready: re-form after the round's last step is recorded."""

    def ends(self, step: int) -> bool:
        return step % self.sync_every == 0

    def joiner_ready(self, quorum: Any, step: int) -> bool:
        """Whether a replacement is ready to join after ``step`` (read at a round's last step only)."""
        return self.ends(step) and bool(quorum.join_pending())

    def attempt(self, job: Any, batch: Any, attempt: Callable[[Any], float]) -> float:
        """The engine's attempt at ``batch``; after a round's last step, the fault phase ``commit`` and the
        re-form for a replacement that was ready."""
        if job.step >= self.batch_step:  # committed, then an error after the vote: nothing to redo
            return self.batch_loss
        self.batch_loss = attempt(batch)
        if self.ends(job.step):
            fault_point(job.step, "commit")
            if self.join_after:
                self.join_after = False
                reform(job, job.guard.quorum)
        return self.batch_loss

    def adopt_epoch(self, job: Any, attempt: Callable[[Any], float]) -> None:
        """Back to the round's start, equal to a live member's round-start state, then the round's earlier
        batches again, divided among the new members (the engine then retries the batch being trained)."""
        self.join_after = False  # whoever was ready joins this epoch
        if self.snapshot is not None:
            state, rng = self.snapshot
            torch.set_rng_state(rng)
            job.load_state_dict(state)  # which takes the next snapshot (`take_snapshot`): no copy shared
        take_live_state(job)
        self.take_snapshot(job)
        for batch in self.batches[:-1]:
            attempt(batch)

    def take_snapshot(self, job: Any) -> None:
        self.snapshot = (copy.deepcopy(job.state_dict()), torch.get_rng_state())
        self.held.clear()

    def commit(self, state: StepState) -> bool:
        """The engine's per-step vote: inner steps go through; the round's vote follows its synchronization."""
        if not self.ends(state.number):
            fault_point(state.number, "after")
        return True

    def end_step(self, job: Any, state: StepState, synchronize: Callable[[], None]) -> None:
        """At a round's last step: ``synchronize`` (the strategy's own exchange), vote (any error votes drop), and
        on commit write the round's records and take the next snapshot."""
        if not self.ends(state.number):
            return
        step, quorum = state.number, job.quorum
        try:
            synchronize()
            fault_point(step, "after")
            committed = quorum.vote(step, ok=True)
        except Exception:
            job.step = step - 1  # not committed (the engine names the step it drops)
            with contextlib.suppress(Exception):  # the others learn of it: a verdict, or our silence
                quorum.vote(step, ok=False)
            raise
        if not committed:
            job.step = step - 1
            raise StepDropped(f"the round ending at step {step}: a member failed it; no member applied it")
        for args, extra in self.held:
            job.metrics.record(*args, **extra)
        self.take_snapshot(job)
        self.batches.clear()
        self.join_after = bool(state.work.get("pending"))

    def record(self, job: Any, state: StepState, **fields: Any) -> None:
        """The engine's record with its phase times, held until the round commits for the round's inner steps."""
        phases = dict(zip(("data_s", "compute_s", "comm_s", "optimizer_s"), state.phases or (), strict=False))
        extra = {**phases, **fields, **({"skipped": True} if state.skipped else {})}
        args = (state.number, time.perf_counter() - state.started, state.local, state.total or 0, state.loss)
        if self.ends(state.number):
            job.metrics.record(*args, **extra)
        else:
            self.held.append((args, extra))

    def refuse_mid_round(self, job: Any) -> None:
        """`synchronize` between round boundaries: a synchronization outside a round could not be dropped and
        redone. At a boundary every member holds the synchronized state already."""
        if job.step % self.sync_every:
            raise ValueError(
                f"rank {job.topology.rank}: synchronize() at step {job.step} under --on-worker-failure heal: "
                f"a round ends every sync_every={self.sync_every} steps, and only a whole round is committed. "
                f"HINT: train a multiple of {self.sync_every} steps (the replicas are synchronized then)"
            )
