"""loom's own TCP links between ring neighbours: authenticated, one socket per direction, driven by the caller.

Why: through gloo's point-to-point calls each ring message crosses thread hand-offs in both processes and a
rendezvous (the sender waits for the receiver's "ready"), which below a few MiB can cost more than moving the
data (``benchmarks/reports/allreduce.md``). Here the calling thread moves the bytes in one poll loop that sends
and receives at once (so two neighbours sending large buffers to each other never deadlock on full socket
buffers), with no per-message protocol: both ends know every message's size from the schedule. It is gloo's
kernel TCP path, so `ring` against `native` still compares algorithms, not transports.

Set-up (`ring_link`, a collective of the ring's members on its first call): each member listens on gloo's
interface (``GLOO_SOCKET_IFNAME``; loopback when unset), tells its left neighbour where, and links to both
neighbours once each end has proved the job secret (`loom.net.handshake`; docs/security.md). All or nothing:
when a member cannot link (no job secret, as outside `loom run`; a neighbour on another host while this one
listens on loopback; another secret, told by a 64-bit hash in the offer, never the secret), the whole ring uses
gloo, so all members cut the data into the same segments.

Failures: a neighbour that exits closes its sockets, so the next exchange raises at once, naming this rank, the
neighbour and the operation; one that stops without exiting is given up after `LINK_TIMEOUT_S` without progress.

Limits: IPv4; CPU tensors under gloo; data after the handshake is not authenticated per message (as with gloo's
own connections); synchronous, and not for two threads at once.
"""

from __future__ import annotations

import hashlib
import os
import select
import socket
import threading
import time
import warnings

import torch
import torch.distributed as dist

from loom.comm._reduce import backend_name, group_rank_and_size, host_digest
from loom.net.auth import job_secret
from loom.net.handshake import HandshakeRefused, dial_handshake
from loom.net.interfaces import interface_address
from loom.net.listener import Listener

__all__ = [
    "CONNECTION_TIMEOUT_S",
    "HANDSHAKE_TIMEOUT_S",
    "LINK_TIMEOUT_S",
    "MAX_PENDING_HANDSHAKES",
    "RingLink",
    "close_links",
    "forget_links",
    "ring_link",
]

LINK_TIMEOUT_S = 300.0
"""An exchange that moves no byte for this long fails, naming the neighbour it waited for."""
HANDSHAKE_TIMEOUT_S = 60.0
"""How long set-up waits for the neighbours to connect and prove the secret."""
CONNECTION_TIMEOUT_S = 5.0
"""Longest a listener spends on one connection's handshake (a silent or slow client is dropped)."""
MAX_PENDING_HANDSHAKES = 64
"""Handshakes a ring listener runs at once; one more evicts the oldest (`loom.net.listener.Listener`)."""

_HELLO = b"LOOMRNG1"


class RingLink:
    """One process's two connected sockets on a ring: ``out`` to the right neighbour, ``inn`` from the left
    one (``right``/``left`` are global ranks)."""

    def __init__(
        self, right: int, left: int, out: socket.socket, inn: socket.socket, rejected: int = 0
    ) -> None:
        self.right, self.left, self.out, self.inn = right, left, out, inn
        self.rejected = rejected
        """Connections the listener closed because they did not prove the job secret."""
        for sock in (out, inn):
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def exchange(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        """Send ``send`` right while receiving ``recv`` from the left (contiguous CPU tensors whose sizes both
        ends know); return when both are done."""
        out, into = _bytes(send), _bytes(recv)
        sent, got = 0, 0
        idle_since = time.monotonic()
        while sent < len(out) or got < len(into):
            moved = False
            if sent < len(out):
                try:
                    sent += self.out.send(out[sent:])
                    moved = True
                except BlockingIOError:
                    pass
                except OSError as error:
                    raise self._failed("send to", self.right, error.strerror or str(error)) from None
            if got < len(into):
                try:
                    count = self.inn.recv_into(into[got:])
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
            # Wait only on the directions still under way: a finished one may report a hang-up forever.
            poller = select.poll()
            if sent < len(out):
                poller.register(self.out, select.POLLOUT)
            if got < len(into):
                poller.register(self.inn, select.POLLIN)
            poller.poll(1000)
            if time.monotonic() - idle_since > LINK_TIMEOUT_S:
                peer = self.left if got < len(into) else self.right
                raise self._failed("exchange with", peer, f"no byte moved for {LINK_TIMEOUT_S:.0f} s")

    def _failed(self, what: str, peer: int, why: str) -> RuntimeError:
        return RuntimeError(
            f"rank {dist.get_rank()}: ring all-reduce: {what} rank {peer} failed: {why}. "
            f"HINT: the log of rank {peer} shows why it stopped."
        )

    def close(self) -> None:
        self.out.close()
        self.inn.close()


def _bytes(t: torch.Tensor) -> memoryview:
    """The bytes of the contiguous CPU tensor ``t``, flat, without a copy."""
    return t.detach().view(torch.uint8).numpy().data.cast("B")


_LINKS: dict[tuple[object, tuple[int, ...], int], RingLink | None] = {}


def ring_link(
    group: dist.ProcessGroup | None, members: tuple[int, ...], position: int, tensor: torch.Tensor
) -> RingLink | None:
    """This process's `RingLink` on the ring of ``members`` (ranks in ``group``, in ring order; this process is
    ``members[position]``), made on first use, or None: the ring goes through gloo (see the module docstring;
    the same answer on every member). Every member must call it for its first ring over ``members``."""
    if tensor.device.type != "cpu":
        return None
    key = (group if group is not None else dist.group.WORLD, members, position)
    if key not in _LINKS:
        _LINKS[key] = _connect(group, members, position) if backend_name(group) == "gloo" else None
    return _LINKS[key]


def forget_links(group: dist.ProcessGroup) -> None:
    """Close the links of ``group`` and let go of it (a healing epoch's group ends at every re-form: a link kept
    here would hold the group alive, and `loom.fault.quorum.Quorum` frees its waiting peers by dropping it)."""
    for key in [k for k in _LINKS if k[0] is group]:
        link = _LINKS.pop(key)
        if link is not None:
            link.close()


def close_links() -> None:
    """Close every link (`loom.topology.shutdown` calls it with the process group's end)."""
    for link in _LINKS.values():
        if link is not None:
            link.close()
    _LINKS.clear()


def _job_secret(me: int) -> bytes | None:
    """The job secret, or None (with a warning) when it is unset or malformed: the ring then goes through gloo."""
    if not os.environ.get("LOOM_JOB_SECRET", ""):
        return None
    try:
        return job_secret()
    except ValueError:
        warnings.warn(
            f"rank {me}: LOOM_JOB_SECRET is not at least 32 hex digits, so the ring goes through gloo. "
            "HINT: let `loom run` generate it, or set 64 hex digits (openssl rand -hex 32) on every node",
            stacklevel=5,
        )
        return None


def _listen_address() -> str:
    """IPv4 address of the first interface in GLOO_SOCKET_IFNAME, else loopback."""
    name = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    return (interface_address(name) if name else None) or "127.0.0.1"


def _swap(payload: bytes, to: int, frm: int, group: dist.ProcessGroup | None) -> bytes:
    """Send ``payload`` to ``to`` while receiving as many bytes from ``frm`` (gloo point-to-point; ranks in
    ``group``, so an explicit group needs no default group behind it). Both are posted before either is waited
    for: every member sends and receives at once, so the ring cannot deadlock."""
    incoming = torch.zeros(len(payload), dtype=torch.uint8)
    outgoing = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    receive = dist.irecv(incoming, group=group, group_src=frm)
    for work in (receive, dist.isend(outgoing, group=group, group_dst=to)):
        if work is not None:  # None only for a process outside ``group``, which group_rank_and_size refuses
            work.wait()
    return incoming.numpy().tobytes()


def _agree(ok: bool, size: int, right: int, left: int, group: dist.ProcessGroup | None) -> bool:
    """Whether every member of the ring is ``ok``: the flag goes round the ring, ``size - 1`` hops."""
    for _ in range(size - 1):
        ok = _swap(bytes([ok]), to=right, frm=left, group=group)[0] == 1 and ok
    return ok


def _connect(group: dist.ProcessGroup | None, members: tuple[int, ...], position: int) -> RingLink | None:
    size = len(members)
    right, left = members[(position + 1) % size], members[(position - 1) % size]
    me = group_rank_and_size(group)[0]
    secret = _job_secret(me)
    digest = host_digest()[:16]
    listener, reason = None, ""
    if secret is not None:
        try:
            listener = socket.create_server((_listen_address(), 0), backlog=8)
        except OSError as error:
            reason = f"cannot listen: {error}"
    try:
        address, port = listener.getsockname()[:2] if listener else ("0.0.0.0", 0)
        check = hashlib.sha256(b"loom ring key check" + secret).digest()[:8] if secret else bytes(8)
        offer = bytes([listener is not None]) + digest + check + socket.inet_aton(address)
        theirs = _swap(offer + port.to_bytes(2, "big"), to=left, frm=right, group=group)
        their_address, their_port = socket.inet_ntoa(theirs[25:29]), int.from_bytes(theirs[29:31], "big")
        if listener is not None and theirs[0] == 1 and theirs[17:25] != check:
            reason = f"rank {right} holds another job secret"
        elif listener is not None and theirs[1:17] != digest and their_address.startswith("127."):
            reason = f"rank {right} is on another host and listens on loopback only"
        ok = listener is not None and theirs[0] == 1 and not reason
        if reason:
            warnings.warn(
                f"rank {me}: ring all-reduce goes through gloo: {reason}. HINT: give every node of a multi-node "
                "job the same LOOM_JOB_SECRET (64 hex digits) and start it with `loom run`",
                stacklevel=5,
            )
        if not _agree(ok, size, right, left, group):
            return None
        assert listener is not None and secret is not None
        return _link_up(listener, secret, me, right, left, their_address, their_port)
    finally:
        if listener is not None:
            listener.close()


def _link_up(
    listener: socket.socket, secret: bytes, me: int, right: int, left: int, address: str, port: int
) -> RingLink:
    """Dial the right neighbour while a thread accepts the left one (each waits on a neighbour doing the
    other, so one thread doing both in turn could wait round the ring forever)."""
    deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
    accepted: list[tuple[socket.socket, Listener]] = []
    errors: list[BaseException] = []

    def take_left() -> None:
        try:
            accepted.append(_accept(listener, secret, left, me, deadline))
        except BaseException as error:  # handed to the calling thread
            errors.append(error)

    thread = threading.Thread(target=take_left, daemon=True)
    thread.start()
    out = None
    try:
        out = _dial(address, port, secret, me, right, deadline)
    finally:
        thread.join()
        if out is None or errors:
            for sock in (out, *(a[0] for a in accepted)):
                if sock is not None:
                    sock.close()
    if errors:
        raise errors[0]
    return RingLink(right, left, out, accepted[0][0], accepted[0][1].rejected)


def _dial(address: str, port: int, secret: bytes, me: int, peer: int, deadline: float) -> socket.socket:
    """Connect to ``peer``'s listener and run the connecting side of the handshake.

    A connection reset or closed during the handshake is tried again until ``deadline`` (a listener crowded by
    other connections drops its oldest pending one); a listener that fails to prove the secret is not."""
    where = f"rank {me}: ring link to rank {peer} at {address}:{port}"
    pause, last = 0.05, "no attempt"
    while True:
        try:
            sock = socket.create_connection((address, port), timeout=max(deadline - time.monotonic(), 1.0))
        except OSError as error:
            raise RuntimeError(f"{where}: cannot connect: {error}") from None
        try:
            dial_handshake(
                sock, secret, me.to_bytes(4, "big") + peer.to_bytes(4, "big"), deadline, _HELLO, b"ring"
            )
            sock.settimeout(None)
            return sock
        except HandshakeRefused as refused:
            sock.close()
            raise RuntimeError(f"{where}: {refused}") from None
        except OSError as error:
            sock.close()
            last = str(error)
        if time.monotonic() + pause >= deadline:
            raise RuntimeError(
                f"{where}: handshake failed until the deadline, last: {last}. HINT: the listener closed every "
                "attempt: it was crowded by other connections, or the processes hold different LOOM_JOB_SECRETs"
            )
        time.sleep(pause)
        pause = min(2 * pause, 1.0)


def _accept(
    listener: socket.socket, secret: bytes, peer: int, me: int, deadline: float
) -> tuple[socket.socket, Listener]:
    """``peer``'s connection to ``listener`` once it proves the job secret, and the `Listener` that closed and
    counted the others (closed on return: handshakes still under way go on counting)."""
    ranks, event = peer.to_bytes(4, "big") + me.to_bytes(4, "big"), threading.Event()
    handshakes = Listener(listener, secret, len(ranks), ranks.__eq__, _HELLO, b"ring", MAX_PENDING_HANDSHAKES,
                          event.set, CONNECTION_TIMEOUT_S, deadline)  # fmt: skip
    try:
        event.wait(max(deadline - time.monotonic(), 0.0))
        if handshakes.arrived:
            return handshakes.arrived.popleft()[1], handshakes
        if handshakes.error is not None:
            raise RuntimeError(f"rank {me}: ring link: accepting rank {peer} failed: {handshakes.error}")
        raise RuntimeError(
            f"rank {me}: ring link: rank {peer} did not connect and prove the job secret within "
            f"{HANDSHAKE_TIMEOUT_S:.0f} s ({handshakes.rejected} other connections refused). HINT: every process "
            f"needs the same LOOM_JOB_SECRET, and rank {peer} must reach this address"
        )
    finally:
        handshakes.close()
