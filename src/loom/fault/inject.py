"""Faults injected at the step engine's own boundaries, keyed on (rank, step, phase): off unless asked.

The tests of healing must kill a worker *inside* a step, at a collective the engine issues, which a script's loop
cannot reach (``tests/workers/faults.py`` acts before a step only). So the engine calls `fault_point` at its phase
boundaries, which acts when ``LOOM_FAULTS`` names this rank, step and phase. A job asks `planned` once at setup:
unset, it gets None and its step calls nothing here (production runs the same code, one test of None per point).

Text form: ``KIND@RANK:STEP:PHASE[#GENERATION]``, several joined by ``,``, e.g. ``"kill@1:3:during"``. Steps count
from 1 (the step being attempted, ``job.step + 1``). ``#GENERATION`` (default 0) is the heal generation the launcher
gives each process of a rank (``LOOM_HEAL_GENERATION``: 0 for the first, 1 for its first replacement...), so a
replacement does not meet its predecessor's fault again. Kinds: ``kill`` (SIGKILL: a crash, nothing flushed),
``freeze`` (SIGSTOP: a hang that is no crash), ``raise`` (a `InjectedFault` exception in the step: an error, not
a death), ``slow`` (a pause of ``LOOM_FAULTS_SLOW_S`` seconds, default 3: a process that is late, not lost).

Phases (`PHASES`), in the order a data-parallel step meets them:

- ``before``: the step begins, before forward and backward;
- ``during``: right before the step's one exchange collective (a round's, for LocalSGD and DiLoCo under heal),
  which the other members have entered by then: a kill here leaves them inside it;
- ``after``: the gradient exchange is complete on this member, before the commit vote;
- ``commit``: after the commit vote said commit, before the optimizer step;
- ``send``: a live member is about to send the training state to a replacement (the healing peer's failure);
  here STEP counts this process's sends to replacements (1: its first), since the step at which a replacement
  arrives depends on how long it took to start;
- ``join``: a process (a replacement, with ``#GENERATION``) is about to announce that it is ready to join; STEP is
  1 (a process joins once): ``slow@1:1:join#1`` makes rank 1's first replacement join late;
- ``form``: a member listed in a membership epoch is about to build the epoch's group with the others; STEP counts
  the epochs this process has been listed in (1: its first), so ``kill@2:2:form`` kills rank 2 while the others
  wait for it to form its second epoch.
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
