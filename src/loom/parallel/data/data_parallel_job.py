"""The job of `DataParallel`: one step's hooks over the job's data axis (`loom.parallel.data.data_axis`: the
topology, or under ``--on-worker-failure heal`` the quorum), so the same job serves both.

Exactness under uneven shares: DDP averages gradients over *processes*, the global-batch gradient only when
every share has the same size. loom scales each replica's mean loss by ``n_r * W / N`` (``n_r`` its samples,
``W`` the axis's size, ``N`` the global batch) before backward, so the average becomes ``sum_r n_r/N * grad_r``:
what one process computes on the whole batch. An empty share still joins the exchange with a zero-weighted
forward (DDP) or zero gradients (after backward).

Guards, on every rank alike so none is left waiting: a non-finite loss or gradient on any rank is never applied
(`loom.fault.desync.NonFiniteGuard`; each rank's flag rides in the loss buffer); a share too small for BatchNorm
in training mode, where PyTorch would raise on one rank only, is refused (`refuse_small_batchnorm_shares`).

Limits: the model must accept a zero-size batch when a share is empty; losses must be mean-reduced over the
batch (the scaling undoes that mean).
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from loom.comm import all_reduce as comm_all_reduce
from loom.comm.compression import CompressionHook
from loom.comm.shared_gradients import SharedGradients
from loom.data.sampler import share_bounds
from loom.fault.desync import gradients_finite
from loom.fault.quorum import Quorum
from loom.job import load_replicated_state, replicated_state
from loom.mesh import Mesh
from loom.observe.metrics import StepMetrics
from loom.observe.phases import COMM, DATA, FLAGS_AT, OPTIMIZER, StepObserver
from loom.parallel._setup import LossFn
from loom.parallel.data.data_axis import AxisJob, check_same_batches, member_share, take_live_state
from loom.parallel.data.data_parallel_config import DataParallelConfig
from loom.parallel.data.data_parallel_sync import AxisGradients, GradientPath
from loom.topology import Topology
from loom.train.batch import LossCall, batch_len, forward_loss, tensors_in, to_device
from loom.train.engine import StepState
from loom.train.heal_step import reform

__all__ = ["DataParallelJob"]


class DataParallelJob(AxisJob):
    """A model set up for data-parallel training (the `loom.job.Job` contract; its state is replicated)."""

    replicated_state = True
    observer: StepObserver  # always kept (off where the strategy does not observe)

    def __init__(
        self,
        module: nn.Module,
        wrapped: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn | LossCall | None,
        mesh: Mesh,
        config: DataParallelConfig,
        metrics: StepMetrics,
        *,
        quorum: Quorum | None = None,
        topology: Topology | None = None,
    ) -> None:
        super().__init__(module, optimizer, loss_fn, mesh, config, metrics, topology=topology, quorum=quorum)
        topology = self.topology
        self.wrapped = wrapped
        """The model as the exchange wraps it (DDP), or `module` itself; `module` is the user's model."""
        self.own_loop_started = False
        """Set by `own_loop`: the model's outputs then weight their gradients, so `train_step` is refused."""
        self.config: DataParallelConfig = config
        self.observer = StepObserver(metrics, topology.world_size)
        """Times the phases of each step into `metrics`; `DataParallel.setup` gives it the DDP hook."""
        self._join_axis(quorum)
        algorithm = config.allreduce
        shared_memory = algorithm in ("auto", "shm", "hierarchical") and topology.device.type == "cpu"
        self._loss_algorithm = algorithm if shared_memory else "native"
        """The loss all-reduce's algorithm (`_reduce_loss`): the job's own where it uses shared memory on CPU
        (cheaper than gloo's on one host, ``benchmarks/reports/metrics_overhead.md``); else gloo's (``ring`` and
        ``driver`` pay two latency-bound rounds on a message this small)."""
        self.compression: CompressionHook | None = None
        """The gradient compression hook when ``config.compression`` is set (its state: `local_state_dict`)."""
        self.gradient_path: GradientPath | None = None
        """How gradients are averaged (None in one process): `data_parallel_sync.choose_gradient_path`."""
        self.shared_gradients: SharedGradients | AxisGradients | None = None
        """Set when gradients are averaged after backward instead of by DDP: in shared memory
        (`loom.comm.shared_gradients`), or over a replaceable axis (`AxisGradients`); then `wrapped` is the model."""
        self._trainable = [p for p in module.parameters() if p.requires_grad]
        self._batchnorm = batchnorm_layers(module)
        self._device, self._distributed = topology.device, topology.is_distributed
        """Read once: the step asks them every time, and the topology does not change."""

    # -- training --------------------------------------------------------------------------------------------
    def _global_count(self, known: int | None, local: int) -> tuple[int, dict[int, int]]:
        """The global batch size, and the shares (rank: samples) too small for the model's BatchNorm layers.

        A loader batch carries its global size (``known``), and its shares follow `share_bounds` over the axis,
        so every member computes every share; a plain batch's sizes travel in the sample-count all-reduce (one
        slot per rank; under heal every member is given the whole batch, so its size is known)."""
        world, accumulate = self.axis.size, self.config.accumulate
        if known is not None:
            total = int(known)
            if not self._batchnorm:
                return total, {}
            shares = [hi - lo for lo, hi in (share_bounds(total, i, world) for i in range(world))]
        elif not self._distributed:
            total, shares = local, [local]
        else:
            counts = torch.zeros(world, dtype=torch.int64, device=self._device)
            counts[self.topology.rank] = local
            with self.collective("sample-count all-reduce"):
                launched = time.perf_counter()
                dist.all_reduce(counts, group=self.axis.group)
                self.observer.collective("all_reduce sample count", launched, time.perf_counter(), 8 * world)
            shares = counts.tolist()
            total = sum(shares)
        if not self._batchnorm:
            return total, {}
        return total, {r: n for r, n in zip(self.axis.members, shares, strict=True) if 0 < n < 2 * accumulate}

    def own_loop(self, loader: Any = None) -> Any:
        """``model, optimizer, loader`` for a script that keeps its own loop (forward, ``loss.backward()``,
        clipping, ``optimizer.step()``): see `loom.parallel.data.own_loop.OwnLoop`. Call it on every rank."""
        from loom.parallel.data.own_loop import OwnLoop  # here: own_loop builds on this module's job

        if self.quorum is not None:
            raise ValueError(
                f"rank {self.topology.rank}: job.own_loop() under --on-worker-failure heal: a step of your own loop "
                "cannot be dropped and retried on every member. HINT: train with job.train_step(batch), or use "
                "--on-worker-failure stop with --max-restarts N"
            )
        return OwnLoop(self, loader)

    # -- the engine's hooks (`loom.train.engine`) ------------------------------------------------------------
    def _check_can_train(self) -> None:
        if self.own_loop_started:
            raise RuntimeError(
                f"rank {self.topology.rank}: job.train_step after job.own_loop(): the model from own_loop weights "
                "its gradients for your loop's backward, and train_step would weight them twice. HINT: train "
                "with the loop's model and optimizer, or call train_step on a job that own_loop was not called on."
            )

    def _prepare(self, state: StepState) -> None:
        """The share on the device and the global count (one all-reduce unless the loader batch carries it)."""
        self.observer.begin_step(state.number)
        batch_here, known = state.batch, getattr(state.batch, "global_size", None)
        if self.quorum is not None:  # a global batch: this member's share by its place among the members
            batch_here, known, state.work["fingerprint"] = member_share(
                batch_here, self.axis, self.loss_call.inputs_of
            )
        batch_here = to_device(batch_here, self._device)
        state.local = batch_len(self.loss_call.inputs_of(batch_here))
        state.work["batch"] = batch_here
        self.observer.lap(DATA)
        state.total, small = self._global_count(known, state.local)
        self.observer.lap(COMM)
        if small and state.total:
            refuse_small_batchnorm_shares(
                self.topology.rank, state.number, self.axis.size, self.config.accumulate,
                self._batchnorm, small, state.total,
            )  # fmt: skip

    def _forward_backward(self, state: StepState) -> None:
        """``accumulate`` micro-batches, each loss weighted by ``n * W / N`` (the module docstring); DDP
        all-reduces inside the last backward. The loss sum and this rank's flag go into the loss buffer."""
        self.observer.lap(OPTIMIZER)
        call, batch_here, total = self.loss_call, state.work["batch"], state.total
        assert total is not None
        world = self.axis.size
        # [loss sum, flags]; under heal [loss sum, flags, fingerprints, the "replacement waiting" mark]
        loss_sum = (
            self.observer.loss_buffer(self._device)
            if self.quorum is None
            else torch.zeros(FLAGS_AT + 2 * world + 1, dtype=torch.float64)
        )
        ddp_syncs = self.shared_gradients is None  # DDP all-reduces inside the last backward
        if not state.local and ddp_syncs:  # empty share: join DDP's all-reduce with zero contribution
            with self.collective("gradient all-reduce"):
                zero_loss(forward_loss(call, self.wrapped, batch_here)[1]).backward()
        pieces = self._micro_batches(
            batch_here, state.local, self.config.accumulate, self.wrapped, lambda n: n * world / total,
            hold=self._no_sync,
            exchange=(lambda: self.collective("gradient all-reduce")) if ddp_syncs else nullcontext,
        )  # fmt: skip
        for loss, n in pieces:
            loss_sum[0] += loss.double() * n
        self.observer.backward_done()
        self._flag_local_loss(loss_sum)
        state.work["buffer"] = loss_sum

    def _synchronize(self, state: StepState) -> None:
        """Gradients averaged after backward (the loss buffer rides along), else the loss buffer's all-reduce.
        The injected fault ``during`` (`loom.fault.inject`) fires right before the exchange (free when unset)."""
        loss_sum = state.work["buffer"]
        if self.quorum is not None:  # this member's batch fingerprint; whether a replacement is ready
            loss_sum[FLAGS_AT + self.axis.size + self.axis.index] = state.work["fingerprint"]
            loss_sum[-1] = 1.0 if self.quorum.join_pending() else 0.0
        if self.shared_gradients is not None:  # an empty share contributes its gradients of None: zeros
            if self._fault is not None:  # the other members are inside the exchange by now
                self._fault(state.number, "during")
            with self.collective("gradient all-reduce"):
                launched = time.perf_counter()
                self.shared_gradients.average(loss_sum)  # the loss rides along: no collective of its own
                self.observer.lap(COMM)
                nbytes = self.shared_gradients.nbytes
                self.observer.collective(
                    "all_reduce gradients and loss", launched, time.perf_counter(), nbytes, estimate=False
                )
        state.gradient_finite = self._reduce_loss(loss_sum)
        world = self.axis.size
        state.flags, state.ranks = loss_sum[FLAGS_AT : FLAGS_AT + world].tolist(), self.axis.members
        assert state.total is not None
        state.loss = float(loss_sum[0].item()) / state.total
        if self.quorum is not None:
            prints = loss_sum[FLAGS_AT + world : FLAGS_AT + 2 * world].tolist()
            check_same_batches(self.topology.rank, state.number, self.axis.members, prints)
            state.work["pending"] = float(loss_sum[-1]) > 0

    def _after_step(self, state: StepState) -> None:
        """Under heal, a replacement is ready: re-form now, at the step boundary every member has reached."""
        self.trained_by = list(state.ranks)
        if state.work.get("pending"):
            reform(self, self.quorum)

    _adopt_epoch = take_live_state  # makes a new epoch's members equal

    def _apply(self, state: StepState) -> None:
        self.optimizer.step()
        self.observer.lap(OPTIMIZER)

    def _record(self, state: StepState, **fields: Any) -> None:
        """The observer's record (DDP's all-reduce inside backward counts as comm, not compute)."""
        if state.skipped:
            self.observer.lap(OPTIMIZER)
        super()._record(state, **fields)

    def _reduce_loss(self, loss_sum: torch.Tensor) -> bool:
        """The all-reduce of ``[loss sum, flags]`` (gloo's launched asynchronously, overlapping the gradient check;
        none after shared-memory gradients, which summed the buffer); whether the averaged gradient is finite."""
        if not self._distributed or self.shared_gradients is not None:
            return self._gradients_finite()
        with self.collective("loss all-reduce"):
            native = self._loss_algorithm == "native"
            launched = time.perf_counter()
            pending = dist.all_reduce(loss_sum, group=self.axis.group, async_op=True) if native else None
            finite = self._gradients_finite()
            self.observer.lap(OPTIMIZER)
            if pending is not None:
                pending.wait()
            else:
                launched = time.perf_counter()
                comm_all_reduce(loss_sum, op="sum", algorithm=self._loss_algorithm)  # counts its own bytes
            self.observer.collective(
                "all_reduce loss", launched, time.perf_counter(), loss_sum.nbytes, estimate=native
            )
            self.observer.lap(COMM)
        return finite

    def _flag_local_loss(self, loss_sum: torch.Tensor) -> None:
        """Set this rank's flag in the buffer when its local loss is NaN or infinite (it rides to every rank).
        On the CPU through the buffer's numpy view (cheaper than a tensor op); elsewhere without a sync."""
        slot = FLAGS_AT + self.axis.index
        if loss_sum.device.type == "cpu":
            values = loss_sum.numpy()
            values[slot] = 0.0 if math.isfinite(values[0]) else 1.0
        else:
            loss_sum[slot] = (~torch.isfinite(loss_sum[0])).double()

    def _gradients_finite(self) -> bool:
        """Whether the averaged gradient is finite: bitwise the same on every rank, so the same verdict."""
        if self.shared_gradients is not None:
            return gradients_finite((), flat=self.shared_gradients.flat)
        return gradients_finite([p.grad for p in self._trainable])

    def _no_sync(self):
        return self.wrapped.no_sync() if isinstance(self.wrapped, DistributedDataParallel) else nullcontext()

    # -- state -----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return replicated_state(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_replicated_state(self, state)

    def local_state_dict(self) -> dict[str, Any]:
        """State that differs between processes: the compression codec's error-feedback residuals and warm
        starts. Not part of `state_dict()` (which is the same on every rank and saved once by rank 0)."""
        return {"compression": self.compression.state_dict() if self.compression is not None else None}

    def load_local_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("compression") is not None and self.compression is not None:
            self.compression.load_state_dict(state["compression"])


def batchnorm_layers(module: nn.Module) -> list[str]:
    """Names of the BatchNorm layers that compute statistics over this process's batch alone (not SyncBatchNorm,
    whose statistics span the processes)."""
    return [
        name or type(m).__name__
        for name, m in module.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, nn.SyncBatchNorm)
    ]


def zero_loss(outputs: Any) -> torch.Tensor:
    """A loss of exactly zero that still reaches every parameter the forward used (for empty shares).

    Built from the batch-shaped outputs (empty: their sums are 0); a scalar output (a model's own loss, NaN as
    the mean of nothing) is used only when there is none, through `nan_to_num`, whose gradient is 0 there."""
    floating = [t for t in tensors_in(outputs) if t.is_floating_point()]
    if not floating:
        raise TypeError("the model's outputs hold no floating-point tensor to build a zero loss from")
    shaped = [t.sum() for t in floating if t.dim() > 0]
    terms = shaped or [torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0) for t in floating]
    return torch.stack(terms).sum() * 0.0


def refuse_small_batchnorm_shares(
    rank: int, step: int, world: int, accumulate: int, batchnorm: list[str], small: dict[int, int], total: int
) -> None:
    """Raise, on every rank alike, for the ``small`` shares (rank: samples) of the global batch of ``total``
    at ``step``: the ``batchnorm`` layers need at least 2 samples per forward in training mode."""
    pieces = f" in {accumulate} micro-batches (accumulate)" if accumulate > 1 else ""
    need = f"2 x {world} replicas" + (f" x {accumulate} micro-batches" if accumulate > 1 else "")
    described = ", ".join(f"rank {r}: {n}" for r, n in small.items())
    layers = ", ".join(repr(n) for n in batchnorm[:3]) + (" ..." if len(batchnorm) > 3 else "")
    raise ValueError(
        f"rank {rank}: at step {step} the global batch of {total} sample(s) gives "
        f"shares too small for BatchNorm in training mode ({described}{pieces}); BatchNorm layers "
        f"({layers}) need at least 2 samples per forward to compute batch statistics. HINT: pass "
        "drop_last=True to job.loader(...) so the ragged last batch is dropped, and use a global batch of "
        f"at least {need} = {2 * world * accumulate} samples."
    )
