"""The checkpoints of `loom.fit`: what is saved and who writes it (resuming: `loom.train.fit_resume`).

One atomic checkpoint directory (`loom.checkpoint.store`) holds the job, the loader's position, the LR scheduler,
every rank's RNG state and the loop's counters. Each rank streams its own ``rank-R.safetensors`` (its part of a
sharded job, or a replicated job's local state) from its tensors; rank 0 writes the shared files and publishes the
manifest last. No rank receives another's model state, so a save costs a rank little memory beyond its state.
The commit protocol, the file table and the limits: docs/checkpoints.md.

Local state (``local_state_dict()``: compression's error-feedback residuals, PowerSGD's warm starts) belongs to
the ranks that kept it: at the same world size rank r loads file r, bitwise (the codecs key it by parameter,
`loom.comm.compression.feedback`, so a resumed run equals an uninterrupted one though a fresh DDP buckets
differently); at another it is dropped (said on stderr when it holds tensors) and the codecs start from zero.
Non-finite state is never written: a NaN or infinite value in any rank's state stops every rank with
`NonFiniteStateError` and the newest checkpoint is kept, so rotation (``keep``) never removes the last good one.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from loom.checkpoint import (
    AsyncCheckpoint,
    CheckpointError,
    capture_rng,
)
from loom.checkpoint.background import publish_async, wait_for_pending
from loom.checkpoint.store import abandon_staging, encode_state, open_staging, publish, write_rank_file
from loom.checkpoint.tree import PackedState, flatten_state
from loom.comm._reduce import all_gather_sized_bytes
from loom.errors import NonFiniteStateError, failure_text
from loom.job import Job
from loom.topology import Topology

__all__ = ["FitCheckpointer", "NonFiniteStateError", "all_gather_ints", "nonfinite_tensors"]

_WRITE_FAILED, _NONFINITE = 1, 2
"""Codes of a rank's verdict in the agreement after a checkpoint."""
_DIVERGED_HINT = (
    "HINT: training diverged before this checkpoint; resume from the kept one with a lower learning rate, or "
    "look for non-finite inputs (DataParallel(nonfinite='skip') drops such steps)."
)


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
def all_gather_ints(values: list[int], topo: Topology) -> list[list[int]]:
    """Every rank's short list of ints, in rank order (`_all_gather_json`'s framing)."""
    return [[int(v) for v in row] for row in _all_gather_json(list(values), topo)]


def _gather_rng(topo: Topology) -> list[dict[str, Any]]:
    """Every rank's RNG state (as `capture_rng` gives it), in rank order; JSON on the wire, never pickle."""
    mine = capture_rng()
    cuda = None if mine["cuda"] is None else [t.tolist() for t in mine["cuda"]]
    states = _all_gather_json(dict(mine, torch=mine["torch"].tolist(), cuda=cuda), topo)
    for state in states:
        state["torch"] = torch.tensor(state["torch"], dtype=torch.uint8)
        if state["cuda"] is not None:
            state["cuda"] = [torch.tensor(t, dtype=torch.uint8) for t in state["cuda"]]
    return states


def _pack_rank_state(job: Job) -> tuple[PackedState | None, str, str]:
    """``(packed, status, detail)`` of what this rank writes into its own file (its local state, and its part of
    the job when not replicated): status ``ok``, ``nonfinite`` (detail: the tensors) or ``failed`` (detail: the
    error); never raises, so that no rank is left waiting. The packed state refers to the job's tensors (written
    before the next step changes them), so saving costs no copy."""
    try:
        if job.replicated_state:
            state = job.local_state_dict()
        else:
            state = {"job": job.state_dict(), "local": job.local_state_dict()}
        nonfinite = nonfinite_tensors(state)
        if nonfinite:
            return None, "nonfinite", _shown(nonfinite)
        return PackedState(state), "ok", ""
    except Exception as err:  # reported on every rank by the caller
        return None, "failed", repr(err)


def _all_gather_json(value: Any, topo: Topology) -> list[Any]:
    """Every rank's small JSON ``value`` (a status, a file name, a hash), in rank order: never model state."""
    if not topo.is_distributed or topo.group is None:
        return [value]
    raw = all_gather_sized_bytes(json.dumps(value).encode(), topo.group, topo.device)
    return [json.loads(item) for item in raw]


def _check_packed(verdicts: list[dict[str, Any]], topo: Topology, refused: str) -> None:
    """Raise on every rank when a rank could not pack its state or holds non-finite values."""
    nonfinite = [r for r, v in enumerate(verdicts) if v["status"] == "nonfinite"]
    failed = [r for r, v in enumerate(verdicts) if v["status"] == "failed"]
    if nonfinite and not failed:
        detail = verdicts[nonfinite[0]]["detail"]
        raise NonFiniteStateError(
            f"the state of rank(s) {nonfinite} holds NaN or infinite values (rank {nonfinite[0]}: {detail}), "
            f"seen on rank {topo.rank}: {refused} {_DIVERGED_HINT}"
        )
    if failed:
        raise CheckpointError(
            f"rank(s) {failed} could not pack their state for the checkpoint (seen on rank {topo.rank}): "
            f"{verdicts[failed[0]]['detail']}. HINT: state must hold only tensors, None, bools, ints, floats, "
            "strings, lists, tuples and dicts."
        )


def _write_own_file(staging: str, payload: PackedState | None, topo: Topology) -> dict[str, Any]:
    """Write this rank's packed state into the shared staging directory and fsync it; its manifest entry,
    or ``{"error": ...}``."""
    try:
        assert payload is not None  # a rank without one raised in `_check_packed`
        return write_rank_file(Path(staging), topo.rank, payload)
    except Exception as err:  # reported on every rank by the caller
        where = "" if Path(staging).is_dir() else " (the staging directory is not there: not shared storage?)"
        return {"error": f"rank {topo.rank} could not write its file into {staging}: {err!r}{where}"}


# -- saving -----------------------------------------------------------------------------------------------------
class FitCheckpointer:
    """Writes the loop's checkpoints from rank 0 and makes every rank agree that the write succeeded."""

    def __init__(self, job: Job, loader, scheduler, directory: Path, keep: int, use_async: bool) -> None:
        self.job, self.loader, self.scheduler = job, loader, scheduler
        self.directory, self.keep, self.use_async = directory, keep, use_async
        self.topo: Topology = getattr(job, "checkpoint_topology", job.topology)
        """Whose collectives a save takes: the job's ranks, or one process for a healing job, whose members
        change between steps (`loom.parallel.data.data_parallel.DataParallelJob.writes_checkpoint` picks the writer)."""
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
        """Save the checkpoint of ``step`` as the module docstring says (who writes what); collective."""
        writes = getattr(self.job, "writes_checkpoint", None)
        if writes is not None and not writes():
            self.saved_step = step  # another member of the healing job writes it
            return
        rng = _gather_rng(self.topo)  # every rank takes part
        refused = self._refused(step)
        payload, status, detail = _pack_rank_state(self.job)
        staging, failure = "", ""
        if self.topo.is_main:
            try:
                wait_for_pending()  # the previous asynchronous save must be done before a new staging opens
                staging = str(open_staging(self.directory, step))
            except Exception as err:  # reported on every rank below
                failure = failure_text(err)
        verdicts = _all_gather_json({"status": status, "detail": detail, "staging": staging}, self.topo)
        staging = verdicts[0]["staging"]
        if not staging:
            raise CheckpointError(
                f"opening the checkpoint of step {step} in {self.directory} failed on rank 0 (seen on rank "
                f"{self.topo.rank}){f': {failure}' if failure else ''}. HINT: check that the directory is "
                "writable and has free space."
            )
        try:
            _check_packed(verdicts, self.topo, refused)
        except CheckpointError:
            if self.topo.is_main:
                abandon_staging(Path(staging))
            raise
        entries = _all_gather_json(_write_own_file(staging, payload, self.topo), self.topo)
        del payload
        failure, code = "", _WRITE_FAILED
        if self.topo.is_main:
            failure, code = self._publish(step, loop_state, rng, Path(staging), entries)
        self._agree(failure, f"saving the checkpoint of step {step}", code, refused)
        self.saved_step = step

    def _publish(
        self, step: int, loop_state: dict[str, Any], rng: list, staging: Path, entries: list[dict[str, Any]]
    ) -> tuple[str, int]:
        """Rank 0: the shared state (the replicated job, loader, scheduler, every RNG) and the manifest, once
        every rank's file is durable; ``(failure, code)`` for `_agree` (``""`` when it succeeded)."""
        errors = [entry["error"] for entry in entries if "error" in entry]
        job_state = self.job.state_dict() if self.job.replicated_state and not errors else None
        nonfinite = nonfinite_tensors(job_state) if job_state is not None else []
        if errors or nonfinite:
            abandon_staging(staging)
            if errors:
                return "; ".join(errors), _WRITE_FAILED
            return f"NaN or infinite values in {_shown(nonfinite)}", _NONFINITE
        fit_state = dict(
            loop_state,
            world_size=self.topo.world_size,
            local_states=True,
            sharded=not self.job.replicated_state,
            mesh=self.job.mesh.shape.describe(),
        )
        state = {
            "job": job_state,
            "loader": self.loader.state_dict(),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "rng": {"ranks": rng},
            "fit": fit_state,
        }
        try:
            if self.use_async:
                self.pending = publish_async(self.directory, staging, step, state, self.keep, entries)
            else:
                skeleton, tensors = flatten_state(state)
                encoded, tensor_bytes = encode_state(step, skeleton), safetensors.torch.save(tensors)
                publish(self.directory, staging, step, encoded, tensor_bytes, self.keep, entries)
        except Exception as err:  # reported on every rank by `_agree`
            abandon_staging(staging)
            return failure_text(err), _WRITE_FAILED
        return "", _WRITE_FAILED

    def _wait_pending(self) -> CheckpointError | None:
        """Let a pending asynchronous write finish; the error that stopped it, if any."""
        pending, self.pending = self.pending, None
        try:
            if pending is not None:
                pending.wait()
        except CheckpointError as err:
            return err
        return None

    def finish(self) -> None:
        error = self._wait_pending()
        self._agree("" if error is None else failure_text(error), "finishing the last checkpoint")

    def abandon(self) -> None:
        """After an error elsewhere: let a pending write finish, without collectives or masking that error."""
        error = self._wait_pending()
        if error is not None:
            warnings.warn(f"the last asynchronous checkpoint also failed: {error}", stacklevel=3)

    def _agree(self, failure: str, operation: str, code: int = _WRITE_FAILED, refused: str = "") -> None:
        flags = [row[0] for row in all_gather_ints([code if failure else 0], self.topo)]
        if _NONFINITE in flags:
            rank = flags.index(_NONFINITE)
            raise NonFiniteStateError(
                f"{operation}: rank {rank}'s state holds {failure or 'NaN or infinite values'} (seen on rank "
                f"{self.topo.rank}): {refused} {_DIVERGED_HINT}"
            )
        if any(flags) and not failure:
            failure = f"rank {next(r for r, f in enumerate(flags) if f)} failed"
        if failure:
            raise CheckpointError(
                f"{operation} in {self.directory} failed (seen on rank {self.topo.rank}): {failure}. "
                "HINT: check that the directory is writable and has free space."
            )
