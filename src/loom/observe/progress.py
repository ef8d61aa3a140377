"""Progress of a training loop, shown by the main process only.

On a terminal it is a live rich progress bar. Under ``loom run`` a worker's output goes through the launcher,
which prefixes every *line* with the rank, so a bar that redraws itself with carriage returns would smear:
there the bar is printed as a fresh line instead (`ProgressBar.line_interval_s`). Given the job's `StepMetrics`
(``metrics=job.metrics``), the bar shows its `StepMetrics.status`.
"""

from __future__ import annotations

import sys
import time

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeRemainingColumn

from loom.observe.metrics import StepMetrics

__all__ = ["ProgressBar"]


class ProgressBar:
    """``with ProgressBar(total, "epoch 1", enabled=topo.is_main) as bar: bar.advance(info="loss 0.12")``."""

    width = 30
    """Characters of the bar printed as a line."""
    line_interval_s = 2.0
    """The least time between two printed lines (the last is printed whatever the time)."""

    def __init__(
        self, total: int, description: str, *, enabled: bool = True, metrics: StepMetrics | None = None
    ) -> None:
        self.metrics = metrics
        self.total = max(total, 1)
        self.description = description
        self.enabled = enabled
        self.done = 0
        self._live = enabled and sys.stdout.isatty()
        self._rich: Progress | None = None
        self._task: TaskID | None = None
        self._started = time.perf_counter()
        self._last_line = self._started
        self._last_info = -1.0

    def __enter__(self) -> ProgressBar:
        if self._live:
            self._rich = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[info]}"),
            )
            self._rich.start()
            self._task = self._rich.add_task(self.description, total=self.total, info="")
        return self

    def advance(self, steps: int = 1, info: str = "") -> None:
        self.done += steps
        if not self.enabled:
            return
        now = time.perf_counter()
        if self._rich is not None and self._task is not None:
            if now - self._last_info < 0.25 and self.done < self.total:  # rich redraws ~10x/s; status costs
                self._rich.update(self._task, advance=steps)
                return
            self._last_info = now
            self._rich.update(self._task, advance=steps, info=self._info(info))
            return
        if now - self._last_line >= self.line_interval_s or self.done >= self.total:
            self._last_line = now
            info = self._info(info)
            fraction = min(self.done / self.total, 1.0)
            filled = int(round(fraction * self.width))
            eta = (now - self._started) / fraction * (1 - fraction) if fraction > 0 else 0.0
            bar = "#" * filled + "." * (self.width - filled)
            print(f"{self.description} [{bar}] {self.done}/{self.total} eta {eta:4.1f}s {info}", flush=True)

    def _info(self, info: str) -> str:
        if self.metrics is None:
            return info
        return " | ".join(part for part in (self.metrics.status(), info) if part)

    def __exit__(self, *exc: object) -> None:
        if self._rich is not None:
            self._rich.stop()
