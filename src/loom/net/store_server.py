"""The store's server (`loom.net.store`): node 0's launcher hosts it; one thread per authenticated connection."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Sequence

from loom.net import store_wire as wire
from loom.net.handshake import answer_handshake

__all__ = ["HANDSHAKE_TIMEOUT_S", "StoreServer"]

HANDSHAKE_TIMEOUT_S = 5.0
"""Longest the server spends on one connection before it has proved the secret (a silent peer is dropped)."""


class _Table:
    """The keys and values, and the condition that wakes waiters when a key appears."""

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}
        self.changed = threading.Condition()

    def wait(self, keys: Sequence[bytes], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self.changed:
            while not all(k in self.data for k in keys):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self.changed.wait(min(remaining, 1.0))
            return True

    def apply(self, op: int, f: list[bytes]) -> tuple[int, list[bytes]]:
        """Run one request; waits happen outside the lock except inside `wait`."""
        if op in (wire.GET, wire.WAIT, wire.MULTI_GET):
            keys = f[1:]
            if not self.wait(keys, int(f[0]) / 1000.0):  # the wait's timeout in milliseconds, then the keys
                missing = [k for k in keys if k not in self.data]
                return wire.TIMEOUT, missing[:1]
            with self.changed:
                return wire.OK, [] if op == wire.WAIT else [self.data[k] for k in keys]
        with self.changed:
            if op == wire.SET:
                self.data[f[0]] = f[1]
            elif op == wire.MULTI_SET:
                self.data.update(zip(f[0::2], f[1::2], strict=True))
            elif op == wire.ADD:
                value = int(self.data.get(f[0], b"0")) + int(f[1])
                self.data[f[0]] = str(value).encode()
                self.changed.notify_all()
                return wire.OK, [self.data[f[0]]]
            elif op == wire.APPEND:
                self.data[f[0]] = self.data.get(f[0], b"") + f[1]
            elif op == wire.COMPARE_SET:
                key, expected, desired = f
                current = self.data.get(key)
                if (current is None and expected == b"") or current == expected:
                    self.data[key] = desired
                    self.changed.notify_all()
                    return wire.OK, [desired]
                return wire.OK, [expected if current is None else current]
            elif op == wire.CHECK:
                return wire.OK, [b"1" if all(k in self.data for k in f) else b"0"]
            elif op == wire.DELETE:
                return wire.OK, [b"1" if self.data.pop(f[0], None) is not None else b"0"]
            elif op == wire.NUM_KEYS:
                return wire.OK, [str(len(self.data)).encode()]
            elif op != wire.PING:
                return wire.ERROR, [f"unknown operation {op}".encode()]
            self.changed.notify_all()
            return wire.OK, []


class StoreServer:
    """The job's store, served on ``host:port`` (port 0: the OS picks one) to clients proving ``secret``."""

    def __init__(self, host: str, port: int, secret: bytes) -> None:
        self.secret = secret
        self.table = _Table()
        self.rejected = 0
        """Connections closed because they did not prove the secret (or spoke something else)."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=64)
        self.host, self.port = host, self._listener.getsockname()[1]
        self._closed = threading.Event()
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept_loop, name="loom-store-accept", daemon=True).start()

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def close(self) -> None:
        """Stop listening and drop every connection (idempotent)."""
        if self._closed.is_set():
            return
        self._closed.set()
        with self._lock:
            conns = list(self._connections)
        for sock in (self._listener, *conns):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError:
                if self._closed.is_set():
                    return
                time.sleep(0.05)  # e.g. EMFILE: do not spin
                continue
            threading.Thread(target=self._serve, args=(sock,), name="loom-store-conn", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        with self._lock:
            self._connections.add(sock)
        try:
            try:
                deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
                answer_handshake(sock, self.secret, 0, lambda ids: True, deadline, wire.HELLO, b"store")
                sock.settimeout(None)
            except OSError:
                self.rejected += 1
                return
            while not self._closed.is_set():
                op, fields = wire.read_message(sock, None)
                try:
                    status, reply = self.table.apply(op, fields)
                except (ValueError, IndexError) as error:
                    status, reply = wire.ERROR, [f"bad request: {error}".encode()]
                sock.sendall(wire.pack(status, reply))
        except OSError:
            pass
        finally:
            with self._lock:
                self._connections.discard(sock)
            sock.close()
