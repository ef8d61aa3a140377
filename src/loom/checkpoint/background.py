"""Asynchronous checkpoints: copy the state now, write it while training goes on.

`save_checkpoint_async` takes the snapshot inside the call (every tensor cloned to fresh CPU memory, the rest
encoded to JSON), so the next optimizer step cannot leak into the checkpoint; only the writes, fsyncs and
renames run on a background thread, with `save_checkpoint`'s commit protocol. At most one asynchronous save is
in flight per process (a second waits for the first, raising if it failed), which bounds the snapshots to one
copy of the state. The writer thread is not a daemon, so a normal interpreter exit lets it finish.

Limits: the snapshot (a host copy of every tensor) is the training loop's pause; the disk time is not.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import safetensors.torch

from loom.checkpoint.store import (
    CheckpointError,
    encode_state,
    publish,
    validate_save_arguments,
    write_checkpoint,
)
from loom.checkpoint.tree import flatten_state
from loom.errors import failure_text

__all__ = ["AsyncCheckpoint", "publish_async", "save_checkpoint_async", "wait_for_pending"]

_slot_lock = threading.Lock()
_in_flight: AsyncCheckpoint | None = None


class AsyncCheckpoint:
    """Handle of a checkpoint being written in the background: `wait()` for it, `done()` to poll."""

    def __init__(self, directory: Path, step: int, write: Callable[[], Path]) -> None:
        """Start writing the checkpoint of ``step`` into ``directory`` with ``write`` on a new thread."""
        self.directory = directory
        self.step = step
        self.path: Path | None = None
        """The checkpoint's directory, once written."""
        self._error: BaseException | None = None
        self._reported = False
        self._thread = threading.Thread(
            target=self._write, args=(write,), name=f"loom-checkpoint-{step}", daemon=False
        )
        self._thread.start()

    def _write(self, write: Callable[[], Path]) -> None:
        try:
            self.path = write()
        except BaseException as err:  # kept for wait(), which re-raises it in the caller's thread
            self._error = err

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> Path:
        """Block until the checkpoint is durable; return its path, or raise the error that stopped it."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"checkpoint of step {self.step} still being written after {timeout} s")
        if self._error is not None:
            self._reported = True
            raise CheckpointError(
                f"writing the checkpoint of step {self.step} to {self.directory} failed: "
                f"{failure_text(self._error)}"
            ) from self._error
        assert self.path is not None  # set whenever there is no error
        return self.path

    def __repr__(self) -> str:
        status = "failed" if self._error else "written" if self.done() else "writing"
        return f"AsyncCheckpoint(step={self.step}, directory={str(self.directory)!r}, {status})"


def save_checkpoint_async(
    directory: str | os.PathLike,
    step: int,
    state: dict[str, Any],
    keep: int | None = 3,
    *,
    local_states: Sequence[bytes] = (),
) -> AsyncCheckpoint:
    """Snapshot ``state`` now and write it as `save_checkpoint` would, in the background; return the handle.
    ``local_states`` (each rank's packed state, see `save_checkpoint`) are bytes, already a snapshot. Waits
    first for this process's previous asynchronous save, raising as `wait_for_pending` does."""
    validate_save_arguments(step, state, keep, local_states)
    write = functools.partial(
        write_checkpoint, Path(directory), step, keep=keep, local_states=tuple(local_states)
    )
    return _start(Path(directory), step, state, write)


def publish_async(
    directory: Path,
    staging: Path,
    step: int,
    state: dict[str, Any],
    keep: int | None,
    rank_entries: Sequence[dict[str, Any]],
) -> AsyncCheckpoint:
    """`publish` in the background: snapshot ``state`` now, then write the shared files and the manifest of
    a staging directory whose rank files (``rank_entries``) are already durable, and commit it."""
    validate_save_arguments(step, state, keep)
    rank_entries = tuple(rank_entries)

    def write(state_bytes: bytes, tensors: dict) -> Path:
        return publish(
            directory, staging, step, state_bytes, safetensors.torch.save(tensors), keep, rank_entries
        )

    return _start(directory, step, state, write)


def wait_for_pending() -> None:
    """Wait for this process's asynchronous save in flight, if any (raising `CheckpointError` if it failed
    and its own `wait()` has not reported it yet), so that a new staging directory can be opened."""
    with _slot_lock:
        _wait_for(_in_flight)


def _wait_for(previous: AsyncCheckpoint | None) -> None:
    if previous is not None and not previous._reported:  # wait; an unseen failure stops what follows
        previous.wait()


def _start(
    directory: Path, step: int, state: dict[str, Any], write: Callable[[bytes, dict], Path]
) -> AsyncCheckpoint:
    global _in_flight
    with _slot_lock:
        previous, _in_flight = _in_flight, None
        _wait_for(previous)
        skeleton, tensors = flatten_state(state, clone=True)
        state_bytes = encode_state(step, skeleton)  # here, so a state too big to load back is refused now
        handle = _in_flight = AsyncCheckpoint(directory, step, lambda: write(state_bytes, tensors))
    return handle
