"""Authenticated point-to-point requests between any two workers, each answered at the receiver's own pace.

Why not the ring links of `loom.comm.links`: gossip (`loom.parallel.gossip.gossip`) needs any worker to ask any
other at any time, answered when the other gets round to it (never when it is dead), with no collective or
barrier. `PeerNode` is one process's end: a listener admits peers that prove the job secret
(`loom.comm.peer_links`); requests go out on a connection this node dials (one per peer, kept open) and are
answered on it; requests from others arrive on the connections they dialed. `pump` moves what can move on every
non-blocking connection at once, so two workers answering each other with large frames never deadlock, and a
node waiting for its own answer keeps answering others. Frames: `loom.comm.peer_wire`.

Symmetry: two ``EXCHANGE`` requests cross when each was sent before its sender saw the other's (a request
carries the seq of the receiver's last request its sender had answered). The lower rank answers the crossing
one ``BUSY`` and the higher one serves, so exactly one happens (both would average with each other's stale
values). A request whose sender had already answered ours waits until that answer, still in flight on the other
connection, is applied. So a pair exchange ends with the same bits on both workers however requests interleave.

Late answers: `request` waits at most its deadline, then returns ``"late"`` and leaves the request outstanding:
a later answer still goes to its callback, so an exchange the peer applied is applied here too, unless the next
request to that peer comes first and abandons it (closes the connection; the peer's half then stays alone,
counted as ``abandoned``). A dead peer's connection reports end of file, so requests to it fail at once.

Limits: IPv4; data after the handshake is authenticated by the TCP connection only, as gloo's and the ring's;
`pump` and `request` must not run in two threads at once (the caller serializes them).
"""

from __future__ import annotations

import contextlib
import math
import select
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from loom.comm import peer_wire as wire
from loom.comm.links import _bytes
from loom.comm.peer_links import DIALER_GETS, DIALER_SENDS, dial, listen_for_peers
from loom.net.handshake import HandshakeRefused

__all__ = ["PeerNode"]

Serve = Callable[[int, int, "torch.Tensor | None"], "torch.Tensor | None"]
"""``serve(kind, peer, values)``: the values (uint8, ``payload_bytes``) to answer a request with, None for BUSY."""
AddressOf = Callable[[int, bool], "str | None"]
"""``address_of(peer, refresh)``: ``HOST:PORT`` of a peer's listener (``refresh``: it was unreachable there)."""


@dataclass
class _Request:
    seq: int
    on_reply: Callable[[torch.Tensor], None]
    late: bool = False
    outcome: str | None = None
    """None while outstanding; then ``done``, ``busy`` or ``lost``."""


class _Conn:
    """One authenticated connection: the frame being read, the bytes waiting to go out, the request in flight."""

    def __init__(self, sock: socket.socket, peer: int) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock, self.peer = sock, peer
        self.head, self.got = bytearray(wire.HEADER.size), 0
        self.frame: tuple[int, int, int, int] | None = None
        """(kind, seq, length, answered) of the frame whose payload is being read."""
        self.payload: torch.Tensor | None = None
        self.out: deque[memoryview] = deque()
        self.request: _Request | None = None
        self.seq = 0
        self.closed = False


class PeerNode:
    """This process's end of the gossip transport (see the module docstring). ``serve`` answers requests,
    ``address_of`` finds peers; both run in whichever thread calls `pump` or `request`."""

    def __init__(self, rank: int, world_size: int, secret: bytes, payload_bytes: int, layout: int,
                 serve: Serve, address_of: AddressOf, host: str | None = None) -> None:  # fmt: skip
        self.rank, self.world_size, self.secret = rank, world_size, secret
        self.payload_bytes, self.layout = payload_bytes, layout & (2**64 - 1)
        self._serve, self._address_of = serve, address_of
        self._stats = wire.PeerStats()
        self.errors: dict[int, str] = {}
        """The last failure with each peer, for messages and `loom report`."""
        self._incoming: list[_Conn] = []
        self._outgoing: dict[int, _Conn] = {}
        self._stale: set[int] = set()
        self._answered: dict[int, int] = {}
        """Per peer: seq of its last request this node answered (on its newest connection)."""
        self._deferred: dict[int, tuple] = {}
        """Per peer: its request held until this node's own request to it is settled."""
        self._closed = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.listener = listen_for_peers(rank, world_size, secret, self.wake, host)
        self.address = "{}:{}".format(*self.listener.sock.getsockname()[:2])
        """``HOST:PORT`` peers dial."""

    @property
    def stats(self) -> wire.PeerStats:
        """What this node did (`loom.comm.peer_wire.PeerStats`), counted since it started."""
        self._stats.rejected = self.listener.rejected  # counted by the listener's handshake threads
        return self._stats

    def wake(self) -> None:
        """Make a `pump` waiting in another thread return now."""
        with contextlib.suppress(OSError):  # full (a wake is pending anyway) or closed
            self._wake_w.send(b"\0")

    # -- moving bytes ---------------------------------------------------------------------------------------
    def pump(self, timeout_s: float = 0.0) -> None:
        """Move every byte that can move, answer complete requests, hand complete answers to their callbacks;
        wait up to ``timeout_s`` for something to happen (`wake` ends the wait early)."""
        while self.listener.arrived:
            ids, sock = self.listener.arrived.popleft()
            peer = int.from_bytes(ids[:4], "big")
            if self._closed:
                sock.close()
                continue
            self._incoming.append(_Conn(sock, peer))
            self._answered[peer] = 0  # its seqs start again on a new connection
            self._stats.accepted += 1  # counted here, in the thread that counts every other byte
            self._stats.bytes_sent += DIALER_GETS
            self._stats.bytes_received += DIALER_SENDS
        conns = {c.sock.fileno(): c for c in [*self._incoming, *self._outgoing.values()]}
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        for fd, conn in conns.items():
            poller.register(fd, select.POLLIN | (select.POLLOUT if conn.out else 0))
        ready = poller.poll(math.ceil(max(timeout_s, 0.0) * 1000))
        # Answers before requests: a reply already here changes this node's values before it serves anyone.
        for fd, events in sorted(ready, key=lambda e: e[0] not in conns or conns[e[0]].request is None):
            if fd == self._wake_r.fileno():
                with contextlib.suppress(OSError):
                    self._wake_r.recv(4096)
                continue
            conn = conns[fd]
            if events & select.POLLOUT and not conn.closed:
                self._flush(conn)
            if events & (select.POLLIN | select.POLLHUP | select.POLLERR) and not conn.closed:
                self._receive(conn)

    def _receive(self, conn: _Conn) -> None:
        while not conn.closed:
            if conn.frame is None:
                need, target = wire.HEADER.size, memoryview(conn.head)
            else:
                assert conn.payload is not None
                need, target = conn.frame[2], _bytes(conn.payload)
            try:
                count = conn.sock.recv_into(target[conn.got : need])
            except BlockingIOError:
                return
            except OSError as error:
                self._lose(conn, f"receive failed: {error.strerror or error}")
                return
            if count == 0:
                self._lose(conn, "the connection closed (did it exit?)")
                return
            self._stats.bytes_received += count
            conn.got += count
            if conn.got < need:
                continue
            conn.got = 0
            if conn.frame is None:  # a complete header: check it, then read its payload
                try:
                    conn.frame = wire.read_header(
                        bytes(conn.head), peer=conn.peer, answers=self._outgoing.get(conn.peer) is conn,
                        layout=self.layout, payload_bytes=self.payload_bytes,
                        outstanding=conn.request.seq if conn.request else None,
                    )  # fmt: skip
                except wire.FrameRefused as refused:
                    self._stats.dropped += 1
                    self._lose(conn, f"dropped: {refused}")
                    return
                if conn.frame[2]:
                    conn.payload = torch.empty(conn.frame[2], dtype=torch.uint8)
                    continue
            frame, payload = conn.frame, conn.payload
            conn.frame, conn.payload = None, None
            self._dispatch(conn, frame, payload)

    def _dispatch(self, conn: _Conn, frame: tuple[int, int, int, int], payload: torch.Tensor | None) -> None:
        kind, seq, _, answered = frame
        if kind in wire.REQUESTS:
            mine = self._outgoing.get(conn.peer)
            if mine is not None and kind == wire.EXCHANGE:
                if answered < mine.seq and self.rank < conn.peer:  # it crossed our latest: the higher rank
                    self._answer(conn, seq, None)  # serves that one, so this one is refused
                    return
                if answered >= mine.seq and mine.request is not None:  # it answered ours, the answer is on
                    self._deferred[conn.peer] = (conn, frame, payload)  # its way: apply that first
                    return
            self._answer(conn, seq, self._serve(kind, conn.peer, payload))
            return
        request = conn.request
        assert request is not None
        conn.request = None
        if kind == wire.BUSY:
            request.outcome = "busy"
            self._stats.busy += 1
        else:
            assert payload is not None
            request.on_reply(payload)
            request.outcome = "done"
            if request.late:
                self._stats.late_applied += 1
            else:
                self._stats.replies += 1
        self._undefer(conn.peer)

    def _undefer(self, peer: int) -> None:
        """Serve the request of ``peer`` held back until this node's own request to it was settled."""
        held = self._deferred.pop(peer, None)
        if held is not None and not held[0].closed:
            self._dispatch(*held)

    def _answer(self, conn: _Conn, seq: int, values: torch.Tensor | None) -> None:
        self._answered[conn.peer] = seq
        if values is None:
            self._stats.refused += 1
            self._send(conn, wire.BUSY, seq, None)
            return
        if values.dtype != torch.uint8 or values.numel() != self.payload_bytes:
            raise ValueError(
                f"rank {self.rank}: gossip serve() answered {values.numel()} {values.dtype} values, "
                f"{self.payload_bytes} uint8 expected"
            )
        self._stats.served += 1
        self._send(conn, wire.REPLY, seq, values)

    def _send(self, conn: _Conn, kind: int, seq: int, values: torch.Tensor | None) -> None:
        length = 0 if values is None else values.numel()
        answered = self._answered.get(conn.peer, 0) if kind in wire.REQUESTS else 0
        conn.out.append(memoryview(wire.header(kind, self.rank, seq, self.layout, length, answered)))
        if values is not None:
            conn.out.append(_bytes(values.contiguous()))
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        while conn.out and not conn.closed:
            try:
                sent = conn.sock.send(conn.out[0])
            except BlockingIOError:
                return
            except OSError as error:
                self._lose(conn, f"send failed: {error.strerror or error}")
                return
            self._stats.bytes_sent += sent
            if sent < len(conn.out[0]):
                conn.out[0] = conn.out[0][sent:]
                return
            conn.out.popleft()

    def _lose(self, conn: _Conn, why: str) -> None:
        conn.closed = True
        conn.sock.close()
        self.errors[conn.peer] = why
        if conn.request is not None:
            conn.request.outcome = "lost"
            if conn.request.late:
                self._stats.abandoned += 1
            conn.request = None
        if self._outgoing.get(conn.peer) is conn:
            del self._outgoing[conn.peer]
            self._stale.add(conn.peer)
            self._undefer(conn.peer)  # no answer will come now: the held request is served as any other
        elif conn in self._incoming:
            self._incoming.remove(conn)

    # -- requesting -----------------------------------------------------------------------------------------
    def request(self, peer: int, kind: int, values: torch.Tensor | None, deadline_s: float,
                on_reply: Callable[[torch.Tensor], None]) -> str:  # fmt: skip
        """Send ``peer`` one request (``EXCHANGE`` with ``values``, or ``COPY``) and wait for its answer, serving
        others meanwhile, at most ``deadline_s``. Nothing is served before the request is sent, so ``values``
        are still this node's when they leave. Returns ``done`` (``on_reply`` got the peer's values), ``busy``,
        ``late`` (no answer yet: ``on_reply`` runs in a later `pump` if it comes) or ``unreachable``."""
        deadline = time.monotonic() + deadline_s
        conn = self._outgoing.get(peer)
        # a peer that exited since the last request
        if conn is not None and conn.request is None and not _open(conn.sock):
            self._lose(conn, "the connection closed (did it exit?)")
            conn = None
        if conn is not None and conn.request is not None:  # an earlier answer is still late: give it up
            self._lose(conn, f"no answer within {deadline_s} s and until the next request")
            return "late"
        if conn is None:
            conn = self._dial(peer, deadline)
            if conn is None:
                self._stats.unreachable += 1
                return "unreachable"
        conn.seq += 1
        request = _Request(conn.seq, on_reply)
        conn.request = request
        self._stats.requests += 1
        self._send(conn, kind, conn.seq, values)
        while request.outcome is None:
            left = deadline - time.monotonic()
            if left <= 0:
                request.late = True
                self._stats.late += 1
                self.errors[peer] = f"no answer within {deadline_s} s"
                return "late"
            self.pump(left)
        if request.outcome == "lost":
            self._stats.unreachable += 1
            return "unreachable"
        return request.outcome

    def _dial(self, peer: int, deadline: float) -> _Conn | None:
        address = self._address_of(peer, peer in self._stale)
        if address is None:
            self.errors[peer] = "no address known"
            return None
        try:
            sock = dial(address, self.rank, peer, self.secret, deadline)
        except (OSError, HandshakeRefused) as error:
            self.errors[peer] = f"cannot link to {address}: {error}"
            self._stale.add(peer)
            return None
        self._stats.dialed += 1
        self._stats.bytes_sent += DIALER_SENDS
        self._stats.bytes_received += DIALER_GETS
        self._stale.discard(peer)
        conn = _Conn(sock, peer)
        self._outgoing[peer] = conn
        return conn

    def outstanding(self) -> list[int]:
        """Peers with a request of this node still unanswered."""
        return [p for p, c in self._outgoing.items() if c.request is not None]

    def close(self, drain_s: float = 0.0) -> None:
        """Stop accepting; for up to ``drain_s`` keep pumping until this node's outstanding requests are
        answered and its queued answers are sent (so an exchange a peer applied is applied here too); close."""
        if self._closed:
            return
        self._closed = True
        self.listener.close()
        end = time.monotonic() + drain_s
        while time.monotonic() < end and (
            self.outstanding() or any(c.out for c in [*self._incoming, *self._outgoing.values()])
        ):
            self.pump(min(0.05, max(end - time.monotonic(), 0.0)))
        for conn in [*self._incoming, *self._outgoing.values()]:
            conn.sock.close()
        self._incoming.clear()
        self._outgoing.clear()
        self._wake_r.close()
        self._wake_w.close()


def _open(sock: socket.socket) -> bool:
    """Whether the peer has not closed ``sock`` (looked at without reading anything)."""
    try:
        return sock.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False
