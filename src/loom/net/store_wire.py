"""The store's wire format (`loom.net.store`): a request is ``op`` (1 byte), ``n`` (4 bytes) and ``n`` fields, each a
4-byte big-endian length and its bytes; a reply is a status byte and fields the same way. Every read is bounded
(fields, sizes, a deadline)."""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence

from loom.net.handshake import read_exact

HELLO = b"LOOMKV01"
MAX_FIELD = 256 << 20
MAX_FIELDS = 1 << 20
OK, TIMEOUT, ERROR = 0, 1, 2
(SET, GET, ADD, CHECK, WAIT, MULTI_GET, MULTI_SET, DELETE, NUM_KEYS, COMPARE_SET, APPEND,
 PING) = range(1, 13)  # fmt: skip


def pack(head: int, fields: Sequence[bytes]) -> bytes:
    parts = [struct.pack(">BI", head, len(fields))]
    for f in fields:
        parts += [struct.pack(">I", len(f)), f]
    return b"".join(parts)


def read_message(sock: socket.socket, deadline: float | None) -> tuple[int, list[bytes]]:
    head, count = struct.unpack(">BI", read_exact(sock, 5, deadline, "a store message"))
    if count > MAX_FIELDS:
        raise ConnectionError(f"{count} fields in one message")
    fields = []
    for _ in range(count):
        (size,) = struct.unpack(">I", read_exact(sock, 4, deadline, "a store message"))
        if size > MAX_FIELD:
            raise ConnectionError(f"a field of {size} bytes")
        fields.append(read_exact(sock, size, deadline, "a store message"))
    return head, fields
