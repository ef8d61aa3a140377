"""Stragglers for the strategies whose step has no all-reduce to carry phase times: through the watchdog.

Data parallelism and LocalSGD/DiLoCo learn every rank's phase times on the loss all-reduce they run anyway
(`loom.observe.phases`). A parameter-server worker, a gossip replica and a model-parallel stage have no such
collective (an asynchronous worker has no collective at all), so their phase times travel the way the hang
watchdog's news does (`loom.fault.watchdog`): each rank keeps a window of its own steps' phase times
(`StragglerWatch.add`, a deque append on the training thread), and the median row of that window rides on the
record its watchdog thread publishes to the job's store every poll anyway (``Watchdog.extras``: no store call
of its own). Rank 0's watchdog thread reads every rank's record every `JUDGE_EVERY_S` seconds and judges the
rows with `loom.observe.stragglers.StragglerDetector.judge`: the warnings are the same lines and
``stragglers.jsonl`` rows as data parallelism's, so ``loom report`` lists them.

Only ranks that do the same work are compared (``peers``): every rank of a data-parallel family, the replicas
of one pipeline stage and tensor shard in a model-parallel job (a pipeline's last stage is busier by design,
not slow). A rank whose window is not full yet is not judged. With asynchronous workers a slow rank also takes
fewer steps; its per-step times are what show it.
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
from typing import Any

from loom.observe.stragglers import StragglerConfig, StragglerDetector, StragglerWarning, _median

__all__ = ["JUDGE_EVERY_S", "StragglerWatch"]

JUDGE_EVERY_S = 2.0
"""How often rank 0 reads the other ranks' rows and judges them (a store read per rank each time)."""


class StragglerWatch:
    """One rank's window of phase times, published on its watchdog's record; on rank 0 also the judge."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        peers: Sequence[Sequence[int]],
        warnings_path: Path | None = None,
        config: StragglerConfig | None = None,
    ) -> None:
        self.rank, self.world_size = rank, world_size
        self.config = config if config is not None else StragglerConfig.from_env()
        self._rows: deque[tuple[float, float, float, float]] = deque(maxlen=self.config.window)
        self._steps = 0
        self.peers = [list(group) for group in peers if len(group) > 1]
        self._detectors = [StragglerDetector(len(group), self.config) for group in self.peers]
        self._warnings_path = warnings_path
        self._next_judgement = 0.0
        self.warnings: list[StragglerWarning] = []
        """Every warning raised on this rank (rank 0 only)."""

    @classmethod
    def attach(
        cls, watchdog: Any, peers: Sequence[Sequence[int]], warnings_path: Path | None
    ) -> StragglerWatch:
        """A watch publishing through ``watchdog`` (a `loom.fault.watchdog.Watchdog`), judging on rank 0."""
        watch = cls(watchdog.rank, watchdog.world_size, peers, warnings_path if watchdog.rank == 0 else None)
        watchdog.extras["phases"] = watch.summary
        if watchdog.rank == 0:
            watchdog.poll_hooks["stragglers"] = watch.poll
        return watch

    def add(self, data_s: float, compute_s: float, comm_s: float, optimizer_s: float) -> None:
        """One step's phase times on this rank (the training thread)."""
        self._rows.append((data_s, compute_s, comm_s, optimizer_s))
        self._steps += 1

    def summary(self) -> list[float] | None:
        """``[step, median data, compute, comm, optimizer]`` over the window, or None before it is full."""
        rows = list(self._rows)  # one copy: the training thread appends meanwhile
        if len(rows) < self.config.window:
            return None
        return [float(self._steps), *(_median([row[p] for row in rows]) for p in range(4))]

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
        for group, detector in zip(self.peers, self._detectors, strict=True):
            table = [rows.get(r) for r in group]
            if any(not isinstance(row, list) or len(row) != 5 for row in table):
                continue  # a rank not started, or whose window is not full yet
            step = int(max(row[0] for row in table))  # type: ignore[index]
            found = detector.judge(step, [row[1:] for row in table])  # type: ignore[index]
            new.extend(replace(w, rank=group[w.rank]) for w in found)
        for warning in new:
            self._report(warning)
        self.warnings.extend(new)
        return new

    def _report(self, warning: StragglerWarning) -> None:
        print(warning.message(), file=sys.stderr, flush=True)
        if self._warnings_path is not None:
            with contextlib.suppress(OSError), open(self._warnings_path, "a") as f:
                f.write(json.dumps(asdict(warning)) + "\n")
