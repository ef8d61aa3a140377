"""Bytes and calls of this process's collectives, kept by every function in `loom.comm`.

Two transports are counted apart and summed in `snapshot()`; `by_transport()` gives them one by one:

- *socket*: bytes of messages through the process-group backend (gloo's TCP, or NCCL).
  ``ring`` and ``driver`` count the exact bytes of the point-to-point messages this process sent and received.
  ``native`` cannot see inside ``torch.distributed.all_reduce`` (gloo and NCCL pick their own algorithm, which
  may be a ring, a tree or halving-doubling), so it records an *estimate*: the bus bytes of a bandwidth-optimal
  ring, ``2 (N-1)/N * D`` each way for ``D`` bytes on ``N`` processes (rounded down to whole bytes). This is the
  convention of NCCL's "bus bandwidth"; compare it with the ring's exact count knowing it is a model.
- *shm*: for ``shm`` and ``hierarchical``, the exact bytes this process wrote into the shared segment for other
  processes to read ("sent") and read from it that other processes wrote ("received"); see `loom.comm.shm`.
  ``hierarchical`` also sends socket bytes: the ring among host leaders.

``auto`` records each call under ``"auto"`` with the traffic of the algorithm it picked. One-time set-up
traffic (exchanging host names and segment names, the calibration of ``auto``) is recorded under ``"setup"``,
with the ring estimate for its small collectives, so a job's totals include everything loom sent.

Every call counts one op under its algorithm, including calls that send nothing (one process, empty tensor).
The counts are per process: sum `snapshot()` over ranks for job totals.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

__all__ = ["CommCounters", "Traffic", "counters"]


class Traffic(NamedTuple):
    """Bytes one collective moved, per transport (see the module docstring for what each field counts)."""

    sent: int = 0
    """Bytes sent through the backend's sockets."""
    received: int = 0
    """Bytes received through the backend's sockets."""
    shm_sent: int = 0
    """Bytes written into shared memory for other processes to read."""
    shm_received: int = 0
    """Bytes read from shared memory that other processes wrote."""

    def plus(self, other: Traffic) -> Traffic:
        """Field-wise sum (``+`` would concatenate the tuples)."""
        return Traffic(*(a + b for a, b in zip(self, other, strict=True)))


class CommCounters:
    """Running totals of one process's collective traffic; `reset()` starts over, `snapshot()` reads them."""

    def __init__(self) -> None:
        # DDP may run communication hooks outside the thread that calls backward, so updates take a lock.
        self._lock = threading.Lock()
        self.socket_bytes_sent = 0
        """Bytes this process sent over sockets (exact for ring/driver, the ring estimate for native)."""
        self.socket_bytes_received = 0
        """Bytes this process received over sockets (same convention as `socket_bytes_sent`)."""
        self.shm_bytes_sent = 0
        """Bytes this process wrote into shared memory for others to read."""
        self.shm_bytes_received = 0
        """Bytes this process read from shared memory that others wrote."""
        self.ops: dict[str, int] = {}
        """Number of calls per algorithm name."""

    def record(
        self, algorithm: str, sent: int, received: int, shm_sent: int = 0, shm_received: int = 0
    ) -> None:
        """Add one call of ``algorithm`` that moved ``sent`` / ``received`` socket bytes (and shm bytes)."""
        with self._lock:
            self.socket_bytes_sent += sent
            self.socket_bytes_received += received
            self.shm_bytes_sent += shm_sent
            self.shm_bytes_received += shm_received
            self.ops[algorithm] = self.ops.get(algorithm, 0) + 1

    def reset(self) -> None:
        with self._lock:
            self.socket_bytes_sent = 0
            self.socket_bytes_received = 0
            self.shm_bytes_sent = 0
            self.shm_bytes_received = 0
            self.ops = {}

    def snapshot(self) -> dict[str, Any]:
        """A copy safe to keep or serialize: ``{"bytes_sent", "bytes_received", "ops": {algorithm: calls}}``.

        The byte totals are over both transports (sockets and shared memory); see `by_transport()`.
        """
        with self._lock:
            return {
                "bytes_sent": self.socket_bytes_sent + self.shm_bytes_sent,
                "bytes_received": self.socket_bytes_received + self.shm_bytes_received,
                "ops": dict(self.ops),
            }

    def totals(self) -> tuple[int, int]:
        """``(bytes sent, bytes received)`` over both transports: `snapshot()`'s sums, without copying ``ops``."""
        return (
            self.socket_bytes_sent + self.shm_bytes_sent,
            self.socket_bytes_received + self.shm_bytes_received,
        )

    def by_transport(self) -> dict[str, dict[str, int]]:
        """``{"socket": {"bytes_sent", "bytes_received"}, "shm": {...}}``: the totals of `snapshot()`, split."""
        with self._lock:
            return {
                "socket": {
                    "bytes_sent": self.socket_bytes_sent,
                    "bytes_received": self.socket_bytes_received,
                },
                "shm": {"bytes_sent": self.shm_bytes_sent, "bytes_received": self.shm_bytes_received},
            }

    def __repr__(self) -> str:
        return f"CommCounters({self.snapshot()})"


# The one piece of module state in loom.comm: a process has one set of sockets, hence one set of totals.
_COUNTERS = CommCounters()


def counters() -> CommCounters:
    """This process's counters (the same object on every call)."""
    return _COUNTERS
