"""What `LocalSGD` and `DiLoCo` share: replicas that step on their own and meet every few steps.

Each process keeps a whole model and takes *inner* steps on its share of each global batch with the user's
optimizer, synchronizing no gradient. `ReplicaJob` is that inner loop, written once: each step ends with one
small all-reduce (`ReplicaJob._reduce_step`), so that every rank returns the global-batch mean loss, skips a step
any rank flagged (`loom.fault.desync.NonFiniteGuard`) and counts the samples since each synchronization, by which
the replicas are averaged (``n_r / N``; why that makes ``sync_every=1`` exact: `loom.parallel.replica.local_sgd`);
then the strategy's `ReplicaJob._exchange` synchronizes when due.

A rank with an empty share runs no forward and no optimizer step (weight 0 at the next average). State is per
rank (the replicas differ between synchronizations): `loom.fit` writes every rank's part and skips its desync
check. Limits: docs/strategies/local-sgd-diloco.md#limits. Under ``--on-worker-failure heal`` the job runs over
the quorum's data axis (`loom.parallel.data.data_axis`), and `round_commit.RoundCommit`, called from the hooks
below, makes the sync round the unit of commit.
"""

from __future__ import annotations

import abc
import functools
import time
from collections.abc import Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from loom.devices import place_model
from loom.fault.quorum import Quorum
from loom.mesh import Mesh
from loom.observe.phases import COMM, DATA, FLAGS_AT, OPTIMIZER, StepObserver, loss_buffer_size
from loom.parallel._setup import LossFn, Strategy, check_setup_arguments, joins_healing, step_metrics
from loom.parallel.consistency import check_same_model
from loom.parallel.data.data_axis import (
    AxisJob,
    check_same_batches,
    healing_store,
    join_first_epoch,
    member_share,
    whole_batches,
)
from loom.parallel.pipeline.pipeline_stages import broadcast_module
from loom.parallel.replica.round_commit import RoundCommit, refuse_round_options
from loom.topology import Topology
from loom.train.batch import batch_len, to_device
from loom.train.engine import Engine, StepState
from loom.train.heal_state import all_reduce_sum

__all__ = [
    "ReplicaJob",
    "ReplicaStrategy",
    "flatten",
    "synced_tensors",
]

JobT = TypeVar("JobT", bound="ReplicaJob")


def synced_tensors(module: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The tensors replicas average: every parameter, and the floating-point buffers (BatchNorm's running
    statistics). Integer buffers (``num_batches_tracked``) stay each replica's own."""
    return list(module.parameters()), [b for b in module.buffers() if b.is_floating_point()]


def flatten(tensors: Sequence[torch.Tensor], scale: float = 1.0) -> torch.Tensor:
    """One new 1-D tensor of ``tensors`` times ``scale``, in their promoted dtype (one collective for all)."""
    dtype = functools.reduce(torch.promote_types, [t.dtype for t in tensors])
    flat = torch.cat([t.detach().reshape(-1).to(dtype) for t in tensors])
    return flat.mul_(scale) if scale != 1.0 else flat


class ReplicaStrategy(Strategy):
    """The setup both strategies share (their constructor is `loom.parallel._setup.Strategy`'s)."""

    def _setup(
        self, job_type: type[JobT], model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn
    ) -> JobT:
        """The setup both strategies share: check the arguments, place the model, refuse replicas that differ
        (model or optimizer, `loom.parallel.consistency`) and start every replica from rank 0's parameters and
        buffers (as DDP does). Under ``--on-worker-failure heal``: refuse what a round cannot honour; the job
        joins the quorum and takes a live member's state (`join_first_epoch`)."""
        topo = self._topology()
        strategy = self.config_type.__name__.removesuffix("Config")
        heal = joins_healing(topo.backend)
        check_setup_arguments(
            model, optimizer, loss_fn, strategy=strategy, conventions=True, heals=True, backend=topo.backend
        )
        if heal:
            refuse_round_options(self.config, strategy)
            store = healing_store()
        place_model(model, topo.device, optimizer, topo.rank)
        args = (model, optimizer, loss_fn, topo, self.config, self.metrics_path, self.observe)
        if heal:
            return join_first_epoch(job_type(*args, quorum=Quorum.from_env(store)))
        if topo.is_distributed:
            check_same_model(model, topo.rank, topo.world_size, topo.group, optimizer=optimizer)
            broadcast_module(model, topo.group)
        return job_type(*args)


class ReplicaJob(AxisJob):
    """Inner steps on this rank's share, one loss reduction per step; subclasses synchronize the replicas."""

    replicated_state = False
    replicas_agree = False
    observer: StepObserver  # always kept (off where the strategy does not observe)

    def __init__(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn, topology: Topology, config: Any,
        metrics_path: str | None = None, observe: bool = True, quorum: Quorum | None = None,
    ) -> None:  # fmt: skip
        """``config``: the strategy's config dataclass (the guard's options, `loom.train.guard.GuardOptions`,
        and its own); the strategy's state is set up by `_start`. ``quorum``: under heal, the data axis."""
        world, heal = topology.world_size, quorum is not None
        metrics = step_metrics(topology, metrics_path)
        # under heal the loader's view is one replica of whole global batches (`whole_batches`)
        mesh = Mesh(topology=whole_batches(topology)) if heal else Mesh(dp=world, topology=topology)
        super().__init__(module, optimizer, loss_fn, mesh, config, metrics, topology=topology, quorum=quorum)
        self.observer = StepObserver.for_process(self.metrics, world, enabled=observe and not heal)
        """Times each step's phases and counts its bytes (synchronizations included) into `metrics`; under heal
        off (the members change; a round's records are `RoundCommit.record`'s)."""
        self._join_axis(quorum)
        self.rounds = RoundCommit(config.sync_every) if heal else None
        """Under heal, the sync round as the unit of commit (`loom.parallel.replica.round_commit`)."""
        self.allreduce = "native" if heal and config.allreduce == "auto" else config.allreduce
        """The synchronization's all-reduce algorithm (under heal ``auto`` is gloo's over the epoch's group)."""
        self._start()

    # -- what a strategy adds ------------------------------------------------------------------------------------
    @abc.abstractmethod
    def _start(self) -> None:
        """Set up the strategy's own state (called once, at the end of ``__init__``)."""

    @abc.abstractmethod
    def _count_samples(self, local: int, total: int) -> None:
        """Note that this rank trained on ``local`` of the ``total`` samples of an applied step."""

    @abc.abstractmethod
    def _exchange(self) -> None:
        """Called on every rank after each step (``self.step`` already counts it): synchronize when due."""

    # -- the inner step: the engine's hooks (`loom.train.engine`) ----------------------------------------------
    def _prepare(self, state: StepState) -> None:
        self.observer.begin_step(state.number)
        batch = state.batch
        if self.quorum is not None:  # a global batch: this member's share by its index among the members
            batch, _, state.work["fingerprint"] = member_share(batch, self.axis, self.loss_call.inputs_of)
        state.work["batch"] = batch = to_device(batch, self.topology.device)
        state.local = batch_len(self.loss_call.inputs_of(batch))
        self.observer.lap(DATA)

    def _forward_backward(self, state: StepState) -> None:
        self._backward_share(state, self.config.accumulate, weight_of_total=False)
        self.observer.backward_done()

    def _synchronize(self, state: StepState) -> None:
        """One small all-reduce: the loss, every flag and the global count (the inner step of
        a replica averages no gradient: each replica steps on its own share)."""
        reduced = self._reduce_step(state)
        state.work["pending"] = bool(reduced[-1] > 0)
        state.total = int(reduced[-2].item())
        world = self.topology.world_size
        state.flags, state.ranks = reduced[FLAGS_AT : FLAGS_AT + world].tolist(), range(world)
        if self.quorum is not None:  # every member must be given the same global batch (as DataParallel's)
            prints = reduced[FLAGS_AT + world : FLAGS_AT + 2 * world].tolist()
            members = self.quorum.members
            check_same_batches(self.topology.rank, state.number, members, [prints[r] for r in members])
        state.loss = float(reduced[0].item()) / state.total if state.total else 0.0

    def _apply(self, state: StepState) -> None:
        if state.local:
            self.optimizer.step()
        assert state.total is not None
        self._count_samples(state.local, state.total)

    def _after_step(self, state: StepState) -> None:
        # before a replacement joins after a round (`writes_checkpoint`)
        self.trained_by = list(self.axis.members)
        self.observer.lap(OPTIMIZER)
        if self.rounds is None:
            self._exchange()
        else:
            self.rounds.end_step(self, state, self._exchange)
        self.observer.lap(COMM)

    def _record(self, state: StepState, **fields: Any) -> None:
        """The observer's record (the synchronization after the step counts as comm), or a healing round's."""
        if self.rounds is not None:
            self.rounds.record(self, state, **fields)
            return
        super()._record(state, **fields)

    def _reduce_step(self, state: StepState) -> torch.Tensor:
        """``[loss sum, flags, samples, a replacement waiting]`` summed over the data axis (one small all-reduce);
        under heal each rank's batch fingerprint after the flags, and the last slot set at a round's last step
        when a replacement is ready (`RoundCommit.joiner_ready`)."""
        world, rank = self.topology.world_size, self.topology.rank
        flags_end = loss_buffer_size(world)
        prints = world if self.rounds is not None else 0
        buffer = torch.zeros(flags_end + prints + 2, dtype=torch.float64, device=self.topology.device)
        buffer[0], buffer[FLAGS_AT + rank], buffer[-2] = state.loss_sum, state.flag, float(state.local)
        if self.rounds is not None:
            buffer[flags_end + rank] = state.work["fingerprint"]
            buffer[-1] = float(self.rounds.joiner_ready(self.quorum, state.number))
        self.observer.lap(COMM)
        if self.topology.is_distributed:
            group = self.axis.group if self.axis.group is not None else dist.group.WORLD
            assert group is not None  # (a distributed job without heal has its default group)
            with self.collective("loss and sample-count all-reduce"):
                launched = time.perf_counter()
                # the group's own call: torch's wrapper, given a group built on the quorum's store (not registered),
                # would replace a lost member's error with "not initialized in the world group map"
                all_reduce_sum(buffer, group)
                self.observer.collective("all_reduce loss", launched, time.perf_counter(), buffer.nbytes)
        self.observer.lap(COMM)
        return buffer

    # -- under heal: the round as the unit of commit (`loom.parallel.replica.round_commit`) ----------------------
    def train_step(self, batch: Any) -> float:
        if self.rounds is not None:  # kept for the replay of a dropped round
            self.rounds.batches.append(batch)
            self.rounds.batch_step = self.step + 1
        return super().train_step(batch)

    def _attempt(self, batch: Any) -> float:
        if self.rounds is None:
            return super()._attempt(batch)
        return self.rounds.attempt(self, batch, super()._attempt)

    def _commit(self, state: StepState) -> bool:
        return super()._commit(state) if self.rounds is None else self.rounds.commit(state)

    def _wait_for_joiner(self) -> None:
        """A replacement joins at a round boundary: wait for one only before the round's last step."""
        if self.rounds is not None and self.rounds.ends(self.step + 1):
            super()._wait_for_joiner()

    def _adopt_epoch(self) -> None:
        assert self.rounds is not None
        self.rounds.adopt_epoch(self, functools.partial(Engine._attempt, self))

    def _state_loaded(self) -> None:
        """After `load_state_dict`: under heal the loaded state is the round's start."""
        if self.rounds is not None:
            self.rounds.take_snapshot(self)
