"""DataParallel under ``loom run --on-worker-failure heal``: a lost worker is replaced while the others go on.

Why a job of its own and not DDP: DDP's reducer is bound to one process group for its life, and the default
WORLD group cannot shrink, while healing changes the members at any step. So here gradients are averaged with
loom's own collective over the current membership epoch's gloo group (`loom.fault.quorum`), one flat buffer
per step; the rest of the step (micro-batches, weighting, the non-finite verdict, the records) is the engine's,
and the commit vote is the engine's guard's (`loom.train.engine`).

Exact accounting: every process loads the whole global batch (`loader` cuts nothing: a rank's share depends on
the members present, which the loader cannot know), and at each attempt the job takes the share of its place
among the epoch's members (`loom.data.sampler.share_bounds` over (member index, members)). Each member's
loss is weighted by its samples over the global batch and the weighted gradients are summed, so a committed step
is the gradient of the global-batch mean loss whatever the membership: the job equals one process on the same
global batches. A step that is dropped (an error or a lost member anywhere) applied nothing on any member and is
retried on the same global batch by the next epoch's members. The data position is the committed step (the
index of the next global batch): a replacement receives it with the model and starts its loader there.

Phases of the injected faults (`loom.fault.inject`): ``before`` and ``after``/``commit`` are the engine's; the
exchange calls ``during`` between its two halves (the gradient buffer is all-reduced in two pieces, so a kill
there lands with half the exchange done).

Limits: every process holds the whole global batch in memory (it is loaded, not trained on, by all);
gradient compression, the ring/shared-memory algorithms and bucketing do not apply (refused at setup).
"""

from __future__ import annotations

import math
import os
import sys
import zlib
from typing import Any, TypeVar

import torch
import torch.utils._pytree
from torch import nn

from loom.data.sampler import share_bounds
from loom.devices import place_model
from loom.errors import DifferentBatches, HealConflict, is_retryable
from loom.fault.desync import gradients_finite
from loom.fault.inject import fault_point
from loom.fault.quorum import Quorum
from loom.job import load_replicated_state, replicated_state
from loom.mesh import Mesh
from loom.observe.metrics import StepMetrics
from loom.topology import Topology
from loom.train.batch import LossCall, batch_len, slice_batch, to_device
from loom.train.engine import Engine, StepState
from loom.train.guard import GuardOptions, StepGuard
from loom.train.heal_state import all_reduce_sum, share_training_state, source_of

__all__ = [
    "HealConflict",
    "HealingJob",
    "healing_metrics_path",
    "healing_store",
    "join_first_epoch",
    "refuse_heal_options",
]

_ALONE = Topology(0, 1, 0, 1, "none")
HealingJobT = TypeVar("HealingJobT", bound="HealingJob")


def batch_fingerprint(batch: Any) -> int:
    """1..251 from the shapes and first 4 KiB of each tensor of ``batch``: equal on members given the same batch;
    a rank-sharded loader's batches differ from the first sample. Small enough to be exact in any gradient dtype
    (bfloat16 holds integers up to 256), so it rides in the step's all-reduce at no extra collective."""
    crc = 0
    for leaf in torch.utils._pytree.tree_leaves(batch):
        if isinstance(leaf, torch.Tensor):
            head = leaf.detach().reshape(-1)[:4096].cpu().contiguous()
            crc = zlib.crc32(str((tuple(leaf.shape), str(leaf.dtype))).encode(), crc)
            crc = zlib.crc32(head.view(torch.uint8).numpy().tobytes(), crc)
    return crc % 251 + 1


def healing_metrics_path() -> str | None:
    """``RUN_DIR/metrics/rank<r>.jsonl``, and ``rank<r>.heal<g>.jsonl`` for a rank's g-th replacement."""
    run_dir, rank = os.environ.get("LOOM_RUN_DIR"), os.environ.get("RANK", "0")
    gen = int(os.environ.get("LOOM_HEAL_GENERATION", "0") or 0)
    return f"{run_dir}/metrics/rank{rank}{f'.heal{gen}' if gen else ''}.jsonl" if run_dir else None


def refuse_heal_options(config: Any) -> None:
    """Options of DataParallel that the healing path cannot honour, refused by name."""
    given = {name: getattr(config, name) for name, default in (("compression", None), ("zero", 0),
             ("allreduce", "auto")) if getattr(config, name, default) != default}  # fmt: skip
    if given:
        raise ValueError(
            f"--on-worker-failure heal averages gradients with gloo over each membership epoch's group, without "
            f"compression, ZeRO or loom's own all-reduce algorithms; got {given}. HINT: drop "
            f"{', '.join(f'{k}=' for k in given)} under heal"
        )


class HealingJob(Engine):
    """A data-parallel job whose members may change between steps (see the module docstring)."""

    replicated_state = True

    def __init__(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, loss_call: LossCall, topology: Topology,
        options: GuardOptions, accumulate: int, quorum: Quorum,
    ) -> None:  # fmt: skip
        self.module = self.wrapped = module
        self.optimizer = optimizer
        self.loss_call = loss_call
        self.loss_fn = loss_call.fn
        self.topology = topology
        self.mesh = Mesh(dp=1, topology=_ALONE)  # the data axis is cut per epoch, not by the loader
        self.config = options
        self.accumulate = accumulate
        self.metrics = StepMetrics(topology.rank, healing_metrics_path())
        self.step = 0
        self.guard = StepGuard.start(_ALONE, options)
        self.guard.quorum = quorum
        self.quorum = quorum
        self.last_step_skipped = False
        self.trained_by: list[int] = []
        """The ranks of the members that trained the last committed step (each on its share)."""
        self._synced = False
        self.joined_running = False
        """This process is a replacement that took a live member's state (`loom.fit` then resumes no checkpoint:
        the state it holds is newer)."""
        self._trainable = [p for p in module.parameters() if p.requires_grad]

    # -- membership ---------------------------------------------------------------------------------------------
    def _adopt_epoch(self) -> None:
        """Make the new epoch's members equal: every member's committed step, then the state from the first
        member holding the highest (`loom.train.heal_state`); a member behind it loads it."""
        self._take_live_state()

    def _take_live_state(self) -> None:
        """The members' committed steps (all-reduced), then the training state of the first member holding the
        highest, broadcast (`share_training_state`, and `_share_more`): a member behind it, or without state yet
        (a replacement, every member at the first epoch), loads it."""
        quorum, group = self.quorum, self.quorum.group
        assert group is not None
        steps = torch.zeros(quorum.size, dtype=torch.int64)
        steps[quorum.index] = self.step if self._synced else -1
        all_reduce_sum(steps, group)
        listed = steps.tolist()
        trained = [s for s in listed if s >= 0]
        if trained and max(trained) - min(trained) > 1:
            # members that trained committed the same steps (one verdict per step); one may be a step behind
            # (it failed after the vote committed a step, before applying it), never more (a joiner claims -1)
            described = ", ".join(
                f"rank {r}: {s}" for r, s in zip(quorum.members, listed, strict=True) if s >= 0
            )
            raise HealConflict(
                f"rank {self.topology.rank}: the members of epoch {quorum.epoch} claim committed steps more than "
                f"one apart ({described}); members that trained all committed the same steps, one step in flight "
                "at most, so one of them is wrong (a process that loaded other state, or a lying worker): no "
                "state is copied and the job stops"
            )
        source = source_of(listed)
        load = not self._synced or listed[quorum.index] < listed[source]
        replacement = listed[source] >= 0 and -1 in listed
        step = share_training_state(
            self.module, self.optimizer, self.step, source, quorum.index, group, load, replacement
        )
        self._share_more(source, load)
        if load:
            self.step = step
            self.joined_running = self.joined_running or replacement
        self._synced = True
        print(f"loom: rank {self.topology.rank}: epoch {quorum.epoch} members {quorum.members} at step {self.step}"
              f"{' (state received from rank ' + str(quorum.members[source]) + ')' if load else ''}",
              file=sys.stderr, flush=True)  # fmt: skip

    def _share_more(self, source: int, load: bool) -> None:
        """Broadcast member ``source``'s state beyond the model and optimizer (none here; DiLoCo's outer
        state); ``load``: this member takes it."""

    def loader(self, dataset: Any, global_batch_size: int, shuffle: bool = True, seed: int = 0,
               drop_last: bool = False, **options: Any) -> Any:  # fmt: skip
        """Whole global batches (every member loads each, and takes its epoch's share at the step), from the
        job's data position: a replacement starts at the global batch after the last committed step."""
        from loom.data.loader import loader as make_loader

        options.setdefault("same_data_check", False)
        shards = make_loader(dataset, global_batch_size, shuffle, seed, drop_last, topology=_ALONE, **options)
        per_epoch = len(shards)
        if self.step and per_epoch:
            state = shards.state_dict()
            state["epoch"] = self.step // per_epoch
            state["consumed"] = min(
                (self.step % per_epoch) * global_batch_size, shards.sampler.epoch_samples()
            )
            shards.load_state_dict(state)
        return shards

    def own_loop(self, loader: Any = None) -> Any:
        raise ValueError(
            f"rank {self.topology.rank}: job.own_loop() under --on-worker-failure heal: a step of your own loop "
            "cannot be dropped and retried on every member. HINT: train with job.train_step(batch), or use "
            "--on-worker-failure stop with --max-restarts N"
        )

    # -- the engine's hooks -------------------------------------------------------------------------------------
    def _prepare(self, state: StepState) -> None:
        whole = to_device(state.batch, self.topology.device)
        total = getattr(state.batch, "global_size", None)
        total = int(total) if total is not None else batch_len(self.loss_call.inputs_of(whole))
        lo, hi = share_bounds(total, self.quorum.index, self.quorum.size)
        state.total, state.local = total, hi - lo
        state.work["batch"] = slice_batch(whole, lo, hi)
        state.work["fingerprint"] = batch_fingerprint(whole)

    def _forward_backward(self, state: StepState) -> None:
        self._backward_share(state, self.accumulate, weight_of_total=True)

    def _synchronize(self, state: StepState) -> None:
        """One flat buffer: every gradient (weighted by its share already), then the loss sum, one flag per
        member and the "replacement waiting" mark, all-reduced (summed) over the epoch's group in two halves."""
        quorum, group = self.quorum, self.quorum.group
        assert group is not None
        grads = [
            p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel()) for p in self._trainable
        ]
        n = sum(g.numel() for g in grads)
        tail = torch.zeros(2 + 2 * quorum.size, dtype=grads[0].dtype if grads else torch.float32)
        tail[0] = state.loss_sum
        tail[2 + quorum.index] = state.flag
        tail[2 + quorum.size + quorum.index] = state.work["fingerprint"]
        tail[1] = 1.0 if quorum.join_pending() else 0.0
        flat = torch.cat([*grads, tail])
        half = n // 2
        if half:  # (a model with one gradient value has no first half)
            with self.guard.collective("gradient all-reduce (first half)"):
                all_reduce_sum(flat[:half], group)
        fault_point(state.number, "during")
        with self.guard.collective("gradient all-reduce (second half)"):
            all_reduce_sum(flat[half:], group)
        offset = 0
        for p in self._trainable:
            piece = flat[offset : offset + p.numel()].view_as(p)
            p.grad = piece.clone() if p.grad is None else p.grad.copy_(piece)
            offset += p.numel()
        loss_sum, state.work["pending"] = float(flat[n]), float(flat[n + 1]) > 0
        state.flags, state.ranks = flat[n + 2 : n + 2 + quorum.size].tolist(), list(quorum.members)
        prints = flat[n + 2 + quorum.size :].tolist()
        if len(set(prints)) > 1:  # the same verdict on every member: each holds the same sums
            raise DifferentBatches(
                f"rank {self.topology.rank}: step {state.number}: the members were given different global batches "
                f"(members {quorum.members}, batch fingerprints {[int(f) for f in prints]}). Under "
                "--on-worker-failure heal every member must load the same whole global batch and the job cuts "
                "each one's share (by the members present): a loader sharded by rank (a DistributedSampler, a "
                "share cut by RANK) would train on a fraction of each batch, and a replacement's own DataLoader "
                "starts at its epoch's first batch, not at the job's committed step. HINT: iterate "
                "job.loader(dataset, global_batch_size=...), which every member, a replacement too, reads from "
                "the job's position"
            )
        assert state.total
        state.loss = loss_sum / state.total
        state.gradient_finite = math.isfinite(loss_sum) and gradients_finite(
            [p.grad for p in self._trainable]
        )

    def _after_step(self, state: StepState) -> None:
        """A replacement is ready: re-form now, at the step boundary every member has reached."""
        self.trained_by = list(state.ranks)
        if state.work.get("pending"):
            self._heal_reform()

    # -- checkpoints (`loom.fit`) ---------------------------------------------------------------------------------
    checkpoint_topology = _ALONE
    """A checkpoint is written by one member without collectives (the default group is a group of one under
    heal, and the members change between steps); every member holds the same replicated state."""

    def writes_checkpoint(self) -> bool:
        """Whether this member writes the checkpoint of the step just committed: the first member of the epoch
        that committed it (every member computes the same answer from the same membership, so each checkpoint
        has one writer; a checkpoint whose writer dies before publishing it is not written, and the previous one
        stays the newest)."""
        return (self.trained_by or self.quorum.members)[0] == self.topology.rank

    # -- state --------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return replicated_state(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_replicated_state(self, state)


def healing_store() -> Any:
    """The launcher's store, which the quorum and each epoch's group are built on."""
    from loom.topology import job_store  # the launcher's store, joined by loom.init()

    store = job_store()
    if store is None:
        raise RuntimeError("--on-worker-failure heal needs loom.init() under loom run (the launcher's store)")
    return store


def start_healing(
    model: nn.Module, optimizer: torch.optim.Optimizer, call: LossCall, topology: Topology, config: Any
) -> HealingJob:
    """`DataParallel.setup` under ``--on-worker-failure heal``: join the quorum (a first start and a replacement
    alike) and take the state of a live member, then return the job."""
    refuse_heal_options(config)
    store = healing_store()
    place_model(model, topology.device, optimizer, topology.rank)
    quorum = Quorum.from_env(store)
    return join_first_epoch(HealingJob(model, optimizer, call, topology, config, config.accumulate, quorum))


def join_first_epoch(job: HealingJobT) -> HealingJobT:
    """Join the quorum (a first start and a replacement alike) and take the state of a live member."""
    fault_point(1, "join")
    job.quorum.join()
    try:
        job._adopt_epoch()
    except Exception as error:
        if not is_retryable(error):  # (HealConflict, HealStateRefused)
            raise
        print(f"loom: rank {job.topology.rank}: first epoch failed while forming ({error}); re-forming",
              file=sys.stderr, flush=True)  # fmt: skip
        job._heal_reform()
    return job
