"""Per-process step records: time, samples, loss.

Each process keeps its own records (its local sample count, its step time); the loss recorded is the global-batch
loss the strategy already reduced, so what a user reads is the same on every rank. `summary()` gives throughput
from this process's view; job-wide figures come from combining the ranks' records (see `loom report`).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["StepRecord", "StepMetrics"]


@dataclass
class StepRecord:
    step: int
    rank: int
    time_s: float
    """Wall time of the whole step on this process."""
    samples: int
    """Samples this process trained on in the step (its share)."""
    global_samples: int
    """Samples in the whole global batch."""
    loss: float
    """Global-batch loss (already reduced across processes)."""
    wall: float = field(default_factory=time.time)


class StepMetrics:
    """Collects a `StepRecord` per step; optionally appends each as a JSON line to a file."""

    def __init__(self, rank: int, path: str | Path | None = None) -> None:
        self.rank = rank
        self.records: list[StepRecord] = []
        self._file = None
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", buffering=1)  # noqa: SIM115 - kept open for the job's lifetime

    def record(self, step: int, time_s: float, samples: int, global_samples: int, loss: float) -> StepRecord:
        rec = StepRecord(step, self.rank, time_s, samples, global_samples, loss)
        self.records.append(rec)
        if self._file is not None:
            self._file.write(json.dumps(asdict(rec)) + "\n")
        return rec

    def summary(self, skip_first: int = 1) -> dict[str, float]:
        """Throughput of the global batch as seen by this process, skipping warm-up steps."""
        recs = self.records[skip_first:] or self.records
        if not recs:
            return {"steps": 0, "samples_per_s": 0.0, "mean_step_s": 0.0}
        total_time = sum(r.time_s for r in recs)
        return {
            "steps": len(self.records),
            "samples_per_s": sum(r.global_samples for r in recs) / total_time if total_time else 0.0,
            "mean_step_s": total_time / len(recs),
        }

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
