"""The files behind loom's shared-memory segments: POSIX shared memory under /dev/shm, named, reserved, checked.

Used by the all-reduce segment (`loom.comm.shm`) and the message rings (`loom.comm.shm_ring`). A creator makes a
segment under a fresh random name (``loom-shm-<pid>-<64 random bits>``, ``O_EXCL``, mode 0600) and announces the
name; the others map it, refusing another name form, size or header, and the name is unlinked as soon as every
user has mapped it. From then on the memory exists only in the mappings: the kernel frees it when the last process exits,
normally or killed, and no later job can open it. A process killed inside the short create-to-unlink window
leaves the name behind; the next creator removes such names once their creator pid is dead and they are older
than `STALE_AFTER_S`.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import struct
import time
from pathlib import Path

from loom.comm.shm_wait import process_alive

__all__ = ["PREFIX", "SHM_DIR", "STALE_AFTER_S", "create_segment", "open_segment"]

SHM_DIR = Path("/dev/shm")
PREFIX = "loom-shm-"
STALE_AFTER_S = 60.0


def create_segment(nbytes: int, header: tuple[int, ...], hint: str = "") -> tuple[str, mmap.mmap]:
    """A new segment of ``nbytes`` under a fresh random name (``O_EXCL``, mode 0600), after sweeping stale names,
    starting with the int64 words of ``header`` and the name's token: (name, the mapping). ``hint`` ends the
    error message of a full /dev/shm."""
    _sweep_stale()
    token = secrets.randbits(63)
    name = f"{PREFIX}{os.getpid()}-{token:016x}"
    path = SHM_DIR / name
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        # Reserve the pages now: a full /dev/shm then fails here, not with SIGBUS on first touch.
        os.posix_fallocate(fd, 0, nbytes)
        mm = mmap.mmap(fd, nbytes)
        struct.pack_into(f"{len(header) + 1}q", mm, 0, *header, token)
        return name, mm
    except OSError as error:
        path.unlink(missing_ok=True)
        raise OSError(
            f"cannot reserve {nbytes} bytes of shared memory in {SHM_DIR}: {error.strerror}. HINT: free "
            f"space there or enlarge it (docker run --shm-size=...){hint}"
        ) from error
    finally:
        os.close(fd)


def open_segment(name: str, nbytes: int, header: tuple[int, ...], unlink: bool = False) -> mmap.mmap:
    """Map the segment ``name`` a creator announced, refusing another name form, size or header (``header`` and
    the name's token, as `create_segment` wrote them). ``unlink``: remove the name once opened (or failed to),
    as the last process to map it."""
    if not name.startswith(PREFIX) or "/" in name:
        raise ValueError(f"{name!r} is not the name of a loom shared-memory segment")
    path = SHM_DIR / name
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        found = os.fstat(fd).st_size
        if found != nbytes:
            raise ValueError(f"segment {name} has {found} bytes, expected {nbytes}")
        mm = mmap.mmap(fd, nbytes)
        words = struct.unpack_from(f"{len(header) + 1}q", mm)
        if words != (*header, int(name.rsplit("-", 1)[1], 16)):
            mm.close()
            raise ValueError(f"segment {name} does not carry this job's header (found {words})")
        return mm
    finally:
        os.close(fd)
        if unlink:
            path.unlink(missing_ok=True)


def _sweep_stale() -> None:
    """Remove names a creator killed between create and unlink left behind (creator dead, name old)."""
    for path in SHM_DIR.glob(PREFIX + "*"):
        try:
            pid = int(path.name[len(PREFIX) :].split("-")[0])
            age = time.time() - path.stat().st_mtime
        except (ValueError, OSError):
            continue
        if age > STALE_AFTER_S and not process_alive(pid):
            with contextlib.suppress(OSError):
                path.unlink()
