"""Your own training loop with loom's semantics: keep forward, ``loss.backward()``, clipping and the step.

Usage, what such a loop may do and its limits (one training forward per loader batch; no step records):
docs/own-loop.md. The model and optimizer come back wrapped. The training forward weights the *gradient* flowing
back into each output by ``w = n * W / N`` (``n`` this call's samples, ``W`` the replicas, ``N`` the global batch:
the loader's, else counted by an all-reduce), an identity in the forward pass, so the all-reduce gives every rank
``sum_r n_r / N * grad_r`` before ``clip_grad_norm_`` reads it. Weighting outputs, not the loss, leaves the user's
``loss`` and ``GradScaler``'s scaling untouched, and terms not from the outputs (a weight penalty) averaged, which
is their global value. Averaged gradients are equal on every rank, so ``GradScaler``'s skipped steps agree.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.autograd import Variable
from torch.nn.parallel import DistributedDataParallel

from loom.data.sampler import share_bounds
from loom.fault.desync import gradients_finite
from loom.train.batch import batch_len, tensors_in

if TYPE_CHECKING:
    from loom.parallel.data.data_parallel import DataParallelJob

__all__ = ["OwnLoop", "OwnLoopModel", "OwnLoopOptimizer"]


class _WeightGradient(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``weight`` and tells the loop a backward began."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, weight: float, loop: OwnLoop) -> torch.Tensor:
        ctx.weight, ctx.loop = weight, loop
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.loop._backward_began()
        return grad * ctx.weight, None, None


def _map_outputs(value: Any, fn: Any, strict: bool) -> Any:
    """``value`` (any nesting of tuples, lists and dicts) with ``fn`` applied to each tensor that needs a
    gradient. ``strict`` (weighting) refuses other types: every output tensor is weighted or the gradient would
    mix weighted and unweighted parts, so an output that may hide tensors elsewhere is refused."""
    if isinstance(value, torch.Tensor):
        return fn(value) if value.requires_grad else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_map_outputs(v, fn, strict) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_map_outputs(v, fn, strict) for v in value)
    if type(value) is dict:
        return {k: _map_outputs(v, fn, strict) for k, v in value.items()}
    if isinstance(value, dict):  # a subclass (Hugging Face's ModelOutput keeps attributes in step with items)
        for k in list(value):
            value[k] = _map_outputs(value[k], fn, strict)
        return value
    if not strict or value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    raise TypeError(
        f"the model returned a {type(value).__name__}: loom weights the gradient of every output tensor by this "
        "rank's share of the global batch, and cannot see inside that type. HINT: return tensors, or tuples, "
        "lists or dicts of them (as most models do)."
    )


class _RefuseBackward(torch.autograd.Function):
    """Identity forward; a backward through it raises ``error`` (a call loom could not weight)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, error: str) -> torch.Tensor:
        ctx.error = error
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        raise ValueError(ctx.error)


class OwnLoopModel(nn.Module):
    """The model for an own loop: call it as the model; ``module`` is the model itself, on every world size (as
    with DDP), and attributes the wrapper does not have are the model's."""

    def __init__(self, loop: OwnLoop) -> None:
        super().__init__()
        self.module = loop.job.module
        self._loop = [loop]  # in a list: not a submodule, not in state_dict

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # parameters, buffers, submodules: ``module`` itself
        except AttributeError:
            if name == "module" or "module" not in self.__dict__.get("_modules", {}):
                raise
            return getattr(self._modules["module"], name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        loop = self._loop[0]
        if not torch.is_grad_enabled():  # evaluation: no gradient to average, no collective
            return self.module(*args, **kwargs)
        mismatch = loop.mismatch(args, kwargs)
        if mismatch is not None:
            # evaluation without torch.no_grad() (Horovod's MNIST example): only a backward through it is refused
            outputs = self.module(*args, **kwargs)
            return _map_outputs(outputs, lambda t: _RefuseBackward.apply(t, mismatch), strict=False)
        weight = loop.weight(args, kwargs)
        outputs = loop.job.wrapped(*args, **kwargs)
        if not loop.job.topology.is_distributed:
            return outputs
        # even at weight 1 (equal shares) the backward must pass through the weighting: it starts the count of
        # the all-reduce and, without DDP, the shared-memory average; one process has neither
        return _map_outputs(outputs, lambda t: _WeightGradient.apply(t, weight, loop), strict=True)

    def train(self, mode: bool = True) -> OwnLoopModel:
        super().train(mode)
        self._loop[0].job.wrapped.train(mode)
        return self

    @property
    def require_backward_grad_sync(self) -> bool:
        """DDP's switch: False lets gradients accumulate locally (no all-reduce) until it is True again."""
        return self._loop[0].sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        loop = self._loop[0]
        loop.sync = bool(value)
        if isinstance(loop.job.wrapped, DistributedDataParallel):
            loop.job.wrapped.require_backward_grad_sync = bool(value)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally, as DDP's ``no_sync``."""
        before = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = before


def _held(name: str) -> Any:
    """The attribute ``name`` of the held optimizer, read and written through."""
    return property(
        lambda self: getattr(self.optimizer, name), lambda self, v: setattr(self.optimizer, name, v)
    )


class OwnLoopOptimizer(torch.optim.Optimizer):
    """The job's optimizer for an own loop: the same state and param groups; ``step`` counts ``job.step`` and
    refuses a non-finite averaged gradient. A `torch.optim.Optimizer`, so LR schedulers and ``GradScaler``
    take it (like Accelerate's ``AcceleratedOptimizer``, it holds the wrapped optimizer instead of copying it)."""

    _step_supports_amp_scaling = False

    def __init__(self, optimizer: torch.optim.Optimizer, loop: OwnLoop) -> None:  # no super(): see the class
        self.optimizer = optimizer
        self._loop = loop

    param_groups = _held("param_groups")  # type: ignore[assignment]
    state = _held("state")  # type: ignore[assignment]
    defaults = _held("defaults")  # type: ignore[assignment]

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loop = self._loop
        if closure is None and loop.skip_step():
            return None
        result = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        loop.job.step += 1
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise RuntimeError(
            "add_param_group on an own loop's optimizer: loom synchronizes the parameters the job was set up "
            "with. HINT: add the group before strategy.setup(model, optimizer)."
        )

    def __repr__(self) -> str:
        return f"OwnLoopOptimizer({self.optimizer!r})"


class _AnnouncingLoader:
    """The loader, unchanged, except that each batch's global size is handed to the loop before it is used."""

    def __init__(self, loader: Any, loop: OwnLoop) -> None:
        self._inner, self._loop = loader, loop

    def __iter__(self) -> Iterator[Any]:
        for batch in self._inner:
            self._loop.global_size = getattr(batch, "global_size", None)
            yield batch

    def __len__(self) -> int:
        return len(self._inner)

    def __getattr__(self, name: str) -> Any:  # set_epoch, state_dict, sampler, epoch, ...
        return getattr(self._inner, name)


class OwnLoop:
    """``model, optimizer, loader = job.own_loop(loader)``: see the module docstring. Unpacks to those three."""

    def __init__(self, job: DataParallelJob, loader: Any = None) -> None:
        self.job = job
        self.sync = True
        """False between ``no_sync`` passes: gradients accumulate locally (DDP's ``require_backward_grad_sync``)."""
        self.global_size: int | None = None
        """Samples in the global batch the loader gave last (None: a batch without it; counted by collective)."""
        self.in_backward = False
        self.model = OwnLoopModel(self)
        self.optimizer = OwnLoopOptimizer(job.optimizer, self)
        self.loader = _AnnouncingLoader(loader, self) if loader is not None else None
        job.own_loop_started = True
        job.module.train()

    def __iter__(self) -> Iterator[Any]:
        return iter((self.model, self.optimizer, self.loader))

    # -- the forward's weight ---------------------------------------------------------------------------------
    def mismatch(self, args: tuple, kwargs: dict[str, Any]) -> str | None:
        """Why a forward on ``args`` cannot be weighted (its size is not this rank's share of the last loader
        batch), or None. Such a call is allowed (evaluation with gradients on); its backward raises this."""
        topo, total = self.job.topology, self.global_size
        if not topo.is_distributed or total is None:
            return None
        n = _samples(args, kwargs)
        lo, hi = share_bounds(total, topo.rank, topo.world_size)
        if n == hi - lo:
            return None
        return (
            f"rank {topo.rank}: backward through a model call on {n} samples, but this rank's share of the last "
            f"global batch of {total} from the loader is {hi - lo}: loom weights each training call by its "
            "share. HINT: for training, call the model once per loader batch on the whole batch (accumulate "
            "over loader batches, under model.no_sync()), or pass job.own_loop() no loader to count every call; "
            "evaluation needs no backward (wrap it in torch.no_grad() to save the graph's memory)."
        )

    def weight(self, args: tuple, kwargs: dict[str, Any]) -> float:
        """``n * W / N`` for a training forward on ``args`` (see the module docstring; `mismatch` is None)."""
        topo = self.job.topology
        if not topo.is_distributed:
            return 1.0
        n = _samples(args, kwargs)
        known = self.global_size  # the loader's, else the step's all-reduce
        total = known if known is not None else self.job._global_count(None, n)[0]
        if total == 0:
            raise ValueError(f"rank {topo.rank}: a training forward on a global batch of 0 samples")
        return n * topo.world_size / total

    # -- backward: the watchdog's count and the shared-memory average -----------------------------------------
    def _backward_began(self) -> None:
        """Called from the first weighted output's backward: count the all-reduce, queue what ends it."""
        if self.in_backward or not self.sync or not self.job.topology.is_distributed:
            return
        self.in_backward = True
        self._counting = self.job.collective("gradient all-reduce")  # entered here, left when backward ends
        self._counting.__enter__()
        Variable._execution_engine.queue_callback(self._gradients_done)

    def _gradients_done(self) -> None:
        """Runs when backward has computed every gradient: average in shared memory (no DDP), or let DDP's own
        end-of-backward callback, queued after this one, wait for its buckets before the count ends."""
        if self.job.shared_gradients is not None:
            self.job.shared_gradients.average()
            self._finished()
        else:
            Variable._execution_engine.queue_callback(self._finished)

    def _finished(self) -> None:
        self.in_backward = False
        self._counting.__exit__(None, None, None)

    # -- the step -----------------------------------------------------------------------------------------------
    def skip_step(self) -> bool:
        """Whether the averaged gradient of the parameters trainable now is non-finite (the same verdict on every
        rank; see `NonFiniteGuard`). One process may unfreeze layers after set-up; several refuse it (only the
        set-up's trainable parameters are averaged), naming the fix."""
        job = self.job
        trainable = [p for p in job.module.parameters() if p.requires_grad]
        world = job.topology.world_size
        if world > 1 and list(map(id, trainable)) != list(map(id, job._trainable)):
            raise RuntimeError(
                f"rank {job.topology.rank}: own loop step {job.step + 1}: which parameters require grad changed after "
                f"setup ({len(trainable)} now, {len(job._trainable)} at set-up); across {world} processes only the "
                "set-up's are averaged. HINT: set requires_grad before strategy.setup(...), and set up again after "
                "freezing or unfreezing layers"
            )
        skip = job.nonfinite.judge(job.step + 1, [], [], gradients_finite([p.grad for p in trainable]))
        job.last_step_skipped = skip
        if skip:
            job.optimizer.zero_grad(set_to_none=True)
            job.step += 1
        return skip


def _samples(args: tuple, kwargs: dict[str, Any]) -> int:
    """Samples in a forward's arguments: the first dimension of the first tensor."""
    for tensor in tensors_in([*args, *kwargs.values()]):
        return batch_len(tensor)
    raise TypeError(
        "the model was called without a tensor argument: loom cannot tell how many samples it saw"
    )
