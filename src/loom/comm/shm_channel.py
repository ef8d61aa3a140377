"""Tensor messages between two processes of one host through shared memory, with no socket on the way.

`channel_to(dst)` / `channel_from(src)` return this process's `ShmSender` / `ShmReceiver` for a peer (global
ranks), or ``None`` when the pair must keep the backend's messages (another host, another CPU than x86-64, no
/dev/shm, a backend other than gloo). The choice is made once per direction by a handshake on the first message,
through the backend with tags of its own: the sender creates a `loom.comm.shm_ring.Ring` and sends a digest of
its host (`loom.comm._reduce.host_key`) and the ring's name; the receiver maps the ring only if the digest is its
own, and answers whether it did. Both ends thus decide the same, per pair: a pipeline spread over two hosts
uses shared memory between the stages of one host and the backend between hosts. The first message in each
direction is therefore a rendezvous (the sender waits until the receiver asks for its first message); the
pipeline's schedules always receive before they send back, so they never wait on each other there.

A message is a header (int64 words: how many words follow, the tensor count, then each tensor's dtype code, rank
and shape), then each tensor's bytes. Sends never block: what does not fit in the ring is queued, and pushed by
every later call of this process that waits for anything (`progress`), and by the handle's ``wait()``; a
receive copies straight into the tensor it returns. Waits are `loom.comm.shm_wait.wait_until`: spin, then sleep
on a futex until the peer wakes it, and raise naming both ranks and the operation when the peer dies or the
time-out passes.
"""

from __future__ import annotations

import ctypes
import hashlib
import struct
from collections import deque
from typing import Any

import torch
import torch.distributed as dist

from loom.comm._reduce import host_key
from loom.comm.shm import shm_unsupported_reason
from loom.comm.shm_ring import Ring
from loom.comm.shm_wait import process_alive, wait_until

__all__ = ["CAPACITY", "DTYPES", "ShmReceiver", "ShmSender", "channel_from", "channel_to", "progress"]

CAPACITY = 1 << 20
"""Bytes of ring per direction and pair; a larger message streams through it while the receiver reads."""
DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool,
]  # fmt: skip
_CODE = {dtype: i for i, dtype in enumerate(DTYPES)}
_MAX_WORDS = 4096
_HELLO_TAG, _ANSWER_TAG = 0x4C4F4F4D, 0x4C4F4F4E  # "LOOM", "LOON": apart from the data's tag 0
_HELLO_BYTES = 32 + 1 + 7 + 64  # host digest, usable, padding, ring name
_DIGEST: bytes | None = None


def _host_digest() -> bytes:
    global _DIGEST
    if _DIGEST is None:
        _DIGEST = hashlib.sha256(host_key().encode()).digest()
    return _DIGEST


def encode_header(tensors: list[torch.Tensor]) -> bytes:
    words = [len(tensors)]
    for t in tensors:
        code = _CODE.get(t.dtype)
        if code is None:
            raise TypeError(f"cannot send a {t.dtype} tensor through shared memory; dtypes: {DTYPES}")
        words += [code, t.dim(), *t.shape]
    return struct.pack(f"<{len(words) + 1}q", len(words), *words)


class ShmSender:
    """The writing end of one ring: this process to global rank ``peer``."""

    def __init__(self, ring: Ring, rank: int, peer: int) -> None:
        self.ring, self.rank, self.peer = ring, rank, peer
        self.check_pid = process_alive(
            ring.reader_pid()
        )  # not when the peer's pids are not visible from here
        self._queue: deque[list[Any]] = deque()  # [address, bytes left, object keeping the memory alive]
        self.sent = 0

    def send(self, tensors: list[torch.Tensor]) -> list[tuple[Any, Any]]:
        """Queue one message and push what fits; returns ``[(handle, None)]``, ``handle.wait()`` ends it."""
        tensors = [t.detach().contiguous().cpu() for t in tensors]
        header = encode_header(tensors)
        buffer = ctypes.create_string_buffer(header, len(header))
        queue = self._queue
        queue.append([ctypes.addressof(buffer), len(header), buffer])
        for t in tensors:
            if t.nbytes:
                queue.append([t.data_ptr(), t.nbytes, t])
        if self not in _BACKLOG:
            _BACKLOG.append(self)
        self.flush()
        self.sent += 1
        return [(_SendHandle(self), None)]

    def flush(self) -> bool:
        """Push queued bytes while they fit; whether the queue is empty."""
        queue, ring = self._queue, self.ring
        try:
            while queue:
                item = queue[0]
                k = ring.put(item[0], item[1])
                if k < item[1]:
                    item[0] += k
                    item[1] -= k
                    return False
                queue.popleft()
            return True
        finally:
            ring.publish()  # once per flush: a whole small message wakes the reader once

    def wait(self) -> None:
        if not self.flush():
            wait_until(
                self.flush, me=f"rank {self.rank}", peer=f"rank {self.peer}", pid=self.ring.reader_pid, progress=progress,
                check_pid=self.check_pid, futex=self.ring.writer_futex, busy=lambda: len(_BACKLOG) > 1,
                what=f"shared-memory send of message {self.sent} to rank {self.peer} (its receiver reads no more)",
            )  # fmt: skip


class _SendHandle:
    def __init__(self, sender: ShmSender) -> None:
        self._sender = sender

    def wait(self) -> None:
        self._sender.wait()


class ShmReceiver:
    """The reading end of one ring: global rank ``peer`` to this process."""

    def __init__(self, ring: Ring, rank: int, peer: int) -> None:
        self.ring, self.rank, self.peer = ring, rank, peer
        self.check_pid = process_alive(ring.writer_pid())
        self._scratch = ctypes.create_string_buffer(8 * _MAX_WORDS)
        self._scratch_addr = ctypes.addressof(self._scratch)
        self.received = 0

    def _read(self, addr: int, n: int, what: str) -> None:
        ring = self.ring
        done = ring.get(addr, n)
        while done < n:
            wait_until(
                ring.readable, me=f"rank {self.rank}", peer=f"rank {self.peer}", pid=ring.writer_pid, progress=progress,
                check_pid=self.check_pid, futex=ring.reader_futex, busy=lambda: bool(_BACKLOG),
                what=f"shared-memory receive of {what} from rank {self.peer}",
            )  # fmt: skip
            done += ring.get(addr + done, n - done)

    def recv(self, device: torch.device | None = None, what: str = "a message") -> list[torch.Tensor]:
        """The next message's tensors (on ``device``, default CPU)."""
        self.received += 1
        what = f"{what} (message {self.received})"
        self._read(self._scratch_addr, 8, what)
        (count,) = struct.unpack_from("<q", self._scratch, 0)
        if not 0 < count < _MAX_WORDS:
            raise RuntimeError(
                f"rank {self.rank}: corrupt message header from rank {self.peer} ({count} words)"
            )
        self._read(self._scratch_addr, 8 * count, what)
        words = struct.unpack_from(f"<{count}q", self._scratch, 0)
        out, i = [], 1
        for _ in range(words[0]):
            dtype, dim = DTYPES[words[i]], words[i + 1]
            t = torch.empty(words[i + 2 : i + 2 + dim], dtype=dtype)
            if t.nbytes:
                self._read(t.data_ptr(), t.nbytes, what)
            out.append(t if device is None or device.type == "cpu" else t.to(device))
            i += 2 + dim
        return out


_BACKLOG: list[ShmSender] = []
"""Senders of this process with queued bytes; `progress` pushes them."""
_SENDERS: dict[tuple[object, int], ShmSender | None] = {}
_RECEIVERS: dict[tuple[object, int], ShmReceiver | None] = {}


def progress() -> None:
    """Push every queued send of this process as far as its ring allows (called by every shared-memory wait)."""
    if _BACKLOG:
        _BACKLOG[:] = [s for s in _BACKLOG if not s.flush()]


def _usable() -> bool:
    """Whether this job's messages may take shared memory: a gloo job (CPU tensors; NCCL keeps its own)."""
    return dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo"


def channel_to(dst: int) -> ShmSender | None:
    """This process's shared-memory sender to global rank ``dst``, or None (see the module docstring).

    The first call for a ``dst`` is a handshake with ``dst``'s first `channel_from` for this rank."""
    key = (dist.group.WORLD, dst)
    if key in _SENDERS:
        return _SENDERS[key]
    if not _usable():  # both ends see the same backend: neither makes the handshake
        _SENDERS[key] = None
        return None
    rank, ring = dist.get_rank(), None
    usable = shm_unsupported_reason() is None
    hello = torch.zeros(_HELLO_BYTES, dtype=torch.uint8)
    try:
        if usable:
            ring = Ring.create(CAPACITY)
            payload = _host_digest() + b"\1" + bytes(7) + ring.name.encode()
            hello[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        dist.send(hello, dst, tag=_HELLO_TAG)
        answer = torch.zeros(1, dtype=torch.uint8)
        dist.recv(answer, dst, tag=_ANSWER_TAG)
    finally:
        if ring is not None:
            ring.unlink()  # the reader removed it already when it mapped it; else nobody will
    sender = ShmSender(ring, rank, dst) if ring is not None and int(answer[0]) == 1 else None
    _SENDERS[key] = sender
    return sender


def channel_from(src: int) -> ShmReceiver | None:
    """This process's shared-memory receiver from global rank ``src``, or None; see `channel_to`."""
    key = (dist.group.WORLD, src)
    if key in _RECEIVERS:
        return _RECEIVERS[key]
    if not _usable():
        _RECEIVERS[key] = None
        return None
    hello = torch.zeros(_HELLO_BYTES, dtype=torch.uint8)
    dist.recv(hello, src, tag=_HELLO_TAG)
    raw = bytes(hello.tolist())
    receiver = None
    if raw[32] == 1 and raw[:32] == _host_digest() and shm_unsupported_reason() is None:
        try:
            ring = Ring.attach(raw[40:].rstrip(b"\0").decode(), CAPACITY)
            receiver = ShmReceiver(ring, dist.get_rank(), src)
        except (OSError, ValueError):
            receiver = None  # the pair keeps the backend's messages; the sender learns it from the answer
    dist.send(torch.tensor([1 if receiver else 0], dtype=torch.uint8), src, tag=_ANSWER_TAG)
    _RECEIVERS[key] = receiver
    return receiver
