"""A few real training steps of the user's model in this process: time per layer, bytes per category.

Measured at each batch size a configuration will run, with the thread count a ``loom run`` worker gets
(``OMP_NUM_THREADS``, 1 unless set); what is measured: docs/plan.md#what-it-measures. Each layer of the model's
chain (`loom.parallel.pipeline.pipeline_split.chain_layers`, else its children) is timed by hooks (`_LayerClock`,
`_backward_per_layer`), exact for a chain, whose backward runs the layers in reverse, one at a time. Saved
activations are counted (``saved_tensors_hooks``) on the untimed pass only, so the timed steps run without the
hooks. The steps are real: the parameters change, as the script's first steps would.
"""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from loom.errors import OutsideCalibration
from loom.observe.memory import peak_rss_bytes, reset_peak_rss, rss_bytes, state_bytes
from loom.plan.capture import CapturedScript

__all__ = ["BatchProfile", "LayerProfile", "ModelProfile", "OutsideCalibration", "profile_model"]


@dataclass(frozen=True)
class LayerProfile:
    name: str
    param_bytes: int
    param_count: int
    forward_s: float
    backward_s: float
    saved_bytes: int
    """Activations autograd keeps for this layer's backward, at this batch size."""
    output_bytes: int
    """The layer's output, at this batch size (a pipeline stage's message when a stage ends here)."""


@dataclass(frozen=True)
class BatchProfile:
    """The model at one batch size."""

    batch_size: int
    forward_s: float
    backward_s: float
    layers: tuple[LayerProfile, ...]

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def activation_bytes(self) -> int:
        return sum(layer.saved_bytes for layer in self.layers)


@dataclass(frozen=True)
class ModelProfile:
    """What `profile_model` measured: the state's bytes, the optimizer step, and each batch size's times."""

    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    param_count: int
    optimizer_s: float
    """One ``optimizer.step()`` plus ``zero_grad`` over all parameters (median)."""
    chain: bool
    """True when the model is a chain loom's `Pipeline` can cut (per-layer times are then per pipeline layer)."""
    chain_refusal: str
    threads: int
    batches: dict[int, BatchProfile]
    tp_pairs: tuple[tuple[int, int], ...] = ()
    """The layers ``TensorParallel(plan="auto")`` splits, as (column-parallel, row-parallel) layer indices:
    found when the model is one MLP chain whose Linear pairs are profiled layers."""
    tp_refusal: str = "not profiled"
    transient_bytes: int = 0
    """What a step holds at its peak beyond the training state and the saved activations (autograd's and the
    optimizer's temporaries): the growth of this process's peak RSS over the first steps, at the largest batch,
    less the gradients, optimizer state and activations they created. 0 where the peak RSS cannot be read."""
    flat_s: float = 0.0
    """ZeRO stage 1's own copies on loom's CPU path (`loom.parallel.data.sharded_flat`): the gradients
    concatenated into one vector, a whole-parameter vector made and copied back into the parameters (median)."""

    def at(self, batch_size: int) -> BatchProfile:
        """The profile at ``batch_size``; refused when it was not measured (no extrapolation)."""
        if batch_size not in self.batches:
            raise OutsideCalibration(
                f"batch size {batch_size} was not measured (measured: {sorted(self.batches)})"
            )
        return self.batches[batch_size]


def _layers(model: nn.Module) -> tuple[list[tuple[str, nn.Module]], bool, str]:
    from loom.parallel.pipeline.pipeline_split import chain_layers  # the cut Pipeline itself makes

    try:
        return chain_layers(model), True, ""
    except ValueError as why:
        children = list(model.named_children()) or [("", model)]
        return children, False, str(why)


def _tp_pairs(
    model: nn.Module, layers: list[tuple[str, nn.Module]]
) -> tuple[tuple[tuple[int, int], ...], str]:
    """`ModelProfile.tp_pairs`, or no pairs and the reason."""
    from loom.parallel.tensor.tensor_parallel_shard import auto_plan, mlp_pairs

    try:
        plan = auto_plan(model)
    except ValueError as why:
        return (), str(why)
    if plan != {"": "mlp"}:
        return (), f"its tensor-parallel plan {plan} is not one MLP chain (only that is predicted)"
    index = {id(module): i for i, (_, module) in enumerate(layers)}
    children = dict(model.named_children())
    pairs = [(index.get(id(children[a])), index.get(id(children[b]))) for a, b in mlp_pairs(model)]
    if any(a is None or b is None for a, b in pairs):
        return (), "its Linear pairs are not layers of the profiled chain"
    return tuple((int(a), int(b)) for a, b in pairs), ""  # type: ignore[arg-type]


def _batch_of(captured: CapturedScript, batch_size: int) -> Any:
    from loom.data.loader import loader
    from loom.topology import Topology

    options = {k: v for k, v in captured.loader_options.items() if k == "collate_fn"}
    data = loader(
        captured.dataset, batch_size, shuffle=False, topology=Topology(0, 1, 0, 1, "none"),
        same_data_check=False, **options,
    )  # fmt: skip
    return next(iter(data))


class _LayerClock:
    """Hooks on each layer: forward start/end, the moment each output's gradient is ready, saved bytes."""

    def __init__(self, layers: list[tuple[str, nn.Module]]) -> None:
        self.layers = layers
        self.fwd_start = [0.0] * len(layers)
        self.fwd_end = [0.0] * len(layers)
        self.grad_ready: list[float | None] = [None] * len(layers)
        self.saved = [0] * len(layers)
        self.output = [0] * len(layers)
        self.current = len(layers) - 1
        self.handles: list[Any] = []
        for i, (_, layer) in enumerate(layers):
            self.handles.append(layer.register_forward_pre_hook(functools.partial(self._pre, i)))
            self.handles.append(layer.register_forward_hook(functools.partial(self._post, i)))

    def _pre(self, i: int, module: nn.Module, args: Any) -> None:
        self.current = i
        self.fwd_start[i] = time.perf_counter()

    def _post(self, i: int, module: nn.Module, args: Any, out: Any) -> None:
        self.fwd_end[i] = time.perf_counter()
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        if outs and isinstance(outs[0], torch.Tensor):
            self.output[i] = sum(t.nbytes for t in outs if isinstance(t, torch.Tensor))
            if outs[0].requires_grad:
                outs[0].register_hook(functools.partial(self._mark, i))

    def _mark(self, i: int, grad: torch.Tensor) -> None:
        self.grad_ready[i] = time.perf_counter()

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def _saved_bytes_hooks(clock: _LayerClock, params: set[int]) -> Any:
    seen: set[tuple[int, int]] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        try:
            key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        except (RuntimeError, NotImplementedError):
            return t
        if key[0] not in params and key not in seen:
            seen.add(key)
            clock.saved[clock.current] += key[1]
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def _one_step(
    captured: CapturedScript,
    call: Any,
    batch: Any,
    clock: _LayerClock,
    count_saved: bool,
    forward_only: bool = False,
) -> dict:
    """One training step (timed by phase); ``count_saved`` counts the activations saved for backward (slower:
    an untimed step); ``forward_only`` stops after the forward, its graph dropped (a counting pass only)."""
    from loom.train.batch import forward_loss

    model, optimizer = captured.model, captured.optimizer
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    clock.grad_ready = [None] * len(clock.layers)
    clock.saved = [0] * len(clock.layers)
    t0 = time.perf_counter()
    with _saved_bytes_hooks(clock, params) if count_saved else contextlib.nullcontext():
        loss, _ = forward_loss(call, model, batch)
    t1 = time.perf_counter()
    if forward_only:
        return {}
    loss.backward()
    t2 = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)  # keep the gradients allocated, as a job does between steps
    t3 = time.perf_counter()
    return {"forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2, "start": t1, "end": t2}


def budgeted(first_s: float, most: int, budget_s: float, least: int = 1) -> int:
    """How many repetitions, between ``least`` and ``most``, fit in ``budget_s`` when one took ``first_s``."""
    return max(least, min(most, int(budget_s / max(first_s, 1e-9))))


PROFILE_BUDGET_S = 2.0
"""The timed steps at one batch size stop at about this much time (at least one, at most ``repeats``): a model
whose step takes seconds is timed once per batch size after its warm-up."""


def _backward_per_layer(clock: _LayerClock, start: float, end: float) -> list[float]:
    """Layer i's backward: from its output's gradient (the last layer: backward's start) to the previous
    layer's output gradient (the first layer: backward's end). Layers whose output has no gradient get 0."""
    begins, finishes = [*clock.grad_ready[:-1], start], [end, *clock.grad_ready[:-1]]
    pairs = zip(begins, finishes, strict=True)
    return [0.0 if b is None or f is None else max(0.0, f - b) for b, f in pairs]


def _profile_batch(
    captured: CapturedScript, call: Any, clock: _LayerClock, size: int, repeats: int, warm: bool
) -> tuple:
    """``repeats`` timed steps at ``size`` (fewer past `PROFILE_BUDGET_S`), after an untimed pass that counts
    the saved activations: a whole step in a fresh process (it creates the optimizer state and the gradients), a
    forward alone once ``warm`` (a later batch size finds the state, the gradients and the allocator's blocks in
    place: its backward and optimizer step would only add time to plan)."""
    batch = _batch_of(captured, size)
    started = time.perf_counter()
    _one_step(captured, call, batch, clock, count_saved=True, forward_only=warm)
    estimate = None if warm else time.perf_counter() - started  # else: the first timed step's
    saved, outputs = list(clock.saved), list(clock.output)
    runs: list[tuple] = []
    while estimate is None or len(runs) < budgeted(estimate, repeats, PROFILE_BUDGET_S):
        started = time.perf_counter()
        step = _one_step(captured, call, batch, clock, count_saved=False)
        estimate = time.perf_counter() - started if estimate is None else estimate
        forward = [e - s for s, e in zip(clock.fwd_start, clock.fwd_end, strict=True)]
        runs.append((step, forward, _backward_per_layer(clock, step["start"], step["end"])))
    med = statistics.median
    layers = tuple(
        LayerProfile(
            name, sum(p.nbytes for p in layer.parameters()), sum(p.numel() for p in layer.parameters()),
            med(r[1][i] for r in runs), med(r[2][i] for r in runs), saved[i], outputs[i],
        )
        for i, (name, layer) in enumerate(clock.layers)
    )  # fmt: skip
    forward, backward, optimizer = (med(r[0][k] for r in runs) for k in ("forward", "backward", "optimizer"))
    return BatchProfile(size, forward, backward, layers), optimizer


def profile_model(captured: CapturedScript, batch_sizes: list[int], repeats: int = 3) -> ModelProfile:
    """Measure ``captured``'s model at each of ``batch_sizes`` (see the module docstring)."""
    from loom.train.batch import LossCall

    call = LossCall.of(captured.loss_fn)
    layers, chain, refusal = _layers(captured.model)
    pairs, tp_refusal = _tp_pairs(captured.model, layers)
    threads = int(os.environ.get("OMP_NUM_THREADS", "1") or 1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    captured.model.train()
    clock = _LayerClock(layers)
    try:
        batches: dict[int, BatchProfile] = {}
        optimizer_s: list[float] = []
        tracked, grown = reset_peak_rss(), 0  # first: it trims the heap, which lowers the RSS
        rss = rss_bytes() or 0
        for size in sorted(set(batch_sizes), reverse=True):  # the first, largest, creates the training state
            batches[size], opt = _profile_batch(captured, call, clock, size, repeats, warm=bool(batches))
            optimizer_s.append(opt)
            if tracked and size == max(batch_sizes):
                grown = (peak_rss_bytes() or 0) - rss
        flat_s = _flat_seconds(captured.model, repeats)
    finally:
        clock.close()
        torch.set_num_threads(before)
    counted = state_bytes(captured.model, captured.optimizer)
    created = counted["gradients"] + counted["optimizer"] + batches[max(batch_sizes)].activation_bytes
    return ModelProfile(
        param_bytes=counted["parameters"], grad_bytes=counted["gradients"], optimizer_bytes=counted["optimizer"],
        param_count=sum(p.numel() for p in captured.model.parameters()),
        optimizer_s=statistics.median(optimizer_s), chain=chain, chain_refusal=refusal, threads=threads,
        batches=batches, tp_pairs=pairs, tp_refusal=tp_refusal, transient_bytes=max(0, grown - created),
        flat_s=flat_s,
    )  # fmt: skip


@torch.no_grad()
def _flat_seconds(model: nn.Module, repeats: int) -> float:
    """`ModelProfile.flat_s`: the copies `sharded_flat` makes around its two all-reduces, on this model's
    parameters (written back with the values they hold: the model is unchanged)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return 0.0
    # the gradients the profile's steps left allocated (zero_grad keeps them): 400 MB not made again at 100 M
    grads = [p.grad if p.grad is not None else torch.ones_like(p) for p in params]
    sizes = [p.numel() for p in params]

    def once() -> float:
        started = time.perf_counter()
        torch.cat([g.reshape(-1) for g in grads])
        full = torch.zeros(sum(sizes), dtype=params[0].dtype)
        full.copy_(torch.cat([p.detach().reshape(-1) for p in params]))  # the all-reduce's result stands in
        for p, piece in zip(params, full.split(sizes), strict=True):
            p.data.view(-1).copy_(piece)
        return time.perf_counter() - started

    first = once()  # its page faults are the job's too: sharded_flat makes new vectors at every step
    if first > PROFILE_BUDGET_S / 4:
        return first  # the measurement itself: a second call would double the time for the same figure
    return statistics.median(once() for _ in range(budgeted(first, repeats, PROFILE_BUDGET_S / 4)))
