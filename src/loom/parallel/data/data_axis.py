"""The data axis of the jobs that heal: who the members are, this process's place among them, their group.

Without healing the axis is the job's topology (`FixedAxis`). Under ``loom run --on-worker-failure heal`` it is
the quorum (`loom.fault.quorum.Quorum`: the current epoch's members, this process's index, and the epoch's gloo
group, replaced at every re-form), after torchft's Manager: the quorum replaces the group, the step is the
ordinary one, its gradients averaged after backward without DDP (`data_parallel_sync.AxisGradients`).

Exact accounting: a member's share depends on the members present, which the loader cannot know, so
`AxisJob.loader` hands out each global batch unloaded (`loom.data.loader.LazyBatch`) and at each attempt of a
step the job fetches only its index's share among the epoch's members (`member_share`). Each loss is weighted by
``n * size / N``, so a committed step is the gradient of the global-batch mean loss whatever the membership. A
dropped step applied nothing on any member and is retried on the same global batch by the next epoch. The data
position is the committed step: a replacement receives it with the model.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from loom.comm.compression import accept_compression
from loom.data import same_data
from loom.data.loader import LazyBatch, loader
from loom.data.sampler import share_bounds
from loom.errors import DifferentBatches, HealConflict, StartRefused, is_retryable
from loom.fault.inject import fault_point
from loom.topology import Topology, job_store
from loom.train.batch import batch_len, slice_batch
from loom.train.engine import Engine
from loom.train.heal_state import all_reduce_sum, share_training_state, source_of
from loom.train.heal_step import reform

__all__ = [
    "AxisJob",
    "DataAxis",
    "FixedAxis",
    "batch_fingerprint",
    "check_same_batches",
    "healing_store",
    "join_first_epoch",
    "member_share",
    "refuse_heal_options",
    "take_live_state",
    "whole_batches",
]

HEAL_ALGORITHMS = ("native", "ring", "driver")
"""The ``allreduce`` algorithms the axis's exchange runs under heal: those of `loom.comm.all_reduce` that take a
group built on a store (each epoch's). ``auto`` runs ``native`` there (gloo)."""
HEAL_CODECS = ("fp16", "bf16", "int8")
"""The codecs the axis's exchange applies under heal: the stateless ones."""
_STATEFUL = ("keeps error-feedback residuals on each member: a dropped attempt would leave its update in them, and a "
             "replacement starts without the lost member's")  # fmt: skip


class DataAxis(Protocol):
    """What DataParallel reads from its data axis (`FixedAxis`, or a `loom.fault.quorum.Quorum` under heal)."""

    @property
    def members(self) -> list[int]: ...
    @property
    def index(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def group(self) -> dist.ProcessGroup | None: ...


@dataclass(frozen=True)
class FixedAxis:
    """The axis without healing: every rank of the job, this process's rank, the topology's group."""

    index: int
    size: int
    members: list[int] = field(default_factory=list)
    group: dist.ProcessGroup | None = None

    @classmethod
    def of(cls, topology: Topology) -> FixedAxis:
        return cls(topology.rank, topology.world_size, list(range(topology.world_size)), topology.group)


def whole_batches(topology: Topology) -> Topology:
    """What a member under heal does alone, without collectives: load whole global batches (its loader's and its
    mesh's data topology: one replica), and write a checkpoint (`loom.fit` with one writer per checkpoint)."""
    return Topology(0, 1, topology.local_rank, topology.local_world_size, "none", topology.device_name,
                    topology.shared_gpu)  # fmt: skip


def batch_fingerprint(batch: Any) -> int:
    """1..251, equal on members given the same global batch: `loom.data.same_data.batch_fingerprint` (for a
    `LazyBatch` from its indices and the dataset's length, nothing loaded). Small enough to be exact in any
    gradient dtype (bfloat16 holds integers up to 256), so it rides in the step's exchange at no extra collective.
    A plain batch: the first 16 KiB of each tensor, on whatever device (the step's loss buffer syncs anyway)."""
    return same_data.batch_fingerprint(batch, 1 << 14, off_cpu=True) % 251 + 1


def member_share(batch: Any, axis: DataAxis, inputs_of: Any) -> tuple[Any, int, int]:
    """This member's share of the global ``batch`` by its index among the members, the global batch's size and
    its fingerprint (`batch_fingerprint`). A `LazyBatch` fetches the share's samples only; a whole batch (the
    user's own loader; ``inputs_of``: the job's `LossCall.inputs_of`, to count it) is sliced."""
    if isinstance(batch, LazyBatch):
        return batch.share(axis.index, axis.size), batch.global_size, batch_fingerprint(batch)
    known = getattr(batch, "global_size", None)
    total = batch_len(inputs_of(batch)) if known is None else int(known)
    return slice_batch(batch, *share_bounds(total, axis.index, axis.size)), total, batch_fingerprint(batch)


def check_same_batches(rank: int, step: int, members: list[int], prints: list[float]) -> None:
    """Raise `DifferentBatches` when the members' fingerprints differ (every member holds the same sums: the
    same verdict everywhere)."""
    if len(set(prints)) > 1:
        raise DifferentBatches(
            f"rank {rank}: step {step}: the members were given different global batches (members {members}, "
            f"batch fingerprints {[int(f) for f in prints]}). Under --on-worker-failure heal every member must "
            "be given the same global batch and the job cuts each one's share (by the members present): a "
            "loader sharded by rank (a DistributedSampler, a share cut by RANK) would train on a fraction of each "
            "batch, and a replacement's own DataLoader starts at its epoch's first batch, not at the job's "
            "committed step. HINT: iterate job.loader(dataset, global_batch_size=...), which every member, a "
            "replacement too, reads from the job's position"
        )


def refuse_under_heal(strategy: str, why: dict[str, str], more: str = "") -> None:
    """Refuse the options in ``why`` (``"name=value"``: the reason) at setup under heal, naming each."""
    if why:
        raise StartRefused(
            f"--on-worker-failure heal: {strategy} cannot honour "
            + "; ".join(f"{option} ({reason})" for option, reason in why.items())
            + f". HINT: drop {', '.join(o.partition('=')[0] + '=' for o in why)} under heal{more}"
        )


def heal_allreduce_refusal(config: Any) -> dict[str, str]:
    """``allreduce`` under heal: only the algorithms that take a group built on a store (`HEAL_ALGORITHMS`)."""
    if config.allreduce in ("auto", *HEAL_ALGORITHMS):
        return {}
    return {
        f"allreduce={config.allreduce!r}": "the shared-memory algorithms map a segment per group and every "
        f"membership epoch has a new group (a healing job runs {', '.join(HEAL_ALGORITHMS)})"
    }


def refuse_heal_options(config: Any) -> None:
    """The options of DataParallel that the axis's exchange cannot honour under heal, refused by name with why."""
    why = heal_allreduce_refusal(config)
    if config.overlap:
        why["overlap=True"] = (
            "the exchange runs after backward: one buffer holds every gradient and the step's marks"
        )
    if config.bucket_cap_mb != 25.0:
        why[f"bucket_cap_mb={config.bucket_cap_mb}"] = "there are no buckets: one flat buffer per step"
    try:
        accept_compression(config.compression, "the data axis under heal", HEAL_CODECS,
                           {"topk": _STATEFUL, "powersgd": _STATEFUL})  # fmt: skip
    except ValueError as error:
        why[f"compression={config.compression!r}"] = str(error)
    refuse_under_heal("DataParallel", why)


def healing_store() -> Any:
    """The launcher's store (joined by `loom.init`), which the quorum and each epoch's group are built on."""
    store = job_store()
    if store is None:
        raise RuntimeError("--on-worker-failure heal needs loom.init() under loom run (the launcher's store)")
    return store


def take_live_state(job: AxisJob) -> None:
    """Make a new epoch's members equal: every member's committed step (all-reduced), then the training state of
    the first member holding the highest, broadcast (`share_training_state`, and the job's ``_share_more``): a
    member behind it, or without state yet (a replacement, every member at the first epoch), loads it."""
    quorum, group = job.quorum, job.quorum.group
    assert group is not None
    steps = torch.zeros(quorum.size, dtype=torch.int64)
    steps[quorum.index] = job.step if job._synced else -1
    all_reduce_sum(steps, group)
    listed = steps.tolist()
    trained = [s for s in listed if s >= 0]
    if trained and max(trained) - min(trained) > 1:
        # members that trained committed the same steps (one verdict per step); one may be a step behind (it
        # failed after the vote committed a step, before applying it), never more (a joiner claims -1)
        described = ", ".join(f"rank {r}: {s}" for r, s in zip(quorum.members, listed, strict=True) if s >= 0)
        raise HealConflict(
            f"rank {job.topology.rank}: the members of epoch {quorum.epoch} claim committed steps more than one "
            f"apart ({described}); members that trained all committed the same steps, one step in flight at "
            "most, so one of them is wrong (a process that loaded other state, or a lying worker): no state is "
            "copied and the job stops"
        )
    source = source_of(listed)
    load = not job._synced or listed[quorum.index] < listed[source]
    replacement = listed[source] >= 0 and -1 in listed
    step = share_training_state(
        job.module, job.optimizer, job.step, source, quorum.index, group, load, replacement
    )
    job._share_more(source, load)
    if load:
        job.step = step
        job.joined_running = job.joined_running or replacement
    job._synced = True
    print(f"loom: rank {job.topology.rank}: epoch {quorum.epoch} members {quorum.members} at step {job.step}"
          f"{' (state received from rank ' + str(quorum.members[source]) + ')' if load else ''}",
          file=sys.stderr, flush=True)  # fmt: skip


HealingT = TypeVar("HealingT", bound="AxisJob")


def join_first_epoch(job: HealingT) -> HealingT:
    """Join the quorum (a first start and a replacement alike) and take the state of a live member. The quorum
    publishes this member's place among the collectives the guard's watchdog counts (`Quorum.count_with`), so
    that a collective that times out names who did not arrive."""
    quorum = job.guard.quorum
    assert quorum is not None
    quorum.count_with(job.guard.watchdog)
    fault_point(1, "join")
    try:
        quorum.join()  # listed in an epoch, then `EpochNotFormed` (a member lost as it formed): check in again
        job._adopt_epoch()
    except Exception as error:
        if not is_retryable(error) or quorum.epoch == 0:  # (HealConflict, HealStateRefused; never listed)
            raise
        print(f"loom: rank {job.topology.rank}: first epoch failed while forming ({error}); re-forming",
              file=sys.stderr, flush=True)  # fmt: skip
        reform(job, quorum)
    return job


class AxisJob(Engine):
    """What the jobs whose data axis heals share (`DataParallelJob`, the replica job): the axis, the loader and
    who writes the checkpoint, with or without the quorum."""

    def _join_axis(self, quorum: Any) -> None:
        """Set the data axis: the topology's, or under heal the ``quorum``'s (called in ``__init__``)."""
        self.quorum = quorum
        """Under ``--on-worker-failure heal``: the membership (`loom.fault.quorum`), which is then the data axis."""
        self.axis: DataAxis = quorum if quorum is not None else FixedAxis.of(self.topology)
        """Who trains each global batch and the group they meet in (the topology, or the quorum)."""
        self.trained_by: list[int] = []
        """The ranks of the members that trained the last committed step (each on its share)."""
        self.joined_running = False
        """Under heal: this process is a replacement that took a live member's state (`loom.fit` then resumes no
        checkpoint: the state it holds is newer)."""
        self._synced = False

    def loader(self, dataset: Any, global_batch_size: int, shuffle: bool = True, seed: int = 0,
               drop_last: bool = False, **options: Any) -> Any:  # fmt: skip
        """`loom.job.Job.loader`; under heal, unloaded global batches (`LazyBatch`: each member fetches its
        epoch's share at the step) from the job's data position, the global batch after the last committed step."""
        if self.quorum is None:
            return super().loader(dataset, global_batch_size, shuffle, seed, drop_last, **options)
        options.setdefault("same_data_check", False)
        shards = loader(
            dataset, global_batch_size, shuffle, seed, drop_last, topology=self.data_topology, **options
        )
        shards.lazy = True
        per_epoch = len(shards)
        if self.step and per_epoch:
            epoch, step = divmod(self.step, per_epoch)
            consumed = min(step * global_batch_size, shards.sampler.epoch_samples())
            shards.load_state_dict({**shards.state_dict(), "epoch": epoch, "consumed": consumed})
        return shards

    @property
    def checkpoint_topology(self) -> Topology:
        """Whose collectives `loom.fit`'s save takes: the job's; under heal one member's, without collectives (the
        members change between steps and every member holds the same state at a commit)."""
        return self.topology if self.quorum is None else whole_batches(self.topology)

    def writes_checkpoint(self) -> bool:
        """Whether this process takes part in writing the checkpoint of the step just committed: always, but under
        heal only the first member that trained it, the same answer on every member (if it dies before publishing
        it, the previous checkpoint stays the newest)."""
        return self.quorum is None or (self.trained_by or self.quorum.members)[0] == self.topology.rank

    def _share_more(self, source: int, load: bool) -> None:
        """Broadcast member ``source``'s state beyond the model and optimizer (DiLoCo's outer state)."""
