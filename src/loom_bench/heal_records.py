"""The per-step records of the healing benchmark (`loom_bench.heal_compare`), and the figures drawn from them.

Both sides of the comparison (torchft's Manager + DDP, loom's ``--on-worker-failure heal``) run workers that
append one JSON object per line to their own file ``<records>/replica<R>-pid<P>.jsonl``, written and flushed as
it happens, so a SIGKILL loses nothing already reported:

- ``{"kind": "start", "replica": R, "pid": P, "t": T}``: the first line of the worker script, before torch is
  imported (so "the replacement's process start" is the same instant on both sides);
- ``{"kind": "ready", ...}``: imports done, the job joined and set up, just before the first step (so a
  replacement's start-up, which neither side can shorten much, is told apart from its joining);
- ``{"kind": "step", "replica": R, "pid": P, "t": T, "t_begin": B, "step": S, "committed": true|false,
  "participants": N, "participating": true|false}``: after each attempt at a training step returns (``B``: when
  the attempt began, before the quorum or the batch). ``S`` counts the job's committed
  steps including this one when committed (1 for the first step), and the step it tried to reach when not;
  ``participants`` is the number of replicas whose gradients the step averaged; ``participating`` says whether
  this replica's own gradients were among them (torchft lets a replica that heals in a step commit it without
  contributing).

The harness adds its own kill lines, ``{"kind": "kill", "replica": R, "pid": P, "t": T, "step": S, "phase": F}``, to
``<records>/harness.jsonl`` (``S``: the step the victim had just committed; ``F``: how far into its next step the
kill was aimed). Times are ``time.time()`` on one host, so lines of different processes compare.

The figures per kill (`event_figures`) are the issue's: (a) from the kill to the survivors' next committed step
(the last survivor to commit, so the job as a whole moved on); that may be the step in flight, when the kill came
after its exchange (torchft commits per replica group, so survivors commit a step the victim's gradients are in),
so (a*) is the same to the survivors' first commit of a step begun after the kill: the stall the kill causes; (b) from the replacement's process start to its
first committed step (its (b°): from its ``ready`` line to its first step with its own gradients), in seconds and in steps (its step number less the job's committed steps when it started:
1 means the very next step), and again to its first step with its own gradients in, (c) steps lost: the survivors' attempts that were not committed between the kill and (a*) (the most on one
survivor), and (a*) in units of a healthy step (which counts a retry inside a step that a side does not
report). This module imports neither torch nor loom, so any interpreter can parse records.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

__all__ = [
    "StepWriter",
    "EventFigures",
    "read_records",
    "event_figures",
    "healthy_step_time",
    "summarize",
    "stop_step",
]

HARNESS_FILE = "harness.jsonl"
STOP_FILE = "stop"
"""The harness writes the step to stop after here, once the schedule is done; workers read it between steps."""


def stop_step(directory: str | os.PathLike[str]) -> int | None:
    """The step the harness asked every worker to stop after, or None while it has not (see `STOP_FILE`)."""
    try:
        return int((Path(directory) / STOP_FILE).read_text())
    except FileNotFoundError:
        return None


class StepWriter:
    """Appends this process's records to ``<directory>/replica<R>-pid<P>.jsonl``, one flushed line each.

    Construct it first thing in a worker script (it writes the ``start`` line), before heavy imports."""

    def __init__(self, directory: str | os.PathLike[str], replica: int) -> None:
        self.replica, self.pid = replica, os.getpid()
        path = Path(directory) / f"replica{replica}-pid{self.pid}.jsonl"
        self._file: TextIO = open(path, "a", encoding="utf-8")  # noqa: SIM115 (open for the process's life)
        self._write({"kind": "start"})

    def step(
        self,
        step: int,
        committed: bool,
        participants: int,
        participating: bool = True,
        t_begin: float | None = None,
    ) -> None:
        """One attempt at a step, written when it returns; ``t_begin``: ``time.time()`` when it began."""
        self._write(
            {
                "kind": "step",
                "t_begin": t_begin,
                "step": step,
                "committed": committed,
                "participants": participants,
                "participating": participating,
            }
        )

    def ready(self) -> None:
        """Imports done, the job joined and set up: the next thing this process does is its first step."""
        self._write({"kind": "ready"})

    def close(self) -> None:
        self._file.close()

    def _write(self, fields: dict[str, Any]) -> None:
        record = {**fields, "replica": self.replica, "pid": self.pid, "t": time.time()}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()


def append_kill(
    directory: str | os.PathLike[str], replica: int, pid: int, step: int, t: float, phase: float = 0.0
) -> None:
    """The harness's line for a SIGKILL it sent (``t`` taken just before ``os.kill``; ``phase``: how far into
    the victim's next step it was aimed, as a fraction of a step)."""
    record = {"kind": "kill", "replica": replica, "pid": pid, "step": step, "t": t, "phase": phase}
    with open(Path(directory) / HARNESS_FILE, "a", encoding="utf-8") as out:
        out.write(json.dumps(record) + "\n")


def read_records(directory: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every record under ``directory``, ordered by time. A truncated last line (a process killed mid-write) is
    skipped; any other malformed line raises, naming the file and line."""
    records: list[dict[str, Any]] = []
    for path in sorted(Path(directory).glob("*.jsonl")):
        lines = path.read_text(encoding="utf-8").split("\n")
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as error:
                if number == len(lines) or (number == len(lines) - 1 and not lines[-1]):
                    continue  # the last line of a killed process may be cut short
                raise ValueError(f"{path}:{number}: not a JSON record ({error}): {line[:80]!r}") from None
    return sorted(records, key=lambda r: r["t"])


@dataclass
class EventFigures:
    """What one kill cost. ``None`` where the run ended before the thing happened (reported as such)."""

    replica: int
    killed_pid: int
    kill_step: int
    kill_t: float
    kill_phase: float
    survivors_next_commit_s: float | None
    survivors_resumed_s: float | None
    survivor_steps_not_committed: int
    stall_in_steps: float | None
    replacement_pid: int | None
    replacement_first_commit_s: float | None
    replacement_first_commit_steps: int | None
    replacement_first_contributing_s: float | None
    replacement_first_contributing_steps: int | None
    kill_to_contributing_s: float | None
    """From the kill to the replacement's first committed step with its own gradients (whatever its start)."""
    kill_to_contributing_steps: int | None
    replacement_ready_s: float | None
    replacement_ready_to_commit_s: float | None
    replacement_ready_to_commit_steps: int | None
    participants_at_next_commit: int | None
    participants_at_resumed: int | None


def _committed(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r["kind"] == "step" and r["committed"]]


def healthy_step_time(records: list[dict[str, Any]], replicas: int) -> float | None:
    """Median time between a replica's consecutive committed steps at full membership (``replicas``
    participants on both), over all replicas: the step time the stall is measured in."""
    gaps: list[float] = []
    by_pid: dict[int, list[dict[str, Any]]] = {}
    for r in _committed(records):
        by_pid.setdefault(r["pid"], []).append(r)
    for steps in by_pid.values():
        for a, b in zip(steps, steps[1:], strict=False):
            if a["participants"] == b["participants"] == replicas and b["step"] == a["step"] + 1:
                gaps.append(b["t"] - a["t"])
    return statistics.median(gaps) if gaps else None


def event_figures(
    records: list[dict[str, Any]], kill: dict[str, Any], step_time: float | None
) -> EventFigures:
    """The figures of one kill line, from the records of the whole run (see the module docstring)."""
    t0 = kill["t"]
    pids_alive = {
        r["pid"] for r in records if r["kind"] == "start" and r["t"] < t0 and r["pid"] != kill["pid"]
    } - {r["pid"] for r in records if r["kind"] == "kill" and r["t"] < t0}
    survivors_next: list[dict[str, Any]] = []
    survivors_resumed: list[dict[str, Any]] = []
    not_committed = 0
    for pid in sorted(pids_alive):
        after = [r for r in records if r["pid"] == pid and r["kind"] == "step" and r["t"] > t0]
        first = next((r for r in after if r["committed"]), None)
        resumed = next((r for r in after if r["committed"] and _begin(r) > t0), None)
        if first is not None:
            survivors_next.append(first)
        if resumed is None:
            continue  # this survivor ended (or was killed) before committing again
        survivors_resumed.append(resumed)
        lost = sum(1 for r in after if r["t"] < resumed["t"] and not r["committed"])
        not_committed = max(not_committed, lost)
    next_commit = max(survivors_next, key=lambda r: r["t"]) if survivors_next else None
    next_s = next_commit["t"] - t0 if next_commit else None
    resumed_commit = max(survivors_resumed, key=lambda r: r["t"]) if survivors_resumed else None
    resumed_s = resumed_commit["t"] - t0 if resumed_commit else None

    replacement = next(
        (r for r in records if r["kind"] == "start" and r["replica"] == kill["replica"] and r["t"] > t0), None
    )
    first_commit = first_contributing = None
    if replacement is not None:
        own = [r for r in _committed(records) if r["pid"] == replacement["pid"]]
        first_commit = own[0] if own else None
        first_contributing = next((r for r in own if r["participating"]), None)

    def since_start(record: dict[str, Any] | None) -> tuple[float | None, int | None]:
        if record is None or replacement is None:
            return None, None
        return record["t"] - replacement["t"], record["step"] - _last_step_before(records, replacement["t"])

    commit_s, commit_steps = since_start(first_commit)
    contributing_s, contributing_steps = since_start(first_contributing)
    ready = next(
        (r for r in records if replacement and r["kind"] == "ready" and r["pid"] == replacement["pid"]), None
    )
    ready_s = ready["t"] - replacement["t"] if ready and replacement else None
    ready_commit_s = ready_commit_steps = None
    if ready is not None and first_contributing is not None:
        ready_commit_s = first_contributing["t"] - ready["t"]
        ready_commit_steps = first_contributing["step"] - _last_step_before(records, ready["t"])
    return EventFigures(
        replica=kill["replica"],
        killed_pid=kill["pid"],
        kill_step=kill["step"],
        kill_t=t0,
        kill_phase=kill.get("phase", 0.0),
        survivors_next_commit_s=next_s,
        survivors_resumed_s=resumed_s,
        survivor_steps_not_committed=not_committed,
        stall_in_steps=(resumed_s / step_time if resumed_s is not None and step_time else None),
        replacement_pid=replacement["pid"] if replacement else None,
        replacement_first_commit_s=commit_s,
        replacement_first_commit_steps=commit_steps,
        replacement_first_contributing_s=contributing_s,
        replacement_first_contributing_steps=contributing_steps,
        kill_to_contributing_s=first_contributing["t"] - t0 if first_contributing else None,
        kill_to_contributing_steps=(
            first_contributing["step"] - _last_step_before(records, t0) if first_contributing else None
        ),
        replacement_ready_s=ready_s,
        replacement_ready_to_commit_s=ready_commit_s,
        replacement_ready_to_commit_steps=ready_commit_steps,
        participants_at_next_commit=next_commit["participants"] if next_commit else None,
        participants_at_resumed=resumed_commit["participants"] if resumed_commit else None,
    )


def _begin(record: dict[str, Any]) -> float:
    """When a step attempt began; a record without ``t_begin`` counts as begun when it ended (the later bound)."""
    return record["t_begin"] if record.get("t_begin") is not None else record["t"]


def _last_step_before(records: list[dict[str, Any]], t: float) -> int:
    """The job's committed step count at time ``t`` (0 before any commit)."""
    return max((r["step"] for r in _committed(records) if r["t"] <= t), default=0)


def summarize(records: list[dict[str, Any]], replicas: int) -> dict[str, Any]:
    """Every kill's figures and the medians over kills (``None`` figures left out of a median; the count of
    kills that reached each figure is given beside it)."""
    step_time = healthy_step_time(records, replicas)
    kills = [r for r in records if r["kind"] == "kill"]
    events = [event_figures(records, kill, step_time) for kill in kills]
    medians: dict[str, Any] = {}
    for name in (
        "survivors_next_commit_s",
        "survivors_resumed_s",
        "survivor_steps_not_committed",
        "stall_in_steps",
        "replacement_first_commit_s",
        "replacement_first_commit_steps",
        "replacement_first_contributing_s",
        "replacement_first_contributing_steps",
        "kill_to_contributing_s",
        "kill_to_contributing_steps",
        "replacement_ready_s",
        "replacement_ready_to_commit_s",
        "replacement_ready_to_commit_steps",
    ):
        values = [getattr(e, name) for e in events if getattr(e, name) is not None]
        medians[name] = {"median": statistics.median(values) if values else None, "n": len(values)}
    committed = _committed(records)
    return {
        "replicas": replicas,
        "healthy_step_s": step_time,
        "steps_committed": max((r["step"] for r in committed), default=0),
        "steps_below_full_membership": len({r["step"] for r in committed if r["participants"] < replicas}),
        "events": [asdict(e) for e in events],
        "medians": medians,
    }
