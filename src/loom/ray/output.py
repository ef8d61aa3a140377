"""What the driver does with a rank's poll: print its lines, write its copied files, blame a failure."""

from __future__ import annotations

import sys
from pathlib import Path

__all__ = ["blame", "prefix_print", "write_chunk"]


def prefix_print(name: str, lines: list[tuple[str, str]], dropped: int) -> None:
    for stream, text in lines:
        out = sys.stderr if stream == "stderr" else sys.stdout
        out.write(f"[{name}]: {text}\n")
    if dropped:
        sys.stderr.write(f"[{name}]: ({dropped} lines not shown; they are in its log)\n")
    sys.stdout.flush()
    sys.stderr.flush()


_APPENDED = (".jsonl", ".log")
"""Copied files that continue the run directory's copy (step records, logs) rather than replace it: the records
of a replaced rank follow those of the one it replaces, as in a directory both write into."""


def write_chunk(run_dir: Path, bases: dict[str, int], rel: str, offset: int, data: bytes) -> None:
    """Write a copied file's bytes into ``run_dir/rel`` (refusing paths that leave it); ``bases``: where this
    process's copy of each appended file starts in the run directory's."""
    parts = Path(rel).parts
    if not parts or Path(rel).is_absolute() or ".." in parts:
        raise ValueError(f"a rank sent a file outside the run directory: {rel!r}")
    path = run_dir.joinpath(*parts)
    path.parent.mkdir(parents=True, exist_ok=True)
    if rel not in bases:
        bases[rel] = path.stat().st_size if rel.endswith(_APPENDED) and path.exists() else 0
    start = bases[rel] + offset
    with open(path, "r+b" if path.exists() and start else "wb") as f:
        f.seek(start)
        f.write(data)
        f.truncate()


def blame(failures: list[tuple[int, float, str]]) -> str:
    """Which of the failures seen at once caused the others: ``(kind, when, what)`` with kind 0 for a lost actor,
    1 for a process killed by a signal, 2 for one that raised or exited non-zero. A lost actor or a killed
    process first (the others fail because of it, e.g. with gloo's "connection closed"), else the earliest."""
    return min(failures)[2]
