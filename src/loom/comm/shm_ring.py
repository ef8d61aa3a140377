"""A one-way byte stream between two processes of one host: a ring buffer in a shared-memory segment.

One process writes, one reads (single producer, single consumer). After a header page (pids, the bytes written
and read since the start, and each end's "asleep" flag, `loom.comm.shm_wait`) comes the ring of `capacity`
bytes. The writer copies into the free part and then advances its counter; the reader copies out of the filled
part and then advances its own. Each counter has one writer, so no lock is needed; the order "data, then
counter" is what x86-64's total store order keeps (the reason `loom.comm.shm.shm_unsupported_reason` refuses
other CPUs). Copies are ``memmove`` between raw addresses: for a message of a few KiB the per-call cost of a
tensor operation would be most of the time.

Lifetime as in `loom.comm.shm_segment`: the writer creates the segment, the reader maps it and removes the name
at once; a writer whose handshake fails removes the name itself.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os

from loom.comm.shm_segment import SHM_DIR, create_segment, open_segment
from loom.comm.shm_wait import futex_wake

__all__ = ["Ring"]

_MAGIC = int.from_bytes(b"LOOMRNG1", "little")
_HEADER = 4096
_WRITER_PID_W, _READER_PID_W = 3, 4  # after the magic, the capacity and the token (`create_segment`)
_WRITTEN_W = 8  # own 64-byte cache line
_READ_W = 16  # own 64-byte cache line
_READER_ASLEEP_W = 24  # set by a reader sleeping until _WRITTEN_W changes (`loom.comm.shm_wait`)
_WRITER_ASLEEP_W = 32  # set by a writer sleeping until _READ_W changes


class Ring:
    """One mapped ring; `put` only from the writer's process, `get` only from the reader's."""

    def __init__(self, name: str, mm: mmap.mmap, capacity: int) -> None:
        self.name, self.capacity = name, capacity
        self.words = words = memoryview(mm)[:_HEADER].cast("q")
        self._anchor = ctypes.c_char.from_buffer(mm)  # keeps the mapping's address valid for memmove
        start = ctypes.addressof(self._anchor)
        self.base = start + _HEADER
        self._data = memoryview(mm)[_HEADER:]
        flag = functools.partial(functools.partial, words.__setitem__)  # flag(word)(value) sets it
        self.reader_futex = (start + 8 * _WRITTEN_W, lambda: words[_WRITTEN_W], flag(_READER_ASLEEP_W))
        """What a reader waiting for data sleeps on (`loom.comm.shm_wait.wait_until`'s ``futex``)."""
        self.writer_futex = (start + 8 * _READ_W, lambda: words[_READ_W], flag(_WRITER_ASLEEP_W))
        """What a writer waiting for room sleeps on."""
        self._written = self.words[_WRITTEN_W]
        self._read = self.words[_READ_W]

    @classmethod
    def create(cls, capacity: int) -> Ring:
        name, mm = create_segment(_HEADER + capacity, (_MAGIC, capacity))
        ring = cls(name, mm, capacity)
        ring.words[_WRITER_PID_W] = os.getpid()
        return ring

    @classmethod
    def attach(cls, name: str, capacity: int) -> Ring:
        """Map the ring ``name`` that the writer announced, check its header, and remove its name."""
        ring = cls(name, open_segment(name, _HEADER + capacity, (_MAGIC, capacity), unlink=True), capacity)
        ring.words[_READER_PID_W] = os.getpid()
        return ring

    def unlink(self) -> None:
        (SHM_DIR / self.name).unlink(missing_ok=True)

    def writer_pid(self) -> int:
        return self.words[_WRITER_PID_W]

    def reader_pid(self) -> int:
        return self.words[_READER_PID_W]

    def room(self) -> int:
        """Bytes `put` takes now without stopping short (writer only)."""
        return self.capacity - (self._written - self.words[_READ_W])

    def put(self, addr: int, n: int) -> int:
        """Copy up to ``n`` bytes from address ``addr`` into the ring; return how many fitted (writer only).
        The reader sees them after the next `publish`."""
        written, cap = self._written, self.capacity
        k = min(n, cap - (written - self.words[_READ_W]))
        if k <= 0:
            return 0
        pos = written % cap
        first = min(k, cap - pos)
        ctypes.memmove(self.base + pos, addr, first)
        if k > first:
            ctypes.memmove(self.base, addr + first, k - first)
        self._written = written + k
        return k

    def publish(self) -> None:
        """Let the reader see everything `put` so far (one counter store, one wake-up if it sleeps)."""
        if self.words[_WRITTEN_W] != self._written:
            self.words[_WRITTEN_W] = self._written  # after the data: what the reader sees is complete
            if self.words[_READER_ASLEEP_W]:
                futex_wake(self.reader_futex[0])

    def get(self, addr: int, n: int) -> int:
        """Copy up to ``n`` bytes out of the ring to address ``addr``; return how many there were (reader only)."""
        read, cap = self._read, self.capacity
        k = min(n, self.words[_WRITTEN_W] - read)
        if k <= 0:
            return 0
        pos = read % cap
        first = min(k, cap - pos)
        ctypes.memmove(addr, self.base + pos, first)
        if k > first:
            ctypes.memmove(addr + first, self.base, k - first)
        self.skip(k)
        return k

    def peek(self, n: int) -> bytes | None:
        """The next ``n`` bytes without taking them, or None while fewer have been published (reader only)."""
        read = self._read
        if self.words[_WRITTEN_W] - read < n:
            return None
        pos, cap = read % self.capacity, self.capacity
        if pos + n <= cap:
            return self._data[pos : pos + n].tobytes()
        return self._data[pos:].tobytes() + self._data[: pos + n - cap].tobytes()

    def skip(self, n: int) -> None:
        """Take ``n`` bytes that `peek` returned or `get` copied (reader only)."""
        self._read += n
        self.words[_READ_W] = self._read  # after the copy: the writer may now reuse these bytes
        if self.words[_WRITER_ASLEEP_W]:
            futex_wake(self.writer_futex[0])

    def readable(self) -> bool:
        return self.words[_WRITTEN_W] > self._read
