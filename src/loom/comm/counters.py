"""Bytes and calls of this process's collectives, kept by every function in `loom.comm`.

Two transports, counted apart (`by_transport()`) and summed (`snapshot()`):

- *socket*: bytes through the process-group backend. ``ring`` and ``driver`` count them exactly; ``native`` cannot
  see inside ``torch.distributed.all_reduce``, so it records an *estimate*, a bandwidth-optimal ring's
  ``2 (N-1)/N * D`` bytes each way for ``D`` bytes on ``N`` processes (NCCL's "bus bandwidth" convention).
- *shm*: the bytes ``shm`` and ``hierarchical`` write into the shared segment for others ("sent") and read from
  it ("received"); ``hierarchical`` also sends socket bytes among host leaders.

``auto`` records each call under ``"auto"``; one-time set-up traffic (host and segment names, calibration) goes
under ``"setup"``, so a job's totals include everything loom sent. Every call counts one op, even one that sends
nothing. Counts are per process: sum `snapshot()` over ranks for job totals.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

__all__ = ["CommCounters", "Tally", "Traffic", "counters"]


class Traffic(NamedTuple):
    """Bytes one collective moved through the backend's sockets and through shared memory (written for others,
    read from others' writes; the module docstring says what each transport counts)."""

    sent: int = 0
    received: int = 0
    shm_sent: int = 0
    shm_received: int = 0

    def plus(self, other: Traffic) -> Traffic:
        """Field-wise sum (``+`` would concatenate the tuples)."""
        return Traffic(*(a + b for a, b in zip(self, other, strict=True)))


class Tally:
    """The calls of one exchange whose traffic per call is fixed when it is set up (`CommCounters.tally`): the
    exchange counts a call with ``tally.calls += 1`` from its one thread, so its step makes no call into this
    module, and the counters add ``calls`` times ``traffic`` when they are read."""

    __slots__ = ("algorithm", "calls", "traffic")

    def __init__(self, algorithm: str, traffic: Traffic) -> None:
        self.algorithm, self.traffic, self.calls = algorithm, traffic, 0


class CommCounters:
    """Running totals of one process's collective traffic; `reset()` starts over, `snapshot()` reads them."""

    def __init__(self) -> None:
        # DDP may run communication hooks outside the thread that calls backward, so updates take a lock.
        self._lock = threading.Lock()
        self._recorded = [0, 0, 0, 0]
        """What `record` added up, field by field as in `Traffic` (added in place: `record` runs at every
        collective that has no `Tally`); the totals add the tallies' (`_traffic`)."""
        self._ops: dict[str, int] = {}
        self._tallies: list[Tally] = []

    def record(
        self, algorithm: str, sent: int, received: int, shm_sent: int = 0, shm_received: int = 0
    ) -> None:
        """Add one call of ``algorithm`` that moved ``sent`` / ``received`` socket bytes (and shm bytes)."""
        with self._lock:
            recorded = self._recorded
            recorded[0] += sent
            recorded[1] += received
            recorded[2] += shm_sent
            recorded[3] += shm_received
            self._ops[algorithm] = self._ops.get(algorithm, 0) + 1

    def tally(self, algorithm: str, traffic: Traffic) -> Tally:
        """A `Tally` for an exchange that moves ``traffic`` at each call, counted under ``algorithm``."""
        tally = Tally(algorithm, traffic)
        with self._lock:
            self._tallies.append(tally)
        return tally

    def _traffic(self) -> Traffic:
        """Everything counted so far: `record`'s sums plus every tally's calls times its traffic (a plain loop:
        the step record reads the totals at every step)."""
        sent, received, shm_sent, shm_received = self._recorded
        for tally in self._tallies:
            calls, traffic = tally.calls, tally.traffic
            if calls:
                sent += calls * traffic.sent
                received += calls * traffic.received
                shm_sent += calls * traffic.shm_sent
                shm_received += calls * traffic.shm_received
        return Traffic(sent, received, shm_sent, shm_received)

    @property
    def socket_bytes_sent(self) -> int:
        """Bytes this process sent over sockets (exact for ring/driver, the ring estimate for native)."""
        return self._traffic().sent

    @property
    def socket_bytes_received(self) -> int:
        """Bytes this process received over sockets (same convention as `socket_bytes_sent`)."""
        return self._traffic().received

    @property
    def shm_bytes_sent(self) -> int:
        """Bytes this process wrote into shared memory for others to read."""
        return self._traffic().shm_sent

    @property
    def shm_bytes_received(self) -> int:
        """Bytes this process read from shared memory that others wrote."""
        return self._traffic().shm_received

    @property
    def ops(self) -> dict[str, int]:
        """Number of calls per algorithm name."""
        with self._lock:
            ops = dict(self._ops)
            for tally in self._tallies:
                if tally.calls:
                    ops[tally.algorithm] = ops.get(tally.algorithm, 0) + tally.calls
        return ops

    def reset(self) -> None:
        with self._lock:
            self._recorded, self._ops = [0, 0, 0, 0], {}
            for tally in self._tallies:
                tally.calls = 0

    def snapshot(self) -> dict[str, Any]:
        """A copy safe to keep or serialize: ``{"bytes_sent", "bytes_received", "ops": {algorithm: calls}}``, the
        byte totals over both transports (split: `by_transport()`)."""
        sent, received = self.totals()
        return {"bytes_sent": sent, "bytes_received": received, "ops": self.ops}

    def totals(self) -> tuple[int, int]:
        """``(bytes sent, bytes received)`` over both transports: `snapshot()`'s sums, without copying ``ops``."""
        with self._lock:
            t = self._traffic()
        return t.sent + t.shm_sent, t.received + t.shm_received

    def by_transport(self) -> dict[str, dict[str, int]]:
        """``{"socket": {"bytes_sent", "bytes_received"}, "shm": {...}}``: the totals of `snapshot()`, split."""
        with self._lock:
            t = self._traffic()
        return {
            "socket": {"bytes_sent": t.sent, "bytes_received": t.received},
            "shm": {"bytes_sent": t.shm_sent, "bytes_received": t.shm_received},
        }

    def __repr__(self) -> str:
        return f"CommCounters({self.snapshot()})"


# The one piece of module state in loom.comm: a process has one set of sockets, hence one set of totals.
_COUNTERS = CommCounters()


def counters() -> CommCounters:
    """This process's counters (the same object on every call)."""
    return _COUNTERS
