"""How much of the machine other processes used while the demo ran one of its halves.

The demo's speed-up divides the 2-worker half's samples/s by the one-process half's; on a machine busy with
other work one half can run beside more load than the other, and the ratio then measures the load, not loom.
`OtherLoad` reads the machine's busy CPU time (``/proc/stat``) and subtracts what the demo's own child processes
used (``getrusage(RUSAGE_CHILDREN)``, which counts every waited-for descendant): the rest is other processes'
share of the CPUs during the half. Linux only; elsewhere the share is unknown (None) and no caveat is printed.
"""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

__all__ = ["BUSY_SHARE", "OtherLoad", "caveat"]

BUSY_SHARE = 0.15
"""Other processes' share of the CPUs above which a half counts as run beside other load."""


def _busy_cpu_s() -> float | None:
    """Seconds of CPU time the whole machine has spent busy (all CPUs), from the first line of /proc/stat."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    ticks = [int(x) for x in fields[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # guest time is already counted in user


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class OtherLoad:
    """Other processes' share of the CPUs between `__enter__` and `__exit__` (`share`; None when unknown)."""

    def __enter__(self) -> OtherLoad:
        self._start = (time.perf_counter(), _busy_cpu_s(), _children_cpu_s())
        self.share: float | None = None
        return self

    def __exit__(self, *exc: object) -> None:
        wall, busy, ours = time.perf_counter(), _busy_cpu_s(), _children_cpu_s()
        if busy is None or self._start[1] is None or wall <= self._start[0]:
            return
        others = (busy - self._start[1]) - (ours - self._start[2])
        self.share = max(0.0, others / ((wall - self._start[0]) * (os.cpu_count() or 1)))


def caveat(distributed: float | None, single: float | None) -> str | None:
    """The line that qualifies the speed-up when either half ran beside other load, else None."""
    if distributed is None or single is None or max(distributed, single) < BUSY_SHARE:
        return None
    return (f"note: other processes used {100 * distributed:.0f}% of this machine's CPUs during the distributed "
            f"half and {100 * single:.0f}% during the one-process half, so the speed-up reflects that load as "
            "well as loom; run `loom demo` again on a quiet machine for a fair figure")  # fmt: skip
