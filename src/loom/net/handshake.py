"""The one challenge-response of loom's sockets: the store, the ring and gossip links (`loom.comm.links`,
`loom.comm.peer_links`) all prove the job secret this way, each under a ``hello`` and a ``label`` of its own.

The dialer sends ``hello``, a fresh nonce and ``ids`` (who dials whom); the listener reads exactly that many
bytes (nothing is decoded before the proof), answers with its own nonce and ``mac("loom <label> accept", ...)``;
the dialer checks it and proves itself with ``mac("loom <label> connect", ...)``; the listener says yes with one
byte. Both proofs cover both nonces and the ids, so a proof is worth nothing in another connection, direction,
protocol or pairing (`loom.net.auth.mac`).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable

from loom.errors import HandshakeRefused
from loom.net.auth import mac, same_proof

__all__ = ["HandshakeRefused", "NONCE_BYTES", "answer_handshake", "dial_handshake", "read_exact"]

NONCE_BYTES = 16
_MAC = 32


def read_exact(sock: socket.socket, n: int, deadline: float | None, what: str = "the handshake") -> bytes:
    """Exactly ``n`` bytes of ``what``, in pieces of at most 1 MiB; TimeoutError once ``deadline`` (None: none)
    passes, ConnectionError when the peer closes first."""
    data = bytearray()
    while len(data) < n:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{what} took too long")
            sock.settimeout(remaining)
        chunk = sock.recv(min(n - len(data), 1 << 20))
        if not chunk:
            raise ConnectionError(f"the peer closed the connection during {what}")
        data += chunk
    return bytes(data)


def dial_handshake(
    sock: socket.socket,
    secret: bytes,
    ids: bytes,
    deadline: float,
    hello: bytes,
    label: bytes,
) -> None:
    """The connecting side of the challenge-response on the connected ``sock``: send ``hello``, a fresh nonce
    and ``ids`` (who dials whom, covered by both proofs), check the listener's proof, send ours, wait for the
    listener's verdict. Raises `HandshakeRefused`, or OSError when the connection fails or ``deadline`` passes."""
    mine = os.urandom(NONCE_BYTES)
    sock.sendall(hello + mine + ids)
    reply = read_exact(sock, NONCE_BYTES + _MAC, deadline)
    theirs = reply[:NONCE_BYTES]
    if not same_proof(reply[NONCE_BYTES:], mac(secret, b"loom " + label + b" accept", mine, theirs, ids)):
        raise HandshakeRefused("the listener did not prove it holds the job secret")
    sock.sendall(mac(secret, b"loom " + label + b" connect", theirs, mine, ids))
    if read_exact(sock, 1, deadline) != b"\1":
        raise HandshakeRefused("the listener refused the handshake")


def answer_handshake(
    sock: socket.socket,
    secret: bytes,
    id_size: int,
    expected: Callable[[bytes], bool],
    until: float,
    hello: bytes,
    label: bytes,
) -> bytes:
    """The listening side of `dial_handshake` on an accepted ``sock``: read exactly one fixed-size hello (nothing
    else is read before the proof), refuse it unless ``expected(ids)``, prove the secret, check the dialer's
    proof, say yes. Returns the dialer's ``ids``; raises OSError (ConnectionError, timeouts) on any failure."""
    first = read_exact(sock, len(hello) + NONCE_BYTES + id_size, until)
    ids = first[len(hello) + NONCE_BYTES :]
    if first[: len(hello)] != hello or not expected(ids):
        raise ConnectionError("not a hello from an expected peer")
    theirs, mine = first[len(hello) : len(hello) + NONCE_BYTES], os.urandom(NONCE_BYTES)
    sock.sendall(mine + mac(secret, b"loom " + label + b" accept", theirs, mine, ids))
    proof = read_exact(sock, _MAC, until)
    if not same_proof(proof, mac(secret, b"loom " + label + b" connect", mine, theirs, ids)):
        raise ConnectionError("wrong proof of the job secret")
    sock.sendall(b"\1")
    return ids
