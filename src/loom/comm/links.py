"""loom's own TCP links between ring neighbours: authenticated, one socket per direction, driven by the caller.

Why: a ring step is a send to the right neighbour during a receive from the left one. Through gloo's
point-to-point calls each message crosses thread hand-offs in both processes (the caller queues it, gloo's
I/O thread moves it, a condition variable wakes the caller) and a rendezvous (the sender waits for the
receiver's "ready" note before sending). On the 2-core development host that cost 0.4-2 ms per exchange,
more than moving the data itself below a few MiB. Here the calling thread moves the bytes: non-blocking
sockets and one poll loop that sends and receives at once (so two neighbours sending large buffers to each
other never deadlock on full socket buffers), and no per-message protocol, since both ends know the size of
every message from the schedule. It is the same kernel TCP path gloo uses, so `ring` against `native` still
compares algorithms over the same transport.

Set-up (`ring_link`, on the first ring call for a group and pair of neighbours; only the ring's members
take part): every process listens on one ephemeral port on the address of the interface gloo uses
(``GLOO_SOCKET_IFNAME``, which `loom run` sets to the interface holding the node's address; loopback when
unset), tells its left neighbour where (a gloo point-to-point message), connects to its right neighbour
while accepting one connection from its left one, then closes the listener. Before any data moves, both
ends of every connection prove they hold the job secret (``LOOM_JOB_SECRET``, from `loom run`):
challenge-response with fresh random nonces from both sides and HMAC-SHA256 under a different label per
direction, so a recorded handshake cannot be replayed. The listener reads only fixed-size fields before the
proof; a connection that fails it is closed and counted, and the listener keeps waiting for its neighbour
until `HANDSHAKE_TIMEOUT_S`.

A direction that cannot have a link uses gloo's point-to-point calls; both of its ends decide alike, from
the listener's offer: no job secret (a job not started by `loom run`), a neighbour on another host while
this process listens on loopback only, or two different secrets (nodes of a multi-node job each started
without a common ``LOOM_JOB_SECRET``: a warning says so; the offer carries a 64-bit hash of the secret to
tell, never the secret).

Failures: a neighbour that exits closes its sockets, so the next exchange raises an error naming this rank,
the neighbour and the operation at once instead of waiting; one that stops without exiting is given up after
`LINK_TIMEOUT_S` without progress.

Limits: IPv4; data after the handshake is not authenticated message by message (whoever can inject into an
established TCP connection could corrupt a reduction, as with gloo's own connections); synchronous.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import os
import select
import socket
import struct
import threading
import time
import warnings

import torch
import torch.distributed as dist

from loom.comm._reduce import exchange, host_key

__all__ = ["HANDSHAKE_TIMEOUT_S", "LINK_TIMEOUT_S", "RingLink", "ring_link"]

LINK_TIMEOUT_S = 300.0
"""An exchange that moves no byte for this long fails, naming the neighbour it waited for."""
HANDSHAKE_TIMEOUT_S = 60.0
"""How long set-up waits for the neighbours to connect and prove the secret."""

_HELLO = b"LOOMRNG1"
_NONCE = 16
_MAC = 32
_SIOCGIFADDR = 0x8915


class RingLink:
    """One process's two directions on a ring: ``out`` to the right neighbour and ``inn`` from the left one,
    each a connected socket or None (that direction goes through gloo). ``right``/``left`` are global ranks."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        right: int,
        left: int,
        out: socket.socket | None,
        inn: socket.socket | None,
        rejected: int = 0,
    ) -> None:
        self.group, self.right, self.left, self.out, self.inn = group, right, left, out, inn
        self.rejected = rejected
        """Connections the listener closed because they did not prove the job secret."""
        self._poll = select.poll()
        for sock, events in ((out, select.POLLOUT), (inn, select.POLLIN)):
            if sock is not None:
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._poll.register(sock, events)

    @property
    def carries(self) -> bool:
        """Whether at least one direction has a socket (else gloo's windowed path is the better one)."""
        return self.out is not None or self.inn is not None

    def exchange(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        """Send ``send`` right while receiving ``recv`` from the left (contiguous tensors; sizes known to both
        ends); return when both are done."""
        works = []  # a direction without a link goes through gloo, posted first and waited for last
        if self.inn is None and recv.numel():
            works.append(dist.irecv(recv, src=self.left, group=self.group))
        if self.out is None and send.numel():
            works.append(dist.isend(send, dst=self.right, group=self.group))
        self._move(
            _bytes(send) if self.out is not None else b"", _bytes(recv) if self.inn is not None else None
        )
        for work in works:
            if work is not None:  # None only for a process outside the group, which the entry point refuses
                work.wait()

    def _move(self, out: memoryview | bytes, into: memoryview | None) -> None:
        sent, got = 0, 0
        to_send, to_get = len(out), len(into) if into is not None else 0
        idle_since = time.monotonic()
        while sent < to_send or got < to_get:
            moved = False
            if sent < to_send:
                try:
                    sent += self.out.send(out[sent:])  # type: ignore[union-attr]
                    moved = True
                except BlockingIOError:
                    pass
                except OSError as error:
                    raise self._failed("send to", self.right, error.strerror or str(error)) from None
            if got < to_get:
                try:
                    count = self.inn.recv_into(into[got:])  # type: ignore[union-attr,index]
                except BlockingIOError:
                    count = -1
                except OSError as error:
                    raise self._failed("receive from", self.left, error.strerror or str(error)) from None
                if count == 0:
                    raise self._failed("receive from", self.left, "the connection closed (did it exit?)")
                if count > 0:
                    got += count
                    moved = True
            if moved:
                idle_since = time.monotonic()
                continue
            if self.out is not None:
                self._poll.modify(self.out, select.POLLOUT if sent < to_send else 0)
            if self.inn is not None:
                self._poll.modify(self.inn, select.POLLIN if got < to_get else 0)
            self._poll.poll(1000)
            if time.monotonic() - idle_since > LINK_TIMEOUT_S:
                peer = self.left if got < to_get else self.right
                raise self._failed("exchange with", peer, f"no byte moved for {LINK_TIMEOUT_S:.0f} s")

    def _failed(self, what: str, peer: int, why: str) -> RuntimeError:
        return RuntimeError(
            f"rank {dist.get_rank()}: ring all-reduce: {what} rank {peer} failed: {why}. "
            f"HINT: the log of rank {peer} shows why it stopped."
        )

    def close(self) -> None:
        for sock in (self.out, self.inn):
            if sock is not None:
                sock.close()


def _bytes(t: torch.Tensor) -> memoryview:
    return t.detach().view(torch.uint8).numpy().data


_LINKS: dict[tuple[object, int, int], RingLink] = {}


def ring_link(group: dist.ProcessGroup | None, right: int, left: int) -> RingLink:
    """The `RingLink` of this process towards ``right`` and from ``left`` (global ranks) on ``group``, made on
    first use: every member of that ring must call it, in the same order of rings."""
    key = (group if group is not None else dist.group.WORLD, right, left)
    link = _LINKS.get(key)
    if link is None:
        link = _LINKS[key] = _connect(group, right, left)
    return link


def _job_secret() -> bytes | None:
    text = os.environ.get("LOOM_JOB_SECRET", "")
    try:
        secret = bytes.fromhex(text.strip())
    except ValueError:
        return None
    return secret if len(secret) >= 16 else None


def _listen_address() -> str:
    """IPv4 address of the first interface in GLOO_SOCKET_IFNAME, else loopback."""
    name = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    if name:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
                return socket.inet_ntoa(raw[20:24])
            except OSError:
                pass
    return "127.0.0.1"


def _swap(payload: bytes, to: int, frm: int, group: dist.ProcessGroup | None) -> bytes:
    """Send ``payload`` to ``to`` while receiving as many bytes from ``frm`` (gloo point-to-point)."""
    incoming = torch.zeros(len(payload), dtype=torch.uint8)
    exchange(torch.frombuffer(bytearray(payload), dtype=torch.uint8), to, incoming, frm, group)
    return incoming.numpy().tobytes()


def _connect(group: dist.ProcessGroup | None, right: int, left: int) -> RingLink:
    me, secret = dist.get_rank(), _job_secret()
    digest = hashlib.sha256(host_key().encode()).digest()[:16]
    listener = None
    if secret is not None:
        try:
            listener = socket.create_server((_listen_address(), 0), backlog=8)
        except OSError as error:  # the offer then says so, and the left neighbour uses gloo
            warnings.warn(f"rank {me}: ring messages from rank {left} go through gloo: {error}", stacklevel=4)
    address, port = listener.getsockname()[:2] if listener else ("0.0.0.0", 0)
    check = hashlib.sha256(b"loom ring key check" + secret).digest()[:8] if secret else bytes(8)
    offer = (
        bytes([listener is not None]) + digest + check + socket.inet_aton(address) + port.to_bytes(2, "big")
    )
    theirs = _swap(offer, to=left, frm=right, group=group)  # the right neighbour's listener
    their_address, their_port = socket.inet_ntoa(theirs[25:29]), int.from_bytes(theirs[29:31], "big")
    dial = listener is not None and theirs[0] == 1
    if dial and theirs[17:25] != check:
        dial = False
        warnings.warn(
            f"rank {me}: ring messages to rank {right} go through gloo: the two processes hold different job "
            "secrets. HINT: give every node of a multi-node job the same LOOM_JOB_SECRET (64 hex digits)",
            stacklevel=4,
        )
    dial = dial and (theirs[1:17] == digest or not their_address.startswith("127."))
    accept = _swap(bytes([dial]), to=right, frm=left, group=group)[0] == 1
    deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
    accepted: list[socket.socket] = []
    errors: list[BaseException] = []
    rejected = [0]

    def take_left() -> None:
        try:
            accepted.append(_accept(listener, secret, left, me, deadline, rejected))  # type: ignore[arg-type]
        except BaseException as error:  # reported by the caller's thread
            errors.append(error)

    thread = threading.Thread(target=take_left, daemon=True) if accept else None
    out = None
    try:
        if thread is not None:
            thread.start()
        if dial:
            out = _dial(their_address, their_port, secret, me, right, deadline)  # type: ignore[arg-type]
    finally:
        if thread is not None:
            thread.join()
        if listener is not None:
            listener.close()
    if errors:
        if out is not None:
            out.close()
        raise errors[0]
    return RingLink(group, right, left, out, accepted[0] if accepted else None, rejected[0])


def _mac(secret: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, label + b"".join(parts), hashlib.sha256).digest()


def _read_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the peer closed the connection during the handshake")
        data += chunk
    return bytes(data)


def _dial(address: str, port: int, secret: bytes, me: int, peer: int, deadline: float) -> socket.socket:
    """Connect to ``peer``'s listener and run the connecting side of the handshake."""
    where = f"rank {me}: ring link to rank {peer} at {address}:{port}"
    try:
        sock = socket.create_connection((address, port), timeout=max(deadline - time.monotonic(), 1.0))
    except OSError as error:
        raise RuntimeError(f"{where}: cannot connect: {error}") from None
    try:
        ranks = me.to_bytes(4, "big") + peer.to_bytes(4, "big")
        mine = os.urandom(_NONCE)
        sock.sendall(_HELLO + mine + ranks)
        reply = _read_exact(sock, _NONCE + _MAC)
        theirs = reply[:_NONCE]
        if not hmac.compare_digest(reply[_NONCE:], _mac(secret, b"loom ring accept", mine, theirs, ranks)):
            raise RuntimeError(f"{where}: the listener did not prove it holds the job secret")
        sock.sendall(_mac(secret, b"loom ring connect", theirs, mine, ranks))
        if _read_exact(sock, 1) != b"\1":
            raise RuntimeError(f"{where}: the listener refused the handshake")
    except (OSError, RuntimeError) as error:
        sock.close()
        if isinstance(error, RuntimeError):
            raise
        raise RuntimeError(
            f"{where}: handshake failed: {error}. HINT: every process needs the same LOOM_JOB_SECRET"
        ) from None
    return sock


def _accept(
    listener: socket.socket, secret: bytes, peer: int, me: int, deadline: float, rejected: list[int]
) -> socket.socket:
    """Accept connections until one is ``peer`` proving the job secret; close and count the others."""
    ranks = peer.to_bytes(4, "big") + me.to_bytes(4, "big")
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RuntimeError(
                f"rank {me}: ring link: rank {peer} did not connect and prove the job secret within "
                f"{HANDSHAKE_TIMEOUT_S:.0f} s ({rejected[0]} other connections refused). HINT: every process "
                f"needs the same LOOM_JOB_SECRET, and rank {peer} must reach this address"
            )
        listener.settimeout(remaining)
        try:
            sock, _ = listener.accept()
        except TimeoutError:
            continue
        sock.settimeout(min(remaining, 10.0))
        try:
            hello = _read_exact(sock, len(_HELLO) + _NONCE + 8)
            if hello[: len(_HELLO)] != _HELLO or hello[-8:] != ranks:
                raise ConnectionError("not a ring hello from the expected neighbour")
            theirs, mine = hello[len(_HELLO) : len(_HELLO) + _NONCE], os.urandom(_NONCE)
            sock.sendall(mine + _mac(secret, b"loom ring accept", theirs, mine, ranks))
            proof = _read_exact(sock, _MAC)
            if not hmac.compare_digest(proof, _mac(secret, b"loom ring connect", mine, theirs, ranks)):
                raise ConnectionError("wrong proof of the job secret")
            sock.sendall(b"\1")
            sock.settimeout(None)
            return sock
        except OSError:  # ConnectionError and timeouts included
            sock.close()
            rejected[0] += 1
