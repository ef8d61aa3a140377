"""The worker's side of the transport: one authenticated DEALER connection per server, requests fanned out.

A request goes to several servers at once and the replies are gathered as they come. A reply must carry the
secret's MAC and answer the exact request sent (same session, the sequence number of one of its sends); anything
else is dropped and counted.

Retries: a server silent for an attempt window (2 s, doubling to 10 s; an answer still arriving chunk by chunk is
waited for) is greeted again every half second until it answers (a restarted server has a new epoch and drops
frames of the old one), then the request is resent under a new sequence number: safe, because the server
recognises pushes it has applied by the worker's clock. A greeting that finds a new epoch records a restart
(`PSClient.restarts`). A request unanswered by its deadline raises `TimeoutError` naming the server, its address,
the operation, the worker and the likely cause (`_why_silent`).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence
from typing import Any

import torch
import zmq

from loom.ps.deaths import death_of
from loom.ps.gate import Inbox, InboxLimits, chunk_key, secure_client, send_frame, source_ip
from loom.ps.wire import Frame, FrameDropped, MessageType, WireLimits, decode, encode

__all__ = ["ServerLink", "PSClient"]

ARRIVING_S = 1.0
"""A request whose answer got a chunk this recently is not retried yet (a long transfer is not a silent server)."""


class ServerLink:
    """One connection to one server: session, sequence numbers, the server's epoch, frames dropped."""

    def __init__(self, context: zmq.Context, address: str, secret: bytes, limits: WireLimits):
        self.address = address
        self.secret = secret
        self.limits = limits
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        try:
            secure_client(self.socket, secret, address)
        except ConnectionError:
            self.socket.close(0)  # an unreachable address: a socket left open would block the context's end
            raise
        self.socket.connect(f"tcp://{address}")
        self.chunk_key = chunk_key(secret)
        self.inbox = Inbox(
            self.chunk_key, limits, InboxLimits(total_bytes=limits.max_frame), self._drop, self._wanted
        )
        self._seqs: set[int] = set()
        self.session = int.from_bytes(os.urandom(8), "little") | 1
        self.seq = 0
        self.epoch = 0
        self.dropped = 0

    def send(
        self, kind: MessageType, meta: dict[str, Any], tensors: dict[str, torch.Tensor] | None
    ) -> tuple[int, int]:
        """Send one frame; returns its sequence number and the bytes handed to ZeroMQ (0: none, see below)."""
        self.seq += 1
        epoch = 0 if kind == MessageType.HELLO else self.epoch
        data = encode(
            self.secret, kind, epoch=epoch, session=self.session, seq=self.seq, meta=meta, tensors=tensors
        )
        # A connection refused at its handshake (a wrong job secret) has no pipe: sending would block. What is
        # not sent is resent after the request's attempt window, then given up on.
        return self.seq, len(data) if send_frame(self.socket, self.chunk_key, data) else 0

    def receive(self, seqs: set[int]) -> Frame | None:
        """A reply to one of the requests ``seqs`` (sends of one request) if waiting; others are dropped."""
        self._seqs = seqs
        while True:
            try:
                chunk = self.socket.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return None
            if chunk.more:  # a chunk is one message: the rest of a multipart one is dropped with it
                self.dropped += 1
                continue
            data = self.inbox.receive(b"", chunk.buffer, time.monotonic())
            if data is None:
                continue
            try:
                frame = decode(self.secret, data, self.limits)
            except FrameDropped:
                self.dropped += 1
                continue
            if frame.session != self.session or frame.seq not in seqs:
                self.dropped += 1  # a late answer to a request given up on
                continue
            return frame

    def _drop(self, reason: str) -> None:
        self.dropped += 1

    def _wanted(self, kind: int, epoch: int, session: int, seq: int, size: int) -> None:
        """Keep only the chunks of an answer to the request being waited for (see `loom.ps.gate.Inbox`)."""
        if (
            kind not in (MessageType.REPLY, MessageType.ERROR)
            or session != self.session
            or seq not in self._seqs
        ):
            raise FrameDropped("late")

    def close(self) -> None:
        self.socket.close(0)


class PSClient:
    """Connections to every server of the job."""

    def __init__(self, addresses: list[str], secret: bytes, limits: WireLimits | None = None) -> None:
        if not addresses:
            raise ValueError("no parameter-server addresses. HINT: start the job with `loom run --servers K`")
        self.context = zmq.Context()
        self.limits = limits or WireLimits()
        self.links: list[ServerLink] = []
        try:
            for address in addresses:
                self.links.append(ServerLink(self.context, address, secret, self.limits))
        except BaseException:  # an address that cannot be reached: leave no socket behind
            self.close()
            raise
        self.traffic: dict[str, list[int]] = {}
        """Bytes sent and received per request type: ``{"PUSH": [sent, received], ...}``."""
        self.restarts: list[dict[str, Any]] = []
        """Servers found restarted (a new epoch) and not yet taken by `take_restarts`: ``{"server", "address",
        "time" (Unix seconds of its first answer), "resumed": {model: version resumed at}, "models": {model:
        version when greeted}}``."""

    def hello(self, timeout_s: float = 60.0) -> list[dict[str, Any]]:
        """Greet every server (waiting for servers still starting); returns their answers."""
        frames = self.request(MessageType.HELLO, [{}] * len(self.links), timeout_s=timeout_s)
        for link, frame in zip(self.links, frames, strict=True):
            link.epoch = frame.epoch
        return [f.meta for f in frames]

    def request(
        self,
        kind: MessageType,
        metas: list[dict[str, Any]],
        tensors: Sequence[dict[str, torch.Tensor] | None] | None = None,
        *,
        servers: list[int] | None = None,
        timeout_s: float = 60.0,
    ) -> list[Frame]:
        """Send ``metas[i]`` (and ``tensors[i]``) to server ``servers[i]``; return the replies in that order."""
        servers = list(range(len(self.links))) if servers is None else servers
        tensors = tensors or [None] * len(servers)
        start = time.monotonic()
        deadline = start + timeout_s
        attempt = {i: 2.0 for i in range(len(servers))}
        retry_at = {i: start + 2.0 for i in range(len(servers))}
        pending = {i: {self._send(servers[i], kind, metas[i], tensors[i])} for i in range(len(servers))}
        replies: dict[int, Frame] = {}
        poller = zmq.Poller()
        for i in pending:
            poller.register(self.links[servers[i]].socket, zmq.POLLIN)
        while pending:
            now = time.monotonic()
            wake = min([deadline, *(retry_at[i] for i in pending)])
            poller.poll(max(0, int((wake - now) * 1000)) + 1)
            for i in list(pending):
                if (frame := self.links[servers[i]].receive(pending[i])) is not None:
                    replies[i] = self._answer(kind, frame)
                    del pending[i]
            now = time.monotonic()
            if pending and now > deadline:
                late, began = [servers[i] for i in pending], time.time() - (now - start)
                raise self._timeout(kind, late, metas[0].get("worker"), timeout_s, began - 30.0)
            for i in [i for i in pending if now >= retry_at[i]]:  # maybe restarted: greet it, then resend
                if self.links[servers[i]].inbox.arriving(b"", now, ARRIVING_S):
                    retry_at[i] = now + ARRIVING_S  # its answer is coming in: greeting now would drop it
                    continue
                greeted = kind == MessageType.HELLO or self._rehello(
                    servers[i], min(attempt[i], deadline - now), pending[i]
                )
                if isinstance(greeted, Frame):  # the answer came in while greeting
                    replies[i] = self._answer(kind, greeted)
                    del pending[i]
                    continue
                if greeted:  # else down (or restarting): greet again at once, resend once it answers
                    pending[i].add(self._send(servers[i], kind, metas[i], tensors[i]))
                    attempt[i] = min(10.0, attempt[i] * 2)
                retry_at[i] = time.monotonic() + (attempt[i] if greeted else 0.0)
        return [replies[i] for i in range(len(servers))]

    def _answer(self, kind: MessageType, frame: Frame) -> Frame:
        """Count a reply to a ``kind`` request; raise the server's error when it is one."""
        self._count(kind, 0, frame.nbytes)
        if frame.type == MessageType.ERROR:
            raise RuntimeError(str(frame.meta.get("error", "parameter server error")))
        return frame

    def _send(self, server: int, kind: MessageType, meta, tensors) -> int:
        seq, sent = self.links[server].send(kind, meta, tensors)
        self._count(kind, sent, 0)
        return seq

    def _rehello(self, server: int, timeout_s: float, waiting: set[int]) -> bool | Frame:
        """Greet ``server`` again (every 0.5 s until it answers or ``timeout_s`` passes): learn its epoch, and
        record a restart when the epoch changed. Returns whether it answered, or the answer to one of the
        requests ``waiting`` (sequence numbers) if that comes in first (it was late, not lost)."""
        link = self.links[server]
        seqs: set[int] = set()
        end = time.monotonic() + max(0.1, timeout_s)
        resend_at = 0.0
        while (now := time.monotonic()) < end:
            if now >= resend_at:  # a server that is down gets nothing; greet again once it may be back
                seqs.add(self._send(server, MessageType.HELLO, {}, None))
                resend_at = now + 0.5
            if link.socket.poll(int(max(1, (min(end, resend_at) - now) * 1000))):
                frame = link.receive(seqs | waiting)
                if frame is not None and frame.seq in waiting:
                    return frame
                if frame is not None:
                    if link.epoch and frame.epoch != link.epoch:
                        resumed, models = frame.meta.get("resumed"), frame.meta.get("models")
                        self.restarts.append({"server": server, "address": link.address, "time": time.time(),
                                              "resumed": resumed if isinstance(resumed, dict) else {},
                                              "models": models if isinstance(models, dict) else {}})  # fmt: skip
                    link.epoch = frame.epoch
                    return True
        return False

    def take_restarts(self) -> list[dict[str, Any]]:
        """The restarts found since the last call (see `restarts`)."""
        taken, self.restarts = self.restarts, []
        return taken

    def _timeout(
        self, kind: MessageType, late: list[int], worker: Any, timeout_s: float, since: float
    ) -> TimeoutError:
        """The error for servers ``late`` that did not answer: each named with its address and the likely cause
        (a death the launcher recorded after ``since``, Unix seconds: shortly before the request, or during it)."""
        who = f"worker rank {worker}" if isinstance(worker, int) else f"rank {os.environ.get('RANK', '?')}"
        causes = [f"parameter server {i} at {self.links[i].address} did not answer {kind.name} within "
                  f"{timeout_s:.0f} s: it {_why_silent(i, self.links[i].address, since)}" for i in late]  # fmt: skip
        return TimeoutError(
            f"{who}: {'; '.join(causes)}. HINT: see the server's lines in the launcher's output (prefixed "
            "[serverK]); a server that loom run did not start must be restarted on the same address, with the "
            "same checkpoint folder"
        )

    def _count(self, kind: MessageType, sent: int, received: int) -> None:
        entry = self.traffic.setdefault(kind.name, [0, 0])
        entry[0] += sent
        entry[1] += received

    def bytes_moved(self) -> int:
        return sum(s + r for s, r in self.traffic.values())

    def close(self) -> None:
        for link in self.links:
            link.close()
        self.context.term()


def _why_silent(index: int, address: str, since: float) -> str:
    """Why server ``index`` does not answer: its death (since ``since``, or for good) in the launcher's record,
    else what a TCP connection to its address finds (nothing listening; or a listener that does not answer:
    hung, or another job secret)."""
    death = death_of(index, since)
    if death is not None:
        return death
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=1.0).close()
    except (OSError, ValueError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        return (
            f"is unreachable: nothing accepts connections there ({reason}); the server process is not running"
        )
    try:
        source = source_ip(address)
    except ConnectionError:
        source = "unknown"
    return (
        "accepts connections but did not answer: it is hung or overloaded, or it refused this worker's "
        "connection: started with another LOOM_JOB_SECRET, or it sees this worker at another address than "
        f"{source} (the connection token is bound to the worker's address: a NAT or proxy between them changes it)"
    )
