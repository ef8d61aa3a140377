"""A step under healing (``--on-worker-failure heal``, `loom.fault.quorum`): retried until a membership epoch
applies it. An exception anywhere in a step or a commit vote that says drop means that no member applied it: the
members re-form (`reform`) and retry the same global batch, up to `MAX_DROPS` times in a row. Part of the step
engine, in a file of its own because a step without healing never enters it.
"""

from __future__ import annotations

import contextlib
import sys
from typing import TYPE_CHECKING, Any

from loom.errors import LeftOutOfQuorum, StepDropped, is_retryable
from loom.fault.desync import NonFiniteStepError

if TYPE_CHECKING:
    from loom.fault.quorum import Quorum
    from loom.train.engine import Engine

__all__ = ["MAX_DROPS", "reform", "retry_step"]

MAX_DROPS = 5
"""Under healing, a step dropped this many times in a row (each time by a newly formed quorum) raises."""


def retry_step(job: Engine, quorum: Quorum, batch: Any) -> float:
    """``job``'s step on ``batch`` (its ``_attempt``), retried after each drop in a newly formed epoch; a step
    that the vote had committed when this member failed is not trained again."""
    number, drops = job.step + 1, 0
    job._wait_for_joiner()
    while True:
        try:
            return job._attempt(batch)
        except (LeftOutOfQuorum, NonFiniteStepError):
            raise  # left out: this process ends; non-finite under "stop": every member raises the same
        except Exception as error:
            if not is_retryable(error):  # `loom.errors.LoomError.retryable`: the retry would meet it again
                raise
            drops += 1
            committed = quorum.committed >= number
            if not committed and not isinstance(error, StepDropped):
                with contextlib.suppress(Exception):  # the others learn of it: a verdict, or our silence
                    quorum.vote(number, ok=False)
            if drops > MAX_DROPS:
                raise
            what = "failed after its commit" if committed else "dropped"
            print(f"loom: rank {job.topology.rank}: step {number} {what} in epoch {quorum.epoch} "
                  f"({_collective_cause(error)}); re-forming the quorum", file=sys.stderr, flush=True)  # fmt: skip
        # outside the except block: the error's traceback holds the frames that hold the epoch's group, and
        # the group closes its connections only once nothing holds it (`Quorum._abandon_group`)
        reform(job, quorum)
        synced = job._last_synchronized
        if job.step >= number and synced is not None and synced.number == number:
            # committed before this member failed: re-forming made it equal to a member that holds the step,
            # and training the batch again would count it twice. Its record is written if the error came first
            if job._last_recorded_step < number:
                job._record(synced)
                job._last_recorded_step = number
            return synced.loss


def reform(job: Engine, quorum: Quorum) -> None:
    """Check in for the next membership epoch and make its members equal (``job._adopt_epoch``); a failure while
    doing so (a member lost meanwhile, while the epoch's group formed or the sending peer) checks in again."""
    for _ in range(MAX_DROPS + 1):
        try:
            # (`loom.errors.EpochNotFormed`: a member lost while the epoch's group formed)
            quorum.reform(job.step)
            job._adopt_epoch()
            return
        except Exception as error:
            if not is_retryable(error):
                raise  # (`loom.errors.HealConflict`: re-forming would meet it again)
            print(f"loom: rank {job.topology.rank}: epoch {quorum.epoch} failed while forming ({error}); "
                  "re-forming", file=sys.stderr, flush=True)  # fmt: skip
    raise RuntimeError(f"rank {job.topology.rank}: no membership epoch formed in {MAX_DROPS + 1} tries")


def _collective_cause(error: BaseException) -> str:
    """``Type: message`` of the error a collective of a membership epoch's group met. torch's logging wrapper of
    the collectives (``c10d_logger``), on the way out of a failed one, asks for the group's backend, which only
    groups in torch's own registry have: an epoch's group is not, so its timeout arrives as a ValueError whose
    context is the real error (gloo's "Timed out waiting ... for recv"). A string, not the error: nothing may
    keep the error's frames, which hold the epoch's group, past the except block (`retry_step`)."""
    context = error.__context__
    if isinstance(error, ValueError) and "not initialized in the world" in str(error) and context is not None:
        error = context
    return f"{type(error).__name__}: {str(error)[:160]}"
