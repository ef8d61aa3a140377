"""Every error loom raises on purpose, in one place: ``except loom.errors.LoomError`` catches them all.

Each also derives from the built-in exception it was before (``ValueError`` for bad input, ``RuntimeError`` for
a failed job), so code that caught those still does. Bad arguments to a function are plain ``ValueError`` /
``TypeError`` with a message naming the value and the fix; the classes here are the conditions a caller may want to
tell apart. This module imports nothing of loom's: every layer may raise these.
"""

from __future__ import annotations

from pathlib import Path

__all__ = [
    "CheckpointError",
    "ClusterSpecError",
    "CorruptCheckpointError",
    "HangError",
    "JSONLimitError",
    "LoomError",
    "ModelMismatchError",
    "NoValidCheckpointError",
    "NonFiniteStateError",
    "NonFiniteStepError",
    "PeerLostError",
    "RayJobFailed",
    "ReplicaDesyncError",
    "failure_text",
]


def failure_text(error: BaseException) -> str:
    """``Type: message``, with the errno of the first OS error in its chain named where the message does not
    already (``[ENOSPC, errno 28: No space left on device, on PATH]``): a failure line that reaches the launcher
    through several wrappers (an asynchronous checkpoint's thread, the ranks' agreement) keeps the cause a user
    can act on."""
    import errno as codes
    import os

    text = f"{type(error).__name__}: {error}"
    seen: BaseException | None = error
    for _ in range(10):  # (chains are short; a cycle must not loop)
        if seen is None:
            break
        if isinstance(seen, OSError) and seen.errno:
            name = codes.errorcode.get(seen.errno, f"errno {seen.errno}")
            if name not in text:
                where = f", on {seen.filename}" if seen.filename else ""
                text += f" [{name}, errno {seen.errno}: {os.strerror(seen.errno)}{where}]"
            break
        seen = seen.__cause__ or seen.__context__
    return text


class LoomError(Exception):
    """The base of every error in this module."""


class HangError(LoomError, RuntimeError):
    """A collective waited longer than the hang timeout (recorded for the launcher; never raised)."""


class PeerLostError(LoomError, RuntimeError):
    """A host of the job stopped answering for longer than the liveness timeout (recorded for the launcher; never
    raised)."""


class ReplicaDesyncError(LoomError, RuntimeError):
    """Replicas that should be identical hold different parameters."""


class NonFiniteStepError(LoomError, FloatingPointError):
    """A step's loss or gradient was non-finite, under policy ``"stop"`` or too many steps in a row."""


class ModelMismatchError(LoomError, ValueError):
    """The model or optimizer is not the same on every process."""


class ClusterSpecError(LoomError, ValueError):
    """A malformed cluster spec; the message names the field and the fix."""


class CheckpointError(LoomError, RuntimeError):
    """A checkpoint could not be written or read."""


class CorruptCheckpointError(CheckpointError):
    """One checkpoint is damaged; ``path`` is the file (or directory) found wrong, ``reason`` says how."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class NoValidCheckpointError(CheckpointError):
    """Checkpoints exist in the directory, but none of them is intact."""


class NonFiniteStateError(CheckpointError):
    """The state to checkpoint holds NaN or infinite values: it is not written (the previous checkpoint stays)."""


class RayJobFailed(LoomError, RuntimeError):
    """A job on Ray failed after its replacements; the message names the rank and what happened to it."""


class JSONLimitError(LoomError, ValueError):
    """JSON that breaks one of the `loom.checkpoint.limits.ReadLimits`; ``field`` names it, so a message can say
    what to raise."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field
