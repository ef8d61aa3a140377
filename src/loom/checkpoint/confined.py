"""Open a checkpoint's files only where they are: regular files in a real directory inside the checkpoint
directory, never through a symbolic link, and read them within a stated size.

A link inside a checkpoint could make loading read anything the process can read (another run's checkpoint, a
device, a FIFO that blocks forever), so links are refused, not followed: the step directory is opened with
``O_NOFOLLOW`` and its files relative to that descriptor (``dir_fd``, ``O_NOFOLLOW``), so nothing can be
swapped for a link between the check and the open; files are opened non-blocking and `fstat` must say
"regular file" (and give the size) before a byte is read.

Limits: POSIX only. The directory given by the caller may itself be reached through links; only what is inside
it is confined. A hard link is a regular file and is read like one.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from loom.errors import CorruptCheckpointError

__all__ = ["ConfinedDirectory", "read_exact", "read_limited", "sha256_of"]


class ConfinedDirectory:
    """A directory opened without following a link at its last component; files opened inside it only.
    `open` and `open_file` raise `CorruptCheckpointError` naming the path and why it cannot be read (missing,
    a link, not a regular file)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd = fd

    @classmethod
    def open(cls, path: Path, *, follow: bool = False) -> ConfinedDirectory:
        """Open directory ``path``; with ``follow=False`` a link at ``path`` is refused."""
        flags = os.O_RDONLY | os.O_DIRECTORY | (0 if follow else os.O_NOFOLLOW)
        try:
            return cls(path, os.open(path, flags))
        except OSError as err:
            raise CorruptCheckpointError(path, _open_failure(path, err, "directory")) from None

    def open_file(self, name: str) -> tuple[BinaryIO, int]:
        """``(file, size)`` for the regular file ``name`` in this directory."""
        path = self.path / name
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=self._fd)
        except OSError as err:
            raise CorruptCheckpointError(path, _open_failure(path, err, "file")) from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            mode = stat.filemode(info.st_mode)
            raise CorruptCheckpointError(path, f"is not a regular file (mode {mode}); refusing to read it")
        os.set_blocking(fd, True)
        return io.FileIO(fd, "rb", closefd=True), info.st_size

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self) -> ConfinedDirectory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _open_failure(path: Path, err: OSError, kind: str) -> str:
    if err.errno == errno.ELOOP or (err.errno == errno.ENOTDIR and path.is_symlink()):
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        return (
            f"is a symbolic link (to {target}); step directories and their files must be regular entries "
            "inside the checkpoint directory, so links are refused. HINT: copy the checkpoint into the "
            "directory instead of linking to it."
        )
    if err.errno == errno.ENOENT:
        return f"the {kind} is missing"
    if err.errno == errno.ENOTDIR:
        return "is not a directory"
    return f"cannot be opened ({err.strerror or err})"


def _pieces(file: BinaryIO, count: int, piece: int) -> Iterator[bytes]:
    """``count`` bytes of ``file`` in reads of at most ``piece`` bytes; ``ValueError`` if it ends first (it
    shrank while read)."""
    left = count
    while left:
        data = file.read(min(left, piece))
        if not data:
            raise ValueError(f"ended after {count - left} of {count} bytes (changed while being read)")
        yield data
        left -= len(data)


def read_exact(file: BinaryIO, count: int) -> bytes:
    """Exactly ``count`` bytes from ``file``; ``ValueError`` if it ends first. In reads of 1 GiB, since one
    ``read`` of a raw file returns at most ~2 GiB on Linux (one piece is returned itself, not copied)."""
    return b"".join(_pieces(file, count, 1 << 30))


def read_limited(file: BinaryIO, size: int, limit: int) -> bytes:
    """The ``size`` bytes of ``file`` (its `fstat` size), refused with ``ValueError`` beyond ``limit`` before
    any is read."""
    if size > limit:
        raise ValueError(f"{size} bytes, more than the limit of {limit}")
    data = read_exact(file, size)
    if file.read(1):
        raise ValueError(f"grew beyond {size} bytes while being read")
    return data


def sha256_of(file: BinaryIO, size: int) -> str:
    """The sha256 of ``file``'s ``size`` bytes, read in 1 MiB pieces (memory independent of ``size``)."""
    digest = hashlib.sha256()
    for piece in _pieces(file, size, 1 << 20):
        digest.update(piece)
    return digest.hexdigest()
