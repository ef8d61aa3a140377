"""A parameter-server process: ``python -m loom.ps.server --index i --num-servers K --bind ADDR:PORT``.

One ZeroMQ ROUTER socket, one thread, one event loop. Every incoming message is checked (`loom.ps.gate`,
`loom.ps.wire`: size, header, MAC with the job secret from ``LOOM_JOB_SECRET``, epoch, sequence number: no replay)
before anything in it is decoded; what fails is dropped, counted by reason, and never answered. What is admitted
goes to the handler of its message type (`loom.ps.handlers`, which also holds the models and their checkpoints;
a restarted server resumes from those). How the process is told to run: `loom.ps.server_config`.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from loom.ps.gate import HELLO_BYTES, Inbox, InboxLimits, chunk_key, secure_server, send_frame
from loom.ps.handlers import HANDLERS, RequestHandlers
from loom.ps.server_config import ServerConfig, default_checkpoint_dir, parse_args
from loom.ps.shard import ModelShard
from loom.ps.wire import (
    DropCounters,
    Frame,
    FrameDropped,
    MessageType,
    SessionTable,
    WireLimits,
    decode,
    encode,
)
from loom.ps.wire import secret_from_hex as _secret_from_hex

__all__ = ["ServerConfig", "ParameterServerProcess", "main"]


class ParameterServerProcess(RequestHandlers):
    """The event loop of one server; `serve()` runs until `stop()` (or SIGTERM in `main`)."""

    def __init__(self, config: ServerConfig, secret: bytes) -> None:
        self.config = config
        self.secret = secret
        self.epoch = int.from_bytes(os.urandom(8), "little") | 1
        self.sessions = SessionTable(self.epoch)
        self.counters = DropCounters()
        self.models = {}
        self.failed = {}
        self.parked_pulls = {}
        self.parked_pushes = {}
        self.restore_tokens = {}
        self._stopping = False
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.gate = secure_server(self.context, self.socket, secret)
        self.chunk_key = chunk_key(secret)
        budget = InboxLimits(total_bytes=max(InboxLimits.total_bytes, 2 * config.limits.max_frame))
        self.inbox = Inbox(self.chunk_key, config.limits, budget, self.counters.drop, self._fresh)
        self.monitor = self.socket.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        )
        if config.listen_fd is not None:
            self.socket.setsockopt(zmq.USE_FD, config.listen_fd)
        self.socket.bind(f"tcp://{config.bind}")
        self.address = self.socket.getsockopt_string(zmq.LAST_ENDPOINT).removeprefix("tcp://")
        self._resume()

    # -- lifecycle --------------------------------------------------------------------------------------------
    def _resume(self) -> None:
        """Load every model saved in `shard_dir` (a restarted server). A file that does not load raises
        `ValueError` naming it: starting empty would silently throw the model away."""
        if self.shard_dir is None or not self.shard_dir.is_dir():
            return
        for path in sorted(self.shard_dir.glob("*.json")):
            shard = ModelShard.load(path)
            self.models[shard.name] = shard
            self.log(f"resumed model {shard.name!r} at version {shard.version} from {path}")

    def stop(self) -> None:
        self._stopping = True

    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        self.log(f"listening on {self.address}")
        try:
            while not self._stopping:
                events = dict(poller.poll(self.config.poll_ms))
                if self.monitor in events:
                    recv_monitor_message(self.monitor)
                    self.counters.drop("bad_handshake")
                drained = True
                if self.socket in events:
                    for _ in range(256):  # drain a burst of chunks before looking at the clocks again
                        try:
                            parts = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        if len(parts) != 2:  # a chunk is one message; ROUTER adds the peer's identity
                            self.counters.drop("malformed")
                            continue
                        data = self.inbox.receive(parts[0].bytes, parts[1].buffer, time.monotonic())
                        if data is not None:
                            self.handle([parts[0], data])
                    else:
                        drained = False
                now = time.monotonic()
                if drained:  # only when nothing waits in ZeroMQ's queues is a peer's silence real
                    self.inbox.expire(now)
                self._tick(now)
        finally:
            if self.models:
                self.checkpoint()
            self.close()

    def close(self) -> None:
        """Close the sockets, stop the connection gate's thread and end the ZeroMQ context."""
        self.socket.disable_monitor()
        self.monitor.close(0)
        self.socket.close(0)
        self.gate.stop()
        self.context.term()

    # -- one message ------------------------------------------------------------------------------------------
    def handle(self, parts: list) -> None:
        """Decode, admit and answer one whole frame: ``parts`` is [identity, frame] (``zmq.Frame``s or the frame's
        bytes, as `Inbox` reassembles it)."""
        identity = parts[0].bytes
        data = parts[1].buffer if hasattr(parts[1], "buffer") else parts[1]
        try:
            frame = decode(self.secret, data, self.config.limits)
            self.sessions.admit(frame)
        except FrameDropped as dropped:
            self.counters.drop(dropped.reason)
            return
        self.counters.accepted += 1
        self.counters.bytes_in += frame.nbytes
        handler = HANDLERS.get(frame.type)
        if handler is None:
            self._error(identity, frame, f"message type {frame.type.name} is not a request")
            return
        try:
            handler(self, identity, frame)
        except (ValueError, KeyError, TypeError, RuntimeError) as error:
            self.counters.drop("rejected")
            self._error(identity, frame, f"{type(error).__name__}: {error}")

    def _fresh(self, kind: int, epoch: int, session: int, seq: int, size: int) -> None:
        """Vet an open chunk's header before its frame's bytes are kept (see `loom.ps.gate.Inbox`)."""
        if not MessageType.HELLO <= kind < MessageType.REPLY:
            raise FrameDropped("malformed", f"message type {kind} is not a request")
        if kind == MessageType.HELLO and size > HELLO_BYTES:
            raise FrameDropped("oversized", f"a HELLO of {size} bytes")
        self.sessions.check(kind, epoch, session, seq)

    def _reply(self, identity: bytes, frame: Frame, meta: dict[str, Any], tensors=None) -> None:
        data = encode(self.secret, MessageType.REPLY, epoch=self.epoch, session=frame.session, seq=frame.seq,
                      meta=meta, tensors=tensors)  # fmt: skip
        self.counters.bytes_out += len(data)
        send_frame(self.socket, self.chunk_key, data, identity)

    def _error(self, identity: bytes, frame: Frame, message: str) -> None:
        data = encode(self.secret, MessageType.ERROR, epoch=self.epoch, session=frame.session, seq=frame.seq,
                      meta={"error": f"parameter server {self.config.index}: {message}"})  # fmt: skip
        send_frame(self.socket, self.chunk_key, data, identity)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    secret_hex = os.environ.get("LOOM_JOB_SECRET")
    if not secret_hex:
        print("loom.ps.server: LOOM_JOB_SECRET is not set. HINT: start servers with `loom run --servers K`",
              file=sys.stderr)  # fmt: skip
        return 2
    torch.set_num_threads(1)
    config = ServerConfig(
        index=args.index,
        num_servers=args.num_servers,
        bind=args.bind,
        listen_fd=args.listen_fd,
        checkpoint_dir=args.checkpoint_dir or default_checkpoint_dir(),
        limits=WireLimits(max_payload=int(args.max_payload_mb * (1 << 20))),
    )
    try:
        server = ParameterServerProcess(config, _secret_from_hex(secret_hex))
    except ValueError as error:  # a checkpoint that does not load
        print(f"loom.ps.server[{config.index}]: {error}", file=sys.stderr, flush=True)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    signal.signal(signal.SIGINT, lambda *_: server.stop())
    server.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
