"""The two ends of a gossip connection (`loom.comm.peer`): dialing a peer, and a listener that admits peers.

Both run the challenge-response of `loom.net.handshake` with this protocol's own hello and label, so a proof made
for a ring link is worth nothing here. The listener binds the address of the interface gloo uses
(``GLOO_SOCKET_IFNAME``, loopback when unset) and admits as the ring's does (`loom.net.listener.Listener`), at most
`MAX_HANDSHAKES` handshakes at once. Admitted connections wait in its ``arrived`` for the thread that pumps.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

from loom.comm.links import CONNECTION_TIMEOUT_S, _listen_address
from loom.net.handshake import HandshakeRefused, dial_handshake
from loom.net.listener import Listener

__all__ = ["DIALER_GETS", "DIALER_SENDS", "MAX_HANDSHAKES", "dial", "listen_for_peers"]

MAX_HANDSHAKES = 16
"""Connections whose handshake may run at once; one more evicts the oldest (`loom.net.listener.Listener`)."""
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


def listen_for_peers(
    rank: int, world_size: int, secret: bytes, wake: Callable[[], None], host: str | None
) -> Listener:
    """A `Listener` admitting the peers of ``rank`` (ranks ``0 .. world_size-1`` but itself) that prove
    ``secret``: the first four bytes of an admitted connection's ids are its dialer's rank."""

    def expected(ids: bytes) -> bool:
        dialer = int.from_bytes(ids[:4], "big")
        return ids[4:] == rank.to_bytes(4, "big") and 0 <= dialer < world_size and dialer != rank

    sock = socket.create_server((host or _listen_address(), 0), backlog=64)
    return Listener(sock, secret, 8, expected, _HELLO, _LABEL, MAX_HANDSHAKES, wake, CONNECTION_TIMEOUT_S,
                    name=f"loom-gossip-accept-{rank}")  # fmt: skip
