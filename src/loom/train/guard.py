"""The guard of a training step, built the same way for every strategy's job so that its guarantees are written
once: `GuardOptions` (the options every strategy's config inherits, validated here) and `StepGuard`, started by
every job's construction: the hang watchdog over its collectives (`loom.fault.watchdog`), the non-finite verdict,
the same on every rank (`loom.fault.desync.NonFiniteGuard`), and under heal the commit vote (`loom.fault.quorum`).
The step calls those owners directly (`loom.train.engine`): this module builds them, it is not a layer.

The flags ride on a collective the step runs anyway (the loss all-reduce, the pipeline's loss gather, a parameter
server's reply), so guarding a step costs no extra collective. An option a strategy cannot honour is refused at
construction, naming what to use instead (`loom.train.options.refuse_options`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from loom.fault.desync import NonFiniteGuard
from loom.fault.inject import fault_point
from loom.fault.quorum import Quorum
from loom.fault.timeouts import hang_timeout_s, liveness_timeout_s, work_timeout_s
from loom.fault.watchdog import Watchdog
from loom.topology import Topology

__all__ = ["GuardOptions", "StepGuard"]


@dataclass(frozen=True, kw_only=True)
class GuardOptions:
    """The step guard's options, shared by every strategy's config (keyword-only). The three timeouts and what
    each covers: docs/fault-tolerance.md, "Slow, stuck or gone"."""

    hang_timeout_s: float | None = None
    """Seconds every rank may spend inside collectives with none completing before the job stops, naming who did
    not arrive (`loom.fault.watchdog`); None: ``LOOM_HANG_TIMEOUT_S``, else 180."""
    work_timeout_s: float | None = None
    """Seconds the others wait in a collective for a rank doing its own work outside collectives before the job
    stops, naming it; None: ``LOOM_WORK_TIMEOUT_S``, else 1800 (PyTorch's gloo default)."""
    liveness_timeout_s: float | None = None
    """Seconds a host may send no heartbeat (a dead link, a partition, a dead machine) before the ranks on both
    sides stop, naming the other side (`loom.fault.liveness`); None: ``LOOM_LIVENESS_TIMEOUT_S``, else 20."""
    nonfinite: str = "skip"
    """A step whose loss or gradient is NaN or infinite on any rank is never applied: ``"skip"`` counts it
    (``job.skipped_steps``, ``skipped`` in its record), ``"stop"`` raises `NonFiniteStepError` naming the ranks."""
    nonfinite_limit: int = 5
    """Under ``"skip"``, this many non-finite steps in a row stop the job (naming the ranks) all the same."""

    def __post_init__(self) -> None:
        if self.hang_timeout_s is not None:
            hang_timeout_s(self.hang_timeout_s)
        if self.work_timeout_s is not None:
            work_timeout_s(self.work_timeout_s)
        if self.liveness_timeout_s is not None:
            liveness_timeout_s(self.liveness_timeout_s)
        NonFiniteGuard(self.nonfinite, self.nonfinite_limit)  # its __post_init__ checks the policy and limit


def set_timeouts(options: GuardOptions) -> tuple[float | None, float | None, float | None]:
    """The hang, work and liveness timeouts the user set (the option, else its ``LOOM_*`` variable), each None
    where neither is set: under heal those keep heal's own defaults."""

    def given(value: float | None, variable: str, resolve: Callable[[float | None], float]) -> float | None:
        return resolve(value) if value is not None or os.environ.get(variable) else None

    return (
        given(options.hang_timeout_s, "LOOM_HANG_TIMEOUT_S", hang_timeout_s),
        given(options.work_timeout_s, "LOOM_WORK_TIMEOUT_S", work_timeout_s),
        given(options.liveness_timeout_s, "LOOM_LIVENESS_TIMEOUT_S", liveness_timeout_s),
    )


class StepGuard:
    """The hang watchdog and the non-finite verdict of one job (see the module docstring)."""

    def __init__(self, watchdog: Watchdog, nonfinite: NonFiniteGuard, quorum: Quorum | None = None) -> None:
        self.watchdog = watchdog
        self.nonfinite = nonfinite
        self.quorum = quorum
        """Set under ``--on-worker-failure heal`` (`loom.fault.quorum`): the step's commit vote."""

    def commit(self, step: int) -> bool:
        """The commit vote on step ``step``, after its exchange and its non-finite verdict: True when every
        member of the quorum finished it (then each applies it, or skips it by the same verdict); False: none
        does. Without healing there is nothing to vote on (a failed collective raised already)."""
        if self.quorum is None:
            return True
        fault_point(step, "after")
        verdict = self.quorum.vote(step, ok=True)
        if verdict:
            fault_point(step, "commit")
        return verdict

    @classmethod
    def start(cls, topology: Topology, options: GuardOptions, quorum: Quorum | None = None) -> StepGuard:
        """The guard of a job on ``topology``: a watchdog thread when there are peers to wait for (one process
        only counts), and the non-finite policy of ``options``. With a ``quorum`` (heal) it holds the commit vote,
        and the timeouts the user set go to `loom.fault.quorum.Quorum.apply_guard`."""
        hang, work, liveness = options.hang_timeout_s, options.work_timeout_s, options.liveness_timeout_s
        if topology.is_distributed or quorum is not None:
            watchdog = Watchdog.start(topology, hang, work, liveness, quorum)
        else:  # nobody to wait for: it only counts (the constructor resolves and checks the timeouts)
            watchdog = Watchdog(topology.rank, topology.world_size, hang, None, work, liveness)
        if quorum is not None:
            quorum.apply_guard(*set_timeouts(options))
        nonfinite = NonFiniteGuard(options.nonfinite, options.nonfinite_limit, topology.rank)
        return cls(watchdog, nonfinite, quorum)
