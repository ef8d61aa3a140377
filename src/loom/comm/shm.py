"""Shared-memory all-reduce for processes on one host: memory copies through a mapped segment, no sockets.

As the intra-node transports of MPI and NCCL, and DeepSpeed's CPU ``shm`` all-reduce. With L processes the data
is split into L chunks; rank r owns chunk r, and each process has one *slot* of the segment:

1. publish: rank r copies every chunk of its input *except its own* into its slot;
2. barrier; rank r reduces chunk r from its own input plus the L-1 published copies, and writes the result into
   its slot at chunk r's place, which step 1 left free;
3. barrier; rank r copies the L-1 other reduced chunks out of the other slots.

Per process: D bytes written and 2 (L-1)/L * D read, as many as a ring moves, but by one memory copy instead of
through two socket buffers and the kernel. Consecutive calls of the same size and element size need no barrier
between them (step 1 writes only chunks nobody reads in step 3, and a result is rewritten only after the next
call's first barrier); a call whose size changes starts with one.

One segment per host and process group (`loom.comm.shm_segment`), made on the first call and remade larger for a
larger tensor, up to `MAX_PIECE_BYTES` per slot; bigger tensors go piece by piece. The barrier is a sequence
counter per process, one cache line each, waited for by `loom.comm.shm_wait.wait_until`.

Limits: Linux (/dev/shm bounds the segment: docker's default 64 MiB fits 4 processes at 4 MiB slots) on x86-64
only, because the barrier relies on x86's total store order and Python cannot issue the fences weaker CPUs need;
elsewhere a ValueError names the alternatives. CPU tensors, synchronous. Each chunk is reduced once, by its
owner, so results are identical on every process and can differ from ``native`` in the last bits.
"""

from __future__ import annotations

import mmap
import os
import platform

import torch
import torch.distributed as dist

from loom.comm._reduce import all_gather_bytes, combine_into, group_rank_and_size, host_digest
from loom.comm.counters import Traffic
from loom.comm.shm_segment import SHM_DIR, create_segment, open_segment
from loom.comm.shm_wait import futex_wake, process_alive, wait_until

__all__ = ["Segment", "ShmContext", "all_reduce_shm", "context_for", "shm_unsupported_reason"]

MAX_PIECE_BYTES = 4 << 20
"""Largest slot per process; larger tensors are reduced in pieces of this many bytes (tests lower it)."""
MIN_CAPACITY = 64 << 10

_MAGIC = int.from_bytes(b"LOOMSHM1", "little")
_LINE_WORDS = 8  # 64 bytes: counters of different processes never share a cache line
_PAGE = 4096


def shm_unsupported_reason() -> str | None:
    """None when this process can use shared-memory all-reduce, else why it cannot."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"its barrier relies on x86-64 store ordering and this CPU is {platform.machine()}"
    if not SHM_DIR.is_dir():
        return f"there is no POSIX shared memory at {SHM_DIR}"
    return None


def _header_bytes(size: int) -> int:
    return -(-(_LINE_WORDS * 8 * (1 + size)) // _PAGE) * _PAGE


def _stride(capacity: int) -> int:
    return -(-capacity // _PAGE) * _PAGE


class Segment:
    """One mapped segment: a header (magic, sizes, token, per-process counter and pid), then one slot per process."""

    def __init__(self, name: str, mm: mmap.mmap, size: int, rank: int, capacity: int) -> None:
        self.name, self.size, self.rank, self.capacity = name, size, rank, capacity
        self.check_pids = True
        """Whether waits check that peers are alive (off when their pids are not visible from here)."""
        header = _header_bytes(size)
        self._words = memoryview(mm)[:header].cast("q")
        self.data = torch.frombuffer(mm, dtype=torch.uint8)
        self.sequence = 0
        """How many barriers this process has passed."""
        self._seq_word = [_LINE_WORDS * (1 + r) for r in range(size)]
        self._peer_words = [w for r, w in enumerate(self._seq_word) if r != rank]
        self._words[self._seq_word[rank] + 1] = os.getpid()

    def offset(self, slot: int) -> int:
        return _header_bytes(self.size) + slot * _stride(self.capacity)

    @classmethod
    def create(cls, size: int, capacity: int) -> Segment:
        header, hint = (_MAGIC, size, capacity), ", or lower loom.comm.shm.MAX_PIECE_BYTES"
        name, mm = create_segment(_header_bytes(size) + size * _stride(capacity), header, hint)
        return cls(name, mm, size, 0, capacity)

    @classmethod
    def attach(cls, name: str, size: int, rank: int, capacity: int) -> Segment:
        """Map the segment ``name`` that this job's creator announced; refuse anything else under that name."""
        mm = open_segment(name, _header_bytes(size) + size * _stride(capacity), (_MAGIC, size, capacity))
        return cls(name, mm, size, rank, capacity)

    def unlink(self) -> None:
        (SHM_DIR / self.name).unlink(missing_ok=True)

    def barrier(self) -> None:
        """Return once every process of the segment has called `barrier` as many times as this one."""
        self.sequence += 1
        seq, words = self.sequence, self._words
        mine = self._seq_word[self.rank]
        words[mine] = seq
        if any(words[w + 2] == self.rank + 1 for w in self._peer_words):  # a peer sleeps until this changes
            futex_wake(self.data.data_ptr() + 8 * mine)
        for word in self._peer_words:
            if words[word] < seq:
                self._wait(word, seq)

    def _wait(self, word: int, seq: int) -> None:
        words, peer, flag = self._words, self._seq_word.index(word), self._seq_word[self.rank] + 2

        def asleep(on: int) -> None:  # tells the peer, when it raises its counter, to wake this process
            words[flag] = peer + 1 if on else 0

        wait_until(
            lambda: words[word] >= seq, me=f"local process {self.rank}", peer=f"local process {peer}",
            pid=lambda: words[word + 1], what=f"shared-memory barrier {seq}", check_pid=self.check_pids,
            futex=(self.data.data_ptr() + 8 * word, lambda: words[word], asleep),
        )  # fmt: skip

    def peers_visible(self) -> bool:
        return all(process_alive(self._words[w + 1]) for w in self._peer_words)


class ShmContext:
    """What shm and hierarchical all-reduce keep per process group: hosts, and this host's segment. Building
    it is a collective exchanging each process's `host_key` digest and whether it can use shared memory."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.rank, self.size = group_rank_and_size(group)
        reason = shm_unsupported_reason()
        mine = host_digest() + bytes([reason is None])
        gathered = all_gather_bytes(mine, len(mine), group, self.size)
        first_of: dict[bytes, int] = {}
        self.hosts = [first_of.setdefault(g[:-1], len(first_of)) for g in gathered]
        """Host index of every group rank, numbered in order of first appearance."""
        self.unsupported = reason or next(
            (f"rank {r} of the group cannot use it" for r, g in enumerate(gathered) if not g[-1]), None
        )
        self.members = [r for r, h in enumerate(self.hosts) if h == self.hosts[self.rank]]
        self.local_rank, self.local_size = self.members.index(self.rank), len(self.members)
        self.leaders = [self.hosts.index(h) for h in range(len(first_of))]
        """Group rank of each host's first process (its leader), in host order."""
        self.host_sizes = [self.hosts.count(h) for h in range(len(first_of))]
        self.segment: Segment | None = None
        self.capacity = 0
        self.layout: tuple[int, int] | None = None
        """(element size, elements) of the last piece reduced in the segment: where its results are."""
        self._views: dict[tuple[torch.dtype, int, int], list[torch.Tensor]] = {}
        self.reduce_order = [(self.local_rank + k) % self.local_size for k in range(1, self.local_size)]

    def require_shared_memory(self, algorithm: str, single_host: bool, tensor: torch.Tensor) -> None:
        if tensor.device.type != "cpu":
            raise ValueError(
                f"algorithm={algorithm!r} reduces CPU tensors only, got one on {tensor.device}. "
                "HINT: use algorithm='native' (NCCL) for GPU tensors."
            )
        if single_host and len(self.host_sizes) > 1:
            raise ValueError(
                f"rank {dist.get_rank()}: algorithm={algorithm!r} needs every process of the group on one host; "
                f"the group's {self.size} processes are on {len(self.host_sizes)} hosts ({self.host_sizes} "
                "processes each). HINT: use algorithm='hierarchical' or 'auto'."
            )
        if self.unsupported and max(self.host_sizes) > 1:
            raise ValueError(
                f"rank {dist.get_rank()}: algorithm={algorithm!r} cannot use shared memory here: "
                f"{self.unsupported}. HINT: use algorithm='ring' or 'native'."
            )

    def reserve(self, nbytes: int) -> int:
        """Make slots hold min(nbytes, MAX_PIECE_BYTES) (a collective when it remaps); return the piece size."""
        want = min(max(nbytes, 1), MAX_PIECE_BYTES)
        if want > self.capacity:
            self._remap(min(max(1 << (want - 1).bit_length(), MIN_CAPACITY), MAX_PIECE_BYTES))
        return self.capacity

    def map_slots(self, nbytes: int) -> None:
        """Give every slot room for exactly ``nbytes`` (no piece limit), for a buffer that lives in the segment
        (`loom.comm.shared_gradients`). A collective; /dev/shm must hold one slot per local process."""
        self._remap(max(nbytes, 64))

    def _remap(self, capacity: int) -> None:
        if MAX_PIECE_BYTES < 64:
            raise ValueError(f"loom.comm.shm.MAX_PIECE_BYTES must be at least 64, got {MAX_PIECE_BYTES}")
        self._views.clear()
        self.segment = None  # the old mapping goes with its last view; its name was unlinked long ago
        creator = self.local_rank == 0 and self.local_size > 1
        segment, error = None, ""
        if creator:
            try:
                segment = Segment.create(self.local_size, capacity)
            except OSError as e:
                error = str(e)
        names = all_gather_bytes(segment.name.encode() if segment else b"", 64, self.group, self.size)
        if self.local_size > 1 and not creator:
            name = names[self.members[0]].rstrip(b"\0").decode()
            try:
                if not name:
                    raise ValueError("this host's first process could not create the segment")
                segment = Segment.attach(name, self.local_size, self.local_rank, capacity)
            except (OSError, ValueError) as e:
                error = str(e)
        statuses = all_gather_bytes(b"" if error else b"\1", 1, self.group, self.size)  # all attached
        if creator and segment is not None:
            segment.unlink()
        failed = [r for r, s in enumerate(statuses) if s != b"\1"]
        if failed:
            raise RuntimeError(
                f"shared-memory set-up failed on group ranks {failed}" + (f"; here: {error}" if error else "")
            )
        if segment is not None:
            segment.check_pids = segment.peers_visible()  # pids from another pid namespace are not
        self.segment, self.capacity, self.layout = segment, capacity, None

    def barrier(self) -> None:
        if self.segment is not None:  # a process alone on its host has no segment and no one to wait for
            self.segment.barrier()

    def slots(self, dtype: torch.dtype, numel: int, offset: int = 0) -> list[torch.Tensor]:
        """``numel`` elements of every slot from byte ``offset`` on, as ``dtype`` tensors (cached: DDP repeats
        sizes)."""
        key = (dtype, numel, offset)
        views, seg = self._views.get(key), self.segment
        if views is None:
            if seg is None:
                raise RuntimeError("no shared-memory segment: call reserve() first")
            if len(self._views) >= 64:
                self._views.clear()
            starts = [seg.offset(j) + offset for j in range(seg.size)]
            views = [seg.data[s : s + numel * dtype.itemsize].view(dtype) for s in starts]
            self._views[key] = views
        return views


_CONTEXTS: dict[object, ShmContext] = {}


def context_for(group: dist.ProcessGroup | None) -> ShmContext:
    """The `ShmContext` of ``group`` (the default group for None), made on first use: a collective."""
    key = group if group is not None else dist.group.WORLD
    if key not in _CONTEXTS:
        _CONTEXTS[key] = ShmContext(group)
    return _CONTEXTS[key]


def reduce_scatter_piece(
    ctx: ShmContext, part: torch.Tensor, op: str
) -> tuple[list[torch.Tensor], list[int], int, int]:
    """Steps 1-2 of the module docstring: leave chunk ``local_rank`` reduced (``avg``: divided by the local size)
    in ``part`` and in this slot. Returns every slot's view of the piece, the chunks' bounds, shm bytes written
    and shm bytes read."""
    r, m = ctx.local_rank, part.numel()
    slots = ctx.slots(part.dtype, m)
    bounds = [j * m // ctx.local_size for j in range(ctx.local_size + 1)]
    lo, hi = bounds[r], bounds[r + 1]
    mine = slots[r]
    if ctx.layout != (part.element_size(), m):
        ctx.barrier()  # the chunks move: wait until every process has read the previous results
        ctx.layout = (part.element_size(), m)
    if lo:
        mine[:lo].copy_(part[:lo])
    if hi < m:
        mine[hi:].copy_(part[hi:])
    ctx.barrier()
    own = part[lo:hi]
    if hi > lo:
        for j in ctx.reduce_order:
            combine_into(own, slots[j][lo:hi], op)
        if op == "avg":
            own.div_(ctx.local_size)
        mine[lo:hi].copy_(own)
    ctx.barrier()
    return slots, bounds, m * part.element_size(), (ctx.local_size - 1) * (hi - lo) * part.element_size()


def all_reduce_local(ctx: ShmContext, flat: torch.Tensor, op: str) -> Traffic:
    """All-reduce over the processes of this host's segment, piece by piece."""
    step = ctx.reserve(flat.nbytes) // flat.element_size()
    r = ctx.local_rank
    sent = received = 0
    for start in range(0, flat.numel(), step):
        part = flat[start : start + step]
        slots, bounds, wrote, read = reduce_scatter_piece(ctx, part, op)
        for j in ctx.reduce_order:  # step 3
            part[bounds[j] : bounds[j + 1]].copy_(slots[j][bounds[j] : bounds[j + 1]])
        sent += wrote
        received += read + (part.numel() - bounds[r + 1] + bounds[r]) * part.element_size()
    return Traffic(shm_sent=sent, shm_received=received)


def all_reduce_shm(flat: torch.Tensor, op: str, group: dist.ProcessGroup | None = None) -> Traffic:
    """Shared-memory all-reduce of a contiguous 1-D CPU tensor in place, every process on one host; raises
    ValueError when the group spans several hosts or shared memory is unusable here. Arguments are not checked
    otherwise: `loom.comm.all_reduce(t, algorithm="shm")` is the entry point."""
    ctx = context_for(group)
    ctx.require_shared_memory("shm", single_host=True, tensor=flat)
    return all_reduce_local(ctx, flat, op)
