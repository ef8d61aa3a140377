"""Hang diagnosis: every collective loom issues carries a sequence number, and a stuck one stops the job.

The idea behind NCCL's flight recorder and torchft's timeouts: a collective completes only when every rank has
entered it, so each rank counts the collectives it issues (one sequence, the same on every rank of a correct
program) and remembers its last completed ``(op, seq)`` and the one it is in. A background thread publishes that
record through the job's store (`loom.fault.side_channel`), which the stuck collective does not depend on, and
checks the clock; every store call is bounded, and a failed store is left alone for `STORE_BACKOFF_S`.

The hang timeout counts only the time during which *every* rank is inside a collective or cannot be heard from;
a rank alive outside any collective (rank 0 evaluating alone) is waited for up to the work timeout, then named.
On a hang the thread prints a report (`loom.fault.hang_report`), records it for ``loom run`` and ends the process
(``os._exit``: the main thread is blocked in C++). The same thread sends and hears heartbeats
(`loom.fault.liveness`). The three timeouts and the watchdog's limits: docs/fault-tolerance.md, "Slow, stuck
or gone".
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from loom.comm.shm_wait import give_way_to
from loom.errors import HangError, PeerLostError
from loom.fault.hang_report import all_inside_s, doing, hang_report, print_stacks, stacks_asked, stop_process
from loom.fault.liveness import Heartbeat
from loom.fault.quorum_records import HEARTBEAT_S
from loom.fault.side_channel import host_description, open_side_channel
from loom.fault.timeouts import hang_timeout_s, liveness_timeout_s, work_timeout_s
from loom.topology import Topology

__all__ = ["Watchdog", "collective"]

WORK_REPORT_SLACK_S = 60.0
"""The shared-memory waits (`loom.comm.shm_wait`) give up this long after the work timeout at the earliest: the
watchdog's report of a rank stuck in its own code (checked every poll, at most 1 s) always comes first."""
STORE_BACKOFF_S = 5.0
"""After a failed store call, the watchdog does not touch the store for this long (at most a quarter of the
liveness timeout: the side cut off from the store must try again within it to tell a blip from a cut)."""
# Keys per restart attempt: a store shared across attempts (torchrun's) still holds the previous attempt's.
_PREFIX = "loom/watchdog/attempt{}/"


class Watchdog:
    """Counts this rank's collectives and stops the process when one of them waits past ``timeout_s``.

    Use `Watchdog.start` (it needs a store); a watchdog built without one only counts (single process, tests).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        timeout_s: float | None,
        store: Any = None,
        work_timeout: float | None = None,
        liveness_timeout: float | None = None,
    ) -> None:
        self.rank, self.world_size, self.store = rank, world_size, store
        self._prefix = _PREFIX.format(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.heartbeat = Heartbeat(rank, world_size, liveness_timeout_s(liveness_timeout), self._prefix)
        self._configure(timeout_s, work_timeout, liveness_timeout)
        self._next_check = 0.0
        self._stacks_asked = False
        """Whether this rank asked the ranks outside collectives for their stacks (once per process)."""
        self._stack_dumped = False
        """Whether this rank printed its own stack because another asked (once per process)."""
        self.seq = 0
        """Sequence number of the last collective this rank entered (0: none yet)."""
        self.current: tuple[str, int, float] | None = None
        """``(op, seq, monotonic start)`` of the collective this rank is in, or None."""
        self.last_done: tuple[str, int] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store_failed_at = -float("inf")
        self.extras: dict[str, Callable[[], Any]] = {}
        """Fields added to this rank's published record, each read by the watchdog thread when it publishes
        (e.g. `loom.observe.straggler_watch`'s phase times): a job sends its peers news at no cost of its own."""
        self.poll_hooks: dict[str, Callable[[Watchdog], None]] = {}
        """Called by the watchdog thread after each publish, by name (a later job's hook replaces an earlier
        one's); an exception counts as a failed store call."""
        self.quorum: Any = None
        """Under ``--on-worker-failure heal``, the member's `loom.fault.quorum.Quorum`: the launcher judges this
        process by the quorum's heartbeat, which this thread sends (`Quorum.beat`), and the thread judges
        nothing itself (a lost member is replaced, not waited for; each epoch's group bounds its collectives)."""

    def _configure(self, timeout_s: float | None, work_timeout: float | None, liveness: float | None) -> None:
        """Set the three timeouts (`hang_timeout_s`, `work_timeout_s`, `liveness_timeout_s` resolve each) and the
        poll interval: at most 1 s, a tenth of the hang timeout, a fifth of the liveness one."""
        self.timeout_s = hang_timeout_s(timeout_s)
        self.work_timeout_s = max(work_timeout_s(work_timeout), self.timeout_s)
        """How long to wait for a rank doing its own work outside collectives (never below ``timeout_s``)."""
        give_way_to(self.work_timeout_s + WORK_REPORT_SLACK_S)
        self.heartbeat.timeout_s = liveness_timeout_s(liveness)
        self.poll_s = min(1.0, self.timeout_s / 10, self.heartbeat.timeout_s / 5)

    @classmethod
    def start(
        cls,
        topology: Topology,
        timeout_s: float | None = None,
        work_timeout: float | None = None,
        liveness_timeout: float | None = None,
        quorum: Any = None,
    ) -> Watchdog:
        """A watchdog for this process, publishing through a new client of the job's TCP store; without a process
        group (one process) it only counts: nobody to wait for. With a ``quorum``: the constructor's ``quorum``."""
        global _active
        if (
            quorum is None
            and _active is not None
            and (_active.rank, _active.world_size) == (topology.rank, topology.world_size)
        ):
            _active._configure(timeout_s, work_timeout, liveness_timeout)  # a second setup() in one process
            return _active
        # under heal a connection of its own: a step's long wait on the quorum's never delays a beat
        if quorum is not None:
            store = quorum.store.clone()
        else:
            store = open_side_channel() if topology.is_distributed else None
        wd = cls(topology.rank, topology.world_size, timeout_s, store, work_timeout, liveness_timeout)
        # A first beat now (the thread retries): a fault may come before the first poll, and a process never
        # heard from is never judged.
        if quorum is not None:
            wd.quorum, wd.poll_s = quorum, HEARTBEAT_S
            wd._beat_for_quorum()
        elif store is not None:
            with contextlib.suppress(Exception):  # bounded
                wd.heartbeat.announce(store, host_description())
                wd._publish()
        if store is not None:
            wd._thread = threading.Thread(target=wd._watch, name=f"loom-watchdog-{wd.rank}", daemon=True)
            wd._thread.start()
            # Registered after `loom.init`'s shutdown, so it runs before it: the thread and the store client
            # go while the process group (and rank 0's store server) still exist; a thread left inside a store
            # call during interpreter teardown can abort the process.
            atexit.register(wd.stop)
        if _active is not None:
            _active.stop()
        _active = wd
        return wd

    def stop(self) -> None:
        """Stop the thread, mark this rank's heartbeat as ended on purpose, close the store client (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        thread_ended = self._thread is not None and not self._thread.is_alive()
        # never two threads on one store client; under heal the quorum says goodbye (`Quorum.close`)
        if thread_ended and self._store_usable() and self.quorum is None:
            with contextlib.suppress(Exception):
                self.heartbeat.leave(self.store)
        self.store = None

    # -- the main thread's side: two attribute writes per collective, no I/O ---------------------------------
    @contextlib.contextmanager
    def collective(self, op: str) -> Iterator[int]:
        """Count the collective(s) issued inside this block as one operation ``op``; yields its number."""
        seq = self.enter(op)
        try:
            yield seq
        finally:
            self.leave()

    def enter(self, op: str) -> int:
        """Enter operation ``op`` (for code whose collective does not fit a ``with`` block); returns its number.
        Every `enter` is followed by one `leave`."""
        self.seq += 1
        self.current = (op, self.seq, time.monotonic())
        return self.seq

    def leave(self) -> None:
        """Leave the operation `enter` entered."""
        current = self.current
        if current is not None:
            self.last_done = (current[0], current[1])
        self.current = None

    def record(self) -> dict[str, Any]:
        """What this rank publishes: its current and last completed operation."""
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            **self.place(),
            **{name: read() for name, read in list(self.extras.items())},
        }

    def place(self, base: int = 0) -> dict[str, Any]:
        """This rank's place among its collectives as its record publishes it (`loom.fault.hang_report` reads
        it), numbered after ``base`` (under heal: within the membership epoch, `loom.fault.quorum.Quorum.place`)."""
        current, done = self.current, self.last_done
        return {
            "current": [current[0], current[1] - base] if current is not None and current[1] > base else None,
            "waiting_s": None if current is None else round(time.monotonic() - current[2], 3),
            "done": [done[0], done[1] - base] if done is not None and done[1] > base else None,
            "time": time.time(),
        }

    # -- the watchdog thread ---------------------------------------------------------------------------------
    def _publish(self) -> None:
        # Every poll, changed or not: the refreshed time tells the others this rank is alive (doing its own work
        # when it is outside a collective), and while it waits, refreshes waiting_s.
        self.store.set(f"{self._prefix}rank{self.rank}", json.dumps(self.record()))

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self.quorum is not None:
                self._beat_for_quorum()
                continue
            current = self.current
            if current is not None:
                self._judge(current)
            if self._store_usable():
                try:
                    self._publish()
                    if self.heartbeat.due():
                        self.heartbeat.beat(self.store)
                    if not self._stack_dumped and self.store.check([f"{self._prefix}stack{self.rank}"]):
                        self._stack_dumped = True  # once: another rank asked
                        print_stacks(self.rank)
                    for hook in list(self.poll_hooks.values()):
                        hook(self)
                except Exception as error:  # noqa: BLE001 - the store's host may be gone or cut off; keep timing
                    self._store_failed_at = time.monotonic()
                    self.heartbeat.store_failed(error)
            lost = self.heartbeat.verdict()
            if lost is not None:
                self._lost(lost)

    def _beat_for_quorum(self) -> None:
        """Under heal: the quorum's heartbeat, judged by the launcher. A failed beat is tried again at the next
        poll, not after the backoff (the launcher's liveness timeout may be a few beats); each call is bounded by
        the job store's own timeout, and a launcher gone for good takes its workers with it (``PDEATHSIG``)."""
        with contextlib.suppress(Exception):  # the store is slow or gone: the next poll tries again
            self.quorum.beat(self.store)

    def _lost(self, lost: str) -> None:
        """A host is lost: stop the process (the launcher stops the rest), unless the job's policy is to go on
        without a lost worker (``--on-worker-failure continue``): then say so once and stop judging that peer."""
        text = f"loom watchdog: rank {self.rank} ({self.heartbeat.host or host_description()}) {lost}"
        if os.environ.get("LOOM_ON_WORKER_FAILURE") == "continue":
            print(f"{text}; going on without it (--on-worker-failure continue)", file=sys.stderr, flush=True)
            self.heartbeat.forget()
            return
        self._stop_process(f"{text} ({doing(self.current)})", PeerLostError)

    def _store_usable(self) -> bool:
        backoff = min(STORE_BACKOFF_S, self.heartbeat.timeout_s / 4)
        return self.store is not None and time.monotonic() - self._store_failed_at > backoff

    def _judge(self, current: tuple[str, int, float]) -> None:
        """Stop the process if the wait in ``current`` is a hang (see the module docstring)."""
        now = time.monotonic()
        waited = now - current[2]
        if waited > self.work_timeout_s:
            records = self.read_records() if self._store_usable() else {}
            if not self._stacks_asked and records:  # their stacks in the output before the job ends
                with contextlib.suppress(Exception):
                    self._ask_for_stacks(current, waited, records)
                    time.sleep(2 * self.poll_s)  # (their watchdog threads print within a poll)
            self._report_and_exit(
                current, f"ranks {_working(records)} were outside collectives longer than the work timeout "
                f"({self.work_timeout_s:.0f} s, LOOM_WORK_TIMEOUT_S)", records or None,
            )  # fmt: skip
        if waited <= self.timeout_s or now < self._next_check:
            return
        records = self.read_records()
        if all_inside_s(records, self.rank, waited) > self.timeout_s:
            self._report_and_exit(current, None, records)
        # some rank is alive outside any collective: its own work; say where it is, once, and look again in a
        # while (one read per rank)
        if not self._stacks_asked:
            try:
                self._ask_for_stacks(current, waited, records)
            except Exception:  # noqa: BLE001 - a failed ask must not stop the timing; the store is left alone a while
                self._store_failed_at = time.monotonic()
        self._next_check = now + max(self.poll_s, min(10.0, self.timeout_s / 10))

    def _ask_for_stacks(self, current: tuple[str, int, float], waited: float, records: dict) -> None:
        """Past the hang timeout with some rank alive outside any collective: ask those ranks (a key each in the
        store, read by their watchdog threads) to print their Python stacks, and say so once for the job."""
        self._stacks_asked = True
        working = _working(records)
        if not working:
            return
        for r in working:
            self.store.set(f"{self._prefix}stack{r}", "1")
        if self.store.add(f"{self._prefix}stacks-announced", 1) != 1:
            return  # another waiting rank said it already
        print(stacks_asked(self.rank, current[0], current[1], waited, working, self.timeout_s,
                           self.work_timeout_s), file=sys.stderr, flush=True)  # fmt: skip

    def read_records(self) -> dict[int, dict | None]:
        """Every rank's published record (None where it could not be read)."""
        records: dict[int, dict | None] = {}
        for r in range(self.world_size):
            try:
                key = f"{self._prefix}rank{r}"
                if r == self.rank:
                    records[r] = self.record()
                elif not self._store_usable():
                    records[r] = None
                else:  # check first: get() waits for a key that does not exist yet
                    records[r] = json.loads(self.store.get(key)) if self.store.check([key]) else None
            except Exception:  # noqa: BLE001 - report what can be read
                self._store_failed_at = time.monotonic()
                records[r] = None
        return records

    def _report_and_exit(
        self, current: tuple[str, int, float], why: str | None = None, records: dict | None = None
    ) -> None:
        """The first rank to time out prints the full report; the others one line (the same facts)."""
        op, seq, waited = current[0], current[1], time.monotonic() - current[2]
        try:
            if not self._store_usable():
                raise ConnectionError("the store failed a moment ago")
            first = self.store.add(f"{self._prefix}reported", 1) == 1
        except Exception:  # noqa: BLE001 - the store's host has reported and exited, died, or is cut off
            self._store_failed_at = time.monotonic()
            first = None
        if first:
            text = hang_report(
                self.rank, op, seq, waited, records if records is not None else self.read_records(), why
            )
        else:
            why = "another rank reported the ranks involved" if first is False else "the store is unreachable"
            text = (
                f"loom watchdog: rank {self.rank} waited {waited:.1f} s in collective '{op}' #{seq} ({why})"
            )
        self._stop_process(text, HangError)

    def _stop_process(self, text: str, error: type[Exception]) -> None:
        stop_process(text, error, self.rank, self.poll_s)


def _working(records: dict[int, dict | None]) -> list[int]:
    """The ranks whose record shows them alive outside any collective (doing their own work)."""
    return [r for r, rec in records.items() if rec is not None and rec.get("current") is None]


_active: Watchdog | None = None
"""The process's watchdog, the one `Watchdog.start` made last: one per process, because a hang stops the process
as a whole."""


def collective(op: str) -> contextlib.AbstractContextManager[int | None]:
    """``with loom.fault.watchdog.collective("my all-gather"): ...`` -- counted by the active watchdog, if any."""
    return _active.collective(op) if _active is not None else contextlib.nullcontext()
