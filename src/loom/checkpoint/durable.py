"""Writes that survive a crash: fsync the file, then the directory that names it.

A rename is atomic but not durable: after a power loss the new name may point at data that never reached the
disk, unless the data was fsynced before the rename and the directory after it; everything here follows that
order (a process crash alone, e.g. SIGKILL, loses nothing the kernel already accepted).

Limits: some network filesystems do not honour fsync on directories; `fsync_directory` then does nothing
(it ignores the ``EINVAL``/``EBADF``/``EISDIR`` they raise), and durability is only as good as the filesystem.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["fsync_directory", "replace_durable", "unique_name", "write_durable"]


def unique_name(prefix: str) -> str:
    """A name no other writer picks: prefix, this process's id and random hex."""
    return f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}"


def write_durable(path: Path, data: bytes | Iterable[memoryview], digest: Any = None) -> None:
    """Create ``path`` (it must not exist) holding ``data`` (bytes, or pieces written in order), and fsync
    it before returning; each piece also updates ``digest`` (a hashlib object) when given."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for piece in [memoryview(data)] if isinstance(data, bytes) else data:
            if digest is not None:
                digest.update(piece)
            view = piece.cast("B")
            while view:
                view = view[os.write(fd, view) :]  # os.write may write less than asked
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_directory(path: Path) -> None:
    """Make the entries of directory ``path`` (creations, renames, removals) durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.EBADF, errno.EISDIR):
            raise
    finally:
        os.close(fd)


def replace_durable(path: Path, data: bytes) -> None:
    """Atomically replace ``path`` with a file holding ``data``: a reader sees the old or the new file, whole."""
    temporary = path.with_name(unique_name(f".{path.name}.tmp"))
    try:
        write_durable(temporary, data)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise
    fsync_directory(path.parent)
