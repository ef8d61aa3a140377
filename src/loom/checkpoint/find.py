"""Find the checkpoint to load: the one ``latest`` names, then back by step past damaged ones.

`load_checkpoint` is the one-process entry point: it verifies each candidate whole (`loom.checkpoint.load
.read_checkpoint`). `loom.fit` walks the same `checkpoint_candidates` with every rank reading only its own
part and the ranks agreeing on each verdict (`loom.train.fit_checkpoint`). The ``latest`` pointer is read with the
same care as the files (no link, at most `ReadLimits.max_pointer_bytes`); when it is unusable, loading warns
and starts from the newest checkpoint instead.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

from loom.checkpoint.confined import ConfinedDirectory, read_limited
from loom.checkpoint.limits import DEFAULT_LIMITS, ReadLimits
from loom.checkpoint.load import read_checkpoint
from loom.checkpoint.store import (
    POINTER_FILE,
    STEP_NAME,
    CorruptCheckpointError,
    CorruptCheckpointWarning,
    NoValidCheckpointError,
    list_checkpoints,
)

__all__ = ["checkpoint_candidates", "load_checkpoint", "newest_intact", "no_valid_checkpoint"]


def _pointer_problem(directory: Path, limits: ReadLimits) -> tuple[str | None, str | None]:
    """``(name, None)`` for a usable ``latest``, ``(None, None)`` for none, ``(None, why)`` for a bad one."""
    try:
        with ConfinedDirectory.open(directory, follow=True) as root:
            file, size = root.open_file(POINTER_FILE)
    except CorruptCheckpointError as err:  # no directory, or no pointer in it: no pointer
        return None, None if err.path == directory or err.reason == "the file is missing" else err.reason
    with file:
        try:
            name = read_limited(file, size, limits.max_pointer_bytes).decode().strip()
        except (ValueError, UnicodeDecodeError) as err:
            return None, f"is unreadable ({err})"
    if not STEP_NAME.fullmatch(name):
        return None, f"holds {name[:40]!r}, not a checkpoint name"
    return name, None


def _warn(message: str) -> None:
    """Warn with `CorruptCheckpointWarning`, attributed two calls above the function calling this one."""
    warnings.warn(message, CorruptCheckpointWarning, stacklevel=4)


def checkpoint_candidates(
    directory: str | os.PathLike, *, limits: ReadLimits = DEFAULT_LIMITS
) -> tuple[list[Path], list[str]]:
    """The checkpoints of ``directory`` to try, newest first: from the one ``latest`` names (the newest if
    there is no usable pointer) back by step; and the problems found on the way (a pointer naming nothing),
    each already warned with `CorruptCheckpointWarning`."""
    directory = Path(directory)
    checkpoints = list_checkpoints(directory)
    pointer, problem = _pointer_problem(directory, limits)
    if problem is not None:
        _warn(f"{directory / POINTER_FILE} {problem}; using the newest intact checkpoint")
    problems: list[str] = []
    candidates = list(checkpoints)
    if pointer is not None:
        newest = int(STEP_NAME.fullmatch(pointer).group(1))  # type: ignore[union-attr]
        if newest not in checkpoints:
            problems.append(f"{directory / POINTER_FILE} names {pointer}, which does not exist")
            _warn(problems[-1] + "; falling back to an earlier checkpoint")
        candidates = [s for s in checkpoints if s <= newest]
    return [checkpoints[s] for s in reversed(candidates)], problems


def no_valid_checkpoint(directory: str | os.PathLike, problems: list[str]) -> NoValidCheckpointError:
    """The error for a directory whose checkpoints all failed, listing ``problems``."""
    return NoValidCheckpointError(
        f"no intact checkpoint in {directory}: "
        + "; ".join(problems)
        + ". HINT: restore the files from a backup, or move the directory away to start from scratch."
    )


def newest_intact(
    directory: str | os.PathLike, *, limits: ReadLimits = DEFAULT_LIMITS
) -> tuple[Path, int, dict[str, Any]] | None:
    """`load_checkpoint`, with the path of the checkpoint read: ``(path, step, state)``."""
    candidates, problems = checkpoint_candidates(directory, limits=limits)
    for checkpoint in candidates:
        try:
            return (checkpoint, *read_checkpoint(checkpoint, limits=limits))
        except CorruptCheckpointError as err:
            problems.append(str(err))
            _warn(f"checkpoint {checkpoint.name} is damaged: {err}; falling back to an earlier checkpoint")
    if not problems:
        return None
    raise no_valid_checkpoint(directory, problems)


def load_checkpoint(
    directory: str | os.PathLike, *, limits: ReadLimits = DEFAULT_LIMITS
) -> tuple[int, dict[str, Any]] | None:
    """The newest intact checkpoint in ``directory`` as ``(step, state)``, or None if there is none, every
    rank's file verified (`read_checkpoint`) within ``limits``. Each damaged checkpoint on the way back
    (`checkpoint_candidates`) is warned with `CorruptCheckpointWarning`, naming the file and the reason;
    `NoValidCheckpointError` when checkpoints exist but none is intact (starting over would throw away a run)."""
    found = newest_intact(directory, limits=limits)
    return None if found is None else found[1:]
