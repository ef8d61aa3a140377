"""Reading checkpoints back: verify everything, bound every allocation, fall back past whatever is damaged.

`read_checkpoint` reads one checkpoint (`read_checkpoint_part`: the shared files and one rank's own) and
raises `CorruptCheckpointError` naming the first file found wrong and how (`loom.checkpoint.find` walks back
past it): damaged, or crafted to exhaust the reader and refused before the allocation it would cause (the
checks: docs/checkpoints.md#reading; `confined`, `bounded_json` and `tensor_file` make them). Manifests of
format 1 are refused, naming `loom.checkpoint.upgrade_checkpoint`. Every file is read once, its sha256 computed
on the same pass.

Limits: a tensor file within `ReadLimits.max_tensor_bytes` whose header is consistent is allocated in full
before its sha256 can be compared (hashing first would read every genuine checkpoint twice). An adversary who
rewrites the manifest's budgets as well is bounded by the absolute `ReadLimits` alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch

from loom.checkpoint.bounded_json import JSONLimitError, parse_json
from loom.checkpoint.confined import ConfinedDirectory, read_limited, sha256_of
from loom.checkpoint.limits import BYTES_PER_ENTRY, DEFAULT_LIMITS, ReadLimits
from loom.checkpoint.store import (
    FORMAT,
    MANIFEST_FILE,
    STATE_FILE,
    STEP_NAME,
    TENSOR_FILE,
    VERSION,
    CheckpointError,
    CorruptCheckpointError,
    local_state_file,
)
from loom.checkpoint.tensor_file import read_tensor_file
from loom.checkpoint.tree import unflatten_state, unpack_tensor_file

__all__ = [
    "open_checkpoint",
    "parse_manifest",
    "parse_state",
    "read_checkpoint",
    "read_checkpoint_part",
    "read_local_state",
]

_SHA256 = re.compile(r"[0-9a-f]{64}")
_LOCAL_NAME = re.compile(r"rank-(\d{5,})\.safetensors")


def _limit_hint(field: str) -> str:
    """What to do about a bound that a genuine checkpoint broke."""
    return (
        f" HINT: if this checkpoint is genuine, load it with limits=loom.checkpoint.ReadLimits({field}=...)."
    )


def _explained(err: ValueError, limits: ReadLimits = DEFAULT_LIMITS, entries: int | None = None) -> str:
    if not isinstance(err, JSONLimitError):
        return str(err)
    if entries is not None and getattr(limits.budgeted(entries), err.field) < getattr(limits, err.field):
        return (
            f"{err}: the read budget its manifest entry gives ({entries} entries: at most {entries} JSON values "
            f"and {entries * BYTES_PER_ENTRY} bytes of JSON), which a file loom wrote always fits (crafted or "
            "damaged)"
        )
    return f"{err}.{_limit_hint(err.field)}"


def parse_manifest(data: bytes, path: Path, limits: ReadLimits = DEFAULT_LIMITS) -> dict[str, Any]:
    """The manifest ``data`` (the bytes of ``path``), checked: format, version, a step, and for every file
    a size and a sha256. Raises `CorruptCheckpointError` (and nothing else) for anything else."""
    try:
        manifest = parse_json(data, limits, "max_manifest_bytes")
    except ValueError as err:
        raise CorruptCheckpointError(path, _explained(err)) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CorruptCheckpointError(path, f"not a {FORMAT} manifest")
    if manifest.get("version") == 1:
        raise CorruptCheckpointError(
            path,
            f"format version 1 (written by an older loom, without the read budgets of version {VERSION}); "
            f"refused, since it could not be read within its own budget. HINT: if it is genuine, convert it "
            f"once with loom.checkpoint.upgrade_checkpoint({str(path.parent)!r})",
        )
    if manifest.get("version") != VERSION:
        raise CorruptCheckpointError(
            path, f"format version {manifest.get('version')!r:.40}, expected {VERSION}"
        )
    step = manifest.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CorruptCheckpointError(path, f"step {step!r:.40} is not an int >= 0")
    files = manifest.get("files")
    ranks = len(files) - 2 if isinstance(files, dict) else 0
    expected = {STATE_FILE, TENSOR_FILE, *(local_state_file(r) for r in range(ranks))}
    if not isinstance(files, dict) or set(files) != expected:
        raise CorruptCheckpointError(
            path,
            f"lists files {files!r:.200}, expected {STATE_FILE}, {TENSOR_FILE} and "
            f"{local_state_file(0)}... for ranks 0 to n-1 if any",
        )
    for name, entry in files.items():
        size, digest = (entry.get("size"), entry.get("sha256")) if isinstance(entry, dict) else (None, None)
        if isinstance(size, bool) or not isinstance(size, int) or size < 0 or not isinstance(digest, str):
            raise CorruptCheckpointError(path, f"the entry of {name} must be an object with size and sha256")
        if not _SHA256.fullmatch(digest):
            raise CorruptCheckpointError(path, f"the sha256 of {name} is not 64 hex digits")
        entries = entry.get("entries")
        if isinstance(entries, bool) or not isinstance(entries, int) or entries < 1:
            raise CorruptCheckpointError(
                path, f"the entries of {name} must be an int >= 1, got {entries!r:.40}"
            )
    return manifest


def parse_state(
    data: bytes,
    tensors: dict[str, torch.Tensor],
    step: int,
    path: Path,
    limits: ReadLimits = DEFAULT_LIMITS,
    entries: int | None = None,
) -> dict[str, Any]:
    """The state ``state.json`` ``data`` (the bytes of ``path``) describes, its tensors put back in place,
    parsed within ``limits`` tightened to the manifest's budget of ``entries`` when given. Raises
    `CorruptCheckpointError` (and nothing else) when it is not the state of ``step`` or does not match
    ``tensors``."""
    budget = limits if entries is None else limits.budgeted(entries)
    try:
        document = parse_json(data, budget, "max_state_bytes")
    except ValueError as err:
        raise CorruptCheckpointError(path, _explained(err, limits, entries)) from None
    if not isinstance(document, dict) or document.get("step") != step or "state" not in document:
        raise CorruptCheckpointError(path, "not a checkpoint state of this step")
    try:
        state = unflatten_state(document["state"], tensors)
    except (ValueError, KeyError, TypeError) as err:
        raise CorruptCheckpointError(path, f"does not match the tensor file: {err!s:.300}") from None
    if not isinstance(state, dict):
        raise CorruptCheckpointError(path, f"the state is a {type(state).__name__}, not a dict")
    return state


@contextlib.contextmanager
def _opened(
    folder: ConfinedDirectory,
    name: str,
    entry: dict[str, Any],
    limit: int | None,
    field: str,
    explain: Callable[[ValueError], str] = str,
) -> Iterator[tuple[BinaryIO, int]]:
    """``(file, size)`` of ``name``, once its size matches the manifest's ``entry`` and is within ``limit``; a
    ``ValueError`` while it is read becomes `CorruptCheckpointError` saying ``explain(err)``."""
    path = folder.path / name
    file, size = folder.open_file(name)
    with file:
        if size != entry["size"]:
            raise CorruptCheckpointError(
                path, f"{size} bytes, the manifest says {entry['size']} (truncated or overwritten)"
            )
        if limit is not None and size > limit:
            raise CorruptCheckpointError(
                path, f"{size} bytes, more than the limit of {limit}.{_limit_hint(field)}"
            )
        try:
            yield file, size
        except ValueError as err:
            raise CorruptCheckpointError(path, explain(err)) from None


def _check_digest(path: Path, digest: str, entry: dict[str, Any]) -> None:
    if digest != entry["sha256"]:
        raise CorruptCheckpointError(path, "sha256 differs from the manifest (the content was damaged)")


def _read_small(folder: ConfinedDirectory, name: str, entry: dict[str, Any], limits: ReadLimits) -> bytes:
    """The bytes of ``name`` (``state.json``), read whole once its size is known to be within its budget."""
    limit, budget = limits.max_state_bytes, limits.budgeted(entry["entries"]).max_state_bytes
    if entry["size"] > budget < limit:  # the manifest contradicts itself: refused before the file is opened
        raise CorruptCheckpointError(
            folder.path / name,
            f"the manifest lists {entry['size']} bytes, more than its own read budget of {entry['entries']} "
            f"entries allows ({budget} bytes; crafted or damaged)",
        )
    with _opened(folder, name, entry, limit, "max_state_bytes") as (file, size):
        data = read_limited(file, size, limit)
    _check_digest(folder.path / name, hashlib.sha256(data).hexdigest(), entry)
    return data


def _read_tensors(
    folder: ConfinedDirectory, name: str, entry: dict[str, Any], limits: ReadLimits
) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """The metadata and tensors of safetensors file ``name``, read and hashed in one bounded pass."""
    budget = limits.budgeted(entry["entries"])
    said = (
        f"; the read budget of its manifest entry is {entry['entries']} entries: at most "
        f"{entry['entries']} JSON values and {budget.max_header_bytes} bytes of header"
        if budget.max_header_bytes < limits.max_header_bytes
        else ""
    )
    with _opened(
        folder, name, entry, limits.max_tensor_bytes, "max_tensor_bytes",
        lambda err: f"not a readable safetensors file ({err}{said})",
    ) as (file, size):  # fmt: skip
        metadata, tensors, digest = read_tensor_file(file, size, budget)
    _check_digest(folder.path / name, digest, entry)
    return metadata, tensors


def _verify(folder: ConfinedDirectory, name: str, entry: dict[str, Any], limits: ReadLimits) -> None:
    """Check ``name``'s size and sha256 against the manifest, hashing it in pieces (nothing kept)."""
    with _opened(folder, name, entry, limits.max_tensor_bytes, "max_tensor_bytes") as (file, size):
        digest = sha256_of(file, size)
    _check_digest(folder.path / name, digest, entry)


def open_checkpoint(
    checkpoint: Path, limits: ReadLimits, parse: Callable[[bytes, Path, ReadLimits], Any] | None = None
) -> tuple[ConfinedDirectory, Any]:
    """The step directory, opened confined, and its manifest (read within its bound), parsed by ``parse``
    (default `parse_manifest`); the caller closes the directory."""
    folder = ConfinedDirectory.open(checkpoint)
    path = checkpoint / MANIFEST_FILE
    try:
        file, size = folder.open_file(MANIFEST_FILE)
        with file:
            try:
                data = read_limited(file, size, limits.max_manifest_bytes)
            except ValueError as err:
                raise CorruptCheckpointError(path, f"{err}.{_limit_hint('max_manifest_bytes')}") from None
        return folder, (parse or parse_manifest)(data, path, limits)
    except BaseException:
        folder.close()
        raise


def _read_own(folder: ConfinedDirectory, name: str, entry: dict[str, Any], limits: ReadLimits) -> Any:
    """The state packed in rank file ``name``, read within the budget of its manifest ``entry``."""
    metadata, tensors = _read_tensors(folder, name, entry, limits)
    try:
        return unpack_tensor_file(metadata, tensors, limits.budgeted(entry["entries"]))
    except ValueError as err:
        raise CorruptCheckpointError(folder.path / name, str(err)) from None


def _read(checkpoint: Path, limits: ReadLimits, rank: int | None) -> tuple[int, dict[str, Any], Any]:
    """``(step, state, own)``: the shared files, and with ``rank`` None every rank file verified (own None),
    else rank ``rank``'s own file unpacked (None when the manifest lists none for it)."""
    folder, manifest = open_checkpoint(checkpoint, limits)
    with folder:
        step, files, own = manifest["step"], manifest["files"], None
        match = STEP_NAME.fullmatch(checkpoint.name)
        if match is not None and int(match.group(1)) != step:  # the manifest contradicts its directory's name
            raise CorruptCheckpointError(
                checkpoint / MANIFEST_FILE, f"step {step} does not match the directory"
            )
        state_bytes = _read_small(folder, STATE_FILE, files[STATE_FILE], limits)
        _, tensors = _read_tensors(folder, TENSOR_FILE, files[TENSOR_FILE], limits)
        if rank is None:
            for name, entry in files.items():  # every rank's file, so damage anywhere falls back
                if _LOCAL_NAME.fullmatch(name):
                    _verify(folder, name, entry, limits)
        elif local_state_file(rank) in files:
            own = _read_own(folder, local_state_file(rank), files[local_state_file(rank)], limits)
    entries = files[STATE_FILE]["entries"]
    return step, parse_state(state_bytes, tensors, step, checkpoint / STATE_FILE, limits, entries), own


def read_checkpoint(
    checkpoint: str | os.PathLike, *, limits: ReadLimits = DEFAULT_LIMITS
) -> tuple[int, dict[str, Any]]:
    """Verify and read one checkpoint directory; raise `CorruptCheckpointError` naming the first bad file."""
    step, state, _ = _read(Path(checkpoint), limits, None)
    return step, state


def read_checkpoint_part(
    checkpoint: str | os.PathLike, rank: int, *, limits: ReadLimits = DEFAULT_LIMITS
) -> tuple[int, dict[str, Any], Any]:
    """``(step, state, own)`` of one checkpoint directory as process ``rank`` needs it: the shared state
    (``state.json``, ``tensors.safetensors``) and its own file unpacked (None when the manifest lists none
    for ``rank``, e.g. at a larger world size). Other ranks' files are not read (`loom.fit` makes the ranks
    agree on the verdict). Raises `CorruptCheckpointError` naming the first bad file."""
    return _read(Path(checkpoint), limits, rank)


def read_local_state(checkpoint: str | os.PathLike, rank: int, *, limits: ReadLimits = DEFAULT_LIMITS) -> Any:
    """Rank ``rank``'s own state in one checkpoint directory (see `save_checkpoint`'s ``local_states``),
    verified against the manifest. Raises `CheckpointError` when the checkpoint holds none for that rank."""
    checkpoint = Path(checkpoint)
    folder, manifest = open_checkpoint(checkpoint, limits)
    files, name = manifest["files"], local_state_file(rank)
    with folder:
        if name not in files:
            raise CheckpointError(
                f"{checkpoint} holds per-rank state for {len(files) - 2} rank(s), none for rank {rank}. "
                "HINT: per-rank state is only meaningful at the world size that wrote it."
            )
        return _read_own(folder, name, files[name], limits)
