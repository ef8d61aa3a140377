"""The two ends of a gossip connection (`loom.comm.peer`): dialing a peer, and a listener that admits peers.

Both run the challenge-response of `loom.net.handshake` with this protocol's own hello and label, so a proof made
for a ring link is worth nothing here. The listener binds the address of the interface gloo uses
(``GLOO_SOCKET_IFNAME``, loopback when unset); a thread accepts connections and hands each to a short-lived thread
for its handshake (`CONNECTION_TIMEOUT_S` each, at most `MAX_HANDSHAKES` at once: one more evicts the oldest).
Admitted connections wait in `PeerListener.arrived` for the thread that pumps.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections import deque
from collections.abc import Callable

from loom.comm.links import (
    CONNECTION_TIMEOUT_S,
    HandshakeRefused,
    PendingHandshakes,
    _listen_address,
    answer_handshake,
    dial_handshake,
)

__all__ = ["DIALER_GETS", "DIALER_SENDS", "MAX_HANDSHAKES", "PeerListener", "dial"]

MAX_HANDSHAKES = 16
"""Connections whose handshake may run at once; one more evicts the oldest (`loom.comm.links.PendingHandshakes`)."""
_HELLO, _LABEL = b"LOOMGSP1", b"gossip"
DIALER_SENDS, DIALER_GETS = len(_HELLO) + 16 + 8 + 32, 16 + 32 + 1
"""Handshake bytes, counted with the traffic: hello, nonce, ids and proof out; nonce, proof and verdict in."""


def dial(address: str, rank: int, peer: int, secret: bytes, deadline: float) -> socket.socket:
    """A connection to ``peer``'s listener at ``HOST:PORT`` that proved the job secret both ways; raises
    OSError (refused, closed, timed out) or `HandshakeRefused`."""
    host, port = address.rsplit(":", 1)
    try:
        sock = socket.create_connection((host, int(port)), timeout=max(deadline - time.monotonic(), 0.001))
    except ValueError as error:
        raise OSError(f"not an address: {address!r}") from error
    try:
        dial_handshake(
            sock, secret, rank.to_bytes(4, "big") + peer.to_bytes(4, "big"), deadline, _HELLO, _LABEL
        )
    except (OSError, HandshakeRefused):
        sock.close()
        raise
    return sock


class PeerListener:
    """Admits the peers of ``rank`` (ranks ``0 .. world_size-1`` but itself) that prove ``secret``."""

    def __init__(
        self, rank: int, world_size: int, secret: bytes, wake: Callable[[], None], host: str | None
    ) -> None:
        self.rank, self.world_size, self.secret, self.wake = rank, world_size, secret, wake
        self.arrived: deque[tuple[int, socket.socket]] = deque()
        """(peer, socket) of each admitted connection, oldest first."""
        self.rejected = 0
        """Connections closed because they did not prove the job secret (or too many at once)."""
        self._lock = threading.Lock()
        self._pending = PendingHandshakes(MAX_HANDSHAKES)
        self._closed = False
        self.sock = socket.create_server((host or _listen_address(), 0), backlog=64)
        self.sock.settimeout(0.5)
        self.address = "{}:{}".format(*self.sock.getsockname()[:2])
        """``HOST:PORT`` peers dial."""
        threading.Thread(target=self._accept_loop, name=f"loom-gossip-accept-{rank}", daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            self._pending.admit(sock)
            threading.Thread(target=self._handshake, args=(sock,), daemon=True).start()

    def _expected(self, ids: bytes) -> bool:
        dialer = int.from_bytes(ids[:4], "big")
        return (
            ids[4:] == self.rank.to_bytes(4, "big") and 0 <= dialer < self.world_size and dialer != self.rank
        )

    def _handshake(self, sock: socket.socket) -> None:
        try:
            until = time.monotonic() + CONNECTION_TIMEOUT_S
            ids = answer_handshake(sock, self.secret, 8, self._expected, until, _HELLO, _LABEL)
            self.arrived.append((int.from_bytes(ids[:4], "big"), sock))
            self.wake()
        except OSError:  # ConnectionError and timeouts included: nothing of it was decoded
            with self._lock:
                self.rejected += 1
            sock.close()
        finally:
            self._pending.done(sock)

    def close(self) -> None:
        """Stop admitting; close the connections admitted but not yet taken."""
        self._closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        while self.arrived:
            self.arrived.popleft()[1].close()
