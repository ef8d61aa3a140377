"""Convert a checkpoint of format version 1 (without read budgets) to the current format, in place.

Loading refuses version 1, since a crafted manifest could otherwise claim the old format to be read within the
absolute limits alone; `upgrade_checkpoint` is the explicit step for a checkpoint known to be genuine. Only the
manifest is rewritten (atomically), after every file's size and sha256 have been checked against it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from loom.checkpoint.bounded_json import parse_json
from loom.checkpoint.confined import ConfinedDirectory, read_limited, sha256_of
from loom.checkpoint.durable import replace_durable
from loom.checkpoint.limits import DEFAULT_LIMITS, ReadLimits
from loom.checkpoint.load import open_checkpoint
from loom.checkpoint.store import MANIFEST_FILE, STATE_FILE, VERSION, CheckpointError, file_entries
from loom.checkpoint.tensor_file import read_header

__all__ = ["upgrade_checkpoint"]


def _read_file(folder: ConfinedDirectory, name: str, limit: int) -> tuple[bytes, int, str]:
    """``(prefix, size, sha256)`` of file ``name``: its first ``limit`` bytes at most (all of a JSON file,
    the length and header of a safetensors file), its size and the sha256 of all of it."""
    file, size = folder.open_file(name)
    with file:
        try:
            data = read_limited(file, size, limit) if name == STATE_FILE else read_header(file, size, limit)
        except ValueError as error:  # a read limit or a cut file: name the file, not a bare ValueError
            raise CheckpointError(f"{folder.path / name}: {error} (the limits are ReadLimits')") from None
        file.seek(0)
        return data, size, sha256_of(file, size)


def upgrade_checkpoint(checkpoint: str | os.PathLike, *, limits: ReadLimits = DEFAULT_LIMITS) -> Path:
    """Rewrite the manifest of the version-1 checkpoint directory ``checkpoint`` as version 2; return its
    path. Raises `CheckpointError` when it is not a version-1 checkpoint or a file does not match it."""
    path = Path(checkpoint)
    folder, manifest = open_checkpoint(
        path, limits, lambda data, _, bounds: parse_json(data, bounds, "max_manifest_bytes")
    )
    with folder:
        files = manifest.get("files") if isinstance(manifest, dict) else None
        if not isinstance(files, dict) or manifest.get("version") != 1:
            raise CheckpointError(f"{path / MANIFEST_FILE} is not a version-1 loom checkpoint manifest")
        for name, entry in files.items():
            if not isinstance(name, str) or "/" in name or not isinstance(entry, dict):
                raise CheckpointError(f"{path / MANIFEST_FILE}: a bad entry {name!r:.80}")
            limit = limits.max_state_bytes if name == STATE_FILE else limits.max_header_bytes
            data, size, digest = _read_file(folder, name, limit)
            if size != entry.get("size") or digest != entry.get("sha256"):
                raise CheckpointError(f"{path / name} does not match its manifest entry (damaged)")
            entry["entries"] = file_entries(name, data)
        manifest["version"] = VERSION
    replace_durable(path / MANIFEST_FILE, json.dumps(manifest, indent=1).encode())
    return path
