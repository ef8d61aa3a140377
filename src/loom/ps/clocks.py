"""Worker clocks and the consistency models a server enforces: ``sync``, ``async``, ``ssp``.

A worker's *clock* is the number of updates it has pushed. Before computing update ``c`` it pulls at clock ``c``.

- ``sync`` (bulk synchronous): an update is applied once every live worker has pushed for that clock; the pushes
  of clock ``c`` are summed in worker order and applied as one optimizer step, so the result is one process's.
- ``async`` (Downpour-style; Dean et al. 2012): every push is applied when it arrives; pulls never wait.
- ``ssp`` (stale synchronous parallel; Ho et al., NIPS 2013, "More effective distributed ML via a stale
  synchronous parallel parameter server"): pushes apply on arrival, but a pull at clock ``c`` is granted only when
  ``c - min_w clock_w <= s``: no worker runs more than ``s`` clocks ahead of the slowest. ``s = 0`` is BSP.

A worker silent for longer than ``timeout_s`` is declared *lost*: ``ssp`` stops waiting for it (and the server
logs it), ``sync`` fails the pending step naming it. A worker that said goodbye is *finished* and never waited for.
This module is pure bookkeeping, tested without sockets.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

__all__ = ["MODES", "ClockTable"]

MODES = ("sync", "async", "ssp")


@dataclass
class ClockTable:
    num_workers: int
    mode: str
    staleness: int = 0
    timeout_s: float = 60.0
    clocks: list[int] = field(default_factory=list)
    last_seen: list[float] = field(default_factory=list)
    status: list[str] = field(default_factory=list)
    """Per worker: ``active``, ``finished`` or ``lost``."""
    max_lead: int = 0
    """Largest ``clock - slowest`` at which a pull was granted (the SSP invariant says it is <= staleness)."""
    grants: list[tuple[int, int, int]] = field(default_factory=list)
    """The last granted pulls as ``(worker, clock, slowest clock)``; at most 10,000 kept."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} is not one of {MODES}")
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if self.staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {self.staleness}")
        n = self.num_workers
        self.clocks = self.clocks or [0] * n
        self.last_seen = self.last_seen or [time.monotonic()] * n  # the clock starts at creation
        self.status = self.status or ["active"] * n

    def check_worker(self, worker: int) -> None:
        if not isinstance(worker, int) or not 0 <= worker < self.num_workers:
            raise ValueError(f"worker {worker!r} is outside 0..{self.num_workers - 1}")

    def seen(self, worker: int, now: float) -> bool:
        """Note that ``worker`` spoke; returns True if it had been declared lost (it is active again)."""
        self.last_seen[worker] = now
        if self.status[worker] == "lost":
            self.status[worker] = "active"
            return True
        return False

    def rejoin(self, worker: int, now: float) -> int:
        """A worker (re)initializes the model: it is active again; returns the clock it continues from."""
        self.last_seen[worker] = now
        self.status[worker] = "active"
        return self.clocks[worker]

    def catch_up(self, worker: int, clock: int) -> bool:
        """A pull at ``clock`` says the worker has pushed ``clock`` updates: a server restarted from an older
        checkpoint learns the clock from it (else ``ssp`` would hold every pull back, waiting for clocks that
        only pushes lost with the old server could have advanced). Returns whether the clock moved."""
        if clock <= self.clocks[worker]:
            return False
        self.clocks[worker] = clock
        return True

    def finish(self, worker: int) -> None:
        self.status[worker] = "finished"

    def pushed(self, worker: int, clock: int) -> bool:
        """Record the push of update ``clock``; False if it was already recorded (a resent duplicate)."""
        if clock < self.clocks[worker]:
            return False
        self.clocks[worker] = clock + 1
        return True

    def expire(self, now: float, waiting: frozenset[int] = frozenset()) -> list[int]:
        """Declare lost every active worker silent for longer than the timeout, except those ``waiting`` for an
        answer from the server (their silence is the server's doing); returns the newly lost."""
        lost = [w for w in self.active() if w not in waiting and now - self.last_seen[w] > self.timeout_s]
        for w in lost:
            self.status[w] = "lost"
        return lost

    def active(self) -> list[int]:
        return [w for w in range(self.num_workers) if self.status[w] == "active"]

    def slowest(self) -> int | None:
        """The smallest clock among active workers (None when none is active)."""
        return min((self.clocks[w] for w in self.active()), default=None)

    def may_pull(self, worker: int, clock: int) -> bool:
        """Whether a pull at ``clock`` may be answered now (always, except in ``ssp``)."""
        if self.mode != "ssp":
            return True
        slowest = self.slowest()
        return slowest is None or clock - slowest <= self.staleness

    def grant(self, worker: int, clock: int) -> int:
        """Record a granted pull; returns the slowest clock at that moment."""
        slowest = self.slowest()
        slowest = clock if slowest is None else slowest
        self.max_lead = max(self.max_lead, clock - slowest)
        if len(self.grants) < 10_000:
            self.grants.append((worker, clock, slowest))
        return slowest

    def state_dict(self) -> dict:
        return {"clocks": list(self.clocks), "status": list(self.status), "max_lead": self.max_lead}

    def load_state_dict(self, state: dict) -> None:
        self.clocks = [int(c) for c in state["clocks"]]
        self.status = ["finished" if s == "finished" else "active" for s in state["status"]]
        self.max_lead = int(state["max_lead"])
