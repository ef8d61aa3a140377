"""The frames of `loom.comm.peer`: a fixed header and raw bytes, checked before anything is allocated.

Every frame is a `HEADER` (44 bytes, big-endian)::

    magic "LMGP" | version u8 | kind u8 | flags u16 | sender u32 | seq u64 | answered u64 | layout u64 | length u64

followed by ``length`` raw bytes of values, whose size both ends know from the set-up (``payload_bytes``).
Nothing else is decoded: `read_header` refuses another length, another ``layout`` (a fingerprint of the model),
a kind that does not belong on the connection (requests travel on the connection their sender dialed, answers
come back on it), a sender other than the authenticated peer, or an answer to no outstanding request. A refused
frame closes its connection; the declared length is never used to allocate anything.

Kinds: ``EXCHANGE`` carries the sender's values and is answered with ``REPLY`` (the receiver's values) or
``BUSY`` (a bare header); ``COPY`` carries nothing and is answered with ``REPLY``. A request's ``answered`` is the
seq of the receiver's last request that the sender had answered when it sent it (the symmetry of
`loom.comm.peer`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, fields

from loom.errors import FrameRefused

__all__ = ["BUSY", "COPY", "EXCHANGE", "HEADER", "MAGIC", "REPLY", "VERSION", "FrameRefused", "PeerStats",
           "header", "read_header"]  # fmt: skip

HEADER = struct.Struct(">4sBBHIQQQQ")
MAGIC, VERSION = b"LMGP", 1
EXCHANGE, COPY, REPLY, BUSY = 1, 2, 3, 4
REQUESTS, ANSWERS = frozenset({EXCHANGE, COPY}), frozenset({REPLY, BUSY})


def header(kind: int, sender: int, seq: int, layout: int, length: int, answered: int = 0) -> bytes:
    return HEADER.pack(MAGIC, VERSION, kind, 0, sender, seq, answered, layout, length)


def read_header(
    head: bytes, *, peer: int, answers: bool, layout: int, payload_bytes: int, outstanding: int | None
) -> tuple[int, int, int, int]:
    """``(kind, seq, length, answered)`` of a complete header received from ``peer`` on a connection that carries
    answers (``answers``: this side dialed it, ``outstanding`` is the seq of its request in flight, or None) or
    requests; raises `FrameRefused` naming what is wrong."""
    magic, version, kind, _, sender, seq, answered, their_layout, length = HEADER.unpack(head)
    expected = payload_bytes if kind in (EXCHANGE, REPLY) else 0
    if magic != MAGIC or version != VERSION:
        raise FrameRefused("not a gossip frame")
    if kind not in (ANSWERS if answers else REQUESTS) or sender != peer:
        raise FrameRefused(f"frame kind {kind} from rank {sender} does not belong on this connection")
    if their_layout != layout:
        raise FrameRefused("its model differs from this one (another parameter layout)")
    if length != expected:
        raise FrameRefused(f"a frame of {length} bytes where {expected} were expected")
    if answers and outstanding != seq:
        raise FrameRefused(f"an answer to request {seq}, which is not outstanding")
    return kind, seq, length, answered


@dataclass
class PeerStats:
    """What one node did since it started (numbers only)."""

    bytes_sent: int = 0
    """Bytes written to peer connections: frames and handshakes."""
    bytes_received: int = 0
    """Bytes read from them."""
    requests: int = 0
    """Requests sent."""
    replies: int = 0
    """Requests answered with values within their deadline."""
    busy: int = 0
    """Requests answered BUSY (the peer was exchanging with this node the other way)."""
    late: int = 0
    """Requests whose answer missed the deadline (training went on without it)."""
    late_applied: int = 0
    """Late answers that arrived afterwards and were applied."""
    abandoned: int = 0
    """Late requests given up (their connection closed) before an answer came."""
    dialed: int = 0
    """Connections this node opened (each a handshake of 64 bytes out, 49 in)."""
    accepted: int = 0
    """Connections from peers that proved the job secret (49 bytes out, 64 in)."""
    unreachable: int = 0
    """Requests that could not be made or lost their connection: no address, refused, closed, bad handshake."""
    served: int = 0
    """Requests from peers answered with this node's values."""
    refused: int = 0
    """Requests from peers answered BUSY."""
    rejected: int = 0
    """Incoming connections closed because they did not prove the job secret (or too many at once)."""
    dropped: int = 0
    """Authenticated connections closed for a refused frame (see `read_header`)."""

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
