"""Admitting connections that prove the job secret, for loom's point-to-point links (the ring's, gossip's).

A listening socket is an attack surface: this is the one place loom's links accept on one. Nothing is decoded before
the challenge-response of `loom.net.handshake`, and each handshake is bounded (`Listener`).
"""

from __future__ import annotations

import collections
import contextlib
import math
import socket
import threading
import time
from collections.abc import Callable

from loom.net.handshake import answer_handshake

__all__ = ["Listener"]


class Listener:
    """Admits on the listening ``sock`` the connections that prove ``secret`` (`answer_handshake` under ``hello``
    and ``label``, with ids of ``id_size`` bytes that ``expected`` accepts) into `arrived`; closes and counts the
    others (`rejected`). ``wake()`` runs after each admission, and when accepting fails (`error`).

    A thread accepts; each connection's handshake runs on a thread of its own within ``timeout_s`` (and
    ``deadline``), so clients that connect and say nothing cannot hold a peer back one after another. At most
    ``limit`` run at once: one more evicts the oldest (its socket is shut down, so its handshake fails and is
    counted), so such clients delay a peer by one eviction at most, never lock it out; dialers retry a reset one.
    """

    def __init__(self, sock: socket.socket, secret: bytes, id_size: int, expected: Callable[[bytes], bool],
                 hello: bytes, label: bytes, limit: int, wake: Callable[[], None], timeout_s: float,
                 deadline: float = math.inf, name: str = "loom-accept") -> None:  # fmt: skip
        self.sock, self.secret, self.id_size, self.expected = sock, secret, id_size, expected
        self.hello, self.label, self.limit, self.wake = hello, label, limit, wake
        self.timeout_s, self.deadline = timeout_s, deadline
        self.arrived: collections.deque[tuple[bytes, socket.socket]] = collections.deque()
        """(ids, socket) of each admitted connection, oldest first."""
        self.rejected = 0
        """Connections closed because they did not prove the job secret (or too many at once)."""
        self.error: OSError | None = None
        """Why accepting failed, if it did (no more connections are accepted then)."""
        self._pending: collections.OrderedDict[socket.socket, None] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._closed = False
        sock.settimeout(0.5)
        threading.Thread(target=self._accept_loop, name=name, daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError as error:
                if not self._closed:
                    self.error = error
                    self.wake()
                return
            with self._lock:
                if len(self._pending) >= self.limit:
                    oldest, _ = self._pending.popitem(last=False)
                    with contextlib.suppress(OSError):
                        oldest.shutdown(socket.SHUT_RDWR)
                self._pending[conn] = None
            threading.Thread(target=self._handshake, args=(conn,), daemon=True, name="loom-handshake").start()

    def _handshake(self, conn: socket.socket) -> None:
        until = min(self.deadline, time.monotonic() + self.timeout_s)
        try:
            ids = answer_handshake(
                conn, self.secret, self.id_size, self.expected, until, self.hello, self.label
            )
            conn.settimeout(None)
            self.arrived.append((ids, conn))
            self.wake()
        except OSError:  # ConnectionError, timeouts and evictions included: nothing of it was decoded
            with self._lock:
                self.rejected += 1  # counted before the client can see its connection closed
            conn.close()
        finally:
            with self._lock:
                self._pending.pop(conn, None)

    def close(self) -> None:
        """Stop accepting; close the connections admitted but not yet taken (handshakes under way go on)."""
        self._closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        while self.arrived:
            self.arrived.popleft()[1].close()
