"""Per-process step records: time split into phases, samples, bytes, loss.

Each process keeps its own records (its local sample count, its step time and phases); the loss recorded is the
global-batch loss the strategy already reduced, so it reads the same on every rank. `summary()` gives throughput
from this process's view; job-wide figures combine the ranks' records (``loom report``).

The phases of a step, as the strategies that time them define them (`loom.observe.phases`), are consecutive laps
of one clock, so they add up to ``time_s``:

- ``data_s``: from the end of the previous step to the start of this one (the loader runs between steps), plus
  moving the batch to the device; whatever else the loop does between steps (logging, evaluation) lands here.
- ``compute_s``: forward and backward, minus the time backward spent blocked on gradient communication.
- ``comm_s``: time the training thread was blocked in collectives (or push/pull): the gradient all-reduce's
  un-overlapped tail, the loss all-reduce's wait. Communication that overlaps computation is not counted.
- ``optimizer_s``: ``zero_grad`` and ``optimizer.step``.

Records survive a crash: each is one JSON line handed to the kernel by a single unbuffered ``os.write`` on an
``O_APPEND`` descriptor before `StepMetrics.record` returns, so a rank killed by SIGKILL (or the OOM killer) loses
only the step it was in (a file buffer would lose up to a second of records). One ``write`` of a few hundred bytes
on an append descriptor is not torn by a kill; a machine crash can leave a torn last line, which
`loom.observe.report.load_records` skips.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["StepRecord", "StepMetrics", "json_line"]


@dataclass
class StepRecord:
    """One step of one process."""

    step: int
    rank: int
    time_s: float
    """Wall time of the whole step on this process, data loading included when the strategy times phases."""
    samples: int
    """Samples this process trained on in the step (its share)."""
    global_samples: int
    """Samples in the whole global batch."""
    loss: float
    """Global-batch loss (already reduced across processes)."""
    wall: float = field(default_factory=time.time)
    """Unix time at which the step ended."""
    data_s: float | None = None
    """Waiting for the next batch (see the module docstring for every phase)."""
    compute_s: float | None = None
    """Forward and backward, without blocked communication."""
    comm_s: float | None = None
    """Blocked in collectives or push/pull."""
    optimizer_s: float | None = None
    """``zero_grad`` and ``optimizer.step``."""
    bytes_sent: int | None = None
    """Bytes this process sent in the step (exact for loom's algorithms, the ring estimate for the backend's)."""
    bytes_received: int | None = None
    """Bytes this process received in the step (same convention)."""
    staleness: float | None = None
    """Parameter servers: versions between the parameters a gradient was computed on and those it updates."""
    bubble_s: float | None = None
    """Pipelines: time this stage sat idle in the schedule's bubble."""
    spread: float | None = None
    """Gossip: the largest L2 distance between this replica's parameters and a peer's, at the last exchange with
    each peer (how far the replicas have drifted apart)."""
    skipped: bool | None = None
    """True when the step's update was not applied (a non-finite loss or gradient on some rank: see
    `loom.fault.desync.NonFiniteGuard`); absent otherwise."""
    memory: dict[str, int] | None = None
    """Sampled steps (a job's ``memory_every``): this rank's training state in bytes after the step, by category
    (``parameters``, ``gradients``, ``optimizer``, ``state``; `loom.observe.memory.state_bytes`)."""
    rss_bytes: int | None = None
    """Sampled steps: this process's resident set size when the step began."""
    peak_rss_bytes: int | None = None
    """Sampled steps: this process's RSS high-water mark during the step (`loom.observe.memory`)."""


_FIELDS = frozenset(StepRecord.__dataclass_fields__)
_HEAD_FIELDS = ("step", "rank", "time_s", "samples", "global_samples", "loss", "wall")
_HEAD_FORMATS = ("%d", "%d", "%.7g", "%d", "%d", "%r", "%.6f")
"""step, rank, time_s, samples, global_samples, loss (exact), wall (to the microsecond)."""


@functools.lru_cache(maxsize=256)  # shapes are few (one per strategy and option); bound it anyway
def _template(kinds: tuple[type, ...], names: tuple[str, ...]) -> str | None:
    """The %-template of a record whose values have these types, or None unless every one is an int or a float
    (a flag, a table, a None: `json_line` writes those through ``json.dumps``)."""
    if any(kind is not int and kind is not float for kind in kinds):
        return None
    specs = [*_HEAD_FORMATS, *("%.7g" if kind is float else "%d" for kind in kinds[7:])]
    fields = [f'"{name}": {spec}' for name, spec in zip((*_HEAD_FIELDS, *names), specs, strict=True)]
    return "{" + ", ".join(fields) + "}\n"


def json_line(
    rank: int, step: int, time_s: float, samples: int, global_samples: int, loss: float, wall: float,
    extra: dict[str, Any],
) -> bytes:  # fmt: skip
    """A record as one JSON line (what `loom.observe.report.load_records` reads), cheaper than ``json.dumps``
    since the training thread writes one per step: one cached %-template per shape of record, filled in one call.
    Measured floats get 7 significant digits (the records in memory keep every digit), the wall clock the
    microsecond, the loss every digit (``repr``). A record holding anything but ints and finite floats (a flag,
    the memory table, NaN) goes through ``json.dumps``, its None fields left out."""
    values = (step, rank, time_s, samples, global_samples, loss, wall, *extra.values())
    template = _template(tuple(map(type, values)), tuple(extra))
    if template is not None:
        total = sum(values)  # NaN and infinities propagate; they need json's spelling
        if total - total == 0.0:
            return (template % values).encode()
    fields = dict(zip(_HEAD_FIELDS, values[:7], strict=True))
    fields.update((k, v) for k, v in extra.items() if v is not None)
    return (json.dumps(fields) + "\n").encode()


def _check_fields(fields: dict[str, Any]) -> None:
    if not _FIELDS.issuperset(fields):
        raise TypeError(
            f"StepRecord has no field(s) {sorted(set(fields) - _FIELDS)}; its fields are the record's columns"
        )


class StepMetrics:
    """Collects a `StepRecord` per step; optionally appends each as a JSON line to a file as it is recorded."""

    def __init__(self, rank: int, path: str | Path | None = None) -> None:
        self.rank = rank
        self._records: list[StepRecord] = []
        self._raw: list[tuple] = []
        self.loss_scope = "global"
        """The job's `loom.job.Job.loss_scope`: a ``"replica"`` loss is labelled as this rank's own."""
        self.slowest: tuple[int, str, float] | None = None
        """Rank 0 of a job that times phases: (rank, phase, seconds over the median) of the slowest rank."""
        self.path = Path(path) if path is not None else None
        """The JSON-lines file the records go to, if any."""
        self._fd: int | None = None
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
            atexit.register(self.close)  # the descriptor is closed at exit; every record is already written

    def record(
        self, step: int, time_s: float, samples: int, global_samples: int, loss: float, **extra: Any
    ) -> None:
        """Add one step; ``extra`` fills the optional fields of `StepRecord` (phases, bytes, staleness...).

        The record is in the file when this returns (the module docstring: it survives a kill). Cheap on
        purpose: one `json_line` and one ``write``; the `StepRecord` objects are built only when `records` is
        read."""
        _check_fields(extra)
        raw = (step, time_s, samples, global_samples, loss, time.time(), extra)
        self._raw.append(raw)
        if self._fd is not None:
            self._write(raw)

    def _write(self, raw: tuple) -> None:
        assert self._fd is not None
        data = json_line(self.rank, *raw)
        written = os.write(self._fd, data)
        if written < len(data):  # only on a full disk: the rest, or the error that says so
            os.write(self._fd, data[written:])

    def annotate(self, step: int, **fields: Any) -> bool:
        """Add ``fields`` to the latest record if it is ``step``'s: measurements taken after the step's clock
        stopped. The record is written again whole (readers keep the last line of a step, as
        `loom.observe.report.load_records` does). False, and nothing done, when ``step`` was not the last
        recorded (a job built with ``observe=False`` records nothing)."""
        _check_fields(fields)
        if self._raw:
            if self._raw[-1][0] != step:
                return False
            self._raw[-1][6].update(fields)
            raw = self._raw[-1]
        elif self._records and self._records[-1].step == step:
            record = self._records[-1]
            for name, value in fields.items():
                setattr(record, name, value)
            head = (getattr(record, name) for name in _HEAD_FIELDS if name != "rank")
            raw = (*head, {k: v for k, v in vars(record).items() if k not in _HEAD_FIELDS})
        else:
            return False
        if self._fd is not None:
            self._write(raw)
        return True

    @property
    def records(self) -> list[StepRecord]:
        """Every step recorded so far, oldest first."""
        if self._raw:
            raw, self._raw = self._raw, []
            self._records.extend(
                StepRecord(step, self.rank, time_s, samples, global_samples, loss, wall=wall, **extra)
                for step, time_s, samples, global_samples, loss, wall, extra in raw
            )
        return self._records

    def flush(self) -> None:
        """Nothing to do: every record is written as it is recorded (kept for callers that flush)."""

    def summary(self, skip_first: int = 1) -> dict[str, float]:
        """Throughput of the global batch as seen by this process, skipping warm-up steps; and the number of
        steps whose update was skipped (non-finite)."""
        recs = self.records[skip_first:] or self.records
        if not recs:
            return {"steps": 0, "samples_per_s": 0.0, "mean_step_s": 0.0, "skipped_steps": 0}
        total_time = sum(r.time_s for r in recs)
        return {
            "steps": len(self.records),
            "skipped_steps": sum(1 for r in self.records if r.skipped),
            "samples_per_s": sum(r.global_samples for r in recs) / total_time if total_time else 0.0,
            "mean_step_s": total_time / len(recs),
        }

    def status(self, window: int = 20) -> str:
        """One line for a progress bar: loss, throughput over the last ``window`` steps, the slowest rank."""
        if not self.records:
            return ""
        recent = self.records[-window:]
        elapsed = sum(r.time_s for r in recent)
        rate = sum(r.global_samples for r in recent) / elapsed if elapsed else 0.0
        label = "loss" if self.loss_scope == "global" else f"rank {self.rank}'s replica loss"
        text = f"{label} {recent[-1].loss:.4f} | {rate:,.0f} samples/s"
        if self.slowest is not None:
            rank, phase, excess = self.slowest
            text += f" | slowest rank {rank} ({phase} +{excess * 1e3:.1f} ms)"
        return text

    def close(self) -> None:
        """Close the file (every record is in it already); records go on being kept in memory."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
