"""Checkpoints on disk: one directory per step, a manifest of checksums, and a `latest` pointer moved last.

Layout of a checkpoint directory::

    directory/
      step-00000012/
        state.json              the state's tree, tensors replaced by placeholders (see `loom.checkpoint.tree`)
        tensors.safetensors     every tensor, keyed by its path in the tree
        rank-00000.safetensors  optional, one per rank: state that differs between processes (`pack_state`)
        manifest.json           step, format version, size and sha256 of every file above
      latest                    "step-00000012": the newest checkpoint known to be complete and durable

The commit protocol, so that a crash at any instant leaves ``latest`` naming a whole checkpoint:

1. write the files into a fresh ``.tmp-*`` directory inside ``directory``, fsync each, then the manifest last,
   then fsync the temporary directory;
2. rename it to ``step-NNNNNNNN`` (atomic) and fsync ``directory``;
3. replace ``latest`` atomically (temporary file, fsync, ``os.replace``, fsync ``directory``);
4. only then retire older checkpoints beyond ``keep`` (renamed to ``.trash-*`` first, so a half-deleted
   checkpoint is never visible under a ``step-*`` name), and checkpoints *newer* than the one just saved: those
   were written by a run that crashed before moving ``latest``, and this run has replaced their timeline.

`load_checkpoint` trusts nothing: it checks the manifest's sizes and sha256 sums, parses the JSON and matches it
against the tensor file. If the checkpoint ``latest`` names is damaged it warns, naming the bad file, and falls
back to the previous checkpoint by step.

Per-rank files let one writer (the main process) commit state that every process holds a different piece of
(e.g. gradient compression's error feedback) in the same atomic step as the rest: each process packs its own
state (`loom.checkpoint.tree.pack_state`) and sends the bytes to the writer; `read_local_state` reads one back.

Limits: one writer per directory (temporary directories of crashed writers are removed by the next save, so
two processes saving into one directory would disturb each other). Every file is read whole into memory to be
checksummed (every rank's file included, so each process loading a checkpoint reads all of them), and saving
holds a serialized copy of the tensors in memory while it writes. Re-saving the step that ``latest`` names has
a short window in which a crash leaves ``latest`` naming nothing; loading then falls back to the previous
checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from loom.checkpoint.durable import fsync_directory, replace_durable, unique_name, write_durable
from loom.checkpoint.tree import flatten_state, unflatten_state, unpack_state

__all__ = [
    "CheckpointError",
    "CorruptCheckpointError",
    "CorruptCheckpointWarning",
    "NoValidCheckpointError",
    "checkpoint_name",
    "list_checkpoints",
    "load_checkpoint",
    "local_state_file",
    "read_checkpoint",
    "read_local_state",
    "save_checkpoint",
]

FORMAT = "loom-checkpoint"
VERSION = 1
STATE_FILE = "state.json"
TENSOR_FILE = "tensors.safetensors"
MANIFEST_FILE = "manifest.json"
POINTER_FILE = "latest"
_NAME = re.compile(r"step-(\d{8,})")
_LOCAL_NAME = re.compile(r"rank-(\d{5,})\.safetensors")

# One write at a time per process: an asynchronous save's background thread and a synchronous save must not
# interleave, since each removes the temporary directories it does not know to be in use.
_write_lock = threading.Lock()


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read."""


class CorruptCheckpointError(CheckpointError):
    """One checkpoint is damaged; ``path`` is the file (or directory) found wrong, ``reason`` says how."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class NoValidCheckpointError(CheckpointError):
    """Checkpoints exist in the directory, but none of them is intact."""


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
    found = {}
    for entry in root.iterdir():
        match = _NAME.fullmatch(entry.name)
        if match and entry.is_dir():
            found[int(match.group(1))] = entry
    return dict(sorted(found.items()))


def validate_save_arguments(step: Any, state: Any, keep: Any, local_states: Any = ()) -> None:
    """Refuse a bad step, state, keep or local states before anything is written (shared with the
    asynchronous save)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep must be an int >= 1 (or None to keep every checkpoint), got {keep!r}")
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
    """Write ``state`` as the checkpoint of ``step``, durably, and return its path.

    ``state`` is a nested dict of tensors, None, bools, ints, floats, strings, lists, tuples and dicts, e.g.
    ``{"job": job.state_dict(), "loader": loader.state_dict(), "rng": capture_rng()}``. ``local_states[r]`` is
    rank r's own state packed with `pack_state`, written to `local_state_file` ``(r)``. Only the newest
    ``keep`` checkpoints (by step) are kept. When this returns, the checkpoint is on disk and ``latest`` names it.
    """
    validate_save_arguments(step, state, keep, local_states)
    skeleton, tensors = flatten_state(state)
    return write_checkpoint(Path(directory), step, skeleton, tensors, keep, local_states)


def write_checkpoint(
    directory: Path,
    step: int,
    skeleton: Any,
    tensors: dict[str, torch.Tensor],
    keep: int | None,
    local_states: Sequence[bytes] = (),
) -> Path:
    """The commit protocol of the module docstring, for a state already flattened (see `flatten_state`)."""
    state_bytes = json.dumps({"step": step, "state": skeleton}, allow_nan=False).encode()
    tensor_bytes = safetensors.torch.save(tensors)
    with _write_lock:
        directory.mkdir(parents=True, exist_ok=True)
        _remove_leftovers(directory)
        name = checkpoint_name(step)
        staging = directory / unique_name(f".tmp-{name}")
        staging.mkdir()
        final, replaced = directory / name, None
        try:
            manifest = {"format": FORMAT, "version": VERSION, "step": step, "created_unix": time.time()}
            files = {STATE_FILE: state_bytes, TENSOR_FILE: tensor_bytes}
            files.update((local_state_file(r), data) for r, data in enumerate(local_states))
            manifest["files"] = {file: _describe(data) for file, data in files.items()}
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
        fsync_directory(directory)
        replace_durable(directory / POINTER_FILE, (name + "\n").encode())
        _retire(directory, step, keep)
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
    return final


def _describe(data: bytes) -> dict[str, Any]:
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _remove_leftovers(directory: Path) -> None:
    """Remove what crashed writers left: staging and trash directories, temporary pointer files."""
    for entry in directory.iterdir():
        if entry.name.startswith((".tmp-", ".trash-")) and entry.is_dir():
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
        shutil.rmtree(target, ignore_errors=True)


# -- reading ---------------------------------------------------------------------------------------------------
def _read_verified(path: Path, expected: dict[str, Any]) -> bytes:
    if not path.is_file():
        raise CorruptCheckpointError(path, "the file is missing")
    data = path.read_bytes()
    if len(data) != expected.get("size"):
        raise CorruptCheckpointError(
            path, f"{len(data)} bytes, the manifest says {expected.get('size')} (truncated or overwritten)"
        )
    if hashlib.sha256(data).hexdigest() != expected.get("sha256"):
        raise CorruptCheckpointError(path, "sha256 differs from the manifest (the content was damaged)")
    return data


def _read_manifest(checkpoint: Path) -> dict[str, Any]:
    path = checkpoint / MANIFEST_FILE
    if not path.is_file():
        raise CorruptCheckpointError(path, "the manifest is missing")
    try:
        manifest = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CorruptCheckpointError(path, f"not valid JSON ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CorruptCheckpointError(path, f"not a {FORMAT} manifest")
    if manifest.get("version") != VERSION:
        raise CorruptCheckpointError(path, f"format version {manifest.get('version')!r}, expected {VERSION}")
    files = manifest.get("files")
    ranks = len(files) - 2 if isinstance(files, dict) else 0
    expected = {STATE_FILE, TENSOR_FILE, *(local_state_file(r) for r in range(ranks))}
    if not isinstance(files, dict) or set(files) != expected:
        raise CorruptCheckpointError(
            path,
            f"lists files {files!r}, expected {STATE_FILE}, {TENSOR_FILE} and "
            f"{local_state_file(0)}... for ranks 0 to n-1 if any",
        )
    if not all(isinstance(v, dict) for v in files.values()):
        raise CorruptCheckpointError(path, "file entries must be objects with size and sha256")
    return manifest


def read_checkpoint(checkpoint: str | os.PathLike) -> tuple[int, dict[str, Any]]:
    """Verify and read one checkpoint directory; raise `CorruptCheckpointError` naming the first bad file."""
    checkpoint = Path(checkpoint)
    manifest = _read_manifest(checkpoint)
    step = manifest.get("step")
    match = _NAME.fullmatch(checkpoint.name)
    if not isinstance(step, int) or (match is not None and int(match.group(1)) != step):
        raise CorruptCheckpointError(
            checkpoint / MANIFEST_FILE, f"step {step!r} does not match the directory"
        )
    state_bytes = _read_verified(checkpoint / STATE_FILE, manifest["files"][STATE_FILE])
    tensor_bytes = _read_verified(checkpoint / TENSOR_FILE, manifest["files"][TENSOR_FILE])
    for name, expected in manifest["files"].items():  # every rank's file, so damage anywhere falls back
        if _LOCAL_NAME.fullmatch(name):
            _read_verified(checkpoint / name, expected)
    try:
        document = json.loads(state_bytes)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CorruptCheckpointError(checkpoint / STATE_FILE, f"not valid JSON ({err})") from None
    try:
        tensors = safetensors.torch.load(tensor_bytes)
    except Exception as err:  # safetensors raises its own error types for a malformed header
        raise CorruptCheckpointError(
            checkpoint / TENSOR_FILE, f"not a readable safetensors file ({err})"
        ) from None
    if not isinstance(document, dict) or document.get("step") != step or "state" not in document:
        raise CorruptCheckpointError(checkpoint / STATE_FILE, "not a checkpoint state of this step")
    try:
        state = unflatten_state(document["state"], tensors)
    except (ValueError, KeyError, TypeError) as err:
        raise CorruptCheckpointError(
            checkpoint / STATE_FILE, f"does not match the tensor file: {err}"
        ) from None
    return step, state


def read_local_state(checkpoint: str | os.PathLike, rank: int) -> Any:
    """Rank ``rank``'s own state in one checkpoint directory (see `save_checkpoint`'s ``local_states``),
    verified against the manifest. Raises `CheckpointError` when the checkpoint holds none for that rank."""
    checkpoint = Path(checkpoint)
    files = _read_manifest(checkpoint)["files"]
    name = local_state_file(rank)
    if name not in files:
        raise CheckpointError(
            f"{checkpoint} holds per-rank state for {len(files) - 2} rank(s), none for rank {rank}. "
            "HINT: per-rank state is only meaningful at the world size that wrote it."
        )
    data = _read_verified(checkpoint / name, files[name])
    try:
        return unpack_state(data)
    except ValueError as err:
        raise CorruptCheckpointError(checkpoint / name, str(err)) from None


def _read_pointer(directory: Path) -> str | None:
    pointer = directory / POINTER_FILE
    if not pointer.exists():
        return None
    try:
        name = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError) as err:
        warnings.warn(
            f"{pointer} is unreadable ({err}); using the newest intact checkpoint",
            CorruptCheckpointWarning,
            stacklevel=3,
        )
        return None
    if not _NAME.fullmatch(name):
        warnings.warn(
            f"{pointer} holds {name[:40]!r}, not a checkpoint name; using the newest intact checkpoint",
            CorruptCheckpointWarning,
            stacklevel=3,
        )
        return None
    return name


def load_checkpoint(directory: str | os.PathLike) -> tuple[int, dict[str, Any]] | None:
    """The newest intact checkpoint in ``directory`` as ``(step, state)``, or None if there is none.

    Starts from the checkpoint ``latest`` names (the newest if there is no pointer yet) and walks back by
    step past damaged ones, warning with `CorruptCheckpointWarning` for each. Raises `NoValidCheckpointError`
    when checkpoints exist but none is intact: starting over silently would throw away a run.
    """
    directory = Path(directory)
    checkpoints = list_checkpoints(directory)
    pointer = _read_pointer(directory)
    problems: list[str] = []
    if pointer is not None:
        newest = int(_NAME.fullmatch(pointer).group(1))  # type: ignore[union-attr]
        if newest not in checkpoints:
            problems.append(f"{directory / POINTER_FILE} names {pointer}, which does not exist")
            warnings.warn(
                problems[-1] + "; falling back to an earlier checkpoint",
                CorruptCheckpointWarning,
                stacklevel=2,
            )
        candidates = [s for s in checkpoints if s <= newest]
    else:
        candidates = list(checkpoints)
    for step in reversed(candidates):
        try:
            return read_checkpoint(checkpoints[step])
        except CorruptCheckpointError as err:
            problems.append(str(err))
            warnings.warn(
                f"checkpoint {checkpoints[step].name} is damaged: {err}; falling back to an earlier "
                "checkpoint",
                CorruptCheckpointWarning,
                stacklevel=2,
            )
    if not problems:
        return None
    raise NoValidCheckpointError(
        f"no intact checkpoint in {directory}: "
        + "; ".join(problems)
        + ". HINT: restore the files from a backup, or move the directory away to start from scratch."
    )
