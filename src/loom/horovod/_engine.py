"""The negotiation engine: Horovod's controller, written over one gloo process group.

Collectives are matched across ranks by *name*, not by call order, as Horovod's are (why:
docs/horovod.md#how-it-works): each submitted `Request` gets a name (the caller's, or ``<kind>.noname.<n>``)
and a JSON description (`Request.meta`). One background thread runs *cycles*: one all-gather of every rank's
new announcements (a second, larger round only when a message does not fit the fixed buffer) updates the table
name -> {rank: meta}, then every operation that all active (not joined) ranks have announced runs, in the
order names were first announced. Every rank sees the same table, so every rank takes the same decision: run
it (`loom.horovod._ops`) or fail it with the same `RuntimeError` naming the ranks and the difference.

Idle cycles back off to ``HOROVOD_CYCLE_TIME`` milliseconds (default 5), and to 50 ms after 2 s without any
operation; a submission wakes this rank's engine at once, a peer's within its current sleep.
"""

from __future__ import annotations

import json
import os
import threading
import time

import torch
import torch.distributed as dist

from loom.horovod import _ops  # the data movement, kept apart from the negotiation
from loom.horovod._request import HorovodInternalError, Request

__all__ = ["Engine", "HorovodInternalError", "Request"]

_BUFFER = 4096  # bytes per rank in the common one-round exchange


def stopped_after_failure(rank: int) -> str:
    """What is true after the engine stopped on its own (a peer was lost: an elastic kill). A new ``hvd.init()``
    in this process cannot rejoin, since loom restarts the whole worker group instead of re-forming the ring."""
    return (
        f"rank {rank}: the Horovod engine stopped after a failure (a peer was lost). Under `loom run "
        "--max-restarts N` the launcher restarts every worker and hvd.elastic.run resumes from the last "
        "state.commit(); this process is ended with the group, and calling hvd.init() again here does not rejoin"
    )


class Engine:
    """The background negotiation thread of one `init()` (see the module docstring)."""

    def __init__(self, rank: int, size: int, group) -> None:
        self.rank, self.size, self.group = rank, size, group
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._submitted: list[Request] = []
        self._mine: dict[str, Request] = {}  # announced, not yet run
        self._table: dict[str, dict[int, dict]] = {}  # in announcement order: the order operations run in
        self._joined: set[int] = set()
        self._join_request: Request | None = None
        self._join_announced = False
        self._last_joined = -1
        self._stop = False
        self._stopped = threading.Event()
        self._counters: dict[str, int] = {}
        self._max_sleep = float(os.environ.get("HOROVOD_CYCLE_TIME", "5")) / 1000.0
        self._thread = threading.Thread(target=self._loop, name="loom-horovod-engine", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- submission (any thread)
    def submit(self, request: Request, name: str | None) -> Request:
        with self._lock:
            if self._stop:  # hvd.shutdown() was called: a new init() starts a new engine
                raise ValueError("Horovod has been shut down; call hvd.init() again.")
            if self._stopped.is_set():
                raise HorovodInternalError(stopped_after_failure(self.rank))
            if name is None:
                n = self._counters.get(request.kind, 0)
                self._counters[request.kind] = n + 1
                name = f"{request.kind}.noname.{n}"
            if name in self._mine or any(r.name == name for r in self._submitted):
                raise ValueError(
                    f"rank {self.rank}: a {request.kind} named {name!r} is already in progress; Horovod requires "
                    "the names of outstanding operations to be unique. HINT: synchronize the first one, or "
                    "use another name"
                )
            request.name = name
            self._submitted.append(request)
        self._wake.set()
        return request

    def join(self) -> int:
        """Announce that this rank has no more data; wait until every rank has; return the last to join."""
        request = Request("join", [], {})
        with self._lock:
            if self._join_request is not None:
                raise ValueError(f"rank {self.rank}: join() is already in progress")
            self._join_request, self._join_announced = request, False
        self._wake.set()
        return self.wait(request)

    def wait(self, request: Request):
        while not request.done.wait(1.0):
            if self._stopped.is_set() and not request.done.is_set():
                raise HorovodInternalError(f"rank {self.rank}: Horovod was shut down during {request.name}")
        if request.error is not None:
            raise request.error
        return request.result

    def stop(self, timeout_s: float = 60.0) -> None:
        """Leave when every rank has asked to; outstanding requests fail."""
        self._stop = True
        self._wake.set()
        self._thread.join(timeout_s)

    # ----------------------------------------------------------------- the cycle (engine thread)
    def _loop(self) -> None:
        sleep, idle_since = 0.0, time.monotonic()
        try:
            while True:
                active, everyone_stops = self._cycle()
                if everyone_stops:
                    break
                now = time.monotonic()
                if active:
                    idle_since = now
                # long idle (2 s): cycle at 20 Hz at most, so a job that waits costs little CPU
                ceiling = self._max_sleep if now - idle_since < 2.0 else max(self._max_sleep, 0.05)
                sleep = 0.0 if active else min(max(sleep * 2, 1e-4), ceiling)
                if sleep:
                    self._wake.wait(sleep)
                    self._wake.clear()
        except BaseException as error:  # noqa: BLE001 - every waiter must learn why
            self._fail_all(HorovodInternalError(f"rank {self.rank}: the Horovod engine failed: {error!r}"))
            raise
        finally:
            self._fail_all(HorovodInternalError(f"rank {self.rank}: Horovod was shut down"))
            self._stopped.set()

    def _cycle(self) -> tuple[bool, bool]:
        """``(active, everyone_stops)``: whether anything was announced or ran; whether every rank asked to stop."""
        with self._lock:
            new, self._submitted = self._submitted, []
            for r in new:
                self._mine[r.name] = r
            join = self._join_request is not None and not self._join_announced
            self._join_announced = self._join_announced or join
            stop = self._stop
        messages = self._exchange({"new": [[r.name, r.meta()] for r in new], "join": join, "stop": stop})
        for rank, m in enumerate(messages):
            for name, meta in m["new"]:
                self._table.setdefault(name, {})[rank] = meta
            if m["join"]:
                self._joined.add(rank)
                self._last_joined = rank
        working = set(range(self.size)) - self._joined
        ready = [n for n in self._table if working and working <= self._table[n].keys()]
        _ops.run_ready(self, [(n, self._table.pop(n), self._mine.pop(n, None)) for n in ready])
        if len(self._joined) == self.size:
            with self._lock:
                request, self._join_request = self._join_request, None
            self._joined.clear()
            if request is not None:
                request.finish(self._last_joined)
        active = bool(ready) or any(m["new"] or m["join"] for m in messages)
        return active, all(m["stop"] for m in messages)

    def _exchange(self, message: dict) -> list[dict]:
        """All-gather one JSON message per rank (one round when all fit in `_BUFFER` bytes)."""
        if self.size == 1:
            return [message]
        data = json.dumps(message, separators=(",", ":")).encode()
        framed = len(data).to_bytes(8, "little") + data
        bufs = self._all_gather(framed if len(framed) <= _BUFFER else framed[:8], _BUFFER)
        lengths = [int.from_bytes(b[:8].numpy().tobytes(), "little") for b in bufs]
        if max(lengths) > _BUFFER - 8:  # a second round, sized for the largest message
            bufs = self._all_gather(framed, 8 + max(lengths))
        return [json.loads(b[8 : 8 + n].numpy().tobytes()) for b, n in zip(bufs, lengths, strict=True)]

    def _all_gather(self, data: bytes, size: int) -> list[torch.Tensor]:
        """Every rank's ``data``, each in a zero-padded buffer of ``size`` bytes."""
        buf = torch.zeros(size, dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        bufs = [torch.empty_like(buf) for _ in range(self.size)]
        dist.all_gather(bufs, buf, group=self.group)
        return bufs

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            waiting = [*self._mine.values(), *self._submitted, self._join_request]
            self._mine, self._submitted, self._join_request = {}, [], None
        for r in waiting:
            if r is not None and not r.done.is_set():
                r.finish(error=error)
