"""Bytes and calls of this process's collectives, kept by every function in `loom.comm`.

What each algorithm records:

- ``ring`` and ``driver`` count the exact bytes of the point-to-point messages this process sent and received.
- ``native`` cannot see inside ``torch.distributed.all_reduce`` (gloo and NCCL pick their own algorithm, which
  may be a ring, a tree or halving-doubling), so it records an *estimate*: the bus bytes of a bandwidth-optimal
  ring, ``2 (N-1)/N * D`` each way for ``D`` bytes on ``N`` processes (rounded down to whole bytes). This is the
  convention of NCCL's "bus bandwidth"; compare it with the ring's exact count knowing it is a model.

Every call counts one op under its algorithm, including calls that send nothing (one process, empty tensor).
The counts are per process: sum `snapshot()` over ranks for job totals.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["CommCounters", "counters"]


class CommCounters:
    """Running totals of one process's collective traffic; `reset()` starts over, `snapshot()` reads them."""

    def __init__(self) -> None:
        # DDP may run communication hooks outside the thread that calls backward, so updates take a lock.
        self._lock = threading.Lock()
        self.bytes_sent = 0
        """Bytes this process sent (exact for ring/driver, the ring estimate for native)."""
        self.bytes_received = 0
        """Bytes this process received (same convention as `bytes_sent`)."""
        self.ops: dict[str, int] = {}
        """Number of calls per algorithm name."""

    def record(self, algorithm: str, sent: int, received: int) -> None:
        """Add one call of ``algorithm`` that moved ``sent`` / ``received`` bytes."""
        with self._lock:
            self.bytes_sent += sent
            self.bytes_received += received
            self.ops[algorithm] = self.ops.get(algorithm, 0) + 1

    def reset(self) -> None:
        with self._lock:
            self.bytes_sent = 0
            self.bytes_received = 0
            self.ops = {}

    def snapshot(self) -> dict[str, Any]:
        """A copy safe to keep or serialize: ``{"bytes_sent", "bytes_received", "ops": {algorithm: calls}}``."""
        with self._lock:
            return {
                "bytes_sent": self.bytes_sent,
                "bytes_received": self.bytes_received,
                "ops": dict(self.ops),
            }

    def __repr__(self) -> str:
        return f"CommCounters({self.snapshot()})"


# The one piece of module state in loom.comm: a process has one set of sockets, hence one set of totals.
_COUNTERS = CommCounters()


def counters() -> CommCounters:
    """This process's counters (the same object on every call)."""
    return _COUNTERS
