"""Faults injected at the step engine's own boundaries, keyed on (rank, step, phase): off unless asked.

The tests of healing must kill a worker *inside* a step, which a script's loop cannot reach, so the engine calls
`fault_point` at its phase boundaries; it acts when ``LOOM_FAULTS`` names this rank, step and phase. A job asks
`planned` once at setup: unset, it gets None and its step calls nothing here. The form
(``KIND@RANK:STEP:PHASE[#GENERATION]``), the kinds and where each of `PHASES` is met: docs/fault-tolerance.md,
"Injecting faults".
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from loom.errors import InjectedFault
from loom.settings import setting

__all__ = ["ENV", "GENERATION_ENV", "PHASES", "InjectedFault", "fault_point", "parse_faults", "planned"]

ENV = "LOOM_FAULTS"
GENERATION_ENV = "LOOM_HEAL_GENERATION"
PHASES = ("before", "during", "after", "commit", "send", "join", "form")
KINDS = ("kill", "freeze", "raise", "slow")
_FORM = re.compile(r"(?P<kind>[a-z]+)@(?P<rank>\d+):(?P<step>\d+):(?P<phase>[a-z]+)(?:#(?P<gen>\d+))?")


@dataclass(frozen=True)
class PlannedFault:
    kind: str
    rank: int
    step: int
    phase: str
    generation: int = 0


def parse_faults(text: str) -> list[PlannedFault]:
    """The faults of a ``LOOM_FAULTS`` value; a malformed item raises a ValueError naming it and the form."""
    faults = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        match = _FORM.fullmatch(item)
        if match is None or match["kind"] not in KINDS or match["phase"] not in PHASES:
            raise ValueError(
                f"{ENV}: {item!r} is not KIND@RANK:STEP:PHASE[#GENERATION] with KIND in {KINDS} and PHASE in "
                f"{PHASES}, e.g. 'kill@1:3:during'"
            )
        rank, step, generation = (int(match[key] or 0) for key in ("rank", "step", "gen"))
        faults.append(PlannedFault(match["kind"], rank, step, match["phase"], generation))
    return faults


_mine: list[PlannedFault] | None = None


def _faults_here() -> list[PlannedFault]:
    global _mine
    if _mine is None:
        text = os.environ.get(ENV, "")
        rank, gen = int(os.environ.get("RANK", "0") or 0), int(os.environ.get(GENERATION_ENV, "0") or 0)
        _mine = [f for f in parse_faults(text) if f.rank == rank and f.generation == gen] if text else []
    return _mine


def planned() -> Callable[[int, str], None] | None:
    """`fault_point` when ``LOOM_FAULTS`` plans a fault for this process, else None (asked once, at setup: the
    module docstring)."""
    return fault_point if _faults_here() else None


def fault_point(step: int, phase: str) -> None:
    """Carry out this process's fault planned at (``step``, ``phase``), if any (see the module docstring)."""
    faults = _faults_here()
    for fault in faults:
        if fault.step == step and fault.phase == phase:
            if fault.kind == "raise":
                faults.remove(fault)  # an error is met once: the retried step must go through
                raise InjectedFault(f"rank {fault.rank}: injected fault at step {step}, phase {phase!r}")
            _note(fault)
            if fault.kind == "slow":
                faults.remove(fault)
                time.sleep(setting("LOOM_FAULTS_SLOW_S"))
                return
            os.kill(os.getpid(), signal.SIGKILL if fault.kind == "kill" else signal.SIGSTOP)


def _note(fault: PlannedFault) -> None:
    """Append when and where a fault fires to ``RUN_DIR/faults.jsonl``: the time a kill landed, for the tests'
    measurements of recovery (the process cannot say it afterwards)."""
    run_dir = os.environ.get("LOOM_RUN_DIR")
    if run_dir:
        line = {key: getattr(fault, key) for key in ("rank", "step", "phase", "kind")} | {"time": time.time()}
        with open(os.path.join(run_dir, "faults.jsonl"), "a") as out:
            out.write(json.dumps(line) + "\n")
