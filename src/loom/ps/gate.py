"""Who may send a parameter server anything, and how much a connection can make it hold.

Every frame is authenticated by its MAC (`loom.ps.wire`), but a MAC is checked only once the whole frame has
arrived, and ZeroMQ buffers a frame in full before handing it over: a client without the secret could make a
server hold hundreds of MiB per connection (measured: 6 connections with 200 MiB partial frames took a server
from 303 MB to 1.5 GB). Two ZeroMQ mechanisms close that:

- **Connection authentication.** Servers speak ZeroMQ's PLAIN mechanism and check it with a ZAP handler (a
  thread in the server): a client must present `connection_token`, derived from the job secret, in its
  handshake, before the connection may deliver one message. A client without it is disconnected after the
  handshake's few hundred bytes. PLAIN sends the token in clear; it is not the job secret (a one-way HMAC of
  it), and frames still need the secret's MAC, so whoever sniffs it can connect but neither forge nor replay a
  request. (ZeroMQ's CURVE would encrypt too, at about a sixth of the throughput here.)
- **Small parts.** Frames travel as multipart messages of at most `PART_BYTES` each, and every socket refuses a
  part larger than that (``MAXMSGSIZE``), so what an unauthenticated connection can make a server buffer
  before it is dropped is one part, not one frame.

Limit: ZeroMQ keeps every part of a multipart message until its last part arrives and bounds only the size of
each part, not their number, so a peer that passed the handshake (a worker, or whoever sniffed the token on the
job's network) can still make a server buffer without bound by never ending a message. Closing that needs each
part sent as a message of its own and reassembled under a byte budget per peer (not done yet).
"""

from __future__ import annotations

import hashlib
import hmac
import logging

import zmq
from zmq.auth.thread import ThreadAuthenticator

__all__ = [
    "PART_BYTES",
    "connection_token",
    "join_parts",
    "secure_client",
    "secure_server",
    "split_frame",
]

PART_BYTES = 1 << 20
"""Largest part of a multipart message any parameter-server socket accepts."""
_USER = "loom"


def connection_token(secret: bytes) -> str:
    """The handshake's password: an HMAC of the job secret under a label of its own (hex)."""
    return hmac.new(secret, b"loom ps connection token v1", hashlib.sha256).hexdigest()


def secure_server(context: zmq.Context, socket: zmq.Socket, secret: bytes) -> ThreadAuthenticator:
    """Make ``socket`` (before it binds) admit only clients presenting the token; returns the running ZAP
    handler, to be stopped with the context."""
    logging.getLogger("zmq.auth").setLevel(logging.WARNING)  # a refusal is counted, not narrated
    gate = ThreadAuthenticator(context)
    gate.start()
    gate.configure_plain(domain="loom-ps", passwords={_USER: connection_token(secret)})
    socket.setsockopt(zmq.MAXMSGSIZE, PART_BYTES)
    socket.plain_server = True
    socket.zap_domain = b"loom-ps"
    return gate


def secure_client(socket: zmq.Socket, secret: bytes) -> None:
    """Make ``socket`` (before it connects) present the token, and refuse oversized parts from its server."""
    socket.setsockopt(zmq.MAXMSGSIZE, PART_BYTES)
    socket.plain_username = _USER.encode()
    socket.plain_password = connection_token(secret).encode()


def split_frame(data: bytes | memoryview) -> list[memoryview]:
    """``data`` cut into parts of at most `PART_BYTES` (views, no copy)."""
    view = memoryview(data).cast("B")
    return [view[i : i + PART_BYTES] for i in range(0, max(len(view), 1), PART_BYTES)]


def join_parts(parts: list, max_bytes: int) -> memoryview | None:
    """The frame a list of received parts (``zmq.Frame`` or bytes) carries, or None if together they exceed
    ``max_bytes`` (the caller drops it)."""
    buffers = [p.buffer if hasattr(p, "buffer") else memoryview(p) for p in parts]
    if sum(b.nbytes for b in buffers) > max_bytes:
        return None
    if len(buffers) == 1:
        return buffers[0]
    return memoryview(b"".join(buffers))
