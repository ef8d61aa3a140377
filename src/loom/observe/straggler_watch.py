"""Stragglers, for every strategy: each rank's phase times ride on its hang watchdog's record.

Each rank keeps a window of its own steps' phase times (`StragglerWatch.add`, a deque append on the training
thread, by `loom.train.engine.Engine`); the window's median row rides on the record its watchdog thread publishes
to the job's store every poll anyway (``Watchdog.extras``: no store call or collective of its own, so it serves
asynchronous workers too). Rank 0's watchdog thread judges every rank's row every `JUDGE_EVERY_S` seconds
(`loom.observe.stragglers.StragglerDetector`); each warning is a line on stderr and a ``stragglers.jsonl`` row
beside rank 0's step records, which ``loom report`` lists: up to `JUDGE_EVERY_S` plus a watchdog poll after the
window that shows it.

Only ranks that do the same work are compared (``peers``): every rank of a data-parallel family, the replicas of
one pipeline stage and tensor shard in a model-parallel job (a pipeline's last stage is busier by design, not
slow). A rank whose window is not full yet is not judged, nor a row of another job (`StragglerWatch.job`). With
asynchronous workers a slow rank also takes fewer steps; its per-step times show it. Without a store for the
watchdog (under healing the members change: its thread sends only the quorum's heartbeat) there is no watch.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from statistics import median
from typing import Any

from loom.observe.stragglers import StragglerConfig, StragglerDetector, StragglerWarning

__all__ = ["JUDGE_EVERY_S", "StragglerWatch"]

JUDGE_EVERY_S = 2.0
"""How often rank 0 reads the other ranks' rows and judges them (a store read per rank each time)."""


class StragglerWatch:
    """One rank's window of phase times, published on its watchdog's record; on rank 0 also the judge."""

    def __init__(
        self,
        peers: Sequence[Sequence[int]],
        warnings_path: Path | None = None,
        config: StragglerConfig | None = None,
        metrics: Any = None,
        job: int = 1,
    ) -> None:
        self.job = job
        """The n-th watch on this rank's watchdog: only rows of the same n are compared (not a previous job's)."""
        self.metrics = metrics
        """Rank 0's `loom.observe.metrics.StepMetrics`, whose ``slowest`` (the progress line) each judgement sets."""
        self.config = config if config is not None else StragglerConfig.from_env()
        self._rows: deque[tuple[float, float, float, float]] = deque(maxlen=self.config.window)
        self._steps = 0
        self.peers = [list(group) for group in peers if len(group) > 1]
        self._detectors = [StragglerDetector(self.config) for _ in self.peers]
        self._warnings_path = warnings_path
        self._next_judgement = 0.0
        self.warnings: list[StragglerWarning] = []
        """Every warning raised on this rank (rank 0 only)."""
        self.judged_steps = 0
        """The fewest steps any rank's row had at the last judgement that judged every peer group (0: none yet):
        what a caller waits on to know that the last steps were judged."""

    @classmethod
    def attach(cls, watchdog: Any, peers: Sequence[Sequence[int]], metrics: Any = None) -> StragglerWatch:
        """A watch publishing through ``watchdog`` (a `loom.fault.watchdog.Watchdog`), judging on rank 0; its
        warnings go beside rank 0's step records (``metrics.path``) when they are written to a file."""
        path = getattr(metrics, "path", None) if watchdog.rank == 0 else None
        warnings_path = path.parent / "stragglers.jsonl" if path is not None else None
        previous = getattr(watchdog.extras.get("phases"), "__self__", None)  # an earlier job's watch
        job = previous.job + 1 if isinstance(previous, StragglerWatch) else 1
        watch = cls(peers, warnings_path, metrics=metrics, job=job)
        watchdog.extras["phases"] = watch.summary
        if watchdog.rank == 0:
            watchdog.poll_hooks["stragglers"] = watch.poll
        return watch

    def add(self, data_s: float, compute_s: float, comm_s: float, optimizer_s: float) -> None:
        """One step's phase times on this rank (the training thread)."""
        self._rows.append((data_s, compute_s, comm_s, optimizer_s))
        self._steps += 1

    def summary(self) -> list[float] | None:
        """``[job, steps, median data, compute, comm, optimizer]`` over the window, or None before it is full."""
        rows = list(self._rows)  # one copy: the training thread appends meanwhile
        if len(rows) < self.config.window:
            return None
        return [float(self.job), float(self._steps), *(median(row[p] for row in rows) for p in range(4))]

    def poll(self, watchdog: Any) -> None:
        """Rank 0's watchdog thread: every `JUDGE_EVERY_S`, read every rank's row and judge each peer group."""
        now = time.monotonic()
        if now < self._next_judgement or not self.peers:
            return
        self._next_judgement = now + JUDGE_EVERY_S
        records = watchdog.read_records()
        rows = {r: rec.get("phases") for r, rec in records.items() if rec is not None}
        self.judge(rows)

    def judge(self, rows: dict[int, Any]) -> list[StragglerWarning]:
        """Judge the ``rows`` (global rank -> `summary`) of every peer group whose rows are all there."""
        new: list[StragglerWarning] = []
        fewest: list[int] = []
        for group, detector in zip(self.peers, self._detectors, strict=True):
            table = [rows.get(r) for r in group]
            if any(not isinstance(row, list) or len(row) != 6 or row[0] != self.job for row in table):
                continue  # a rank not started, whose window is not full yet, or still showing a previous job's
            steps = [int(row[1]) for row in table]  # type: ignore[index]
            fewest.append(min(steps))
            found = detector.judge(max(steps), [row[2:] for row in table])  # type: ignore[index]
            new.extend(replace(w, rank=group[w.rank]) for w in found)
        if fewest and len(fewest) == len(self.peers):
            self.judged_steps = min(fewest)
        self._note_slowest()
        for warning in new:
            self._report(warning)
        self.warnings.extend(new)
        return new

    def _note_slowest(self) -> None:
        """The slowest rank of every group judged, by its excess over its group's median, for the progress line."""
        judged = [(d.slowest, g) for d, g in zip(self._detectors, self.peers, strict=True) if d.slowest]
        if self.metrics is not None and judged:
            (rank, phase, excess), group = max(judged, key=lambda item: item[0][2])  # type: ignore[index]
            self.metrics.slowest = (group[rank], phase, excess)

    def _report(self, warning: StragglerWarning) -> None:
        print(warning.message(), file=sys.stderr, flush=True)
        if self._warnings_path is not None:
            with contextlib.suppress(OSError), open(self._warnings_path, "a") as f:
                f.write(json.dumps(asdict(warning)) + "\n")
