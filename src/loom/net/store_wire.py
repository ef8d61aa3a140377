"""The store's wire format (`loom.net.store`): a request is ``op`` (1 byte), ``n`` (4 bytes) and ``n`` fields, each a
4-byte big-endian length and its bytes; a reply is a status byte and fields the same way. Every read is bounded
(fields, sizes, a deadline)."""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Sequence

from loom.errors import StoreTimeout, StoreUnreachable

__all__ = ["StoreTimeout", "StoreUnreachable"]

_HELLO = b"LOOMKV01"
_MAX_FIELD = 256 << 20
_MAX_FIELDS = 1 << 20
_OK, _TIMEOUT, _ERROR = 0, 1, 2
(_SET, _GET, _ADD, _CHECK, _WAIT, _MULTI_GET, _MULTI_SET, _DELETE, _NUM_KEYS, _COMPARE_SET, _APPEND,
 _PING) = range(1, 13)  # fmt: skip


def _recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    data = bytearray()
    while len(data) < n:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("timed out")
            sock.settimeout(remaining)
        chunk = sock.recv(min(n - len(data), 1 << 20))
        if not chunk:
            raise ConnectionError("the connection closed")
        data += chunk
    return bytes(data)


def _pack(head: int, fields: Sequence[bytes]) -> bytes:
    parts = [struct.pack(">BI", head, len(fields))]
    for f in fields:
        parts += [struct.pack(">I", len(f)), f]
    return b"".join(parts)


def _read_message(sock: socket.socket, deadline: float | None) -> tuple[int, list[bytes]]:
    head, count = struct.unpack(">BI", _recv_exact(sock, 5, deadline))
    if count > _MAX_FIELDS:
        raise ConnectionError(f"{count} fields in one message")
    fields = []
    for _ in range(count):
        (size,) = struct.unpack(">I", _recv_exact(sock, 4, deadline))
        if size > _MAX_FIELD:
            raise ConnectionError(f"a field of {size} bytes")
        fields.append(_recv_exact(sock, size, deadline))
    return head, fields
