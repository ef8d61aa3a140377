"""What the all-reduce algorithms share: argument checks, group arithmetic, the local reduction, hosts."""

from __future__ import annotations

import contextlib
import hashlib
import socket
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from loom.comm.counters import counters
from loom.errors import check_choice
from loom.settings import setting

OPS = ("sum", "avg", "max", "min")
ALGORITHMS = ("native", "ring", "driver", "shm", "hierarchical", "auto")


def check_algorithm(algorithm: str) -> None:
    check_choice("algorithm", algorithm, ALGORITHMS)


def check_tensor(tensor: object, op: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"all_reduce expects a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype == torch.bool or tensor.dtype.is_complex:
        raise TypeError(
            f"all_reduce does not support dtype {tensor.dtype}. HINT: use a floating-point or integer tensor."
        )
    if op == "avg" and not tensor.dtype.is_floating_point:
        # Refused rather than floor-divided: a silently truncated mean is a worse surprise than an error.
        raise ValueError(
            f"op='avg' is not supported for integer tensors (dtype {tensor.dtype}): their mean is not an integer. "
            "HINT: all-reduce with op='sum' and divide, or convert to a floating-point dtype first."
        )


def group_rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """This process's rank in ``group`` and the group's size; (0, 1) when there is no process group.

    An explicit group answers for itself (``group.rank()``, ``group.size()``), so a group built directly on a
    store (``torch.distributed.ProcessGroup`` with a gloo backend, as the tests' thread harness does: one group
    per thread, no default group) works as well as one from ``new_group``."""
    if group is not None and group is not dist.GroupMember.WORLD:
        if not isinstance(group, dist.ProcessGroup):  # new_group's answer to a non-member: NON_GROUP_MEMBER
            raise ValueError(
                f"rank {dist.get_rank()} called a collective on a group it is not a member of. "
                "HINT: call collectives on a group only from its members."
            )
        return group.rank(), group.size()
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def backend_name(group: dist.ProcessGroup | None) -> str:
    """``"gloo"``, ``"nccl"``, ...: the backend of ``group`` (the default group's for None), whether or not
    ``group`` was registered with torch.distributed."""
    if group is None or group is dist.GroupMember.WORLD:
        return str(dist.get_backend())
    return str(group.name())


def combine_into(acc: torch.Tensor, incoming: torch.Tensor, op: str) -> None:
    """``acc = op(acc, incoming)`` elementwise, in ``acc``'s dtype (``avg`` sums; the caller divides once)."""
    if op in ("sum", "avg"):
        acc.add_(incoming)
    else:
        (torch.maximum if op == "max" else torch.minimum)(acc, incoming, out=acc)


_SCRATCH = threading.local()


def scratch_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``numel`` elements of a buffer kept per (thread, dtype, device) and reused from call to call.

    Why: a fresh multi-MiB ``torch.empty`` is a fresh ``mmap`` whose pages fault in (and are zeroed by the
    kernel) on first touch, every call. The buffer grows to the largest request and is kept for the thread's
    lifetime (at most a few segments, see `loom.comm.ring`).
    Per thread, so a communication thread (`loom.comm.ddp_async`) never shares one with the main thread; a
    caller must be done with it before it asks again (nothing in `loom.comm` nests ring calls).
    """
    cache: dict[tuple[torch.dtype, torch.device], torch.Tensor] = _SCRATCH.__dict__.setdefault("buffers", {})
    key = (dtype, device)
    buffer = cache.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = cache[key] = torch.empty(numel, dtype=dtype, device=device)
    return buffer[:numel]


def host_key() -> str:
    """This host's identity: ``$LOOM_HOST_ID`` if set (tests pretend to be several hosts), else name + boot id."""
    override = setting("LOOM_HOST_ID")
    if override:
        return override
    boot = ""
    with contextlib.suppress(OSError):  # the boot id tells apart machines that share a host name
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return f"{socket.gethostname()}/{boot}"


def host_digest() -> bytes:
    """SHA-256 of `host_key`: what processes compare to tell whether they share a host."""
    return hashlib.sha256(host_key().encode()).digest()


def all_gather_bytes(
    payload: bytes,
    length: int,
    group: dist.ProcessGroup | None,
    n: int,
    device: torch.device | None = None,
) -> list[bytes]:
    """Every rank's ``payload`` (zero-padded to ``length``): plain bytes through the backend, no pickle.

    For one-time set-up and control messages; its traffic is recorded under ``"setup"`` with the ring estimate.
    ``device`` is where the backend wants its tensors (a GPU under NCCL).
    """
    mine = torch.zeros(length, dtype=torch.uint8, device=device)
    mine[: len(payload)] = torch.tensor(list(payload), dtype=torch.uint8)
    out = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(out, mine, group=group)
    counters().record("setup", (n - 1) * length, (n - 1) * length)
    return [t.cpu().numpy().tobytes() for t in out]


def all_gather_sized_bytes(
    payload: bytes, group: dist.ProcessGroup | None = None, device: torch.device | None = None
) -> list[bytes]:
    """Every rank's ``payload`` whatever its length: the lengths first, then `all_gather_bytes`."""
    n = dist.get_world_size(group)
    mine = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    lengths = [torch.zeros_like(mine) for _ in range(n)]
    dist.all_gather(lengths, mine, group=group)
    sizes = [int(t.item()) for t in lengths]
    padded = all_gather_bytes(payload, max(sizes), group, n, device)
    return [raw[:size] for raw, size in zip(padded, sizes, strict=True)]
