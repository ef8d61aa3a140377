"""``loom export CHECKPOINT OUT.safetensors``: the whole model's state dict, under its original names, from any
loom checkpoint, in one process, without a process group.

A replicated job's checkpoint holds the model in its shared state (``job.model``); a `ShardedDataParallel`
checkpoint holds it in pieces, one file per rank (`loom.checkpoint.sharded_state`), reassembled here one rank's
file at a time. Other sharded jobs' layouts are refused, naming the fix. ``CHECKPOINT`` is a `loom.fit`
checkpoint directory (its newest intact checkpoint is exported) or one ``step-N`` directory in it;
``model.load_state_dict(safetensors.torch.load_file(OUT))`` restores the model.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from loom.checkpoint.find import newest_intact
from loom.checkpoint.load import read_checkpoint, read_local_state
from loom.checkpoint.store import MANIFEST_FILE, CheckpointError, list_checkpoints

__all__ = ["export_model", "model_state_dict"]


def _newest(directory: Path) -> tuple[Path, int, dict[str, Any]]:
    if (directory / MANIFEST_FILE).is_file() or not list_checkpoints(directory):
        return (directory, *read_checkpoint(directory))
    found = newest_intact(directory)
    assert found is not None  # there are checkpoints: one is read, or NoValidCheckpointError
    return found


def model_state_dict(checkpoint: str | os.PathLike) -> tuple[int, dict[str, torch.Tensor]]:
    """``(step, state dict)`` of the whole model in ``checkpoint`` (a `loom.fit` directory or one checkpoint)."""
    from loom.checkpoint.sharded_state import full_state_dict, is_sharded_part

    path, step, state = _newest(Path(checkpoint))
    job = state.get("job")
    if isinstance(job, dict) and isinstance(job.get("model"), dict):
        return step, dict(job["model"])
    saved = state.get("fit")
    fit: dict[str, Any] = saved if isinstance(saved, dict) else {}
    world = fit.get("world_size")
    if not fit.get("sharded") or not isinstance(world, int):
        raise CheckpointError(
            f"{path} holds no model state (no 'job.model' entry, not a sharded job's parts)"
        )
    own = read_local_state(path, 0)
    first = own.get("job") if isinstance(own, dict) else None
    if not is_sharded_part(first):
        raise CheckpointError(
            f"{path} was written by a sharded job whose parts are not ShardedDataParallel's (mesh "
            f"{fit.get('mesh')}): export supports replicated jobs and ShardedDataParallel. HINT: load it into "
            "the strategy that wrote it and save job.module.state_dict() from each part."
        )
    return step, full_state_dict(first if r == 0 else read_local_state(path, r)["job"] for r in range(world))


def export_model(checkpoint: str | os.PathLike, out: str | os.PathLike) -> tuple[int, int]:
    """Write the whole model of ``checkpoint`` to the safetensors file ``out``; ``(step, tensors written)``."""
    step, state = model_state_dict(checkpoint)
    tensors = {name: t.detach().contiguous().clone() for name, t in state.items()}
    safetensors.torch.save_file(tensors, str(out), metadata={"loom_step": str(step)})
    return step, len(tensors)
