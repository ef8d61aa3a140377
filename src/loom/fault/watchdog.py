"""Hang diagnosis: every collective loom issues carries a sequence number, and a stuck one stops the job.

The idea is the one behind NCCL's flight recorder and torchft's timeouts: a collective only completes when
every rank has entered it, so each rank counts the collectives it issues (one sequence number for all of
them, in issue order, which is the same on every rank of a correct program) and remembers its last completed
``(op, seq)`` and the one it is in now. A background thread publishes that record to a side channel that does
not depend on the stuck collective -- a client of the job's store (``MASTER_ADDR:MASTER_PORT``: loom's
authenticated store under `loom run`, a ``TCPStore`` under ``torchrun``), under ``loom/watchdog/rank<r>`` -- and
checks the clock. Every store call is bounded (`STORE_CALL_S`) and a store that fails is left alone for
`STORE_BACKOFF_S`, so a partitioned node (the store's host unreachable) still detects its hang on time. When this rank has waited in one collective longer than
the timeout, the thread reads every rank's record, prints a report naming

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
sample-count and evaluation reductions, and `loom.fault.desync` its check; DDP's own start-up broadcast and
buffer broadcasts are not). The published records lag by the poll interval (a tenth of the timeout, at most
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

from loom.topology import Topology

__all__ = ["DEFAULT_TIMEOUT_S", "HangError", "Watchdog", "active", "collective", "hang_timeout_s"]

DEFAULT_TIMEOUT_S = 180.0
"""Below the process group's own 300 s timeout, so loom's report comes before gloo's bare error."""
STORE_CALL_S = 3.0
"""Longest one store call of the watchdog may take (connecting included)."""
STORE_BACKOFF_S = 5.0
"""After a failed store call, the watchdog does not touch the store for this long."""
# Keys per restart attempt: a store shared across attempts (torchrun's) still holds the previous attempt's.
_PREFIX = "loom/watchdog/attempt{}/"


class HangError(RuntimeError):
    """A collective waited longer than the hang timeout (recorded for the launcher; never raised)."""


def hang_timeout_s(requested: float | None = None) -> float:
    """The timeout to use: ``requested``, else ``LOOM_HANG_TIMEOUT_S``, else `DEFAULT_TIMEOUT_S`."""
    if requested is None:
        raw = os.environ.get("LOOM_HANG_TIMEOUT_S", "")
        try:
            requested = float(raw) if raw else DEFAULT_TIMEOUT_S
        except ValueError:
            raise ValueError(f"LOOM_HANG_TIMEOUT_S={raw!r} is not a number of seconds") from None
    if isinstance(requested, bool) or not float(requested) > 0:
        raise ValueError(f"the hang timeout must be a positive number of seconds, got {requested!r}")
    return float(requested)


class Watchdog:
    """Counts this rank's collectives and stops the process when one of them waits past ``timeout_s``.

    Use `Watchdog.start` (it needs a store); a watchdog built without one only counts (single process, tests).
    """

    def __init__(self, rank: int, world_size: int, timeout_s: float, store: Any = None) -> None:
        self.rank, self.world_size, self.timeout_s = rank, world_size, hang_timeout_s(timeout_s)
        self.store = store
        self.poll_s = min(1.0, self.timeout_s / 10)
        self.seq = 0
        """Sequence number of the last collective this rank entered (0: none yet)."""
        self.current: tuple[str, int, float] | None = None
        """``(op, seq, monotonic start)`` of the collective this rank is in, or None."""
        self.last_done: tuple[str, int] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._published: Any = None
        self._prefix = _PREFIX.format(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self._store_failed_at = -float("inf")

    @classmethod
    def start(cls, topology: Topology, timeout_s: float | None = None) -> Watchdog:
        """A watchdog for this process, publishing through a new client of the job's TCP store.

        Without a process group (one process) the watchdog only counts: there is nobody to wait for.
        """
        timeout = hang_timeout_s(timeout_s)
        reuse = _active
        if reuse is not None and (reuse.rank, reuse.world_size) == (topology.rank, topology.world_size):
            reuse.timeout_s, reuse.poll_s = timeout, min(1.0, timeout / 10)  # a second setup() in one process
            return reuse
        store = _side_channel() if topology.is_distributed else None
        wd = cls(topology.rank, topology.world_size, timeout, store)
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
        self.seq += 1
        seq = self.seq
        self.current = (op, seq, time.monotonic())
        try:
            yield seq
        finally:
            self.last_done = (op, seq)
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
        current, done = self.current, self.last_done
        state = (None if current is None else current[:2], done)
        if state != self._published or current is not None:  # while waiting, refresh waiting_s
            self.store.set(f"{self._prefix}rank{self.rank}", json.dumps(self.record()))
            self._published = state

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            current = self.current
            if current is not None and time.monotonic() - current[2] > self.timeout_s:
                self._report_and_exit(current)
            if self._store_usable():
                try:
                    self._publish()
                except Exception:  # noqa: BLE001 - the store's host may be gone or cut off; keep timing anyway
                    self._store_failed_at = time.monotonic()

    def _store_usable(self) -> bool:
        return self.store is not None and time.monotonic() - self._store_failed_at > STORE_BACKOFF_S

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

    def _report_and_exit(self, current: tuple[str, int, float]) -> None:
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
            text = hang_report(self.rank, op, seq, waited, self._read_records())
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
        from loom.launch.store import LoomStore, job_secret  # `loom run`'s store (authenticated)

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


def hang_report(rank: int, op: str, seq: int, waited_s: float, records: dict[int, dict | None]) -> str:
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
