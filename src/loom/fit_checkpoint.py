"""The checkpoints of `loom.fit`: what is saved, who writes it, how every rank resumes from it.

A checkpoint of the loop holds the job (model, optimizer, step), the loader's position, the LR scheduler,
every rank's RNG state and the loop's counters, in one atomic checkpoint directory (`loom.checkpoint.store`).

Who writes: the state of a replicated job (`DataParallel`) is the same on every rank, so rank 0 alone writes
it, after gathering every rank's RNG state and *local state*; at each checkpoint the ranks then agree (one small
all-gather) that it succeeded, so a failed write stops every rank with the same error instead of leaving some
waiting. Every rank loads the checkpoint itself and the ranks check they found the same step.

Local state is what a job's ``local_state_dict()`` returns, when it has one: state that differs between ranks,
such as gradient compression's error-feedback residuals and PowerSGD's warm starts (`DataParallel` with
``compression=``). Each rank packs its own (`loom.checkpoint.tree.pack_state`), rank 0 gathers the bytes and
stores them as one file per rank inside the same checkpoint, under its manifest's checksums. On resume at the
same world size rank r loads file r, bitwise. At another world size the local state is dropped, with a line on
stderr saying so when it holds tensors: residuals belong to the ranks that kept them, and there is no meaningful
way to share them among a different number of ranks (the codecs start from zero).

Non-finite state is never written: before a checkpoint every rank that writes state checks it (rank 0 the
replicated job state; every rank its own local state, or its part of a sharded job) for NaN and infinite
values, and the ranks agree on the verdict with the collectives the write already takes (the size gather, the
success agreement). A non-finite state stops the job on every rank with `NonFiniteStateError`, naming the
ranks, the tensors and the newest checkpoint, which is kept: the checkpoints on disk are all finite, so rotation
(``keep``) never removes the last good one in favour of a bad one.

Limits: rank 0 holds every rank's local state at once while it writes (for error feedback: one gradient's worth
per rank), and every rank loading a checkpoint reads (to verify) every rank's file. The codecs key their state
by parameter (`loom.comm.compression.feedback`), so the restored residuals reach the gradients even though a
fresh DDP buckets them differently on its first step: a resumed compressed run equals an uninterrupted one
(tests/test_fit.py), provided the model and DataParallel settings (hence the parameter numbering) are the same.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from loom.checkpoint import (
    AsyncCheckpoint,
    CheckpointError,
    capture_rng,
    checkpoint_name,
    load_checkpoint,
    pack_state,
    read_local_state,
    restore_rng,
    save_checkpoint,
    save_checkpoint_async,
)
from loom.checkpoint.tree import flatten_state
from loom.comm._reduce import all_gather_sized_bytes
from loom.errors import NonFiniteStateError  # noqa: F401 - raised here, defined there
from loom.fault.resize import resize_factor, scale_learning_rate
from loom.job import Job
from loom.topology import Topology

__all__ = ["FitCheckpointer", "NonFiniteStateError", "nonfinite_tensors", "resume_fit"]

_WRITE_FAILED, _NONFINITE = 1, 2
"""Codes of a rank's verdict in the agreement after a checkpoint."""


def nonfinite_tensors(state: Any) -> list[str]:
    """The keys (as `flatten_state` names them) of the floating-point tensors of ``state`` that are not finite."""
    _, tensors = flatten_state(state)
    return [
        key
        for key, t in tensors.items()
        if (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all())
    ]


def _shown(keys: list[str]) -> str:
    return ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")


# -- collectives (no-ops in a single process) -------------------------------------------------------------------
def _collective(topo: Topology) -> bool:
    return topo.is_distributed and dist.is_available() and dist.is_initialized()


def _all_gather_int(value: int, topo: Topology) -> list[int]:
    if not _collective(topo):
        return [value]
    mine = torch.tensor([value], dtype=torch.int64, device=topo.device)
    gathered = [torch.zeros_like(mine) for _ in range(topo.world_size)]
    dist.all_gather(gathered, mine)
    return [int(t.item()) for t in gathered]


def _gather_rng(topo: Topology) -> list[dict[str, Any]]:
    """Every rank's RNG state (as `capture_rng` gives it), in rank order; JSON on the wire, never pickle."""
    mine = capture_rng()
    if not _collective(topo):
        return [mine]
    wire = dict(
        mine,
        torch=mine["torch"].tolist(),
        cuda=None if mine["cuda"] is None else [t.tolist() for t in mine["cuda"]],
    )
    states = [
        json.loads(raw) for raw in all_gather_sized_bytes(json.dumps(wire).encode(), device=topo.device)
    ]
    for state in states:
        state["torch"] = torch.tensor(state["torch"], dtype=torch.uint8)
        if state["cuda"] is not None:
            state["cuda"] = [torch.tensor(t, dtype=torch.uint8) for t in state["cuda"]]
    return states


def _rank_state(job: Job) -> dict[str, Any]:
    """What this rank writes into its own file: its local state, and its part of the job when not replicated."""
    if job.replicated_state:
        return job.local_state_dict()
    return {"job": job.state_dict(), "local": job.local_state_dict()}


def _gather_rank_states(job: Job, topo: Topology, refused: str) -> list[bytes] | None:
    """Every rank's packed `_rank_state` on rank 0, in rank order (None elsewhere). The lengths are
    all-gathered first (-1: this rank could not pack its state, -2: it holds non-finite values; every rank
    raises, ``refused`` saying what is kept), then the bytes are gathered to rank 0 alone, zero-padded to the
    longest."""
    payload, error = b"", None
    nonfinite: list[str] = []
    try:
        state = _rank_state(job)
        nonfinite = nonfinite_tensors(state)
        payload = pack_state(state) if not nonfinite else b""
    except Exception as err:  # reported on every rank below, so no rank is left waiting in the gather
        error = err
    sizes = _all_gather_int(-1 if error else -2 if nonfinite else len(payload), topo)
    if -2 in sizes and -1 not in sizes:
        ranks = [r for r, n in enumerate(sizes) if n == -2]
        here = f" (here: {_shown(nonfinite)})" if nonfinite else ""
        raise NonFiniteStateError(
            f"the state of rank(s) {ranks} holds NaN or infinite values{here}, seen on rank {topo.rank}: "
            f"{refused} HINT: training diverged before this checkpoint; resume from the kept one with a lower "
            "learning rate, or look for non-finite inputs (DataParallel(nonfinite='skip') drops such steps)."
        )
    if error is not None or min(sizes) < 0:
        failed = [r for r, n in enumerate(sizes) if n < 0]
        raise CheckpointError(
            f"rank(s) {failed} could not pack their state for the checkpoint (seen on rank "
            f"{topo.rank}){f': {error!r}' if error else ''}. HINT: state must hold only tensors, None, "
            "bools, ints, floats, strings, lists, tuples and dicts."
        ) from error
    if not _collective(topo):
        return [payload]
    mine = torch.zeros(max(sizes), dtype=torch.uint8)
    mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    mine = mine.to(topo.device)
    gathered = [torch.empty_like(mine) for _ in sizes] if topo.is_main else None
    dist.gather(mine, gathered, dst=0)
    if gathered is None:
        return None
    return [t.cpu().numpy().tobytes()[:n] for t, n in zip(gathered, sizes, strict=True)]


# -- saving -----------------------------------------------------------------------------------------------------
class FitCheckpointer:
    """Writes the loop's checkpoints from rank 0 and makes every rank agree that the write succeeded."""

    def __init__(self, job: Job, loader, scheduler, directory: Path, keep: int, use_async: bool) -> None:
        self.job, self.loader, self.scheduler = job, loader, scheduler
        self.directory, self.keep, self.use_async = directory, keep, use_async
        self.topo: Topology = job.topology
        self.pending: AsyncCheckpoint | None = None
        self.saved_step: int | None = None

    def _refused(self, step: int) -> str:
        kept = (
            f"the newest checkpoint, of step {self.saved_step}, is kept"
            if self.saved_step is not None
            else "no checkpoint was written before it"
        )
        return f"the checkpoint of step {step} is not written to {self.directory}; {kept}."

    def save(self, step: int, loop_state: dict[str, Any]) -> None:
        rng = _gather_rng(self.topo)  # every rank takes part
        local = _gather_rank_states(self.job, self.topo, self._refused(step))
        failure, code = "", _WRITE_FAILED
        if self.topo.is_main:
            fit_state = dict(
                loop_state,
                world_size=self.topo.world_size,
                local_states=True,
                sharded=not self.job.replicated_state,
                mesh=self.job.mesh.shape.describe(),
            )
            job_state = self.job.state_dict() if self.job.replicated_state else None
            nonfinite = nonfinite_tensors(job_state) if job_state is not None else []
            state = {
                "job": job_state,
                "loader": self.loader.state_dict(),
                "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
                "rng": {"ranks": rng},
                "fit": fit_state,
            }
            try:
                files = local or ()
                if nonfinite:
                    failure, code = f"NaN or infinite values in {_shown(nonfinite)}", _NONFINITE
                elif self.use_async:
                    self.pending = save_checkpoint_async(
                        self.directory, step, state, keep=self.keep, local_states=files
                    )
                else:
                    save_checkpoint(self.directory, step, state, keep=self.keep, local_states=files)
            except Exception as err:  # reported on every rank below
                failure = repr(err)
        self._agree(failure, f"saving the checkpoint of step {step}", code, self._refused(step))
        self.saved_step = step

    def finish(self) -> None:
        failure = ""
        if self.pending is not None:
            try:
                self.pending.wait()
            except CheckpointError as err:
                failure = repr(err)
            self.pending = None
        self._agree(failure, "finishing the last checkpoint")

    def abandon(self) -> None:
        """After an error elsewhere: let a pending write finish, without collectives or masking that error."""
        if self.pending is not None:
            try:
                self.pending.wait()
            except CheckpointError as err:
                warnings.warn(f"the last asynchronous checkpoint also failed: {err}", stacklevel=3)
            self.pending = None

    def _agree(self, failure: str, operation: str, code: int = _WRITE_FAILED, refused: str = "") -> None:
        flags = _all_gather_int(code if failure else 0, self.topo)
        if _NONFINITE in flags:
            rank = flags.index(_NONFINITE)
            raise NonFiniteStateError(
                f"{operation}: rank {rank}'s state holds {failure or 'NaN or infinite values'} (seen on rank "
                f"{self.topo.rank}): {refused} HINT: training diverged before this checkpoint; resume from "
                "the kept one with a lower learning rate, or look for non-finite inputs "
                "(DataParallel(nonfinite='skip') drops such steps)."
            )
        if any(flags) and not failure:
            failure = f"rank {next(r for r, f in enumerate(flags) if f)} failed"
        if failure:
            raise CheckpointError(
                f"{operation} in {self.directory} failed (seen on rank {self.topo.rank}): {failure}. "
                "HINT: check that the directory is writable and has free space."
            )


# -- resuming ---------------------------------------------------------------------------------------------------
def resume_fit(
    job: Job, loader, scheduler, directory: Path, topo: Topology, scale_lr: bool = False
) -> tuple[int, dict[str, Any]] | None:
    """Load the newest intact checkpoint of ``directory`` into the loop's objects; return its step and the
    loop's saved counters, or None when there is no checkpoint. Collective: every rank calls it."""
    error: Exception | None = None
    try:
        found = load_checkpoint(directory)
    except CheckpointError as err:  # raised on every rank after the steps are compared, so nobody hangs
        found, error = None, err
    steps = _all_gather_int(-2 if error else -1 if found is None else found[0], topo)
    if error is not None:
        raise error
    if len(set(steps)) > 1:
        described = ", ".join(f"rank {r}: {'none' if s < 0 else s}" for r, s in enumerate(steps))
        raise CheckpointError(
            f"ranks found different checkpoints in {directory} ({described}). HINT: checkpoint_dir must be "
            "storage every rank sees (a shared filesystem), used by one job at a time."
        )
    if found is None:
        return None
    step, state = found
    if not isinstance(state.get("fit"), dict):
        raise ValueError(
            f"the checkpoint of step {step} in {directory} was not written by loom.fit (no 'fit' entry). "
            "HINT: pass a checkpoint_dir of its own to fit()."
        )
    checkpoint = directory / checkpoint_name(step)
    if state["fit"].get("sharded") or not job.replicated_state:
        _restore_sharded_state(job, state["fit"], checkpoint, step, topo)
    else:
        job.load_state_dict(state["job"])
        _restore_local_state(job, state["fit"], checkpoint, step, topo)
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
    job: Job, saved: dict[str, Any], checkpoint: Path, step: int, topo: Topology
) -> None:
    """Load this rank's part of a job whose state differs per rank; only the layout that wrote it fits."""
    mesh = job.mesh.shape.describe()
    if job.replicated_state or saved.get("world_size") != topo.world_size or saved.get("mesh") != mesh:
        raise CheckpointError(
            f"the checkpoint of step {step} in {checkpoint.parent} holds a job sharded over "
            f"{saved.get('world_size')} processes (mesh {saved.get('mesh')}); this job is "
            f"{'replicated' if job.replicated_state else 'sharded'} over {topo.world_size} (mesh {mesh}). "
            "HINT: resume with the strategy, world size and mesh degrees that wrote it."
        )
    mine = read_local_state(checkpoint, topo.rank)
    job.load_state_dict(mine["job"])
    job.load_local_state_dict(mine["local"])


def _restore_local_state(
    job: Job, saved: dict[str, Any], checkpoint: Path, step: int, topo: Topology
) -> None:
    """Load this rank's own saved state into ``job`` when the world size is the one that wrote it."""
    if not saved.get("local_states"):
        return
    written_by = saved.get("world_size")
    if written_by != topo.world_size:
        # Said only when something is lost: local state without tensors (no compression) is nothing to miss.
        if topo.is_main and flatten_state(read_local_state(checkpoint, 0))[1]:
            print(
                f"loom.fit: the checkpoint of step {step} was written by {written_by} processes, this run has "
                f"{topo.world_size}: each rank's local state (gradient compression's error feedback and warm "
                "starts) is dropped, since it belongs to the ranks that kept it; it starts again from zero.",
                file=sys.stderr,
                flush=True,
            )
        return
    job.load_local_state_dict(read_local_state(checkpoint, topo.rank))
