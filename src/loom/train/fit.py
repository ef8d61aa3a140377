"""`fit`: the training loop, with checkpoints, automatic resume, progress and an LR schedule (an example:
docs/concepts.md, "Training with loom.fit").

Run again after a crash (or restarted by ``loom run --max-restarts``), `fit` continues from the newest intact
checkpoint with the job, the loader's position in global samples, the LR scheduler, every rank's RNG state and the
loop's counters restored, so it takes the same steps on the same samples as an uninterrupted run. ``steps`` and
``epochs`` are totals for the run, not for this call. `fit` uses only the `loom.job.Job` contract, so every
strategy's job runs here; what a checkpoint holds and who writes it: `loom.train.fit_checkpoint`.

Limits: ``checkpoint_dir`` must be storage every rank sees (a shared filesystem across hosts). Jobs whose state
differs per rank (pipeline stages, tensor shards) resume at the world size and mesh that wrote them unless they
reshard. RNG states are restored exactly at the same world size; after a resize rank r takes saved rank
``r mod old_world_size``'s (resizing and ``scale_lr_with_world_size``: `loom.fault.resize`). With
``async_checkpoint=True`` a checkpoint is durable only once the next one starts or `fit` returns.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loom.errors import check_int
from loom.fault.desync import check_replicas_agree
from loom.job import Job
from loom.observe.progress import ProgressBar
from loom.observe.trackers import FitTrackers
from loom.train.fit_checkpoint import FitCheckpointer
from loom.train.fit_resume import resume_fit

if TYPE_CHECKING:
    from collections.abc import Sequence

    from loom.observe.trackers import Tracker

__all__ = ["DESYNC_EVERY", "FitResult", "fit"]

DESYNC_EVERY = 100
"""Default interval, in steps, of the parameter check across replicas (`check_replicas_agree`: a pass over the
parameters, an all-gather of 8 bytes per tensor; ``loom_bench.nonfinite_cost`` measures its cost)."""


@dataclass(frozen=True)
class FitResult:
    """What `fit` did."""

    steps: int
    """Optimizer steps of the whole run so far (including those before a resume)."""
    epochs: int
    """Epochs completed in the whole run."""
    last_loss: float | None
    """The loss the job's train_step returned at the last step: the global-batch loss, or this replica's own for
    jobs without one (Gossip) (None if the run has taken no step)."""
    resumed_from: int | None
    """Step of the checkpoint this call resumed from, or None if it started fresh."""
    steps_run: int
    """Steps taken by this call."""
    skipped_steps: int = 0
    """Steps of this call whose update the job did not apply (a non-finite loss or gradient on some rank)."""
    loss_scope: str = "global"
    """What ``last_loss`` is: the global batch's (``"global"``) or this replica's own (``"replica"``), as the
    job's `loom.job.Job.loss_scope` says."""


def _lacking(obj: Any, *methods: str) -> list[str]:
    return [m for m in methods if not callable(getattr(obj, m, None))]


def _validate(
    job, loader, epochs, steps, checkpoint_dir, checkpoint_every, keep, async_checkpoint, scheduler, log_every
) -> None:
    if (epochs is None) == (steps is None):
        raise ValueError(
            f"pass exactly one of epochs= or steps=, got epochs={epochs!r}, steps={steps!r}. "
            "HINT: steps counts optimizer steps, epochs full passes over the data; both are totals for the run."
        )
    check_int("epochs", epochs, optional=True)
    check_int("steps", steps, optional=True)
    check_int("checkpoint_every", checkpoint_every)
    check_int("keep", keep)
    check_int("log_every", log_every, optional=True)
    if not isinstance(job, Job):
        raise TypeError(
            f"fit() expects a job from a strategy's setup() (a loom.job.Job), got {type(job).__name__}. "
            "HINT: job = loom.DataParallel().setup(model, optimizer, loss_fn)."
        )
    if not hasattr(loader, "__iter__"):
        raise TypeError(f"loader must be iterable, got {type(loader).__name__}")
    if scheduler is not None and (lacking := _lacking(scheduler, "step", "state_dict", "load_state_dict")):
        raise TypeError(f"lr_scheduler {type(scheduler).__name__} lacks {lacking}; pass a torch LR scheduler")
    if checkpoint_dir is None:
        if async_checkpoint:
            raise ValueError("async_checkpoint=True needs a checkpoint_dir")
        return
    if _lacking(loader, "state_dict", "load_state_dict"):
        raise TypeError(
            f"checkpointing needs a loader with state_dict()/load_state_dict() to resume its position; "
            f"{type(loader).__name__} has none. HINT: use loom.data.loader(dataset, global_batch_size)."
        )


@dataclass
class _Position:
    """Where the loop stands; saved in every checkpoint under ``"fit"``."""

    step: int
    epoch: int
    epoch_step: int = 0
    """Batches of ``epoch`` taken so far."""
    last_loss: float | None = None


def _len(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None


@dataclass
class _Loop:
    job: Any
    loader: Any
    scheduler: Any
    checkpointer: FitCheckpointer | None
    checkpoint_every: int
    epochs: int | None
    steps: int | None
    log_every: int | None
    desync_every: int
    trackers: FitTrackers
    skipped: int = 0

    def loop_state(self, at: _Position) -> dict[str, Any]:
        """What a checkpoint keeps of the loop: its position, and the trackers' runs when there are any."""
        return dict(asdict(at), trackers=self.trackers.states()) if self.trackers else asdict(at)

    def finished(self, at: _Position) -> bool:
        """True when ``at`` has reached the goal (``steps`` or ``epochs``): `run` would take no step."""
        return (self.steps is not None and at.step >= self.steps) or (
            self.epochs is not None and at.epoch >= self.epochs
        )

    def steps_left(self, at: _Position) -> int | None:
        if self.steps is not None:
            return self.steps - at.step
        per_epoch = _len(self.loader)
        if per_epoch is None or self.epochs is None:
            return None
        return max(per_epoch * (self.epochs - at.epoch) - at.epoch_step, 0)

    def run(self, at: _Position, bar: ProgressBar) -> None:
        empty_passes, started, first = 0, time.perf_counter(), at.step
        while not self.finished(at):
            if callable(getattr(self.loader, "set_epoch", None)):
                self.loader.set_epoch(at.epoch)  # a no-op when resuming inside this epoch
            taken = 0
            for batch in self.loader:
                at.last_loss = float(self.job.train_step(batch))
                if self.scheduler is not None:
                    self.scheduler.step()
                at.step, at.epoch_step, taken = at.step + 1, at.epoch_step + 1, taken + 1
                self._report(at, bar, (at.step - first) / (time.perf_counter() - started))
                self.trackers.log(self.job, at.last_loss, at.epoch, at.step)
                if self.job.last_step_skipped:  # a non-finite step: no update was applied
                    self.skipped += 1
                self.check_and_save(
                    at, self.checkpointer is not None and at.step % self.checkpoint_every == 0
                )
                if self.steps is not None and at.step >= self.steps:
                    break
            else:
                at.epoch, at.epoch_step = at.epoch + 1, 0
            # One empty pass is normal after resuming from the last batch of an epoch; two mean no data.
            empty_passes = empty_passes + 1 if taken == 0 else 0
            if empty_passes >= 2:
                raise ValueError(
                    f"the loader yielded no batch in epochs {at.epoch - 2} and {at.epoch - 1}. "
                    "HINT: check that the dataset is not empty (or smaller than the batch with drop_last)."
                )

    def check_and_save(self, at: _Position, saving: bool) -> None:
        """The desync check when due (also before every checkpoint, so that none saves a desynchronized state),
        then the checkpoint of ``at`` when ``saving``."""
        due = bool(self.desync_every) and (at.step % self.desync_every == 0 or saving)
        if due and self.job.replicas_agree and self.job.mesh.group("dp") is not None:
            check_replicas_agree(self.job.module, self.job.mesh.group("dp"), step=at.step)
        if saving:
            self.checkpointer.save(at.step, self.loop_state(at))  # type: ignore[union-attr]

    def _report(self, at: _Position, bar: ProgressBar, steps_per_s: float) -> None:
        # "replica loss" for a job whose `train_step` returns its replica's own
        where = f"step {at.step} epoch {at.epoch} {'' if self.job.loss_scope == 'global' else 'replica '}loss"
        bar.advance(info=f"{where} {at.last_loss:.4f}")
        if self.log_every is not None and self.job.topology.is_main and at.step % self.log_every == 0:
            print(f"{where} {at.last_loss:.6g} ({steps_per_s:.2f} steps/s)", flush=True)

    def completed_epochs(self, at: _Position) -> int:
        """Epochs done, counting one whose last batch was taken though its iterator was not run to the end."""
        per_epoch = _len(self.loader)
        return at.epoch + 1 if per_epoch is not None and 0 < per_epoch <= at.epoch_step else at.epoch


def fit(
    job: Any,
    loader: Any,
    *,
    epochs: int | None = None,
    steps: int | None = None,
    checkpoint_dir: str | Path | None = None,
    checkpoint_every: int = 100,
    keep: int = 3,
    async_checkpoint: bool = False,
    lr_scheduler: Any = None,
    log_every: int | None = None,
    progress: bool = True,
    scale_lr_with_world_size: bool = False,
    desync_every: int = DESYNC_EVERY,
    trackers: Sequence[Tracker] | None = None,
) -> FitResult:
    """Train ``job`` on ``loader`` until the run has taken ``steps`` steps or completed ``epochs`` epochs.

    ``checkpoint_dir``: resume from it when it holds a checkpoint, save into it every ``checkpoint_every``
    steps and at the end, keeping the newest ``keep``; ``async_checkpoint`` writes them in the background.
    ``lr_scheduler`` is stepped after every optimizer step and checkpointed. ``log_every``: the main process
    prints a line every so many steps. ``progress``: show a progress bar on the main process.
    ``scale_lr_with_world_size``: on resume at another world size, multiply the learning rates by new / saved
    world size (for jobs whose global batch grows with the workers). ``desync_every``: every so many steps,
    and before each checkpoint, check that the replicas' parameters are bitwise equal (0: never; one small
    all-gather per check; skipped for jobs whose ``replicas_agree`` is False). ``trackers``: experiment
    trackers the main process logs each step to, without a collective (docs/trackers.md); their runs are kept in
    the checkpoints, so a resumed fit continues them, each step logged once.
    Without a checkpoint, counting starts at the job's ``step`` and the loader's ``epoch`` (0 for fresh ones).
    """
    _validate(job, loader, epochs, steps, checkpoint_dir, checkpoint_every, keep, async_checkpoint,
              lr_scheduler, log_every)  # fmt: skip
    check_int("desync_every", desync_every, 0, hint="0 never checks")
    tracking = FitTrackers(trackers, job.topology.is_main)
    at = _Position(int(getattr(job, "step", 0)), int(getattr(loader, "epoch", 0)))
    resumed_from, checkpointer, saved_trackers = None, None, None
    if checkpoint_dir is not None:
        directory = Path(checkpoint_dir)
        checkpointer = FitCheckpointer(job, loader, lr_scheduler, directory, keep, async_checkpoint)
        # a healing job's checkpoints are one member's, without collectives (`DataParallelJob.checkpoint_topology`),
        # and a replacement that joined a running job holds a live member's state, newer than any checkpoint
        resumed = None if getattr(job, "joined_running", False) else resume_fit(
            job, loader, lr_scheduler, directory, checkpointer.topo, scale_lr_with_world_size
        )  # fmt: skip
        if resumed is not None:
            resumed_from, saved = resumed
            at = _Position(resumed_from, saved["epoch"], saved["epoch_step"], saved["last_loss"])
            saved_trackers = saved.get("trackers")
        checkpointer.saved_step = resumed_from
    loop = _Loop(job, loader, lr_scheduler, checkpointer, checkpoint_every, epochs, steps, log_every, desync_every,
                 tracking)  # fmt: skip
    first_step, left = at.step, loop.steps_left(at)
    goal = f"step {steps}" if steps is not None else f"epoch {epochs}"
    if resumed_from is not None and job.topology.is_main:
        # a finished run resumed trains nothing: say so plainly (the README's example, run twice, did silently)
        done = (
            f": the run already reached {goal}, nothing left to train; delete {checkpoint_dir} to start again"
        )
        print(f"loom.fit: resumed from the checkpoint of step {resumed_from} in {checkpoint_dir}"
              f"{done if loop.finished(at) else ''}", file=sys.stderr, flush=True)  # fmt: skip
    show = progress and job.topology.is_main and left is not None
    try:
        tracking.open(saved_trackers, at.step)
        with ProgressBar(left or 0, f"fit to {goal}", enabled=show) as bar:
            loop.run(at, bar)
        if checkpointer is not None:
            if at.step != checkpointer.saved_step and at.step > first_step:
                loop.check_and_save(at, saving=True)
            checkpointer.finish()
    except BaseException:
        if checkpointer is not None:
            checkpointer.abandon()
        tracking.close(failed=True)
        raise
    tracking.close()
    return FitResult(
        at.step, loop.completed_epochs(at), at.last_loss, resumed_from, at.step - first_step, loop.skipped,
        job.loss_scope,
    )  # fmt: skip
