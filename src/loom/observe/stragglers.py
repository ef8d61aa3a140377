"""Straggler detection on rank 0, from every rank's typical phase times over a window of steps.

In synchronous training every rank's *step* time is the same: the fast ranks wait for the slow one inside the
gradient all-reduce. So the slow rank is found by its *busy* time, ``data + compute + optimizer`` (the step
without the time blocked in communication), against the median over ranks. Each rank's phase times are their
median over a window of steps, not their mean, so a rank counts as slow only when it is slow in most steps of
the window: work outside steps (rank 0 alone evaluating or writing a checkpoint) is one step in a window and
raises no alarm however long it takes. Communication is named when a rank's own communication time stands out
while its busy time is not below the median (a rank merely waiting for a slower peer has a short busy time):
what a slow link looks like for point-to-point traffic (push/pull to parameter servers). The thresholds:
`StragglerConfig` (``LOOM_STRAGGLER_*``, docs/settings.md); its absolute floor keeps microsecond jitter on tiny
steps from being reported.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from statistics import median

from loom.errors import check_int
from loom.settings import setting

__all__ = ["PHASES", "StragglerConfig", "StragglerDetector", "StragglerWarning"]

PHASES = ("data", "compute", "comm", "optimizer")
"""Phase names in the order strategies report them (the columns of a row of phase times)."""


@dataclass(frozen=True)
class StragglerConfig:
    """When a rank counts as a straggler."""

    margin: float = 0.2
    """How much slower than the median a rank's busy time must be, as a fraction (0.2 = 20 %)."""
    window: int = 10
    """Steps whose median phase times are judged; a warning needs the rank to stay slow over most of a window."""
    min_excess_s: float = 0.002
    """Absolute floor on the excess over the median, in seconds."""

    def __post_init__(self) -> None:
        for name, value in (("margin", self.margin), ("min_excess_s", self.min_excess_s)):
            if not value >= 0:  # NaN too
                raise ValueError(f"straggler {name} must be >= 0, got {value!r}")
        check_int("straggler window", self.window)

    @classmethod
    def from_env(cls) -> StragglerConfig:
        """``LOOM_STRAGGLER_MARGIN``, ``LOOM_STRAGGLER_WINDOW`` and ``LOOM_STRAGGLER_MIN_MS`` as `loom.settings`
        reads them (with this class's defaults; a bad value is refused there, naming the variable and the fix)."""
        margin, window, min_ms = (setting(f"LOOM_STRAGGLER_{n}") for n in ("MARGIN", "WINDOW", "MIN_MS"))
        return cls(margin, window, min_ms / 1e3)


@dataclass(frozen=True)
class StragglerWarning:
    """A rank that stayed slower than the median over a window of steps, and its slow phase."""

    step: int
    rank: int
    phase: str
    """``data``, ``compute``, ``comm`` or ``optimizer``."""
    rank_s: float
    """The rank's typical time per step, the median over the window (busy time, or communication time when
    ``phase`` is ``comm``)."""
    median_s: float
    """The median over ranks of the same quantity."""
    window: int

    def message(self) -> str:
        what = "communication" if self.phase == "comm" else "busy (data + compute + optimizer)"
        return (
            f"loom: straggler: rank {self.rank} is slower than the median by "
            f"{(self.rank_s - self.median_s) * 1e3:.1f} ms/step over the last {self.window} steps "
            f"(step {self.step}; {what} {self.rank_s * 1e3:.1f} ms vs median {self.median_s * 1e3:.1f} ms); "
            f"slow phase: {self.phase}"
        )


class StragglerDetector:
    """Give `judge` one table of every rank's typical phase times at a time; it returns the new warnings."""

    def __init__(self, config: StragglerConfig | None = None) -> None:
        if config is not None and not isinstance(config, StragglerConfig):
            raise TypeError(f"StragglerDetector takes a StragglerConfig or None, got {config!r}")
        self.config = config if config is not None else StragglerConfig()
        self._flagged: set[tuple[int, str]] = set()
        self.slowest: tuple[int, str, float] | None = None
        """(rank, phase, seconds over the median busy time) over the window at the last judgement."""

    def judge(self, step: int, means: Sequence[Sequence[float]]) -> list[StragglerWarning]:
        """Judge one table of every rank's typical phase times (row r: rank r's median data, compute, comm,
        optimizer seconds over a full window, as `loom.observe.straggler_watch` summarizes it on each rank)."""
        medians = [median(m[p] for m in means) for p in range(4)]
        busy = [m[0] + m[1] + m[3] for m in means]
        median_busy = median(busy)
        slow = max(range(len(means)), key=lambda r: busy[r])
        self.slowest = (slow, _slowest_phase(means[slow], medians), busy[slow] - median_busy)
        new = []  # one rank alone is its own median: never above it
        for rank in range(len(means)):
            suspects = []  # (phase, the rank's seconds, the median's)
            if _exceeds(busy[rank], median_busy, self.config):
                suspects.append((_slowest_phase(means[rank], medians), busy[rank], median_busy))
            if busy[rank] >= median_busy and _exceeds(means[rank][2], medians[2], self.config):
                suspects.append(("comm", means[rank][2], medians[2]))
            for phase, rank_s, median_s in suspects:
                if (rank, phase) not in self._flagged:
                    self._flagged.add((rank, phase))
                    new.append(StragglerWarning(step, rank, phase, rank_s, median_s, self.config.window))
            if not suspects:  # recovered: re-arm its warnings
                self._flagged = {f for f in self._flagged if f[0] != rank}
        return new


def _exceeds(value: float, median: float, cfg: StragglerConfig) -> bool:
    return value > median * (1 + cfg.margin) and value - median > cfg.min_excess_s


def _slowest_phase(row: Sequence[float], medians: Sequence[float]) -> str:
    """The busy phase of ``row`` furthest above its median: data or compute (optimizer time counts as compute)."""
    data = row[0] - medians[0]
    compute = row[1] + row[3] - medians[1] - medians[3]
    return "data" if data >= compute else "compute"
