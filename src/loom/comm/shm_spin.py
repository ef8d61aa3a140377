"""How long a shared-memory message waiter spins before it sleeps: adapted to its peer and to the machine.

`loom.comm.shm_wait.wait_until` spins, then sleeps on a futex. A fixed short spin (`loom.comm.shm_wait.SPIN_S`)
suits barriers, where every process arrives at about the same time, but not always a message answered by another
one (a pipeline's ping-pong): a waiter that gives up just before the answer sleeps, the wake-up costs both sides,
and two processes that sleep on each other keep answering each other late. Spinning longer costs only where a
core is contended: the spinner keeps it from the peer (or anyone) that needs it.

So `SpinBudget` follows an adaptive mutex's rule, with one more input: a wait that ended within `SPIN_MAX_S`
raises the budget to twice that wait, at most `SPIN_MAX_S`; a longer wait halves it, down to `SPIN_S` (a peer
computing for milliseconds is not spun for). And while this process waits for a CPU (`cpu_contended`: the
kernel's run-queue delay of this process, ``/proc/self/schedstat``, above `CONTENDED` of the time it was runnable
over the last `CHECK_EVERY_S`) the spin is `SPIN_S` whatever the budget.

By default `SPIN_MAX_S` equals `SPIN_S`, which turns the growth off: it did not measure better
(benchmarks/reports/model_parallel.md). A machine with cores to spare may raise it (``--spin-max-us``).
"""

from __future__ import annotations

import os
import time

from loom.comm import shm_wait

__all__ = ["CONTENDED", "SPIN_MAX_S", "SpinBudget", "cpu_contended"]

SPIN_MAX_S = shm_wait.SPIN_S
"""The longest spin; `SPIN_S` (no growth) by default, see the module docstring. A module attribute: the
micro-benchmark varies it."""
CONTENDED = 0.1
"""Run-queue delay, as a fraction of the time this process was runnable, above which the spin stays short."""
CHECK_EVERY_S = 0.02
"""How often `cpu_contended` reads the kernel's counters (each read is one ``pread``)."""


class _Contention:
    """This process's share of runnable time spent waiting for a CPU, read from ``/proc/self/schedstat``
    (nanoseconds on a CPU, nanoseconds waiting on a run queue) at most every `CHECK_EVERY_S`."""

    def __init__(self, path: str = "/proc/self/schedstat") -> None:
        self.path, self.fd, self.pid, self.contended = path, -1, 0, True
        self.next_check, self.ran, self.waited = 0.0, 0, 0

    def check(self) -> bool:
        now = time.perf_counter()
        if now < self.next_check:
            return self.contended
        self.next_check = now + CHECK_EVERY_S
        try:
            if self.pid != os.getpid():  # first use, or a forked child: /proc/self was resolved at open
                if self.fd >= 0:
                    os.close(self.fd)
                self.fd, self.pid = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC), os.getpid()
            ran, waited = (int(x) for x in os.pread(self.fd, 128, 0).split()[:2])
        except (OSError, ValueError):  # no schedstat (a kernel without it): keep the short spin
            self.contended, self.next_check = True, float("inf")
            return True
        d_ran, d_waited = ran - self.ran, waited - self.waited
        self.ran, self.waited = ran, waited
        if d_ran + d_waited >= 1_000_000:  # under 1 ms runnable: too little to tell, keep the last verdict
            self.contended = d_waited > CONTENDED * (d_ran + d_waited)
        return self.contended


cpu_contended = _Contention().check
"""Whether this process waited for a CPU more than `CONTENDED` of its runnable time lately."""


class SpinBudget:
    """How long one waiter (one end of a message channel) spins before it sleeps; see the module docstring."""

    __slots__ = ("seconds",)

    def __init__(self) -> None:
        self.seconds = shm_wait.SPIN_S

    def spin(self) -> float:
        """Seconds to spin in the wait about to start."""
        floor = shm_wait.SPIN_S
        return floor if self.seconds <= floor or cpu_contended() else min(self.seconds, SPIN_MAX_S)

    def update(self, waited: float) -> None:
        """Learn from a wait that took ``waited`` seconds."""
        if waited <= self.seconds:
            return
        if waited <= SPIN_MAX_S:
            self.seconds = min(SPIN_MAX_S, 2 * waited)
        else:
            self.seconds = max(shm_wait.SPIN_S, self.seconds / 2)
