"""`DistributedOptimizer`: Horovod's optimizer wrapper, gradients all-reduced as backward produces them.

Each parameter's gradient is submitted (``allreduce_async_``, named after the parameter) from a
post-accumulate-grad hook on the ``backward_passes_per_step``-th backward pass, so communication overlaps the
rest of backward; `step` (or `synchronize`) waits for all of them, and all-reduces as zeros the gradients this
rank did not compute (another rank may have: the engine matches them by name). Gradients of several backward
passes are summed, as in Horovod: divide the loss by ``backward_passes_per_step`` to average them. The
returned object is an instance of a subclass of the wrapped optimizer's class (as Horovod's is), sharing its
``param_groups`` and ``state``.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from loom.horovod import basics
from loom.horovod._ops import ADASUM, AVERAGE, SUM
from loom.horovod.collectives import allreduce_async_, sparse_allreduce_async, synchronize
from loom.horovod.compression import Compression

__all__ = ["DistributedOptimizer"]


class _DistributedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, sparse_as_dense, process_set) -> None:  # fmt: skip
        super(self.__class__, self).__init__(params)  # type: ignore[call-arg]  # the wrapped optimizer's class, as Horovod does
        self._compression = compression
        all_params = [p for group in self.param_groups for p in group["params"]]
        if named_parameters is None:  # Horovod's names: by group and position
            named_parameters = [
                (f"allreduce.noname.{i}.{j}", p)
                for i, group in enumerate(self.param_groups)
                for j, p in enumerate(group["params"])
            ]
        named_parameters = list(named_parameters)
        if any(not isinstance(x, tuple) or len(x) != 2 for x in named_parameters):
            raise ValueError("named_parameters should be a sequence of (name, parameter) tuples, e.g. "
                             "model.named_parameters()")  # fmt: skip
        names = [name for name, _ in named_parameters]
        if len(set(names)) < len(names):
            dups = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"Parameter names in named_parameters must be unique; repeated: {dups}")
        named = {id(p) for _, p in named_parameters}
        unnamed = [i for i, p in enumerate(all_params) if id(p) not in named]
        if unnamed:
            raise ValueError(
                "named_parameters was specified, but one or more model parameters were not named "
                f"(optimizer parameters at positions {unnamed[:10]}). HINT: pass model.named_parameters()"
            )
        self._parameter_names = {p: name for name, p in named_parameters}
        self.backward_passes_per_step = int(backward_passes_per_step)
        if self.backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        if op == ADASUM:
            raise basics.refuse("Adasum (DistributedOptimizer op=hvd.Adasum)", "use op=hvd.Average")
        if op not in (AVERAGE, SUM):
            raise ValueError(f"DistributedOptimizer supports op=hvd.Average or hvd.Sum, got {op!r}")
        if gradient_predivide_factor != 1.0 and op != AVERAGE:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        basics.check_process_set(process_set)
        self.op, self.gradient_predivide_factor = op, float(gradient_predivide_factor)
        self.sparse_as_dense, self.process_set = sparse_as_dense, process_set
        self._handles: dict = {}
        self._allreduce_delay = {p: self.backward_passes_per_step for p in all_params}
        self._requires_update = {p for p in all_params if p.requires_grad}
        self._synchronized = False
        self._should_synchronize = True
        if basics.size() > 1:
            for p in self._requires_update:
                p.register_post_accumulate_grad_hook(self._on_grad)

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        self._allreduce_delay = dict.fromkeys(self._allreduce_delay, passes)

    def _on_grad(self, p: torch.Tensor) -> None:
        if p in self._handles and self._handles[p][0] is not None and self._allreduce_delay[p] <= 0:
            raise AssertionError(
                "Gradients were computed more than backward_passes_per_step times before call to step(). "
                "Increase backward_passes_per_step to accumulate gradients locally."
            )
        self._allreduce_delay[p] -= 1
        self._handles[p] = self._allreduce_grad_async(p) if self._allreduce_delay[p] == 0 else (None, None)

    def _allreduce_grad_async(self, p: torch.Tensor):
        if p.grad is None:  # not computed here, but maybe on another rank (dynamic graphs)
            p.grad = torch.zeros_like(p)
        name = self._parameter_names.get(p)
        if p.grad.is_sparse and not self.sparse_as_dense:
            return sparse_allreduce_async(p.grad, name=name, op=self.op), "sparse"
        compressed, ctx = self._compression.compress(p.grad.to_dense())  # (a dense gradient itself)
        f = self.gradient_predivide_factor  # 1.0 unless op is Average (then the engine also divides by size)
        return allreduce_async_(
            compressed, name=name, op=self.op, prescale_factor=1.0 / f, postscale_factor=f
        ), ctx

    def synchronize(self) -> None:
        """Wait for every gradient's all-reduce (submitting the ones backward did not); grads are then final."""
        if basics.size() == 1:
            self._synchronized = True
            return
        for p in self._requires_update.union(self._handles):
            if p not in self._handles or self._handles[p][0] is None:  # not submitted during backward
                self._handles[p] = self._allreduce_grad_async(p)
        for p, (handle, ctx) in self._handles.items():
            self._allreduce_delay[p] = self.backward_passes_per_step
            if ctx == "sparse":
                p.grad = handle()
                continue
            output = self._compression.decompress(synchronize(handle), ctx).to(p.grad.dtype)
            if p.grad.is_sparse:  # sparse_as_dense: reduced dense, given back in the optimizer's layout
                p.grad = output.to_sparse()
            else:
                p.grad.set_(output)
        self._handles.clear()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Inside it, `step` does not synchronize: for ``synchronize(); clip; step()``."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(). This can cause training slowdown. You may want to consider using "
                    "optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code.",
                    stacklevel=2,
                )
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none: bool = True):
        if self._handles:
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                "optimizer.synchronize(). This is prohibited as it can cause a race condition."
            )
        return super(self.__class__, self).zero_grad(set_to_none)


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,  # noqa: N802
                         backward_passes_per_step=1, op=AVERAGE, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=basics.global_process_set):  # fmt: skip
    """Wrap ``optimizer`` so that `step` applies gradients averaged (``op=Average``) or summed over all ranks.
    ``gradient_predivide_factor`` f splits the averaging: 1/f before the sum, f/size after it. ``num_groups``
    and ``groups`` (explicit fusion groups) are refused unless left unset: loom fuses by dtype per operation."""
    if num_groups or groups:
        raise basics.refuse("DistributedOptimizer(num_groups=/groups=) (explicit fusion groups)",
                            "leave them unset")  # fmt: skip
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, sparse_as_dense, process_set)  # fmt: skip
