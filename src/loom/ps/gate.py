"""Who may send a parameter server anything, and how much a connection can make it hold.

Every frame is authenticated by its MAC (`loom.ps.wire`), but that MAC can be checked only once the whole frame
has arrived. Three mechanisms bound what a peer can make a receiver hold before then (what they stop, what not,
and what was measured: docs/security.md):

- **Connection authentication.** Servers speak ZeroMQ's PLAIN mechanism, checked by a ZAP handler thread: a client
  must present `connection_token`, an HMAC of the job secret *and of the client's IP address as the server sees
  it* (so no NAT between a client and its servers), before the connection may deliver one message.
- **Chunks.** A frame travels as single-part ZeroMQ messages (`split_frame`) of at most `CHUNK_BYTES`. The first
  ("open") chunk carries the frame's header under a MAC of its own (`chunk_key`), checked with the declared
  lengths, the chunk count and (on a server) epoch, session and sequence (`SessionTable`) before one byte of the
  frame is kept; later chunks must follow in order with exactly the expected size (of no open frame: dropped
  unhashed).
- **Budgets.** `Inbox` keeps at most one open frame per peer and per session, reserves its declared size against
  `InboxLimits.total_bytes` and drops it after `InboxLimits.open_timeout_s` of silence. Every drop is counted.

Limit: libzmq buffers every part of a *multipart* message until its last arrives, below where `Inbox` sees
anything, so a peer past the handshake can make a server or a worker buffer without bound; closing it needs the
client to authenticate the server first (CURVE, at its cost) or a transport other than libzmq's.
"""

from __future__ import annotations

import logging
import math
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass

import zmq
from zmq.auth.thread import ThreadAuthenticator

from loom.net.auth import mac, mac_stream, same_proof
from loom.net.interfaces import route_address
from loom.ps.wire import HEADER, FrameDropped, WireLimits, read_header

__all__ = [
    "CHUNK_BYTES",
    "HELLO_BYTES",
    "QUEUE_CHUNKS",
    "Inbox",
    "InboxLimits",
    "chunk_key",
    "connection_token",
    "secure_client",
    "secure_server",
    "send_frame",
    "source_ip",
    "split_frame",
]

CHUNK_BYTES = 1 << 20
"""Frame bytes one chunk carries (all but the last chunk of a frame carry exactly this many)."""
QUEUE_CHUNKS = 4
"""Incoming chunks ZeroMQ queues per peer (``RCVHWM``) before it stops reading that connection."""
HELLO_BYTES = 64 << 10
"""Largest HELLO frame a server accepts: a hello opens a session, so the replay table cannot vouch for it."""
_USER = "loom"
_PREFIX = struct.Struct("<4sQI")  # tag, frame id, chunk count (open) or chunk index (data)
_OPEN, _DATA = b"LMCo", b"LMCd"
_TAG = 32  # the open chunk's MAC
_OPEN_HEAD = _PREFIX.size + _TAG
_MAX_MESSAGE = _OPEN_HEAD + CHUNK_BYTES


def connection_token(secret: bytes, client_ip: str) -> str:
    """The handshake's password for a client connecting from ``client_ip`` (as the server sees it): an HMAC
    of the job secret under a label of its own and the address (hex)."""
    return mac(secret, b"loom ps connection token v2\0", client_ip.encode()).hex()


def source_ip(address: str) -> str:
    """The local IP address this host sends from to ``address`` (``HOST:PORT``): what a server there sees as
    the client's address (barring NAT). A UDP socket's connect sends nothing; it only picks the route."""
    host, _, port = address.rpartition(":")
    try:
        return route_address(host.strip("[]"), int(port))
    except (OSError, ValueError) as error:
        raise ConnectionError(
            f"parameter server address {address!r} cannot be reached from this host ({error}). HINT: check the "
            "server addresses (LOOM_PS_ADDRS, or the cluster spec's hosts) and that this host resolves the name"
        ) from None


class _AddressBoundGate(ThreadAuthenticator):
    """A ZAP handler admitting PLAIN clients whose password is `connection_token` for the address the
    connection comes from (ZAP hands the handler that address with each request)."""

    def __init__(self, context: zmq.Context, secret: bytes) -> None:
        super().__init__(context)
        self._secret = secret
        self._address = ""

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        self._address = msg[3].decode("ascii", "replace") if len(msg) > 3 else ""
        await super().handle_zap_message(msg)

    def _authenticate_plain(self, domain: str, username: str, password: str) -> tuple[bool, bytes]:
        expected = connection_token(self._secret, self._address)
        if username == _USER and same_proof(expected.encode(), password.encode()):
            return True, b"OK"
        return False, b"Invalid credentials"


def chunk_key(secret: bytes) -> bytes:
    """The key of open chunks' MACs: an HMAC of the job secret under a label of its own."""
    return mac(secret, b"loom ps open chunk v1")


def secure_server(context: zmq.Context, socket: zmq.Socket, secret: bytes) -> ThreadAuthenticator:
    """Make ``socket`` (before it binds) admit only clients presenting the token, refuse messages larger than a
    chunk and queue few per peer; returns the running ZAP handler, to be stopped with the context."""
    logging.getLogger("zmq.auth").setLevel(logging.WARNING)  # a refusal is counted, not narrated
    gate = _AddressBoundGate(context, secret)
    gate.start()
    socket.setsockopt(zmq.MAXMSGSIZE, _MAX_MESSAGE)
    socket.setsockopt(zmq.RCVHWM, QUEUE_CHUNKS)
    socket.plain_server = True
    socket.zap_domain = b"loom-ps"
    return gate


def secure_client(socket: zmq.Socket, secret: bytes, address: str) -> None:
    """Make ``socket`` (before it connects to ``address``, ``HOST:PORT``) present the token for the address it
    connects from, refuse messages larger than a chunk from its server and queue few. Its send queue stays
    ZeroMQ's default (1000 chunks, more than the largest frame), so that a request fanned out to several servers
    is handed to ZeroMQ at once rather than server by server."""
    socket.setsockopt(zmq.MAXMSGSIZE, _MAX_MESSAGE)
    socket.setsockopt(zmq.RCVHWM, QUEUE_CHUNKS)
    socket.plain_username = _USER.encode()
    socket.plain_password = connection_token(secret, source_ip(address)).encode()


def split_frame(key: bytes, data: bytes | bytearray | memoryview) -> list[bytes]:
    """The chunks that carry the frame ``data`` (see the module docstring); ``key`` is `chunk_key`."""
    view = memoryview(data).cast("B")
    if len(view) < HEADER.size:
        raise ValueError(f"a frame has at least {HEADER.size} bytes, got {len(view)}")
    frame_id = int.from_bytes(os.urandom(8), "little")
    count = max(1, math.ceil(len(view) / CHUNK_BYTES))
    prefix = _PREFIX.pack(_OPEN, frame_id, count)
    tag = mac_stream(key, prefix)
    tag.update(view[: HEADER.size])
    chunks = [b"".join((prefix, tag.digest(), view[:CHUNK_BYTES]))]
    for index in range(1, count):
        piece = view[index * CHUNK_BYTES : (index + 1) * CHUNK_BYTES]
        chunks.append(b"".join((_PREFIX.pack(_DATA, frame_id, index), piece)))
    return chunks


def send_frame(
    socket: zmq.Socket, key: bytes, data: bytes | bytearray, identity: bytes | None = None
) -> bool:
    """Queue ``data``'s chunks on ``socket`` without blocking (a ROUTER socket: to peer ``identity``); False if
    ZeroMQ refused one (no connection, or its queue full): the receiver drops the incomplete frame."""
    head = [identity] if identity is not None else []
    try:
        for chunk in split_frame(key, data):
            socket.send_multipart([*head, chunk], flags=zmq.NOBLOCK, copy=False)
    except zmq.Again:
        return False
    return True


@dataclass(frozen=True)
class InboxLimits:
    """What a receiver holds for frames still arriving."""

    total_bytes: int = 4 << 30
    """Bytes reserved for open frames over all peers (each open reserves its declared size). A server uses
    ``max(this, 2 * max_frame)``. A safety net more than a quota: only holders of the job secret can open a
    frame, and a replayed open chunk holds at most one frame per session. 4 GiB lets 16 workers push 256 MiB
    frames at once; past it a refused open is resent by its client after the attempt window (2 s)."""
    open_timeout_s: float = 10.0
    """An open frame whose peer sends nothing for this long is dropped."""


@dataclass
class _Open:
    frame_id: int
    session: int
    seq: int
    count: int
    size: int
    """Declared frame size (reserved)."""
    pieces: list[memoryview]
    received: int
    last_s: float


class Inbox:
    """Reassembles chunked frames per peer under budgets; `receive` returns a frame once its last chunk arrives.

    ``check_open(kind, epoch, session, seq, size)`` vets an authenticated open chunk's header (raise
    `FrameDropped` to drop it); ``drop(reason)`` counts a drop."""

    def __init__(
        self,
        key: bytes,
        limits: WireLimits,
        budget: InboxLimits,
        drop: Callable[[str], None],
        check_open: Callable[[int, int, int, int, int], None] | None = None,
    ) -> None:
        if budget.total_bytes < limits.max_frame:
            raise ValueError(
                f"InboxLimits.total_bytes={budget.total_bytes} is below the largest frame ({limits.max_frame}"
                " bytes): such a frame could never be received. HINT: raise it or lower max_payload"
            )
        self.key = key
        self.limits = limits
        self.budget = budget
        self._drop = drop
        self._check_open = check_open
        self._open: dict[bytes, _Open] = {}
        self._by_session: dict[int, bytes] = {}
        self.reserved = 0
        """Bytes reserved by open frames (never above ``budget.total_bytes``)."""
        self.buffered = 0
        """Bytes of open frames received so far (never above ``reserved``)."""

    def receive(self, peer: bytes, chunk: memoryview, now: float) -> bytes | memoryview | None:
        """Take one chunk from ``peer``; the whole frame if this chunk completed it, else None (a chunk dropped is
        counted by reason)."""
        try:
            if len(chunk) < _PREFIX.size:
                raise FrameDropped("malformed")
            tag, frame_id, number = _PREFIX.unpack_from(chunk)
            if tag == _OPEN:
                return self._opened(peer, chunk, frame_id, number, now)
            if tag != _DATA:
                raise FrameDropped("malformed")
            held = self._open.get(peer)
            if held is None:
                raise FrameDropped("orphan_chunk")
            piece = chunk[_PREFIX.size :]
            expected = min(CHUNK_BYTES, held.size - held.received)
            if frame_id != held.frame_id or number != len(held.pieces) or len(piece) != expected:
                self._close(peer)
                raise FrameDropped("chunk_order")
        except FrameDropped as dropped:
            self._drop(dropped.reason)
            return None
        held.pieces.append(piece)
        held.received += len(piece)
        self.buffered += len(piece)
        held.last_s = now
        if len(held.pieces) < held.count:
            return None
        self._close(peer)
        return b"".join(held.pieces)

    def _opened(self, peer: bytes, chunk: memoryview, frame_id: int, count: int, now: float):
        """Vet an open chunk (`FrameDropped` when it is dropped) and open its frame, or return a one-chunk frame."""
        if peer in self._open:  # the peer moved on (a resend under a new sequence number)
            self._close(peer)
            self._drop("abandoned")
        if len(chunk) < _OPEN_HEAD + HEADER.size:
            raise FrameDropped("truncated")
        tag = mac_stream(self.key, chunk[: _PREFIX.size])
        tag.update(chunk[_OPEN_HEAD : _OPEN_HEAD + HEADER.size])
        if not same_proof(tag.digest(), bytes(chunk[_PREFIX.size : _OPEN_HEAD])):
            raise FrameDropped("bad_mac")
        kind, epoch, session, seq, _, _, size = read_header(chunk, self.limits, _OPEN_HEAD)
        if count != max(1, math.ceil(size / CHUNK_BYTES)):
            raise FrameDropped("chunk_count", f"{count} chunks for {size} bytes")
        piece = chunk[_OPEN_HEAD:]
        if len(piece) != min(CHUNK_BYTES, size):
            reason = "truncated" if len(piece) < min(CHUNK_BYTES, size) else "length_mismatch"
            raise FrameDropped(reason, f"the open chunk carries {len(piece)} of {size} bytes")
        if self._check_open is not None:
            self._check_open(kind, epoch, session, seq, size)
        rival = self._by_session.get(session)
        if rival is not None:  # one open frame per session: a replayed open chunk cannot multiply
            if seq <= self._open[rival].seq:
                raise FrameDropped("replay", "an open frame of this session is newer")
            self._close(rival)
            self._drop("abandoned")
        if count > 1 and self.reserved + size > self.budget.total_bytes:
            raise FrameDropped("budget", f"{self.reserved} + {size} bytes reserved")
        if count == 1:
            return piece
        self._open[peer] = _Open(frame_id, session, seq, count, size, [piece], len(piece), now)
        self._by_session[session] = peer
        self.reserved += size
        self.buffered += len(piece)
        return None

    def _close(self, peer: bytes) -> None:
        held = self._open.pop(peer)
        if self._by_session.get(held.session) == peer:
            del self._by_session[held.session]
        self.reserved -= held.size
        self.buffered -= held.received

    def expire(self, now: float) -> None:
        """Drop the open frames of peers silent for ``open_timeout_s`` (disconnected peers among them)."""
        for peer in [p for p, held in self._open.items() if now - held.last_s > self.budget.open_timeout_s]:
            self._close(peer)
            self._drop("expired")

    def arriving(self, peer: bytes, now: float, within_s: float) -> bool:
        """Whether a frame from ``peer`` is open and got a chunk in the last ``within_s`` seconds (it is still
        coming: a sender waiting for it should not give up on it)."""
        held = self._open.get(peer)
        return held is not None and now - held.last_s <= within_s

    def __len__(self) -> int:
        return len(self._open)
