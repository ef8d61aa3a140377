"""Straggler detection on rank 0, from every rank's phase times of each step.

In synchronous training every rank's *step* time is the same: the fast ranks wait for the slow one inside the
gradient all-reduce. So the slow rank is found by its *busy* time, ``data + compute + optimizer`` (the step
without the time blocked in communication), compared with the median over ranks. Each rank's phase times are
taken as their median over a window of steps, not their mean, so a rank counts as slow only when it is slow in
most steps of the window: work outside steps, such as rank 0 evaluating or writing a checkpoint alone (which
lands in its *data* phase, the gap since its previous step, and in the others' *comm* phase of the next step),
is one step in a window and raises no alarm however long it takes. The phase named is the one whose time exceeds that phase's median by the
most. Communication is named when a rank's own communication time stands out while its busy time is not below
the median (a rank that merely waits for a slower peer shows a long communication time too, but a short busy
time) — this is what a slow link looks like for point-to-point traffic (push/pull to parameter servers).

The phase times arrive without an extra collective: `loom.observe.phases` piggybacks them on the loss
all-reduce the strategy already does, one step late.

Configuration: `StragglerConfig`, or the environment variables ``LOOM_STRAGGLER_MARGIN`` (fraction over the
median, default 0.2), ``LOOM_STRAGGLER_WINDOW`` (steps, default 10) and ``LOOM_STRAGGLER_MIN_MS`` (an absolute
floor on the excess, default 2 ms, so microsecond jitter on tiny steps is not reported).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["PHASES", "StragglerConfig", "StragglerDetector", "StragglerWarning"]

PHASES = ("data", "compute", "comm", "optimizer")
"""Phase names in the order strategies report them (the columns of a row of phase times)."""


@dataclass(frozen=True)
class StragglerConfig:
    """When a rank counts as a straggler."""

    margin: float = 0.2
    """How much slower than the median a rank's busy time must be, as a fraction (0.2 = 20 %)."""
    window: int = 10
    """Steps averaged before judging; a warning needs the rank to stay slow over a whole window."""
    min_excess_s: float = 0.002
    """Absolute floor on the excess over the median, in seconds."""

    def __post_init__(self) -> None:
        if not self.margin >= 0:
            raise ValueError(f"straggler margin must be >= 0, got {self.margin!r}")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"straggler window must be an int >= 1, got {self.window!r}")
        if not self.min_excess_s >= 0:
            raise ValueError(f"straggler min_excess_s must be >= 0, got {self.min_excess_s!r}")

    @classmethod
    def from_env(cls) -> StragglerConfig:
        """Defaults overridden by ``LOOM_STRAGGLER_MARGIN``, ``LOOM_STRAGGLER_WINDOW``, ``LOOM_STRAGGLER_MIN_MS``."""
        env = os.environ
        try:
            return cls(
                margin=float(env.get("LOOM_STRAGGLER_MARGIN", cls.margin)),
                window=int(env.get("LOOM_STRAGGLER_WINDOW", cls.window)),
                min_excess_s=float(env.get("LOOM_STRAGGLER_MIN_MS", cls.min_excess_s * 1e3)) / 1e3,
            )
        except ValueError as error:
            raise ValueError(f"{error}. HINT: check the LOOM_STRAGGLER_* environment variables") from None


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
    """Feed one ``[world_size x 4]`` table of phase times per step to `observe`; it returns new warnings."""

    def __init__(self, world_size: int, config: StragglerConfig | None = None) -> None:
        self.world_size = world_size
        self.config = config if config is not None else StragglerConfig()
        self.every = max(1, (self.config.window + 1) // 2)
        """Judge every this many steps (half a window): a step only appends its row, keeping rank 0's per-step
        cost to a few microseconds; a warning comes at most ``every - 1`` steps later than a per-step check."""
        self._window = np.zeros((self.config.window, world_size, 4))
        """The last ``window`` steps' tables, a ring (row ``seen % window`` is the newest)."""
        self._seen = 0
        self._flagged: set[tuple[int, str]] = set()
        self.warnings: list[StragglerWarning] = []
        """Every warning raised so far."""
        self.slowest: tuple[int, str, float] | None = None
        """(rank, phase, seconds over the median busy time) over the window at the last judgement."""

    def observe(self, step: int, times: Any) -> list[StragglerWarning]:
        """Add the phase times of ``step`` (row r: rank r's data, compute, comm, optimizer seconds; a sequence of
        rows or a ``[world_size, 4]`` array). Rank 0 calls this every step, so it is one array copy; every
        `every` steps the window's medians are one sort (a Python median per rank and phase cost 10x more at
        16 ranks)."""
        if len(times) != self.world_size:
            raise ValueError(f"expected phase times of {self.world_size} ranks, got {len(times)}")
        window = self.config.window
        self._window[self._seen % window] = times  # numpy refuses a row that is not 4 values
        self._seen += 1
        if (self._seen - min(self._seen, window)) % self.every:
            return []
        n = min(self._seen, window)
        # per rank, per phase: the median over the window (robust to one long step; see the module docstring);
        # np.sort and the middle row(s): np.median's generality costs 6x more on a table this small
        ordered = np.sort(self._window[:n], axis=0)
        medians = ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
        return self.judge(step, medians.tolist(), full=n >= window)

    def judge(self, step: int, means: Sequence[Sequence[float]], full: bool = True) -> list[StragglerWarning]:
        """Judge one table of every rank's typical phase times (row r: rank r's median data, compute, comm,
        optimizer seconds over a window); ``full``: the window is complete (before that only ``slowest`` is
        updated). `observe` calls it every half window; `loom.observe.straggler_watch` with windows that each
        rank summarized itself."""
        n = self.config.window
        medians = [_median([m[p] for m in means]) for p in range(4)]
        busy = [m[0] + m[1] + m[3] for m in means]
        median_busy = _median(busy)
        slow = max(range(self.world_size), key=lambda r: busy[r])
        self.slowest = (slow, _slowest_phase(means[slow], medians), busy[slow] - median_busy)
        if not full or self.world_size < 2:
            return []
        new = []
        for rank in range(self.world_size):
            for phase, rank_s, median_s in self._suspects(rank, means, medians, busy, median_busy):
                if (rank, phase) not in self._flagged:
                    self._flagged.add((rank, phase))
                    new.append(StragglerWarning(step, rank, phase, rank_s, median_s, n))
            if not self._suspects(rank, means, medians, busy, median_busy):  # recovered: re-arm its warnings
                self._flagged = {f for f in self._flagged if f[0] != rank}
        self.warnings.extend(new)
        return new

    def _suspects(
        self,
        rank: int,
        means: Sequence[Sequence[float]],
        medians: list[float],
        busy: list[float],
        median_busy: float,
    ) -> list[tuple[str, float, float]]:
        cfg = self.config
        found = []
        if _exceeds(busy[rank], median_busy, cfg):
            found.append((_slowest_phase(means[rank], medians), busy[rank], median_busy))
        comm, median_comm = means[rank][2], medians[2]
        if busy[rank] >= median_busy and _exceeds(comm, median_comm, cfg):
            found.append(("comm", comm, median_comm))
        return found


def _median(values: list[float]) -> float:
    """The median (statistics.median is 5x slower)."""
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _exceeds(value: float, median: float, cfg: StragglerConfig) -> bool:
    return value > median * (1 + cfg.margin) and value - median > cfg.min_excess_s


def _slowest_phase(row: Sequence[float], medians: Sequence[float]) -> str:
    """The busy phase of ``row`` furthest above its median: data or compute (optimizer time counts as compute)."""
    data = row[0] - medians[0]
    compute = row[1] + row[3] - medians[1] - medians[3]
    return "data" if data >= compute else "compute"
