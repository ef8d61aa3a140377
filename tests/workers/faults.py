"""One fault injector for every fault test: kill, freeze, NaN or a skipped collective at a given (rank, step).

A test says which faults a job meets in one environment variable, `ENV`, that the launcher hands to every rank;
the training script makes one `Injector` and asks it at each step. Faults are data, so a test states them in
one line and every script reads them the same way:

    env = {ENV: plan(Fault("freeze", rank=1, step=3))}              # in the test
    faults = Injector.from_env(topo.rank)                         # in the script, once
    for step, batch in enumerate(loader, start=1):
        faults.before_step(step, batch)        # kill / freeze this process, or put a NaN in the batch
        loss = job.train_step(batch)
        if faults.skips(step):                 # "skip": this rank leaves out the collective the script names
            continue

The text form is ``KIND@RANK:STEP`` with an optional ``#ATTEMPT`` (the fault fires only on that restart attempt,
`ATTEMPT_ENV`, so a restarted job does not meet it again), several joined by ``,``: ``"nan@0:3,kill@1:5#0"``.
Steps count from 1: step k is the k-th step of the job (``job.step + 1`` before `train_step`). Kinds:

- ``kill``: SIGKILL to this process (a crash: no handler runs, no file is flushed).
- ``freeze``: SIGSTOP to this process (a hang that is no crash: its sockets stay open; the launcher, the test or
  a SIGCONT ends it). ``on_fire`` runs before, e.g. to write the time it froze.
- ``nan``: the first element of the batch's first floating-point input becomes NaN, in place (the batch keeps its
  layout: global size, fingerprint); an empty share is left as it is.
- ``skip``: nothing happens by itself; the script asks `Injector.skips` where it leaves out a collective.

Faults *inside* a step (between the engine's collectives: before, during and after the gradient exchange, after
the commit vote, while sending state to a replacement) cannot be reached from a script's loop: the engine itself
calls `loom.fault.inject.fault_point` there, planned by ``LOOM_FAULTS=KIND@RANK:STEP:PHASE[#GENERATION]`` (the heal
generation plays the part of ``#ATTEMPT``), used by tests/test_heal.py.

Used by tests/test_guard.py, tests/test_nonfinite.py and tests/test_elastic.py (and the scripts they run); the
lanes' own unit tests are in tests/test_faults.py.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

ENV = "LOOM_TEST_FAULTS"
ATTEMPT_ENV = "TORCHELASTIC_RESTART_COUNT"  # what `loom run` (torch elastic) sets on every restart
KINDS = ("kill", "freeze", "nan", "skip")
_FORM = re.compile(r"(?P<kind>[a-z]+)@(?P<rank>\d+):(?P<step>\d+)(?:#(?P<attempt>\d+))?")


@dataclass(frozen=True)
class Fault:
    """``kind`` on rank ``rank`` at step ``step`` (from 1); on restart ``attempt`` only, or on every attempt."""

    kind: str
    rank: int
    step: int
    attempt: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; kinds are {', '.join(KINDS)}")
        if self.rank < 0 or self.step < 1 or (self.attempt is not None and self.attempt < 0):
            raise ValueError(f"a fault needs rank >= 0, step >= 1 and attempt >= 0, got {self}")

    def __str__(self) -> str:
        return f"{self.kind}@{self.rank}:{self.step}" + ("" if self.attempt is None else f"#{self.attempt}")


def plan(*faults: Fault) -> str:
    """The `ENV` value for ``faults``."""
    return ",".join(map(str, faults))


def parse(text: str) -> list[Fault]:
    """The faults of an `ENV` value (empty: none); a malformed item raises a ValueError naming it."""
    faults = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        match = _FORM.fullmatch(item)
        if match is None:
            raise ValueError(
                f"{ENV}: {item!r} is not KIND@RANK:STEP[#ATTEMPT], e.g. 'freeze@1:3' or 'kill@0:5#0'"
            )
        attempt = match["attempt"]
        faults.append(
            Fault(
                match["kind"],
                int(match["rank"]),
                int(match["step"]),
                None if attempt is None else int(attempt),
            )
        )
    return faults


class Injector:
    """This rank's faults: `before_step` carries out kill, freeze and NaN; `skips` answers for ``skip``."""

    def __init__(
        self, rank: int, faults: list[Fault], attempt: int = 0, on_fire: Callable[[Fault], None] | None = None
    ) -> None:
        self.rank, self.attempt, self.on_fire = rank, attempt, on_fire
        self.faults = [f for f in faults if f.rank == rank and f.attempt in (None, attempt)]
        self.fired: list[Fault] = []

    @classmethod
    def from_env(
        cls, rank: int, env: Mapping[str, str] | None = None, on_fire: Callable[[Fault], None] | None = None
    ) -> Injector:
        env = os.environ if env is None else env
        return cls(rank, parse(env.get(ENV, "")), int(env.get(ATTEMPT_ENV, "0") or 0), on_fire)

    def due(self, kind: str, step: int) -> Fault | None:
        return next((f for f in self.faults if f.kind == kind and f.step == step), None)

    def before_step(self, step: int, batch: Any = None) -> None:
        """Carry out this rank's ``nan``, ``freeze`` and ``kill`` faults of step ``step``, in that order."""
        poison = self.due("nan", step)
        if poison is not None and _poison(batch):
            self._fire(poison)
        for kind, signum in (("freeze", signal.SIGSTOP), ("kill", signal.SIGKILL)):
            fault = self.due(kind, step)
            if fault is not None:
                self._fire(fault)
                os.kill(os.getpid(), signum)

    def skips(self, step: int) -> bool:
        """Whether this rank leaves out, at step ``step``, the collective the script asks about."""
        fault = self.due("skip", step)
        if fault is not None:
            self._fire(fault)
        return fault is not None

    def _fire(self, fault: Fault) -> None:
        self.fired.append(fault)
        if self.on_fire is not None:
            self.on_fire(fault)


def _poison(batch: Any) -> bool:
    """NaN into the first element of the first non-empty floating-point tensor of ``batch``; whether it did."""
    tensors = (
        [batch]
        if isinstance(batch, torch.Tensor)
        else list(batch)
        if isinstance(batch, (list, tuple))
        else []
    )
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor.numel():
            tensor[(0,) * tensor.dim()] = float("nan")
            return True
    return False
