"""The step engine: the one `train_step` and the one `eval_step` of every strategy.

The order of a step is written once, here; a strategy supplies only what differs, as the hooks of `Engine`:

=====  ===========================================  ==========================================================
 #      the engine does                               the strategy's hook says how
=====  ===========================================  ==========================================================
 1      refuse a batch cut for another layout         (`loom.job.check_batch_layout`, for every strategy)
 2      prepare: the batch on the device, its size,   `_prepare`: e.g. the global count's all-reduce, a parameter
        the global count where it is known first      server's pull, the replica's sample check
 3      train mode, gradients cleared                 (every strategy)
 4      forward and backward through the schedule     `_forward_backward`: micro-batches weighted by their share,
                                                      or a pipeline's instructions; the loss sum and the flag
 5      synchronize                                   `_synchronize`: gradients averaged (or pushed); the loss,
                                                      the global count and every rank's flag reduced
 6      the verdict, `NonFiniteGuard.judge` (the      `_commit`: a strategy whose unit of commit is larger
        same flags on every rank); under heal the     votes at the unit's end
        commit vote
 7      the step; a skipped step's gradients are      `_apply`: the optimizer's step, or nothing (a server's)
        cleared instead
 8      count the step; the after-step exchange       `_after_step`: LocalSGD, DiLoCo, Gossip
 9      the step record with the phase times (and     `_record`: the strategy's own fields (phases, bubble,
        sampled memory); the straggler watch's row    staleness, bytes)
=====  ===========================================  ==========================================================

`train_step` returns ``StepState.loss``: the global batch's mean loss, or this replica's (``loss_scope``,
`loom.job.Job`); a global batch of 0 samples is refused on every rank. Under ``--on-worker-failure heal`` a step
no member applied is retried (`loom.train.heal_step`). Fault points (`loom.fault.inject`): ``before``, ``after``
(before the vote) and ``commit`` (after it) here; a strategy places ``during`` right before its exchange.
"""

from __future__ import annotations

import abc
import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from loom.data.loader import LazyBatch
from loom.errors import StepDropped
from loom.fault.desync import local_flag
from loom.fault.inject import planned
from loom.job import Job, MetricFn, check_batch_layout
from loom.observe.memory import MEMORY_EVERY, StepMemory
from loom.observe.straggler_watch import StragglerWatch
from loom.train.batch import LossCall, batch_len, forward_loss, micro_batches, to_device
from loom.train.guard import GuardOptions, StepGuard
from loom.train.heal_step import retry_step
from loom.train.step_state import ShareOptions, StepState

if TYPE_CHECKING:
    from loom.fault.quorum import Quorum
    from loom.mesh import Mesh
    from loom.observe.phases import StepObserver
    from loom.topology import Topology

__all__ = ["Engine", "ShareOptions", "StepState"]  # the last two re-exported


class Engine(Job):
    """A `loom.job.Job` whose `train_step` and `eval_step` are the engine's (see the module docstring).

    A strategy's job subclasses it, calls its constructor (the contract's attributes and the guard) and implements
    the hooks."""

    guard: StepGuard
    _watch: StragglerWatch | None
    loss_call: LossCall
    """How the model and the loss are called on a batch (`loom.LossCall`)."""
    memory_every: int = MEMORY_EVERY
    """Steps 1, 2 and every ``memory_every``-th carry this rank's memory in their record: the training state by
    category and the step's peak RSS (`loom.observe.memory.StepMemory`); 0: never."""
    _last_synchronized: StepState | None = None
    """The last step that reached its synchronization (under healing: a step committed before this member failed
    is not trained again, `train_step`)."""
    _last_recorded_step: int = 0
    """The number of the last step whose record was written."""
    observer: StepObserver | None = None
    """A strategy's finer clock of the step's phases (`loom.observe.phases`), where it keeps one: it then writes
    the step record (`_record`) and gives the straggler watch its phase times."""

    def __init__(
        self, module: Any, optimizer: torch.optim.Optimizer, loss_fn: Any, mesh: Mesh, config: GuardOptions,
        metrics: Any, *, topology: Topology | None = None, quorum: Quorum | None = None,
    ) -> None:  # fmt: skip
        """What every strategy's job holds (the `loom.job.Job` contract) and its guard on ``config``'s options,
        started here once (`loom.train.guard.StepGuard.start`; ``quorum`` under heal, whose job trains on the
        quorum's axis: ``topology``, else the mesh's). A strategy's job calls it first, then sets its own."""
        self.module = module
        self.optimizer = optimizer
        self.loss_call = LossCall.of(loss_fn)
        self.loss_fn = self.loss_call.fn
        self.mesh = mesh
        self.topology = topology if topology is not None else mesh.topology
        self.config: Any = config
        """The strategy's config dataclass (the guard's options among its fields)."""
        self.metrics = metrics
        self.step = 0
        """Steps committed (for a parameter-server worker: updates pushed, its clock)."""
        self.fetches_shares = quorum is not None  # under heal (`loom.job.Job.fetches_shares`)
        self.guard = StepGuard.start(self.topology, config, quorum)
        """The hang watchdog over this job's communication and the non-finite verdict (`loom.train.guard`)."""
        self.nonfinite = self.guard.nonfinite
        """The verdict on non-finite steps (`loom.fault.desync.NonFiniteGuard`), judged by the step itself."""
        self._fault = planned()
        """`loom.fault.inject.fault_point` when ``LOOM_FAULTS`` plans a fault for this process, else None."""
        self._data_layout = (mesh.index(self.data_axis), mesh.size(self.data_axis))
        """``(shard_index, shard_count)`` a loader batch must carry (`_check_layout`): fixed by the mesh."""
        self.last_step_skipped = False

    def collective(self, op: str) -> contextlib.AbstractContextManager[int]:
        """The one place a job tells the hang watchdog of a collective (or of several issued as one operation
        ``op``, whose name a hang report gives): every strategy's step and evaluation wrap each exchange in it
        (`loom.fault.watchdog.Watchdog.collective`: two attribute writes). Yields its number."""
        return self.guard.watchdog.collective(op)

    @property
    def skipped_steps(self) -> int:
        """Steps whose update was not applied because their loss or gradient was non-finite on some rank."""
        return self.nonfinite.skipped

    # -- the step ------------------------------------------------------------------------------------------------
    def train_step(self, batch: Any) -> float:
        """One step on the global batch ``batch`` is this rank's share of; returns ``loss_scope``'s loss. Under
        healing a step dropped on every member is retried in a new epoch (`loom.train.heal_step.retry_step`)."""
        self._check_can_train()
        self._check_layout(batch)
        quorum = self.guard.quorum
        return self._attempt(batch) if quorum is None else retry_step(self, quorum, batch)

    def _wait_for_joiner(self) -> None:
        """Under healing, before a step: wait a bounded moment for a replacement that is starting
        (`loom.fault.quorum.Quorum.wait_for_joiner`); a strategy whose unit of commit is larger waits only
        before the unit's last step."""
        self.guard.quorum.wait_for_joiner()  # type: ignore[union-attr]

    def _adopt_epoch(self) -> None:
        """Make a new membership epoch's members equal (a healing job copies a live peer's state)."""
        raise NotImplementedError(f"{type(self).__name__} cannot heal")

    def _attempt(self, batch: Any) -> float:
        state = StepState(self.step + 1, batch)
        if self._fault is not None:
            self._fault(state.number, "before")
        every = self.memory_every
        sample = StepMemory() if every > 0 and (state.number <= 2 or state.number % every == 0) else None
        clock = time.perf_counter
        with self._step_context():
            self._prepare(state)
            self._refuse_empty(state)
            prepared = clock()
            self.module.train()
            self.optimizer.zero_grad(set_to_none=True)
            self._forward_backward(state)
            computed = clock()
            self._synchronize(state)
            self._refuse_empty(state)
            self._last_synchronized = state
            synchronized = clock()
            state.skipped = self.nonfinite.judge(
                state.number, state.flags, state.ranks, state.gradient_finite
            )
            if not self._commit(state):
                raise StepDropped(f"step {state.number}: a member failed it; no member applied it")
            if state.skipped:
                self.optimizer.zero_grad(set_to_none=True)
            else:
                self._apply(state)
            applied = clock()
            self.step = state.number
            self.last_step_skipped = state.skipped
            self._after_step(state)
            ended = clock()
            since = getattr(self, "_step_ended", state.started)  # the gap since the last step counts as data
            self._step_ended = ended
            comm = synchronized - computed + ended - applied
            state.phases = (prepared - since, computed - prepared, comm, applied - synchronized)
            self._record(state)
            self._last_recorded_step = state.number
            # data, compute, comm and optimizer seconds: the observer's (None when it is off), else the engine's
            phases = self.observer.last_phases if self.observer is not None else state.phases
            if phases is not None and (watch := self._straggler_watch()) is not None:
                watch.add(*phases)
            if sample is not None:  # after the record: its time and phases do not include the sampling
                self.metrics.annotate(state.number, **sample.fields(self.module, self.optimizer))
        return state.loss

    def _check_layout(self, batch: Any) -> None:
        """Step 1: refuse a batch cut for another data layout (`_data_layout`), or a `LazyBatch` this job does not
        fetch shares of (`loom.job.check_batch_layout`, called only for a batch it refuses, to name the fix)."""
        count = getattr(batch, "shard_count", None)
        foreign = count is not None and (batch.shard_index, count) != self._data_layout
        if foreign or (not self.fetches_shares and isinstance(batch, LazyBatch)):
            check_batch_layout(batch, self)

    def _refuse_empty(self, state: StepState) -> None:
        if state.total == 0:
            raise ValueError(
                f"rank {self.topology.rank}: train_step got a global batch of 0 samples (every share is empty) "
                f"at step {state.number}. HINT: check the dataset's length and global_batch_size."
            )

    # -- the hooks -----------------------------------------------------------------------------------------------
    def _check_can_train(self) -> None:
        """Raise when `train_step` must not run now (e.g. the job's model is driven by the user's own loop)."""

    def _step_context(self) -> contextlib.AbstractContextManager[Any]:
        """Held around the whole step (e.g. Gossip: no peer changes the parameters meanwhile)."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def _prepare(self, state: StepState) -> None:
        """Set ``state.local`` (and ``state.total`` where known now); anything the forward needs first."""

    @abc.abstractmethod
    def _forward_backward(self, state: StepState) -> None:
        """Forward and backward on this rank's share; set ``state.loss_sum`` and ``state.flag``."""

    @abc.abstractmethod
    def _synchronize(self, state: StepState) -> None:
        """Exchange what the step needs; set ``total``, ``flags``, ``ranks``, ``gradient_finite``, ``loss``."""

    def _commit(self, state: StepState) -> bool:
        """Whether to apply the step: the guard's commit vote under healing (`StepGuard.commit`); without healing
        there is nothing to vote on. A strategy whose unit of commit is larger than a step
        (`loom.parallel.replica.round_commit`: a sync round) votes at the unit's end instead."""
        return self.guard.quorum is None or self.guard.commit(state.number)  # no call at all without healing

    def _apply(self, state: StepState) -> None:
        """Apply the update (not called for a skipped step)."""
        self.optimizer.step()

    def _after_step(self, state: StepState) -> None:
        """Called on every rank after the step is counted (``self.step`` is ``state.number``)."""

    def _record(self, state: StepState, **fields: Any) -> None:
        """Write the step record, with a strategy's own ``fields`` (a subclass passes them through here) and the
        phase times: the `observer`'s where the strategy keeps one (nothing when it is off), else the engine's
        (`StepState.phases`)."""
        if self.observer is not None:
            assert state.total is not None
            self.observer.end_step(
                state.number, state.local, state.total, state.loss, skipped=state.skipped, **fields
            )
            return
        names = ("data_s", "compute_s", "comm_s", "optimizer_s")
        phases = {} if state.phases is None else dict(zip(names, state.phases, strict=True))
        extra: dict[str, Any] = {**phases, **fields, **({"skipped": True} if state.skipped else {})}
        elapsed = time.perf_counter() - state.started
        self.metrics.record(state.number, elapsed, state.local, state.total or 0, state.loss, **extra)

    def _straggler_peers(self) -> list[list[int]]:
        """The groups of ranks that do the same work, compared with each other for stragglers."""
        return [list(range(self.topology.world_size))]

    def _straggler_watch(self) -> StragglerWatch | None:
        """The `loom.observe.straggler_watch.StragglerWatch` of this job, made at its first step with phase times;
        None in one process, without a store for the watchdog, or under heal (its members change)."""
        if not hasattr(self, "_watch"):
            watchdog, watch = self.guard.watchdog, None
            if self.topology.is_distributed and watchdog.store is not None and watchdog.quorum is None:
                watch = StragglerWatch.attach(watchdog, self._straggler_peers(), self.metrics)
            self._watch = watch
        return self._watch

    def _micro_batches(
        self,
        batch: Any,
        local: int,
        accumulate: int,
        model: torch.nn.Module,
        weight: Callable[[int], float],
        hold: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        exchange: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ) -> Iterator[tuple[torch.Tensor, int]]:
        """The one micro-batch loop, every strategy's forward and backward on its share: ``batch``'s ``local``
        samples in ``accumulate`` pieces (empty ones left out); for each, the forward of ``model`` under the job's
        `LossCall`, then its detached loss and samples are yielded (the caller adds them up, or stops before the
        backward: a non-finite loss), then ``(loss * weight(n)).backward()``. Every piece but the last runs
        inside ``hold()`` (DataParallel: DDP's ``no_sync``, gradients accumulate locally), the last backward
        inside ``exchange()`` (DataParallel: DDP all-reduces inside it, counted by the watchdog)."""
        pieces = [p for p in micro_batches(batch, local, accumulate) if p[1] > 0]
        for i, (piece, n) in enumerate(pieces):
            last = i == len(pieces) - 1
            with hold() if not last else contextlib.nullcontext():
                loss = forward_loss(self.loss_call, model, piece)[0]
                yield loss.detach(), n
                with exchange() if last else contextlib.nullcontext():
                    (loss * weight(n)).backward()

    def _backward_share(
        self, state: StepState, accumulate: int, weight_of_total: bool, stop_on_nonfinite: bool = False
    ) -> None:
        """Forward and backward on this rank's share in ``accumulate`` micro-batches,
        each loss weighted by its samples over the share's (or, ``weight_of_total``, over the global batch's:
        ``state.total``); set ``state.loss_sum`` and ``state.flag``. ``stop_on_nonfinite``: no backward once a
        loss is non-finite (the step is skipped anyway)."""
        if not state.local:
            return
        batch = state.work.get("batch", state.batch)
        whole = state.total if weight_of_total else state.local
        assert whole
        loss_sum, values = 0.0, []
        for loss, n in self._micro_batches(batch, state.local, accumulate, self.module, lambda n: n / whole):
            value = float(loss.double())
            values.append(value)
            loss_sum += value * n
            if stop_on_nonfinite and local_flag(value):
                state.loss_sum, state.flag = loss_sum, 1.0
                break  # before this piece's backward
        # the share's mean loss (one micro-batch: the loss itself, not ``loss_sum / local`` rounded twice)
        state.work["share_mean"] = values[0] if len(values) == 1 else loss_sum / state.local
        if state.flag:
            return
        state.loss_sum = loss_sum
        state.flag = local_flag(loss_sum, [p.grad for p in self.module.parameters() if p.grad is not None])

    # -- evaluation ----------------------------------------------------------------------------------------------
    def eval_step(self, batch: Any, metrics: dict[str, MetricFn] | None = None) -> dict[str, float]:
        """The global-batch mean loss and any extra mean-reduced ``metrics``, in eval mode, without gradients.
        Collective over the data axis: every rank calls it, and the result is the same everywhere."""
        self._check_layout(batch)
        names, sums = self._evaluate(batch, metrics)
        group = self._eval_group()
        if group is not None:
            with self.collective("evaluation all-reduce"):
                dist.all_reduce(sums, group=group)
        count = float(sums[-1].item())  # the global-batch means from the shares' sums added up
        if count == 0:
            raise ValueError(
                f"rank {self.topology.rank}: eval_step got a global batch of 0 samples (every share is empty)"
            )
        return {name: float(sums[i].item()) / count for i, name in enumerate(names)}

    @contextlib.contextmanager
    def _eval_mode(self) -> Iterator[None]:
        """The model in eval mode for the block, then back in the mode it was in (an exception too)."""
        was_training = self.module.training
        self.module.eval()
        try:
            yield
        finally:
            self.module.train(was_training)

    @torch.no_grad()
    def _evaluate(self, batch: Any, metrics: dict[str, MetricFn] | None) -> tuple[list[str], torch.Tensor]:
        """``names`` and this rank's ``[sum per name..., samples]``: the share's loss and
        ``metrics`` under the job's `LossCall`, in eval mode (the model's mode restored after). Under heal each
        member evaluates the whole global batch alone (its data axis for evaluation is one replica: no sum over a
        membership that may change meanwhile), so a `LazyBatch` is loaded whole."""
        call, device = self.loss_call, self.topology.device
        batch_here = to_device(batch.load() if isinstance(batch, LazyBatch) else batch, device)
        local = batch_len(call.inputs_of(batch_here))
        sums = torch.zeros(len(metrics or {}) + 2, dtype=torch.float64, device=device)
        sums[-1] = local
        with self._eval_mode():
            if local:
                loss, outputs = forward_loss(call, self.module, batch_here)
                second = call.second_argument(batch_here)
                values = [loss, *(fn(outputs, second) for fn in (metrics or {}).values())]
                for i, value in enumerate(values):
                    sums[i] = float(value) * local
        return ["loss", *(metrics or {})], sums

    def _eval_group(self) -> Any:
        """The group the evaluation sums are added up over; None: they are global already (one process, or a
        strategy whose `_evaluate` reduced them)."""
        return self.mesh.group(self.data_axis)
