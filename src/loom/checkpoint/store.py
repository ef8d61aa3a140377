"""Checkpoints on disk: one directory per step, a manifest of checksums, and a `latest` pointer moved last.

The layout, the manifest and the commit protocol step by step: docs/checkpoints.md. The guarantee: a crash at
any instant leaves ``latest`` naming a whole checkpoint, because every file is fsynced into a fresh ``.tmp-*``
staging directory (manifest last), which is renamed to ``step-NNNNNNNN`` atomically before ``latest`` is
replaced atomically; only then are checkpoints beyond ``keep``, and any newer one (a crashed run's timeline),
retired through ``.trash-*``. Per-rank files let each process write the part it alone holds into the same
commit; only its manifest entry travels. `encode_state` refuses what `loom.checkpoint.load` would refuse.

Limits: one writer per directory (the next save removes other writers' staging directories). Saving holds a
serialized copy of the shared tensors in memory. Re-saving the step ``latest`` names has a short window in
which a crash leaves ``latest`` naming nothing; loading then falls back to the previous checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from loom.checkpoint.bounded_json import count_json_values
from loom.checkpoint.durable import fsync_directory, replace_durable, unique_name, write_durable
from loom.checkpoint.limits import BYTES_PER_ENTRY
from loom.checkpoint.tree import TAG, PackedState, flatten_state, readable_json
from loom.errors import CheckpointError, CorruptCheckpointError, NoValidCheckpointError, check_int  # noqa: F401 - raised here, defined there

__all__ = [
    "CheckpointError",
    "CorruptCheckpointError",
    "CorruptCheckpointWarning",
    "NoValidCheckpointError",
    "checkpoint_name",
    "encode_state",
    "list_checkpoints",
    "local_state_file",
    "save_checkpoint",
]

FORMAT = "loom-checkpoint"
VERSION = 2
"""2: every file's manifest entry holds its read budget (``entries``); 1 (before): size and sha256 only."""
STATE_FILE = "state.json"
TENSOR_FILE = "tensors.safetensors"
MANIFEST_FILE = "manifest.json"
POINTER_FILE = "latest"
STEP_NAME = re.compile(r"step-(\d{8,})")
"""A checkpoint directory's name; group 1 is its step."""

# One write at a time per process: an asynchronous save's background thread and a synchronous save must not
# interleave, since each removes the temporary directories it does not know to be in use.
_write_lock = threading.RLock()
_staging_in_use: set[Path] = set()
"""Staging directories opened by `open_staging` and not yet published or abandoned: never leftovers."""


class CorruptCheckpointWarning(UserWarning):
    """A damaged checkpoint was skipped in favour of an earlier one."""


def checkpoint_name(step: int) -> str:
    """The directory name of the checkpoint of ``step``: ``step-00000012``."""
    return f"step-{step:08d}"


def local_state_file(rank: int) -> str:
    """The file name of rank ``rank``'s own state inside a checkpoint: ``rank-00003.safetensors``."""
    return f"rank-{rank:05d}.safetensors"


def list_checkpoints(directory: str | os.PathLike) -> dict[int, Path]:
    """The ``step-*`` directories in ``directory``, by step, oldest first (not verified)."""
    root = Path(directory)
    if not root.is_dir():
        return {}
    found = {int(m.group(1)): e for e in root.iterdir() if (m := STEP_NAME.fullmatch(e.name)) and e.is_dir()}
    return dict(sorted(found.items()))


def validate_save_arguments(step: Any, state: Any, keep: Any, local_states: Any = ()) -> None:
    """Refuse a bad step, state, keep or local states before anything is written (shared with the
    asynchronous save)."""
    check_int("step", step, 0)
    check_int("keep", keep, optional=True, hint="None keeps every checkpoint")
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict, got {type(state).__name__}")
    if not isinstance(local_states, Sequence) or not all(isinstance(b, bytes) for b in local_states):
        kinds = sorted({type(b).__name__ for b in local_states}) if isinstance(local_states, Sequence) else []
        raise TypeError(
            f"local_states must be a sequence of bytes, one per rank, got {type(local_states).__name__} "
            f"of {kinds}. HINT: each rank packs its state with loom.checkpoint.pack_state(state)."
        )


def save_checkpoint(
    directory: str | os.PathLike,
    step: int,
    state: dict[str, Any],
    keep: int | None = 3,
    *,
    local_states: Sequence[bytes] = (),
) -> Path:
    """Write ``state`` (a nested dict of tensors, None, bools, ints, floats, strings, lists, tuples and dicts)
    as the checkpoint of ``step``, keeping the newest ``keep``; ``local_states[r]`` is rank r's `pack_state`
    bytes. When this returns, the checkpoint is durable and ``latest`` names it; returns its path.
    """
    validate_save_arguments(step, state, keep, local_states)
    skeleton, tensors = flatten_state(state)
    return write_checkpoint(Path(directory), step, encode_state(step, skeleton), tensors, keep, local_states)


def encode_state(step: int, skeleton: Any) -> bytes:
    """The bytes of ``state.json`` for a flattened state (see `flatten_state`); ``ValueError`` when loading
    them would break the default `ReadLimits`, so that nothing saved is unreadable."""
    return readable_json({"step": step, "state": skeleton}, "the state's JSON (everything but its tensors)")


def write_checkpoint(
    directory: Path,
    step: int,
    state_bytes: bytes,
    tensors: dict[str, torch.Tensor],
    keep: int | None,
    local_states: Sequence[bytes] = (),
) -> Path:
    """The commit protocol of the module docstring, for a state already encoded (see `encode_state`), with
    every rank's file written by this process."""
    tensor_bytes = safetensors.torch.save(tensors)
    with _write_lock:  # held throughout, so that no other save of this process interleaves
        staging = open_staging(directory, step)
        try:
            entries = [write_rank_file(staging, r, data) for r, data in enumerate(local_states)]
        except BaseException:
            abandon_staging(staging)
            raise
        return publish(directory, staging, step, state_bytes, tensor_bytes, keep, entries)


def open_staging(directory: Path, step: int) -> Path:
    """Create the staging directory of the checkpoint of ``step`` (step 1 of the protocol), after removing
    what crashed writers left; the writer that publishes calls it, and hands its path to every rank."""
    with _write_lock:
        directory.mkdir(parents=True, exist_ok=True)
        _remove_leftovers(directory)
        staging = directory / unique_name(f".tmp-{checkpoint_name(step)}")
        staging.mkdir()
        _staging_in_use.add(staging)
    return staging


def write_rank_file(staging: Path, rank: int, data: bytes | PackedState) -> dict[str, Any]:
    """Write rank ``rank``'s packed state (`pack_state` bytes, or a `PackedState` streamed from its tensors)
    durably into ``staging`` (any process may, the staging directory being shared storage); return its
    manifest entry, which the publishing writer collects."""
    name, digest = local_state_file(rank), hashlib.sha256()
    pieces, size, header = (
        (data.chunks(), data.size, data.header) if isinstance(data, PackedState) else (data, len(data), data)
    )
    write_durable(staging / name, pieces, digest)
    return {"file": name, "size": size, "sha256": digest.hexdigest(), "entries": file_entries(name, header)}


def abandon_staging(staging: Path) -> None:
    """Remove a staging directory that will not be published (a rank failed); the newest checkpoint stays."""
    _staging_in_use.discard(staging)
    shutil.rmtree(staging, ignore_errors=True)


def publish(
    directory: Path,
    staging: Path,
    step: int,
    state_bytes: bytes,
    tensor_bytes: bytes,
    keep: int | None,
    rank_entries: Sequence[dict[str, Any]] = (),
) -> Path:
    """Steps 1 (the shared files and the manifest) to 4 of the protocol, once every rank's file listed in
    ``rank_entries`` (as `write_rank_file` returned them, in rank order) is durable in ``staging``."""
    with _write_lock:
        name = checkpoint_name(step)
        final, replaced = directory / name, None
        try:
            expected = [local_state_file(r) for r in range(len(rank_entries))]
            if [entry.get("file") for entry in rank_entries] != expected:
                raise CheckpointError(
                    f"rank files {[e.get('file') for e in rank_entries]}, expected {expected}"
                )
            manifest: dict[str, Any] = {
                "format": FORMAT, "version": VERSION, "step": step, "created_unix": time.time()
            }  # fmt: skip
            files = {STATE_FILE: state_bytes, TENSOR_FILE: tensor_bytes}
            manifest["files"] = {
                f: {"size": len(d), "sha256": hashlib.sha256(d).hexdigest(), "entries": file_entries(f, d)}
                for f, d in files.items()
            }
            for entry in rank_entries:
                manifest["files"][entry["file"]] = {k: v for k, v in entry.items() if k != "file"}
            for file, data in files.items():
                write_durable(staging / file, data)
            write_durable(staging / MANIFEST_FILE, json.dumps(manifest, indent=1).encode())
            fsync_directory(staging)
            if final.exists():  # re-saving a step (a resumed run catching up): retire the old copy first
                replaced = directory / unique_name(f".trash-{name}")
                os.rename(final, replaced)
            os.rename(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            if replaced is not None and not final.exists():
                os.rename(replaced, final)  # put the old copy back rather than lose it
            raise
        finally:
            _staging_in_use.discard(staging)
        fsync_directory(directory)
        replace_durable(directory / POINTER_FILE, (name + "\n").encode())
        _retire(directory, step, keep)
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
    return final


def file_entries(name: str, data: bytes) -> int:
    """The read budget of checkpoint file ``name`` holding ``data``, in entries (what counts:
    docs/checkpoints.md#on-disk; what reading allows for it: `ReadLimits.budgeted`)."""
    text = data if name == STATE_FILE else data[8 : 8 + int.from_bytes(data[:8], "little")]
    values = count_json_values(text)
    if name != STATE_FILE:
        skeleton = json.loads(text).get("__metadata__", {}).get(TAG)
        if isinstance(skeleton, str):
            values += count_json_values(skeleton.encode())
    return max(values, -(-len(text) // BYTES_PER_ENTRY), 1)


def _remove_leftovers(directory: Path) -> None:
    """Remove what crashed writers left: staging and trash directories, temporary pointer files."""
    for entry in directory.iterdir():
        if entry in _staging_in_use:  # a staging directory this process has handed to the ranks
            continue
        if entry.name.startswith((".tmp-", ".trash-")) and entry.is_symlink():  # a retired linked step-*
            entry.unlink(missing_ok=True)
        elif entry.name.startswith((".tmp-", ".trash-")) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        elif entry.name.startswith(f".{POINTER_FILE}.tmp-") and entry.is_file():
            entry.unlink(missing_ok=True)


def _retire(directory: Path, saved_step: int, keep: int | None) -> None:
    checkpoints = list_checkpoints(directory)
    older = [s for s in checkpoints if s <= saved_step]
    doomed = [s for s in checkpoints if s > saved_step]
    if keep is not None:
        doomed += older[: max(len(older) - keep, 0)]
    if not doomed:
        return
    trash = []
    for step in doomed:
        target = directory / unique_name(f".trash-{checkpoint_name(step)}")
        os.rename(checkpoints[step], target)
        trash.append(target)
    fsync_directory(directory)
    for target in trash:
        if target.is_symlink():  # a linked step-* (refused by loading): remove the link, not what it names
            target.unlink()
        else:
            shutil.rmtree(target, ignore_errors=True)
