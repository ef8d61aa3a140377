"""Bounds on what `loom run` accepts, checked before anything is created (each bound and what it stops:
docs/fault-tolerance.md, "Launcher input bounds").

A launcher that trusts its input can be made to do unbounded work by one typo (``loom run -n 1000000``), a spec
with deeply nested brackets ends in a `RecursionError`, and a FIFO given as the spec hangs the launcher. Every
bound here is checked before a directory, a socket or a process exists, and a refusal is one line naming the value
and the fix (`refuse`).
"""

from __future__ import annotations

import os
import re
import stat
import sys

__all__ = ["MAX_NPROC_PER_CORE", "MAX_SPEC_NESTING", "MIN_WORKER_BYTES", "check_nproc", "default_max_nproc",
           "json_nesting_depth", "memory_max_nproc", "read_regular_file", "refuse"]  # fmt: skip

MAX_NPROC_PER_CORE = 8
"""Worker processes allowed per core of the host by default (``--max-nproc`` overrides)."""
MIN_WORKER_BYTES = 64 << 20
"""The least memory a worker process takes (an interpreter with torch imported, forked or not, holds more of
its own once it trains): a host holds at most its memory divided by this many workers, whatever the flags say."""
MAX_SPEC_NESTING = 32
"""Deepest nesting of brackets a cluster spec may have (a valid spec needs 4)."""

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKET = re.compile(r"[\[\]{}]")


def default_max_nproc() -> int:
    """`MAX_NPROC_PER_CORE` times this host's cores (1 core when Python cannot tell)."""
    return MAX_NPROC_PER_CORE * (os.cpu_count() or 1)


def memory_max_nproc() -> int | None:
    """The most workers this host's physical memory can hold (`MIN_WORKER_BYTES` each); None where the OS does
    not say."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None
    return max(1, total // MIN_WORKER_BYTES)


def check_nproc(
    nproc: int,
    max_nproc: int | None,
    what: str = "-n/--nproc",
    override: str = "to run more processes than that on this host, pass --max-nproc N explicitly",
) -> None:
    """Refuse ``nproc`` above ``max_nproc`` (None: `default_max_nproc`), naming the bound and the override, and
    above what the host's memory holds (`memory_max_nproc`), whatever ``max_nproc`` says."""
    bound = default_max_nproc() if max_nproc is None else max_nproc
    if nproc > bound:
        origin = (
            f"{MAX_NPROC_PER_CORE} per core on this host's {os.cpu_count() or 1} core(s)"
            if max_nproc is None
            else "--max-nproc"
        )
        raise ValueError(
            f"{what} {nproc} is more worker processes than the bound of {bound} ({origin}). HINT: check the "
            f"number; {override}"
        )
    held = memory_max_nproc()
    if held is not None and nproc > held:
        raise ValueError(
            f"{what} {nproc} is more worker processes than this host's memory can hold ({held}: "
            f"{held * MIN_WORKER_BYTES >> 30} GiB at {MIN_WORKER_BYTES >> 20} MiB per worker, whatever --max-nproc "
            "says). HINT: check the number; spread the workers over more hosts"
        )


def refuse(line: str, status: int = 2) -> int:
    """``line`` on stderr, and the status for the command to exit with: 2 (the default) when it refused to start
    (a bad option, spec or setting), 1 when the job failed."""
    print(line, file=sys.stderr)
    return status


def json_nesting_depth(text: str) -> int:
    """The deepest nesting of ``[]``/``{}`` in JSON ``text``, strings skipped; no recursion, linear time."""
    depth = deepest = 0
    for bracket in _BRACKET.findall(_STRING.sub("", text)):
        if bracket in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def read_regular_file(path: str, limit: int) -> bytes:
    """Up to ``limit + 1`` bytes of the regular file at ``path`` (the caller refuses a longer one).

    Raises `ValueError` naming the path when it is not a regular file (a directory, a FIFO, a device, a
    socket), and `OSError` when it cannot be opened. Never blocks on a FIFO: the file type is checked with
    ``os.stat`` first and again with ``os.fstat`` on a descriptor opened with ``O_NONBLOCK`` (the path may change
    between the two)."""
    _require_regular(path, os.stat(path).st_mode)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        _require_regular(path, os.fstat(fd).st_mode)
        chunks, left = [], limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _require_regular(path: str, mode: int) -> None:
    if stat.S_ISREG(mode):
        return
    kinds = {stat.S_ISDIR: "a directory", stat.S_ISFIFO: "a FIFO (named pipe)", stat.S_ISSOCK: "a socket",
             stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device"}  # fmt: skip
    kind = next((name for test, name in kinds.items() if test(mode)), "not a regular file")
    raise ValueError(f"{path!r} is {kind}, not a regular file")
