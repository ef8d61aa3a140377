"""The frames between the launcher and its zygote (`loom.launch.zygote`), written once for both sides.

A request is a 4-byte big-endian length and that many bytes of JSON, sent by one ``sendmsg`` that carries the
worker's three standard streams as ``SCM_RIGHTS``; the zygote reads exactly the header, then exactly the body,
each with ``recvmsg``, so it never reads into the next request's bytes and every descriptor it receives arrives
with the request it belongs to. A reply, from the zygote, is one JSON line: ``{"ready": ...}`` once its
imports are done, ``{"id": N, "pid": P}`` for request N, ``{"exited": P, "status": S}`` when a worker ends.
"""

from __future__ import annotations

import array
import json
import os
import socket
from typing import Any

__all__ = ["MAX_REQUEST", "MAX_REPLY", "read_request", "reply", "send_request"]

MAX_REQUEST = 1 << 20
"""The longest request a zygote reads (the environment and arguments of one worker)."""
MAX_REPLY = 4096
"""The longest line the launcher reads from its zygote (a pid or an exit status)."""
_HEADER = 4
_FDS = 3


def send_request(sock: socket.socket, request: dict[str, Any], fds: list[int]) -> bool:
    """Send ``request`` with its descriptors as one frame; False (nothing sent) when it is over `MAX_REQUEST`."""
    body = json.dumps(request).encode()
    if len(body) > MAX_REQUEST:
        return False
    frame = len(body).to_bytes(_HEADER, "big") + body
    sent = socket.send_fds(sock, [frame], fds)  # the descriptors ride with the frame's first bytes
    if sent < len(frame):
        sock.sendall(frame[sent:])
    return True


def _receive(sock: socket.socket, size: int, fds: list[int]) -> bytes:
    """Exactly ``size`` bytes (fewer only at the end of the stream), the descriptors met on the way in ``fds``."""
    data = bytearray()
    room = socket.CMSG_SPACE(_FDS * array.array("i").itemsize)
    while len(data) < size:
        chunk, ancillary, flags, _ = sock.recvmsg(size - len(data), room)
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
                fds.extend(got)
        if flags & socket.MSG_CTRUNC:
            _close(fds)
            raise SystemExit(f"loom zygote: a request came with more than {_FDS} descriptors; refused")
        if not chunk:
            break
        data += chunk
    return bytes(data)


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def read_request(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """One request and its three descriptors (the zygote's side); None when the launcher closed its end.
    A malformed request stops the zygote with one line (SystemExit), its descriptors closed."""
    fds: list[int] = []
    header = _receive(sock, _HEADER, fds)
    if not header and not fds:
        return None
    try:
        size = int.from_bytes(header, "big") if len(header) == _HEADER else -1
        if not 0 < size <= MAX_REQUEST or len(body := _receive(sock, size, fds)) < size:
            raise SystemExit(f"loom zygote: a request over {MAX_REQUEST} bytes or cut short; refused")
        try:
            request = json.loads(body)
        except ValueError:
            raise SystemExit("loom zygote: a request that is not JSON; refused") from None
        _check(request, fds)
    except SystemExit:
        _close(fds)
        raise
    return request, fds


def _check(request: Any, fds: list[int]) -> None:
    if not isinstance(request, dict):
        raise SystemExit("loom zygote: a request must be a JSON object")
    env, argv = request.get("env"), request.get("argv")
    if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise SystemExit("loom zygote: the request's env must map names to strings")
    if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
        raise SystemExit("loom zygote: the request's argv must be a non-empty list of strings")
    if len(fds) != _FDS:
        raise SystemExit(f"loom zygote: a request needs stdin, stdout and stderr; got {len(fds)} descriptors")


def reply(sock: socket.socket, message: dict[str, Any]) -> None:
    """One reply line to the launcher."""
    sock.sendall((json.dumps(message) + "\n").encode())
