"""LocalSGD and DiLoCo under ``loom run --on-worker-failure heal``: the unit of commit is the sync round.

A round is the ``H = sync_every`` inner steps between two synchronizations, and the synchronization that ends it
(LocalSGD: the weighted average of the replicas; DiLoCo: the outer step on the averaged pseudo-gradient). Between
two synchronizations the replicas differ, so a single inner step cannot be committed on its own: a member lost
mid-round takes its drift with it, and the others' drift, averaged without its part, is not what any membership
would have trained. So a failure anywhere in a round (a member's death met at one of the round's collectives,
an error on a member, a drop vote) makes every member drop the whole round: each restores the state it held at
the round's start (the snapshot taken when the previous round committed: model, optimizer, step, RNG, and
DiLoCo's global copy and outer optimizer), the members re-form (`loom.fault.quorum`), make themselves equal
(`loom.train.heal_state`: a replacement takes a live member's round-start state), and redo the round's global
batches, each divided among the members present. Hence the job equals a one-process simulation of the strategy
with the same membership per round, whatever the failures (tested to 1e-5).

Built on `loom.parallel.data.data_parallel.DataParallelJob` over the quorum's data axis (`loom.parallel.data.data_axis`:
the loader of whole global batches, the share of each batch by member index, joining and the state transfer) with
the engine's hooks; what differs:

- **The vote.** The engine's per-step vote becomes a round's (`_commit` lets inner steps through); the round's
  vote is taken after the synchronization, in `_after_step` of the round's last step, so the synchronization
  itself is inside what is committed. Every inner step still all-reduces ``[loss sum, pending mark, one flag per
  member]`` over the epoch's group, so `train_step` returns the global-batch mean loss and the non-finite
  verdict is the same on every member, as without healing.
- **The replay.** The job keeps the round's global batches (the cost: up to ``H`` whole global batches in
  memory on every member, on top of the snapshot, a second copy of the model and optimizer state). The engine
  retries the `train_step` call that met the failure; before, `_adopt_epoch` replays the round's earlier
  batches from the snapshot. So the caller sees: the call that met the failure returns its own step's loss, the
  round's earlier inner steps being redone inside it; the losses earlier calls of a dropped round returned were
  of attempts that were dropped. Step records are written once per committed step, when its round commits
  (those of the round's inner steps wait until then), with the committed shares and losses.
- **Joining.** A replacement joins at a round boundary: the members see its ``pending`` mark on the last step's
  all-reduce and re-form once the round has committed, or it joins the epoch that re-forms after a failure, at
  the dropped round's start. It takes the round-start state of a live member. Under LocalSGD with a momentum
  optimizer the lost replica's own optimizer state (its momentum) is gone: the replacement takes a live peer's.

Member failures at the collectives of members at different inner steps (one raised after a step's all-reduce,
the others met it at the next step's) need nothing more: each restores the snapshot and replays up to the batch
its own `train_step` holds, and the replays issue the same collectives, in the same order, as the attempts of
the member behind.

Limits: one host (the launcher's quorum, `loom.launch.heal`); gloo over each epoch's group, so LocalSGD's
``allreduce`` algorithms and DiLoCo's ``fragments``, ``overlap_steps`` and ``compression`` are refused under heal
(`refuse_round_options`); `synchronize` between round boundaries is refused (end on a multiple of
``sync_every``); `own_loop` is refused as for DataParallel.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from loom.devices import place_model
from loom.fault.inject import fault_point
from loom.fault.quorum import Quorum, StepDropped
from loom.job import replicated_state
from loom.mesh import Mesh
from loom.observe.metrics import StepMetrics
from loom.observe.phases import StepObserver
from loom.parallel._setup import HEALS, StartRefused, check_setup_arguments
from loom.parallel.data.data_axis import (
    healing_metrics_path,
    healing_store,
    join_first_epoch,
    take_live_state,
    whole_batches,
)
from loom.parallel.data.data_parallel import DataParallelJob
from loom.parallel.replica._replica_sync import flatten, synced_tensors, unflatten_into
from loom.topology import Topology, current
from loom.train.engine import Engine, StepState
from loom.train.heal_state import all_reduce_sum, share_training_state

__all__ = ["HealingRounds", "refuse_round_options", "start_healing_rounds"]


def refuse_round_options(config: Any, strategy: str) -> None:
    """The options of LocalSGD and DiLoCo that a healing round cannot honour, refused by name."""
    given = {}
    if getattr(config, "allreduce", "auto") not in ("auto", "native"):
        given["allreduce"] = config.allreduce
    if strategy == "DiLoCo":
        if config.fragments != 1:
            given["fragments"] = config.fragments
        if config.overlap != 0:
            given["overlap_steps"] = config.overlap
        if config.compression is not None:
            given["compression"] = config.compression
    if given:
        raise StartRefused(
            f"--on-worker-failure heal: {strategy} heals with one synchronization of the whole model per round, "
            f"all-reduced with gloo over each membership epoch's group, without overlap or compression"
            f"; got {given}. HINT: drop "
            f"{', '.join(f'{k}=' for k in given)} under heal (the strategies that heal: {HEALS})"
        )


@dataclass
class _Snapshot:
    """A member's state at the start of a round (when the previous one committed)."""

    step: int
    tensors: list[torch.Tensor]
    optimizer: dict[str, Any]
    rng: torch.Tensor
    outer: list[torch.Tensor] = field(default_factory=list)
    outer_optimizer: dict[str, Any] | None = None


def _holder(tensors: list[torch.Tensor]) -> nn.Module:
    """A module whose buffers are ``tensors`` themselves, so that `share_training_state` broadcasts them."""
    module = nn.Module()
    for i, tensor in enumerate(tensors):
        module.register_buffer(f"t{i}", tensor)
    return module


class HealingRounds(DataParallelJob):
    """A LocalSGD or DiLoCo job whose members may change between rounds (see the module docstring)."""

    replicated_state = False
    replicas_agree = False
    memory_every = 0  # a sampled step's memory annotates the last record; records of inner steps wait

    def __init__(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, loss_call: Any, topology: Topology,
        config: Any, quorum: Quorum, outer_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None,
    ) -> None:  # fmt: skip
        metrics = StepMetrics(topology.rank, healing_metrics_path())
        mesh = Mesh(dp=1, topology=whole_batches(topology))  # the loader's view: whole global batches
        super().__init__(
            module, module, optimizer, loss_call, mesh, config, metrics, quorum=quorum, topology=topology
        )
        self.observer = StepObserver(metrics, enabled=False)  # a round's records are its own (`_record`)
        self.quorum: Quorum = quorum
        self.accumulate: int = config.accumulate
        self.sync_every: int = config.sync_every
        self.global_params: list[torch.Tensor] = []
        """DiLoCo's global copy (what the outer optimizer steps; the same on every member)."""
        self.outer_optimizer: torch.optim.Optimizer | None = None
        if outer_optimizer is not None:
            self.global_params = [p.detach().clone() for p in module.parameters()]
            self.outer_optimizer = outer_optimizer(self.global_params)
        self.averages = 0
        """Rounds committed by this job object (a counter for tests and reports)."""
        self._round: list[Any] = []
        """The round's global batches so far, the one being trained last."""
        self._held_records: list[tuple[Any, ...]] = []
        self._snapshot: _Snapshot | None = None
        self._samples = self._global_samples = 0
        self._batch_step, self._batch_loss = 0, 0.0
        self._join_after = False
        """The round committed while a replacement was ready: re-form after the round's last step."""

    def _round_ends(self, step: int) -> bool:
        return step % self.sync_every == 0

    def _wait_for_joiner(self) -> None:
        """A replacement joins at a round boundary: wait for one only before the round's last step."""
        if self._round_ends(self.step + 1):
            super()._wait_for_joiner()

    # -- the step: a round's batches kept, a failure replays them -------------------------------------------------
    def train_step(self, batch: Any) -> float:
        """One inner step on ``batch`` (the whole global batch; this member trains its share); the step that ends
        a round also synchronizes and commits the round. Returns the global-batch mean loss of this step."""
        self._round.append(batch)
        self._batch_step = self.step + 1
        return super().train_step(batch)

    def _attempt(self, batch: Any) -> float:
        if self.step >= self._batch_step:  # committed, then an error after the vote: nothing to redo
            return self._batch_loss
        self._batch_loss = super()._attempt(batch)
        if self._round_ends(self.step):  # committed and recorded: now a fault, or a replacement, may come in
            fault_point(self.step, "commit")
            if self._join_after:
                self._join_after = False
                self._heal_reform()
        return self._batch_loss

    def _adopt_epoch(self) -> None:
        """Back to the round's start, equal to a live member's round-start state, then the round's earlier
        batches again, divided among the new members (the engine then retries the batch being trained)."""
        self._join_after = False  # whoever was ready joins this epoch
        if self._snapshot is not None:
            self._restore()
        take_live_state(self)
        self._take_snapshot()
        for batch in self._round[:-1]:
            Engine._attempt(self, batch)

    def _share_more(self, source: int, load: bool) -> None:
        """DiLoCo: the global copy and the outer optimizer's state travel with the model."""
        if self.outer_optimizer is not None:
            group = self.quorum.group
            assert group is not None
            holder = _holder(self.global_params)
            share_training_state(
                holder, self.outer_optimizer, self.step, source, self.quorum.index, group, load
            )

    def _take_snapshot(self) -> None:
        module = self.module
        self._snapshot = _Snapshot(
            self.step,
            [t.detach().clone() for t in (*module.parameters(), *module.buffers())],
            copy.deepcopy(self.optimizer.state_dict()),
            torch.get_rng_state(),
            [g.clone() for g in self.global_params],
            copy.deepcopy(self.outer_optimizer.state_dict()) if self.outer_optimizer is not None else None,
        )
        self._samples = self._global_samples = 0
        self._held_records.clear()

    def _restore(self) -> None:
        snap = self._snapshot
        assert snap is not None
        module = self.module
        with torch.no_grad():
            for tensor, saved in zip((*module.parameters(), *module.buffers()), snap.tensors, strict=True):
                tensor.copy_(saved)
            for g, saved in zip(self.global_params, snap.outer, strict=True):
                g.copy_(saved)
        # copies: load_state_dict may keep the tensors it is given, which the next steps change in place
        self.optimizer.load_state_dict(copy.deepcopy(snap.optimizer))
        if self.outer_optimizer is not None and snap.outer_optimizer is not None:
            self.outer_optimizer.load_state_dict(copy.deepcopy(snap.outer_optimizer))
        torch.set_rng_state(snap.rng)
        self.step = snap.step
        self._samples = self._global_samples = 0
        self._held_records.clear()

    # -- the engine's hooks ---------------------------------------------------------------------------------------
    def _forward_backward(self, state: StepState) -> None:
        self._backward_share(state, self.accumulate, weight_of_total=False)

    def _synchronize(self, state: StepState) -> None:
        """``[loss sum, pending mark, one flag per member]`` summed over the epoch's group: no gradient (each
        member steps on its own share); the pending mark is read on a round's last step only."""
        quorum, group = self.quorum, self.quorum.group
        assert group is not None and state.total
        buffer = torch.zeros(2 + quorum.size, dtype=torch.float64)
        buffer[0] = state.loss_sum
        buffer[1] = 1.0 if self._round_ends(state.number) and quorum.join_pending() else 0.0
        buffer[2 + quorum.index] = state.flag
        with self.collective("loss all-reduce"):
            all_reduce_sum(buffer, group)
        state.loss = float(buffer[0]) / state.total
        state.work["pending"] = float(buffer[1]) > 0
        state.flags, state.ranks = buffer[2:].tolist(), list(quorum.members)

    def _commit(self, state: StepState) -> bool:
        """Inner steps go through: the round's vote follows its synchronization (`_end_round`)."""
        if not self._round_ends(state.number):
            fault_point(state.number, "after")
        return True

    def _apply(self, state: StepState) -> None:
        if state.local:
            self.optimizer.step()
        assert state.total is not None
        self._samples += state.local
        self._global_samples += state.total

    def _after_step(self, state: StepState) -> None:
        if self._round_ends(state.number):
            self._end_round(state)

    def _end_round(self, state: StepState) -> None:
        """Synchronize, vote (any error votes drop), and on commit: the new snapshot and the round's records
        written; once the step's own record is written, `_attempt` re-forms if a replacement is ready."""
        step = state.number
        try:
            self._synchronize_round(step)
            fault_point(step, "after")
            committed = self.quorum.vote(step, ok=True)
        except Exception:
            self.step = step - 1  # not committed (the engine names the step it drops)
            with contextlib.suppress(Exception):  # the others learn of it: a verdict, or our silence
                self.quorum.vote(step, ok=False)
            raise
        if not committed:
            self.step = step - 1
            raise StepDropped(f"the round ending at step {step}: a member failed it; no member applied it")
        self.trained_by = list(state.ranks)
        self.averages += 1
        for held in self._held_records:
            self.metrics.record(*held[:5], **held[5])
        self._take_snapshot()
        self._round.clear()
        self._join_after = bool(state.work.get("pending"))

    def _synchronize_round(self, step: int) -> None:
        """LocalSGD: the average of the members' parameters and floating-point buffers, each weighted by its
        samples in the round over the job's; DiLoCo: the same average of the pseudo-gradients (global copy minus
        local parameters) and buffers, the outer optimizer's step on the global copy, which every member then
        takes. One flat buffer, one all-reduce (the fault phase ``during`` fires right before it).
        Nothing when no step of the round was applied (every member is still at the round's start)."""
        if not self._global_samples:
            return
        group = self.quorum.group
        assert group is not None
        params, buffers = synced_tensors(self.module)
        held = self.global_params
        pieces = [g - p.detach() for g, p in zip(held, params, strict=True)] if held else list(params)
        flat = flatten(pieces + buffers, self._samples / self._global_samples)
        fault_point(step, "during")  # the other members are inside the all-reduce by now
        with self.collective("round all-reduce"):
            all_reduce_sum(flat, group)
        if self.outer_optimizer is None:
            unflatten_into(flat, params + buffers)
            return
        sizes = [t.numel() for t in pieces]
        averaged = flat[: sum(sizes)].split(sizes)
        self.outer_optimizer.zero_grad(set_to_none=True)
        for g, piece in zip(held, averaged, strict=True):
            g.grad = piece.view_as(g).to(g.dtype)
        self.outer_optimizer.step()
        self.outer_optimizer.zero_grad(set_to_none=True)
        unflatten_into(torch.cat([g.reshape(-1) for g in held] + [flat[sum(sizes) :]]), params + buffers)

    def _record(self, state: StepState, **fields: Any) -> None:
        """The engine's record, held until the round commits for the round's inner steps."""
        phases = dict(zip(("data_s", "compute_s", "comm_s", "optimizer_s"), state.phases or (), strict=False))
        extra = {**phases, **fields, **({"skipped": True} if state.skipped else {})}
        held = (
            state.number,
            time.perf_counter() - state.started,
            state.local,
            state.total or 0,
            state.loss,
            extra,
        )
        if self._round_ends(state.number):
            self.metrics.record(*held[:5], **extra)
        else:
            self._held_records.append(held)

    # -- the contract -------------------------------------------------------------------------------------------
    def synchronize(self) -> None:
        """At a round boundary every member holds the synchronized state already: nothing to do. Between
        boundaries, refused: a synchronization outside a round could not be dropped and redone."""
        if self.step % self.sync_every:
            raise ValueError(
                f"rank {self.topology.rank}: synchronize() at step {self.step} under --on-worker-failure heal: "
                f"a round ends every sync_every={self.sync_every} steps, and only a whole round is committed. "
                f"HINT: train a multiple of {self.sync_every} steps (the replicas are synchronized then)"
            )

    def state_dict(self) -> dict[str, Any]:
        """This member's model, optimizer and step (and DiLoCo's global copy and outer optimizer)."""
        state = replicated_state(self)
        if self.outer_optimizer is not None:
            state.update(
                global_copy=list(self.global_params), outer_optimizer=self.outer_optimizer.state_dict()
            )
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if self.outer_optimizer is not None:
            with torch.no_grad():
                for g, saved in zip(self.global_params, state["global_copy"], strict=True):
                    g.copy_(saved)
            self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        self._take_snapshot()


def start_healing_rounds(
    model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Any, topology: Topology | None, config: Any,
    strategy: str, outer_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None,
) -> HealingRounds:  # fmt: skip
    """`LocalSGD.setup` / `DiLoCo.setup` under ``--on-worker-failure heal``: refuse what a round cannot honour,
    join the quorum, take a live member's state (every member takes the first member's at the first epoch).
    ``outer_optimizer``: DiLoCo's (its factory of the outer optimizer over the global copy); None for LocalSGD."""
    call = check_setup_arguments(model, optimizer, loss_fn, strategy=strategy, conventions=True, heals=True)
    refuse_round_options(config, strategy)
    store = healing_store()
    topo = topology if topology is not None else current()
    place_model(model, topo.device, optimizer, topo.rank)
    quorum = Quorum.from_env(store)
    job = HealingRounds(model, optimizer, call, topo, config, quorum, outer_optimizer)
    return join_first_epoch(job)
