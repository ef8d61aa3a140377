"""loom's key-value store for a job: authenticated, no pickle, every call bounded in time.

Why not PyTorch's ``TCPStore``: it accepts any client, and the elastic rendezvous unpickles what it finds there
(docs/security.md#secrets-and-listeners). So loom hosts its own: `StoreServer` (`loom.net.store_server`) in node
0's launcher, and `LoomStore`, a ``torch.distributed.Store`` usable wherever a ``TCPStore`` is (the elastic
agent, ``init_process_group(store=...)``, ``new_group``), in every process that needs it. User-facing summary:
docs/launching.md.

Authentication: every connection starts with both sides proving ``LOOM_JOB_SECRET`` (`loom.net.handshake`,
within `HANDSHAKE_TIMEOUT_S`); an unauthenticated peer can neither read nor write a key. Values are opaque
bytes; only lengths and decimal integers (``add``) are decoded (`loom.net.store_wire`).

Bounded: a client gives up connecting after ``connect_timeout_s`` (retrying refused connections until then: the
server may not be up yet) and waits for a reply at most the operation's own wait plus ``io_timeout_s``, then
raises `StoreUnreachable` naming the address and reconnects on its next call. The server answers a wait when
its keys appear or its timeout passes, never later.

Limits: IPv4 and IPv6 by address; after the handshake traffic is authenticated by the TCP connection only (like
gloo's own connections), not per message; one server thread per connection.
"""

from __future__ import annotations

import datetime
import errno
import socket
import threading
import time

import torch.distributed as dist

from loom.errors import StoreTimeout, StoreUnreachable
from loom.net import store_wire as wire
from loom.net.auth import job_secret  # noqa: F401 - the store's callers take it from here
from loom.net.handshake import HandshakeRefused, dial_handshake
from loom.net.store_server import HANDSHAKE_TIMEOUT_S, StoreServer

__all__ = [
    "HANDSHAKE_TIMEOUT_S",
    "LoomStore",
    "StoreServer",
    "StoreTimeout",
    "StoreUnreachable",
    "job_secret",
]


class LoomStore(dist.Store):
    """A ``torch.distributed.Store`` backed by a `StoreServer`: over an authenticated connection to
    ``host:port``, or in this process when given ``server=`` (node 0's launcher).

    ``prefix`` is prepended to every key (one store, many rounds: each rendezvous round and each restart
    attempt of a job uses its own prefix). ``timeout`` is the default wait for ``get``/``wait``; see the module
    docstring for ``connect_timeout_s`` and ``io_timeout_s``.
    """

    def __init__(
        self,
        host: str = "",
        port: int = 0,
        secret: bytes = b"",
        *,
        prefix: str = "",
        timeout: datetime.timedelta = datetime.timedelta(seconds=300),
        connect_timeout_s: float = 30.0,
        io_timeout_s: float = 30.0,
        server: StoreServer | None = None,
    ) -> None:
        super().__init__()
        self.set_timeout(timeout)
        self.host, self.port, self.secret, self.prefix = host, port, secret, prefix
        self.connect_timeout_s, self.io_timeout_s = connect_timeout_s, io_timeout_s
        self._server = server
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._clones: list[LoomStore] = []

    @property
    def address(self) -> str:
        return self._server.address if self._server else f"{self.host}:{self.port}"

    def with_prefix(self, prefix: str) -> LoomStore:
        """A store on the same server whose keys all start with ``prefix`` (a connection of its own)."""
        return LoomStore(
            self.host, self.port, self.secret, prefix=self.prefix + prefix, timeout=self.timeout,
            connect_timeout_s=self.connect_timeout_s, io_timeout_s=self.io_timeout_s, server=self._server,
        )  # fmt: skip

    def clone(self) -> LoomStore:
        """Another client of the same server and prefix, with a connection of its own. Kept alive by this one:
        torch holds only the C++ side of a Python store."""
        copy = self.with_prefix("")
        self._clones.append(copy)
        return copy

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    # -- transport ---------------------------------------------------------------------------------------
    def _connect(self) -> socket.socket:
        deadline = time.monotonic() + self.connect_timeout_s
        where = f"the loom store at {self.address}"
        while True:
            remaining = deadline - time.monotonic()
            try:
                sock = socket.create_connection((self.host, self.port), timeout=max(0.1, min(remaining, 5.0)))
                break
            except OSError as error:
                retry = isinstance(error, (ConnectionRefusedError, TimeoutError)) or error.errno in (
                    errno.ECONNREFUSED, errno.ETIMEDOUT, errno.ECONNRESET, errno.EAGAIN,
                )  # fmt: skip
                if not retry or time.monotonic() + 0.2 >= deadline:
                    why = "connection refused" if isinstance(error, ConnectionRefusedError) else str(error)
                    raise StoreUnreachable(
                        f"cannot connect to {where} within {self.connect_timeout_s:g} s: {why}"
                    ) from None
                time.sleep(0.2)
        try:
            deadline = time.monotonic() + max(HANDSHAKE_TIMEOUT_S, self.io_timeout_s)
            dial_handshake(sock, self.secret, b"", deadline, wire.HELLO, b"store")
        except HandshakeRefused:
            sock.close()
            raise StoreUnreachable(
                f"{where} does not hold this job's secret (LOOM_JOB_SECRET differs)"
            ) from None
        except OSError as error:
            sock.close()
            raise StoreUnreachable(
                f"{where} refused this process's job secret or closed the connection ({error}). "
                "HINT: every node needs the same LOOM_JOB_SECRET"
            ) from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _call(self, op: int, fields: list[bytes], wait_s: float = 0.0) -> list[bytes]:
        if self._server is not None:
            status, reply = self._server.table.apply(op, fields)
        else:
            with self._lock:
                try:
                    if self._sock is None:
                        self._sock = self._connect()
                    self._sock.sendall(wire.pack(op, fields))
                    status, reply = wire.read_message(
                        self._sock, time.monotonic() + wait_s + self.io_timeout_s
                    )
                except OSError as error:
                    if self._sock is not None:
                        self._sock.close()
                        self._sock = None
                    why = (
                        "no answer" if isinstance(error, TimeoutError) else str(error) or type(error).__name__
                    )
                    raise StoreUnreachable(
                        f"the loom store at {self.address} failed: {why} "
                        f"(waited up to {wait_s + self.io_timeout_s:g} s)"
                    ) from None
        if status == wire.TIMEOUT:
            missing = reply[0].decode(errors="replace") if reply else "?"
            raise StoreTimeout(f"timed out after {wait_s:g} s waiting for key {missing!r} in {self.address}")
        if status != wire.OK:
            raise RuntimeError(
                f"the loom store at {self.address}: {b''.join(reply).decode(errors='replace')}"
            )
        return reply

    def _key(self, key: str | bytes) -> bytes:
        return (self.prefix + (key.decode() if isinstance(key, bytes) else key)).encode()

    def _waiting(self, op: int, keys: list[str], timeout: datetime.timedelta | None = None) -> list[bytes]:
        """``op`` on ``keys``, which the server answers once they all exist or ``timeout`` (default: the store's)
        passes."""
        wait_s = (timeout if timeout is not None else self.timeout).total_seconds()
        return self._call(op, [str(int(wait_s * 1000)).encode(), *(self._key(k) for k in keys)], wait_s)

    # -- the c10d Store interface ------------------------------------------------------------------------
    @property
    def timeout(self) -> datetime.timedelta:
        return self._timeout

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout = timeout
        super().set_timeout(timeout)

    def set(self, key: str, value: str | bytes) -> None:
        self._call(wire.SET, [self._key(key), value.encode() if isinstance(value, str) else bytes(value)])

    def get(self, key: str) -> bytes:
        return self._waiting(wire.GET, [key])[0]

    def add(self, key: str, value: int) -> int:
        return int(self._call(wire.ADD, [self._key(key), str(int(value)).encode()])[0])

    def check(self, keys: list[str]) -> bool:
        return self._call(wire.CHECK, [self._key(k) for k in keys])[0] == b"1"

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._waiting(wire.WAIT, keys, timeout)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._waiting(wire.MULTI_GET, keys)

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        fields: list[bytes] = []
        for k, v in zip(keys, values, strict=True):
            fields += [self._key(k), v.encode() if isinstance(v, str) else bytes(v)]
        self._call(wire.MULTI_SET, fields)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        enc = [x.encode() if isinstance(x, str) else bytes(x) for x in (expected, desired)]
        return self._call(wire.COMPARE_SET, [self._key(key), *enc])[0]

    def append(self, key: str, value: str | bytes) -> None:
        self._call(wire.APPEND, [self._key(key), value.encode() if isinstance(value, str) else bytes(value)])

    def delete_key(self, key: str) -> bool:
        return self._call(wire.DELETE, [self._key(key)])[0] == b"1"

    def num_keys(self) -> int:
        return int(self._call(wire.NUM_KEYS, [])[0])

    def ping(self) -> None:
        """One round trip (raises `StoreUnreachable` if the server does not answer within ``io_timeout_s``)."""
        self._call(wire.PING, [])
