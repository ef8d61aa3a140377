"""Resuming `loom.fit` from its checkpoints (written by `loom.train.fit_checkpoint`, which has the format's story):
each rank reads the shared files and its own file only (`loom.checkpoint.read_checkpoint_part`), and the ranks agree
on each candidate (`_load_agreed`; docs/checkpoints.md, "Reading").
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

from loom.checkpoint import (
    CheckpointError,
    CorruptCheckpointError,
    CorruptCheckpointWarning,
    checkpoint_name,
    local_state_file,
    read_checkpoint_part,
    read_local_state,
    restore_rng,
)
from loom.checkpoint.find import checkpoint_candidates, no_valid_checkpoint
from loom.checkpoint.tree import flatten_state
from loom.fault.resize import resize_factor, scale_learning_rate
from loom.job import Job
from loom.topology import Topology
from loom.train.fit_checkpoint import all_gather_ints

__all__ = ["resume_fit"]


def _load_agreed(directory: Path, topo: Topology) -> tuple[int, dict[str, Any], Any] | None:
    """Collective: the newest checkpoint every rank finds intact, ``(step, shared state, this rank's own part)``, or
    None. After each candidate (newest first) the ranks all-gather ``(step, verdict)``: one damaged in any rank's
    file makes every rank fall back together, as one process reading every file would, and ranks that find different
    checkpoints (storage not shared) stop, naming each rank's step."""
    candidates, problems = checkpoint_candidates(directory)
    for checkpoint in [*candidates, None]:  # None: every rank has run out of candidates
        found, verdict = None, 0
        error: CheckpointError | None = None
        step = int(checkpoint.name.split("-")[1]) if checkpoint is not None else -1
        if checkpoint is not None:
            try:
                found = read_checkpoint_part(checkpoint, topo.rank)
            except CorruptCheckpointError as err:
                verdict, error = 1, err
            except CheckpointError as err:  # raised on every rank below, so nobody hangs
                verdict, error = 2, err
        steps, verdicts = zip(*all_gather_ints([step, verdict], topo), strict=True)
        if 2 in verdicts:
            if isinstance(error, CheckpointError) and verdict == 2:
                raise error
            rank = verdicts.index(2)
            raise CheckpointError(f"rank {rank} could not read the checkpoint of step {step} in {directory}")
        if len(set(steps)) > 1:
            described = ", ".join(f"rank {r}: {'none' if s < 0 else s}" for r, s in enumerate(steps))
            raise CheckpointError(
                f"ranks found different checkpoints in {directory} ({described}). HINT: checkpoint_dir must be "
                "storage every rank sees (a shared filesystem), used by one job at a time."
            )
        if checkpoint is None:
            break
        damaged = [r for r, v in enumerate(verdicts) if v == 1]
        if not damaged:
            return found
        reason = str(error) if error is not None else f"rank(s) {damaged} found a file damaged"
        problems.append(reason)
        warnings.warn(
            f"checkpoint {checkpoint.name} is damaged: {reason}; falling back to an earlier checkpoint",
            CorruptCheckpointWarning,
            stacklevel=3,
        )
    if problems:
        raise no_valid_checkpoint(directory, problems)
    return None


def resume_fit(
    job: Job, loader, scheduler, directory: Path, topo: Topology, scale_lr: bool = False
) -> tuple[int, dict[str, Any]] | None:
    """Load the newest intact checkpoint of ``directory`` into the loop's objects; return its step and the
    loop's saved counters, or None when there is no checkpoint. Collective: every rank calls it."""
    found = _load_agreed(directory, topo)
    if found is None:
        return None
    step, state, own = found
    if not isinstance(state.get("fit"), dict):
        raise ValueError(
            f"the checkpoint of step {step} in {directory} was not written by loom.fit (no 'fit' entry). "
            "HINT: pass a checkpoint_dir of its own to fit()."
        )
    if state["fit"].get("sharded") or not job.replicated_state:
        _restore_sharded_state(job, state["fit"], directory / checkpoint_name(step), step, topo, own)
    else:
        job.load_state_dict(state["job"])
        _restore_local_state(job, state["fit"], step, topo, own)
    loader.load_state_dict(state["loader"])
    if scheduler is not None:
        if state.get("scheduler") is None:
            raise ValueError(
                f"fit() got an lr_scheduler but the checkpoint of step {step} in {directory} holds none. "
                "HINT: resume with the same arguments as the run that wrote it."
            )
        scheduler.load_state_dict(state["scheduler"])
    if scale_lr:  # the linear scaling rule, relative to the world size that wrote the checkpoint
        scale_learning_rate(
            job.optimizer, scheduler, resize_factor(state["fit"].get("world_size"), topo.world_size)
        )
    ranks = state["rng"]["ranks"]
    restore_rng(ranks[topo.rank % len(ranks)])
    return step, state["fit"]


def _restore_sharded_state(
    job: Job, saved: dict[str, Any], checkpoint: Path, step: int, topo: Topology, own: Any
) -> None:
    """Load this rank's part of a job whose state differs per rank; only the layout that wrote it fits."""
    mesh = job.mesh.shape.describe()
    written_by = saved.get("world_size")
    reshards = not job.replicated_state and job.reshards
    if reshards and isinstance(written_by, int) and written_by != topo.world_size:
        if topo.is_main:
            print(
                f"loom.fit: resharding the checkpoint of step {step}, written by {written_by} processes, over "
                f"{topo.world_size}",
                file=sys.stderr,
                flush=True,
            )
        job.load_resharded(lambda r: _sharded_part(checkpoint, r), written_by)
        return
    if job.replicated_state or written_by != topo.world_size or saved.get("mesh") != mesh:
        raise CheckpointError(
            f"the checkpoint of step {step} in {checkpoint.parent} holds a job sharded over "
            f"{saved.get('world_size')} processes (mesh {saved.get('mesh')}); this job is "
            f"{'replicated' if job.replicated_state else 'sharded'} over {topo.world_size} (mesh {mesh}). "
            "HINT: resume with the strategy, world size and mesh degrees that wrote it."
        )
    if not isinstance(own, dict) or set(own) != {"job", "local"}:
        raise CorruptCheckpointError(checkpoint / local_state_file(topo.rank), "not a sharded job's part")
    job.load_state_dict(own["job"])
    job.load_local_state_dict(own["local"])


def _sharded_part(checkpoint: Path, rank: int) -> Any:
    """Rank ``rank``'s saved part of a sharded job (its file's ``job`` entry), for resharding."""
    part = read_local_state(checkpoint, rank)
    if not isinstance(part, dict) or "job" not in part:
        raise CorruptCheckpointError(checkpoint / local_state_file(rank), "not a sharded job's part")
    return part["job"]


def _restore_local_state(job: Job, saved: dict[str, Any], step: int, topo: Topology, own: Any) -> None:
    """Load this rank's own saved state into ``job`` when the world size is the one that wrote it."""
    if not saved.get("local_states"):
        return
    written_by = saved.get("world_size")
    if written_by != topo.world_size:
        # Said only when something is lost: local state without tensors (no compression) is nothing to miss.
        if topo.is_main and own is not None and flatten_state(own)[1]:
            print(
                f"loom.fit: the checkpoint of step {step} was written by {written_by} processes, this run has "
                f"{topo.world_size}: each rank's local state (gradient compression's error feedback and warm "
                "starts) is dropped, since it belongs to the ranks that kept it; it starts again from zero.",
                file=sys.stderr,
                flush=True,
            )
        return
    job.load_local_state_dict(own)
