"""Liveness apart from slowness: heartbeats on the watchdog's side channel, and a peer lost when they stop.

Each poll the watchdog thread of every rank bumps its own counter in the job's store (``beat<r>``) and reads the
next rank's on a ring. A peer is lost when its counter has not moved for ``liveness_timeout_s``
(`loom.fault.timeouts`); a rank cut off from the store judges by its own store calls failing for that long. A peer
that has not beaten yet is not judged; a rank that stops on purpose writes ``-1``. Why, the cost, how both sides of
a cut are named, the limits and the measurements: docs/fault-tolerance.md, "How liveness works".
"""

from __future__ import annotations

import os
import time
from typing import Any

__all__ = ["Heartbeat"]


class Heartbeat:
    """One rank's heartbeat bookkeeping: `beat` each interval, `verdict` after it (see the module docstring).

    ``store`` calls go through the caller (the watchdog thread), which tells `store_failed` when one raised;
    ``clock`` is injectable for tests.
    """

    def __init__(self, rank: int, world_size: int, timeout_s: float, prefix: str, clock: Any = None) -> None:
        self.rank, self.world_size, self.timeout_s, self.prefix = rank, world_size, timeout_s, prefix
        self.store_address = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        self.clock = clock or time.monotonic
        self.watched = (rank + 1) % world_size
        """The peer this rank listens to: the next rank on the ring."""
        self.watched_host: str | None = None
        self.last_count: int | None = None
        self.heard_at: float | None = None
        """When the watched peer's counter last moved (None: it has not beaten yet)."""
        self.left = False
        """The watched peer stopped its watchdog on purpose (its process ended)."""
        self.answered_at = self.clock()
        """When the store last answered a heartbeat round."""
        self.failed_at: float | None = None
        self.error = ""
        self.beat_at = -float("inf")
        self.host: str | None = None
        """This rank's host in words (`announce`), worked out once: a cut may take the route it was read from."""

    def key(self, rank: int, what: str = "beat") -> str:
        return f"{self.prefix}{what}{rank}"

    def announce(self, store: Any, host: str) -> None:
        """Publish this rank's host, for the reports of whoever watches it, and a first beat: the peer that
        watches this rank judges it from the first beat it reads, and a cut may come before the first poll."""
        self.host = host
        store.set(self.key(self.rank, "host"), host)
        store.add(self.key(self.rank), 1)

    def due(self) -> bool:
        """Whether a beat is due: one a second (a fifth of the timeout if shorter), however often the caller
        polls (a short hang timeout polls the watchdog more often)."""
        return self.clock() - self.beat_at >= min(1.0, self.timeout_s / 5) * 0.9

    def beat(self, store: Any) -> None:
        """One interval: bump this rank's counter and read the watched peer's (raises if the store fails)."""
        self.beat_at = self.clock()
        store.add(self.key(self.rank), 1)
        if self.world_size < 2:
            return
        count = int(store.add(self.key(self.watched), 0))  # add 0: a read that never waits for a missing key
        now = self.clock()
        self.answered_at = now
        if count != self.last_count:
            self.last_count = count
            if count < 0:
                self.left = True
            elif count > 0:
                self.left, self.heard_at = False, now
        if self.watched_host is None:  # each beat until known: a link cut early must still name the peer
            key = self.key(self.watched, "host")
            if store.check([key]):
                self.watched_host = store.get(key).decode(errors="replace")

    def store_failed(self, error: BaseException) -> None:
        self.failed_at = self.clock()
        self.error = f"{type(error).__name__}: {error}".strip()

    def leave(self, store: Any) -> None:
        """Mark this rank's silence from now on as intended (its watchdog stops; the process ends)."""
        store.set(self.key(self.rank), "-1")

    def forget(self) -> None:
        """Stop judging the watched peer, and the store's silence so far (after a verdict the job goes on from)."""
        self.left, self.failed_at, self.answered_at = True, None, self.clock()

    def verdict(self) -> str | None:
        """Why the job has lost a host, in words naming it, or None while every heartbeat is on time."""
        now = self.clock()
        setting = f"(liveness_timeout_s={self.timeout_s:g}, LOOM_LIVENESS_TIMEOUT_S)"
        peer = f"rank {self.watched}" + (f" ({self.watched_host})" if self.watched_host else "")
        silent_store = now - self.answered_at
        failing = self.failed_at is not None and self.failed_at >= self.answered_at  # none answered since
        if failing and silent_store > self.timeout_s:
            return (
                f"lost the job's store at {self.store_address} (the host of rank 0 and its launcher) and every "
                f"rank it reaches: no heartbeat for {silent_store:.0f} s {setting}, none of its calls answered "
                f"(last: {self.error or 'no answer'}); {peer} and the ranks on that side are out of sight. HINT: "
                "check the network between this host and the store's; this side stops, and the other side stops "
                "when it misses this side's heartbeats"
            )
        if self.left or self.heard_at is None or self.world_size < 2:
            return None
        silent_peer = now - self.heard_at
        if silent_peer > self.timeout_s and silent_store < self.timeout_s:
            return (
                f"lost {peer}: no heartbeat for {silent_peer:.0f} s {setting} while the job's store at "
                f"{self.store_address} answers: that host is down, or cut off from the store's. HINT: check that "
                "host and the network to it; raise LOOM_LIVENESS_TIMEOUT_S if its processes pause that long"
            )
        return None
