"""Hang diagnosis: every collective loom issues carries a sequence number, and a stuck one stops the job.

The idea is the one behind NCCL's flight recorder and torchft's timeouts: a collective only completes when
every rank has entered it, so each rank counts the collectives it issues (one sequence number for all of
them, in issue order, which is the same on every rank of a correct program) and remembers its last completed
``(op, seq)`` and the one it is in now. A background thread publishes that record to a side channel that does
not depend on the stuck collective -- a client of the job's store (``MASTER_ADDR:MASTER_PORT``: loom's
authenticated store under `loom run`, a ``TCPStore`` under ``torchrun``), under ``loom/watchdog/rank<r>`` -- and
checks the clock. Every store call is bounded (`STORE_CALL_S`) and a store that fails is left alone for
`STORE_BACKOFF_S`, so a partitioned node (the store's host unreachable) still detects its hang on time.

Uneven work between collectives is ordinary: rank 0 evaluating or writing a checkpoint alone while the others
wait in the next collective is not a hang. So the hang timeout (``timeout_s``, default `DEFAULT_TIMEOUT_S`)
counts only the time during which *every* rank is inside a collective (the same one, stuck, or different ones:
they disagree on the order and will never meet) or cannot be heard from (its record unreadable, or not refreshed:
every rank's thread re-publishes its record each poll, so a live rank's record is never older than a few polls).
A rank outside any collective and alive is doing its own work; the others wait for it up to ``work_timeout_s``
(default `DEFAULT_WORK_TIMEOUT_S`, the 30 minutes PyTorch's gloo and ``torchrun`` wait by default), and only then
stop the job with a report naming it. When a rank has waited past the timeout and the check says hung, the
thread reads every rank's record, prints a report naming

- the operation and sequence number this rank waits at,
- the ranks that did not arrive there (their current sequence number is lower, or they are inside another
  operation at the same number: a mismatch), and
- every rank's last completed operation and how long ago it published,

records it in the elastic agent's error file (so ``loom run`` names it), and ends the process with exit code
1 (``os._exit`` after flushing: the main thread is blocked inside C++ and cannot be interrupted). The launcher
then stops the other workers, so the job never hangs silently.

```python
wd = Watchdog.start(topology, timeout_s=120)
with wd.collective("loss all-reduce"):
    dist.all_reduce(loss)
```

Limits: only collectives wrapped in `collective` are counted (DataParallel wraps its gradient, loss,
sample-count and evaluation reductions, `loom.parallel.data.own_loop` the gradient all-reduce of a backward, and
`loom.fault.desync` its check; DDP's own start-up broadcast and buffer broadcasts are not); a rank blocked in a
collective that is not counted looks like a rank doing its own work, so it is waited for up to the work timeout.
The process group's own timeout (``loom.init(timeout_s=...)``) must be at least the work timeout, or gloo gives
up first with its bare error. The published records lag by the poll interval (a tenth of the timeout, at most
1 s), so a rank killed with SIGKILL shows its state from up to that long before it died. The store is hosted
by rank 0; if rank 0 itself died the report says that the other ranks' records could not be read. Detection
takes between the timeout and the timeout plus one poll interval.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import os
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from loom.errors import HangError  # noqa: F401 - raised here, defined there
from loom.topology import Topology

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DEFAULT_WORK_TIMEOUT_S",
    "HangError",
    "Watchdog",
    "active",
    "collective",
    "hang_timeout_s",
    "work_timeout_s",
]

DEFAULT_TIMEOUT_S = 180.0
"""How long every rank may sit inside collectives without one completing. No rank is doing its own work then,
so nothing can still arrive: minutes are a hang on any network (and below the process group's timeout, so loom's
report comes before gloo's bare error). The launcher also takes it as the time after which a silent node is
lost."""
DEFAULT_WORK_TIMEOUT_S = 1800.0
"""How long ranks wait in a collective for a rank that is alive and doing its own work outside collectives
(rank-0-only evaluation, checkpoint writing): PyTorch's default process-group timeout for gloo (30 minutes)."""
STORE_CALL_S = 3.0
"""Longest one store call of the watchdog may take (connecting included)."""
STORE_BACKOFF_S = 5.0
"""After a failed store call, the watchdog does not touch the store for this long."""
# Keys per restart attempt: a store shared across attempts (torchrun's) still holds the previous attempt's.
_PREFIX = "loom/watchdog/attempt{}/"


def hang_timeout_s(requested: float | None = None) -> float:
    """The timeout to use: ``requested``, else ``LOOM_HANG_TIMEOUT_S``, else `DEFAULT_TIMEOUT_S`."""
    return _seconds(requested, "LOOM_HANG_TIMEOUT_S", DEFAULT_TIMEOUT_S, "hang timeout")


def work_timeout_s(requested: float | None = None) -> float:
    """The wait for a rank doing its own work: ``requested``, else ``LOOM_WORK_TIMEOUT_S``, else
    `DEFAULT_WORK_TIMEOUT_S`."""
    return _seconds(requested, "LOOM_WORK_TIMEOUT_S", DEFAULT_WORK_TIMEOUT_S, "work timeout")


def _seconds(requested: float | None, variable: str, default: float, what: str) -> float:
    if requested is None:
        raw = os.environ.get(variable, "")
        try:
            requested = float(raw) if raw else default
        except ValueError:
            raise ValueError(f"{variable}={raw!r} is not a number of seconds") from None
    if isinstance(requested, bool) or not float(requested) > 0:
        raise ValueError(f"the {what} must be a positive number of seconds, got {requested!r}")
    return float(requested)


class Watchdog:
    """Counts this rank's collectives and stops the process when one of them waits past ``timeout_s``.

    Use `Watchdog.start` (it needs a store); a watchdog built without one only counts (single process, tests).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        timeout_s: float,
        store: Any = None,
        work_timeout: float | None = None,
    ) -> None:
        self.rank, self.world_size, self.timeout_s = rank, world_size, hang_timeout_s(timeout_s)
        self.work_timeout_s = max(work_timeout_s(work_timeout), self.timeout_s)
        """How long to wait for a rank doing its own work outside collectives (never below ``timeout_s``)."""
        self.store = store
        self.poll_s = min(1.0, self.timeout_s / 10)
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
        self._prefix = _PREFIX.format(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self._store_failed_at = -float("inf")

    @classmethod
    def start(
        cls, topology: Topology, timeout_s: float | None = None, work_timeout: float | None = None
    ) -> Watchdog:
        """A watchdog for this process, publishing through a new client of the job's TCP store.

        Without a process group (one process) the watchdog only counts: there is nobody to wait for.
        """
        timeout = hang_timeout_s(timeout_s)
        reuse = _active
        if reuse is not None and (reuse.rank, reuse.world_size) == (topology.rank, topology.world_size):
            reuse.timeout_s, reuse.poll_s = timeout, min(1.0, timeout / 10)  # a second setup() in one process
            reuse.work_timeout_s = max(work_timeout_s(work_timeout), timeout)
            return reuse
        store = _side_channel() if topology.is_distributed else None
        wd = cls(topology.rank, topology.world_size, timeout, store, work_timeout)
        if store is not None:
            with contextlib.suppress(Exception):  # bounded; the thread retries
                wd._publish()
            wd._thread = threading.Thread(target=wd._watch, name=f"loom-watchdog-{wd.rank}", daemon=True)
            wd._thread.start()
            # Registered after `loom.init`'s shutdown, so it runs before it: the thread and the store client
            # go while the process group (and rank 0's store server) still exist; a thread left inside a store
            # call during interpreter teardown can abort the process.
            atexit.register(wd.stop)
        _set_active(wd)
        return wd

    def stop(self) -> None:
        """Stop the thread and close the store client (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
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
        current = self.current
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "current": None if current is None else [current[0], current[1]],
            "waiting_s": None if current is None else round(time.monotonic() - current[2], 3),
            "done": None if self.last_done is None else list(self.last_done),
            "time": time.time(),
        }

    # -- the watchdog thread ---------------------------------------------------------------------------------
    def _publish(self) -> None:
        # Every poll, changed or not: the refreshed time tells the others this rank is alive (doing its own work
        # when it is outside a collective), and while it waits, refreshes waiting_s.
        self.store.set(f"{self._prefix}rank{self.rank}", json.dumps(self.record()))

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            current = self.current
            if current is not None:
                self._judge(current)
            if self._store_usable():
                try:
                    self._publish()
                    if not self._stack_dumped and self.store.check([f"{self._prefix}stack{self.rank}"]):
                        self._dump_stack()
                except Exception:  # noqa: BLE001 - the store's host may be gone or cut off; keep timing anyway
                    self._store_failed_at = time.monotonic()

    def _store_usable(self) -> bool:
        return self.store is not None and time.monotonic() - self._store_failed_at > STORE_BACKOFF_S

    def _judge(self, current: tuple[str, int, float]) -> None:
        """Stop the process if the wait in ``current`` is a hang (see the module docstring)."""
        now = time.monotonic()
        waited = now - current[2]
        if waited > self.work_timeout_s:
            records = self._read_records() if self._store_usable() else {}
            working = [r for r, rec in records.items() if rec is not None and rec.get("current") is None]
            self._report_and_exit(
                current, f"ranks {working} were outside collectives longer than the work timeout "
                f"({self.work_timeout_s:.0f} s, LOOM_WORK_TIMEOUT_S)", records or None,
            )  # fmt: skip
        if waited <= self.timeout_s or now < self._next_check:
            return
        records = self._read_records()
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
        working = [r for r, rec in records.items() if rec is not None and rec.get("current") is None]
        if not working:
            return
        for r in working:
            self.store.set(f"{self._prefix}stack{r}", "1")
        if self.store.add(f"{self._prefix}stacks-announced", 1) != 1:
            return  # another waiting rank said it already
        print(
            f"loom watchdog: rank {self.rank} has waited {waited:.0f} s in collective '{current[0]}' #{current[1]} "
            f"(past the hang timeout, {self.timeout_s:.0f} s, LOOM_HANG_TIMEOUT_S) while rank(s) {working} are "
            "outside any collective: their own work (evaluation, a checkpoint) or stuck in it. Their Python "
            f"stacks follow on their output; the others wait for them up to the work timeout "
            f"({self.work_timeout_s:.0f} s, LOOM_WORK_TIMEOUT_S).",
            file=sys.stderr,
            flush=True,
        )

    def _dump_stack(self) -> None:
        """Print every thread's Python stack to stderr (the launcher's output), once: another rank asked."""
        import faulthandler

        self._stack_dumped = True
        print(
            f"loom watchdog: rank {self.rank} is outside any collective while other ranks wait for it; its Python "
            "stack (every thread, most recent call first):",
            file=sys.stderr,
            flush=True,
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()

    def _read_records(self) -> dict[int, dict | None]:
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
                self.rank, op, seq, waited, records if records is not None else self._read_records(), why
            )
        else:
            why = "another rank reported the ranks involved" if first is False else "the store is unreachable"
            text = (
                f"loom watchdog: rank {self.rank} waited {waited:.1f} s in collective '{op}' #{seq} ({why})"
            )
        print(text, file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):
            from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

            ErrorHandler().record_exception(HangError(text.splitlines()[0]))
        sys.stdout.flush()
        if self.rank == 0:  # rank 0 hosts the store: give the others a moment to read it before it goes
            time.sleep(self.poll_s)
        os._exit(1)


def _side_channel() -> Any:
    """A client of the job's TCP store of its own (not shared with the main thread, which may be blocked in
    it), else the process group's store, else None (the watchdog then only counts, with a warning)."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    if addr and port.isdigit() and "LOOM_STORE_PREFIX" in os.environ:
        from loom.net.store import LoomStore, job_secret  # `loom run`'s store (authenticated)

        with contextlib.suppress(Exception):
            return LoomStore(
                addr, int(port), job_secret(), prefix=os.environ["LOOM_STORE_PREFIX"],
                timeout=datetime.timedelta(seconds=STORE_CALL_S), connect_timeout_s=STORE_CALL_S,
                io_timeout_s=STORE_CALL_S,
            )  # fmt: skip
    elif addr and port.isdigit():
        with contextlib.suppress(Exception):
            return dist.TCPStore(
                addr,
                int(port),
                is_master=False,
                timeout=datetime.timedelta(seconds=STORE_CALL_S),  # bounds every call
                wait_for_workers=False,
            )
    with contextlib.suppress(Exception):
        return dist.distributed_c10d._get_default_store()
    warnings.warn("loom watchdog: no store to publish progress to; hangs will not be diagnosed", stacklevel=3)
    return None


def all_inside_s(records: dict[int, dict | None], rank: int, waited_s: float) -> float:
    """How long every rank has been inside a collective or silent, as far as ``records`` tell (see the module
    docstring): the minimum over ranks of a rank's time in its collective, or of the time since it was last heard
    from when it is outside one (a live rank's is under a few polls). A record that could not be read counts as
    forever (the rank cannot be shown to be working); this rank's own wait is ``waited_s``."""
    now, inside = time.time(), waited_s
    for r, rec in records.items():
        if r == rank or rec is None:
            continue
        age = max(0.0, now - float(rec.get("time", now)))
        waiting = rec.get("waiting_s") if rec.get("current") is not None else 0.0
        inside = min(inside, float(waiting or 0.0) + age)
    return inside


def hang_report(
    rank: int,
    op: str,
    seq: int,
    waited_s: float,
    records: dict[int, dict | None],
    why: str | None = None,
) -> str:
    """The report: first line a summary (what the launcher shows), then one line per rank.

    A rank did not arrive at ``(op, seq)`` if it has not entered collective ``seq`` yet, or is inside a
    different operation under that number (the ranks disagree on the order of collectives).
    """
    missing, unknown = [], [r for r, rec in sorted(records.items()) if rec is None]
    for r, rec in sorted(records.items()):
        if rec is None:
            continue
        cur, done = rec.get("current"), rec.get("done")
        entered = cur[1] if cur else (done[1] if done else 0)
        if entered < seq or (cur is not None and cur[1] == seq and cur[0] != op):
            missing.append(r)
    who = f"ranks {missing} did not arrive" if missing else "every rank that published arrived (a slow op?)"
    if unknown:
        who += f"; ranks {unknown} could not be read"
    if why:
        who += f"; {why}"
    lines = [
        f"loom watchdog: rank {rank} waited {waited_s:.1f} s in collective '{op}' #{seq}; {who}. "
        "HINT: every rank must issue the same collectives in the same order; raise LOOM_HANG_TIMEOUT_S "
        "if the operation is just slow."
    ]
    for r, rec in sorted(records.items()):
        if rec is None:
            lines.append(f"  rank {r}: no record (not started, or the store is unreachable)")
            continue
        cur, done = rec.get("current"), rec.get("done")
        now = f"in '{cur[0]}' #{cur[1]} for {rec.get('waiting_s')} s" if cur else "not in a collective"
        last = f"'{done[0]}' #{done[1]}" if done else "none"
        age = time.time() - float(rec.get("time", time.time()))
        lines.append(f"  rank {r}: last completed {last}; {now} (published {age:.1f} s ago)")
    return "\n".join(lines)


_active: Watchdog | None = None


def _set_active(wd: Watchdog) -> None:
    """The process's watchdog: one per process, because a hang stops the process as a whole."""
    global _active
    if _active is not None and _active is not wd:
        _active.stop()
    _active = wd


def active() -> Watchdog | None:
    """The watchdog `Watchdog.start` made last in this process, or None."""
    return _active


@contextlib.contextmanager
def collective(op: str) -> Iterator[int | None]:
    """``with loom.fault.watchdog.collective("my all-gather"): ...`` -- counted by the active watchdog, if any."""
    wd = _active
    if wd is None:
        yield None
        return
    with wd.collective(op) as seq:
        yield seq
