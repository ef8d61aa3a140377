"""Timeline of a window of steps as Chrome-trace JSON (opens in https://ui.perfetto.dev or chrome://tracing).

``loom run --trace-steps 10:20`` sets ``LOOM_TRACE_STEPS=10:20`` for the workers: steps 10 to 20 inclusive (steps
count from 1). Each process records its phases (data, compute, comm wait, optimizer) on one track and every
collective it issued, from launch to completion with its sequence number, on another; sequence numbers follow the
order of issue, which is the same on every rank, so collective #n on rank 0 and on rank 1 are the same
all-reduce. Each process writes ``RUN_DIR/trace/rank<r>.json`` when the window closes (or at exit), and
`merge_traces` joins them into ``RUN_DIR/trace.json``, one process per rank in the viewer.

Timestamps are wall-clock microseconds, so the ranks of one host line up; across hosts they are only as aligned as
the hosts' clocks. Format: the "JSON object" form of the Trace Event Format, complete ("X") events plus metadata
("M") events that name processes and threads.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from loom.checkpoint.durable import replace_durable
from loom.settings import SETTINGS, setting

__all__ = ["TraceRecorder", "merge_traces", "merge_traces_and_say", "parse_steps", "trace_from_env"]

PHASE_TRACK = 0
COLLECTIVE_TRACK = 1


def parse_steps(text: str) -> tuple[int, int]:
    """``"10:20"`` -> ``(10, 20)``: the first and last step traced, inclusive; checked by the one rule of
    ``LOOM_TRACE_STEPS`` (`loom.settings`, which ``loom run --trace-steps`` applies too)."""
    try:
        first, last = SETTINGS["LOOM_TRACE_STEPS"].parse(text).split(":")
    except ValueError as error:
        raise ValueError(f"--trace-steps (LOOM_TRACE_STEPS) {error}, got {text!r}") from None
    return int(first), int(last)


class TraceRecorder:
    """Collects one process's trace events for steps ``first..last`` and writes them to ``path``."""

    def __init__(self, rank: int, first: int, last: int, path: str | Path) -> None:
        self.rank = rank
        self.first, self.last = first, last
        self.path = Path(path)
        self.events: list[dict[str, Any]] = [
            _meta("process_name", rank, None, f"rank {rank}"),
            _meta("process_sort_index", rank, None, rank, key="sort_index"),
            _meta("thread_name", rank, PHASE_TRACK, "phases"),
            _meta("thread_name", rank, COLLECTIVE_TRACK, "collectives"),
        ]
        self._perf0 = time.perf_counter()
        self._wall0_us = time.time() * 1e6
        self._written = False
        atexit.register(self.flush)

    def active(self, step: int) -> bool:
        return self.first <= step <= self.last

    def _us(self, t: float) -> float:
        return self._wall0_us + (t - self._perf0) * 1e6

    def phase(self, name: str, start: float, end: float, step: int) -> None:
        """A phase of ``step`` between two ``time.perf_counter()`` readings."""
        self.events.append(_complete(name, "phase", self._us(start), (end - start) * 1e6, self.rank, PHASE_TRACK,
                                     {"step": step}))  # fmt: skip

    def collective(self, name: str, seq: int, start: float, end: float, step: int, nbytes: int) -> None:
        """Collective number ``seq`` of this process, from launch to completion."""
        args = {"seq": seq, "step": step, "bytes": nbytes}
        self.events.append(_complete(f"{name} #{seq}", "collective", self._us(start), (end - start) * 1e6,
                                     self.rank, COLLECTIVE_TRACK, args))  # fmt: skip

    def flush(self) -> None:
        """Write the events (once; later calls do nothing)."""
        if self._written:
            return
        self._written = True
        self.path.parent.mkdir(parents=True, exist_ok=True)
        replace_durable(self.path, json.dumps({"traceEvents": self.events, "displayTimeUnit": "ms"}).encode())


def _meta(name: str, pid: int, tid: int | None, value: Any, key: str = "name") -> dict[str, Any]:
    thread = {} if tid is None else {"tid": tid}  # a process's metadata names no thread
    return {"name": name, "ph": "M", "pid": pid, "args": {key: value}, **thread}


def _complete(name: str, cat: str, ts: float, dur: float, pid: int, tid: int, args: dict) -> dict[str, Any]:
    return {"name": name, "cat": cat, "ph": "X", "ts": round(ts, 3), "dur": round(max(dur, 0.0), 3),
            "pid": pid, "tid": tid, "args": args}  # fmt: skip


def trace_from_env(rank: int) -> TraceRecorder | None:
    """A recorder when ``LOOM_TRACE_STEPS`` and ``LOOM_RUN_DIR`` are set (as ``loom run --trace-steps`` does)."""
    window, run_dir = setting("LOOM_TRACE_STEPS"), os.environ.get("LOOM_RUN_DIR")
    if not window or not run_dir:
        return None
    first, last = parse_steps(window)
    return TraceRecorder(rank, first, last, Path(run_dir) / "trace" / f"rank{rank}.json")


def merge_traces(run_dir: str | Path) -> Path | None:
    """Join ``RUN_DIR/trace/rank*.json`` into ``RUN_DIR/trace.json``; returns its path, or None without traces."""
    parts = sorted(Path(run_dir).glob("trace/rank*.json"), key=lambda p: int(p.stem.removeprefix("rank")))
    if not parts:
        return None
    events = [event for part in parts for event in json.loads(part.read_text())["traceEvents"]]
    out = Path(run_dir) / "trace.json"
    out.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return out


def merge_traces_and_say(run_dir: str | Path, who: str) -> None:
    """`merge_traces`, then one line on stderr from the launcher ``who`` (``"loom run"``): where the timeline
    is (Perfetto / chrome://tracing), or why it could not be merged (the job's own verdict stands either way)."""
    try:
        merged = merge_traces(run_dir)
    except (OSError, ValueError) as error:
        print(f"{who}: could not merge the trace files: {error}", file=sys.stderr)
        return
    if merged is not None:
        print(f"{who}: timeline written to {merged}", file=sys.stderr)
