"""Tensor messages between two processes of one host through shared memory, with no socket on the way.

`channel_to(dst)` / `channel_from(src)` return this process's `ShmSender` / `ShmReceiver` for a peer (global
ranks), or ``None`` when the pair must keep the backend's messages (another host, a CPU other than x86-64, no
/dev/shm, a backend other than gloo). Each direction decides once, by a handshake through the backend on its
first message: the sender offers a `loom.comm.shm_ring.Ring` with a digest of its host, and the receiver maps it
only if the digest is its own. So both ends decide the same, per pair: a pipeline over two hosts uses shared
memory within a host and the backend between hosts. That first message is a rendezvous (the sender waits for
the receiver to ask); the pipeline's schedules always receive before they send back, so they never deadlock.

A message is a header (int64 words: how many words follow, the tensor count, then each tensor's dtype code, rank
and shape), then each tensor's bytes. Sends never block: what does not fit in the ring is queued and pushed by
every later wait of this process (`progress`) and by the handle's ``wait()``. Waits are
`loom.comm.shm_wait.wait_until`, raising with both ranks and the operation when the peer dies or the time-out
passes. Small messages cost a few microseconds of Python per end, so both ends cache headers per signature
(dtypes and shapes; a pipeline repeats a handful).
"""

from __future__ import annotations

import ctypes
import math
import struct
from collections import deque
from typing import Any

import torch
import torch.distributed as dist

from loom.comm._reduce import host_digest
from loom.comm.shm import shm_unsupported_reason
from loom.comm.shm_ring import Ring
from loom.comm.shm_spin import SpinBudget
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
_MAX_SIGNATURES = 256
"""Header caches per end: a pipeline has a handful of signatures, a varying one is bounded."""
_HELLO_TAG, _ANSWER_TAG = 0x4C4F4F4D, 0x4C4F4F4E  # "LOOM", "LOON": apart from the data's tag 0
_HELLO_BYTES = 32 + 1 + 7 + 64  # host digest, usable, padding, ring name


class _Header:
    """One message signature's encoded header, kept with its address (the ring copies from it)."""

    __slots__ = ("buffer", "addr", "nbytes")

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        words = [len(tensors)]
        for t in tensors:
            code = _CODE.get(t.dtype)
            if code is None:
                raise TypeError(f"cannot send a {t.dtype} tensor through shared memory; dtypes: {DTYPES}")
            words += [code, t.dim(), *t.shape]
        raw = struct.pack(f"<{len(words) + 1}q", len(words), *words)
        self.buffer = ctypes.create_string_buffer(raw, len(raw))
        self.addr, self.nbytes = ctypes.addressof(self.buffer), len(raw)


class ShmSender:
    """The writing end of one ring: this process to global rank ``peer``."""

    def __init__(self, ring: Ring, rank: int, peer: int) -> None:
        self.ring, self.rank, self.peer = ring, rank, peer
        # not when the peer's pids are not visible from here
        self.check_pid = process_alive(ring.reader_pid())
        self._queue: deque[list[Any]] = deque()  # [address, bytes left, object keeping the memory alive]
        self._headers: dict[tuple[tuple[torch.dtype, torch.Size], ...], _Header] = {}
        self._budget = SpinBudget()
        self.sent = 0

    def send(self, tensors: list[torch.Tensor]) -> list[tuple[Any, Any]]:
        """Queue one message and push what fits (copied in at once when nothing is queued); returns
        ``[(handle, None)]``, ``handle.wait()`` ends it."""
        signature = tuple([(t.dtype, t.shape) for t in tensors])
        header = self._headers.get(signature)
        if header is None:
            if len(self._headers) >= _MAX_SIGNATURES:
                self._headers.clear()
            header = self._headers[signature] = _Header(tensors)
        parts, total = [], header.nbytes
        for t in tensors:
            if not (t.is_cpu and t.is_contiguous()):
                t = t.detach().contiguous().cpu()
            n = t.nbytes
            if n:
                parts.append(t)
                total += n
        self.sent += 1
        ring = self.ring
        if not self._queue and ring.room() >= total:
            ring.put(header.addr, header.nbytes)
            for t in parts:
                ring.put(t.data_ptr(), t.nbytes)
            ring.publish()
            return [(self, None)]
        queue = self._queue
        queue.append([header.addr, header.nbytes, header])
        for t in parts:  # each tensor stays alive until its bytes are in the ring
            queue.append([t.data_ptr(), t.nbytes, t])
        if self not in _BACKLOG:
            _BACKLOG.append(self)
        self.flush()
        return [(self, None)]

    def flush(self) -> bool:
        """Push queued bytes while they fit; whether the queue is empty."""
        queue, ring = self._queue, self.ring
        if not queue:
            return True
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
                check_pid=self.check_pid, futex=self.ring.writer_futex, busy=lambda: len(_BACKLOG) > 1, budget=self._budget,
                what=f"shared-memory send of message {self.sent} to rank {self.peer} (its receiver reads no more)",
            )  # fmt: skip


class ShmReceiver:
    """The reading end of one ring: global rank ``peer`` to this process."""

    def __init__(self, ring: Ring, rank: int, peer: int) -> None:
        self.ring, self.rank, self.peer = ring, rank, peer
        self.check_pid = process_alive(ring.writer_pid())
        self._scratch = ctypes.create_string_buffer(8 * _MAX_WORDS + 8)
        self._scratch_addr = ctypes.addressof(self._scratch)
        self._count = ctypes.c_int64.from_buffer(self._scratch)
        self._specs: dict[bytes, list[tuple[tuple[int, ...], torch.dtype, int]]] = {}
        self._budget = SpinBudget()
        self.received = 0

    def _read(self, addr: int, n: int, what: str) -> None:
        """Copy ``n`` bytes out of the ring to address ``addr``, waiting for those not there yet."""
        ring = self.ring
        done = ring.get(addr, n)
        while done < n:
            wait_until(
                ring.readable, me=f"rank {self.rank}", peer=f"rank {self.peer}", pid=ring.writer_pid, progress=progress,
                check_pid=self.check_pid, futex=ring.reader_futex, busy=lambda: bool(_BACKLOG), budget=self._budget,
                what=f"shared-memory receive of {what} (message {self.received}) from rank {self.peer}",
            )  # fmt: skip
            done += ring.get(addr + done, n - done)

    def _spec(self, raw: bytes) -> list[tuple[tuple[int, ...], torch.dtype, int]]:
        """The (shape, dtype, bytes) of each tensor of a header (``raw``: all its words, the count first)."""
        spec = self._specs.get(raw)
        if spec is None:
            words = struct.unpack(f"<{len(raw) // 8}q", raw)
            spec, i = [], 2
            for _ in range(words[1]):
                if not 0 <= words[i] < len(DTYPES):
                    raise RuntimeError(
                        f"rank {self.rank}: corrupt message header from rank {self.peer} (dtype code {words[i]})"
                    )
                dtype, dim = DTYPES[words[i]], words[i + 1]
                shape = tuple(words[i + 2 : i + 2 + dim])
                spec.append((shape, dtype, math.prod(shape) * dtype.itemsize))
                i += 2 + dim
            if len(self._specs) >= _MAX_SIGNATURES:
                self._specs.clear()
            self._specs[raw] = spec
        return spec

    def _header(self, what: str) -> bytes:
        """The next message's header words, the count first: taken straight from the ring when all of it is
        there (a small message is published whole), else read as it comes."""
        ring = self.ring
        head = ring.peek(8)
        if head is not None:
            count = int.from_bytes(head, "little", signed=True)
            raw = ring.peek(8 + 8 * count) if 0 < count < _MAX_WORDS else None
            if raw is not None:
                ring.skip(len(raw))
                return raw
        scratch = self._scratch_addr
        self._read(scratch, 8, what)
        count = self._count.value
        if not 0 < count < _MAX_WORDS:
            raise RuntimeError(
                f"rank {self.rank}: corrupt message header from rank {self.peer} ({count} words)"
            )
        self._read(scratch + 8, 8 * count, what)
        return ctypes.string_at(scratch, 8 + 8 * count)

    def recv(self, device: torch.device | None = None, what: str = "a message") -> list[torch.Tensor]:
        """The next message's tensors (on ``device``, default CPU)."""
        self.received += 1
        out = []
        for shape, dtype, nbytes in self._spec(self._header(what)):
            t = torch.empty(shape, dtype=dtype)
            if nbytes:
                self._read(t.data_ptr(), nbytes, what)
            out.append(t)
        if device is not None and device.type != "cpu":
            out = [t.to(device) for t in out]
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
    hello = torch.zeros(_HELLO_BYTES, dtype=torch.uint8)
    try:
        if shm_unsupported_reason() is None:
            ring = Ring.create(CAPACITY)
            payload = host_digest() + b"\1" + bytes(7) + ring.name.encode()
            hello[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        dist.send(hello, dst, group=dist.group.WORLD, tag=_HELLO_TAG)
        answer = torch.zeros(1, dtype=torch.uint8)
        dist.recv(answer, dst, group=dist.group.WORLD, tag=_ANSWER_TAG)
    finally:
        if ring is not None:
            ring.unlink()  # the reader removed it already when it mapped it; else nobody will
    sender = _SENDERS[key] = ShmSender(ring, rank, dst) if ring is not None and int(answer[0]) == 1 else None
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
    dist.recv(hello, src, group=dist.group.WORLD, tag=_HELLO_TAG)
    raw = bytes(hello.tolist())
    receiver = None
    if raw[32] == 1 and raw[:32] == host_digest() and shm_unsupported_reason() is None:
        try:
            ring = Ring.attach(raw[40:].rstrip(b"\0").decode(), CAPACITY)
            receiver = ShmReceiver(ring, dist.get_rank(), src)
        except (OSError, ValueError):
            receiver = None  # the pair keeps the backend's messages; the sender learns it from the answer
    answer = torch.tensor([1 if receiver else 0], dtype=torch.uint8)
    dist.send(answer, src, group=dist.group.WORLD, tag=_ANSWER_TAG)
    _RECEIVERS[key] = receiver
    return receiver
