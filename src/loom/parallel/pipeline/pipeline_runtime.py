"""The pipeline runtime: executes one stage's instruction stream (`pipeline_schedule`) on real tensors.

Per micro-batch it holds the stage's received inputs (they carry the input gradient after backward) and its
outputs (the graph to run backward through) from forward to backward: the *activation liveness* the schedules
differ in, measured here (`StageStats`) as the micro-batches alive and the bytes autograd saved for them
(``saved_tensors_hooks``, the stage's weights left out; a tensor saved twice counts twice: an upper bound).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from loom.parallel.pipeline.pipeline_communications import recv_gradients, recv_tensors, send_tensors
from loom.parallel.pipeline.pipeline_schedule import Instruction, Op

__all__ = ["PipelineStage", "StageStats", "run_instructions"]


class PipelineStage(nn.Module):
    """A contiguous run of the model's chain of layers, applied in order.

    A layer's tuple output is unpacked into the next layer's positional arguments (how a chain passes several
    tensors, e.g. an encoder's memory with the decoder's input). `named_state` uses the full model's names.
    """

    def __init__(self, layers: Sequence[tuple[str, nn.Module]], index: int, stages: int) -> None:
        super().__init__()
        self.layer_names = [name for name, _ in layers]
        self.layers = nn.ModuleList([module for _, module in layers])
        self.index = index
        self.stages = stages

    def forward(self, *inputs: Any) -> Any:
        x: Any = inputs if len(inputs) != 1 else inputs[0]
        for layer in self.layers:
            x = layer(*x) if isinstance(x, tuple) else layer(x)
        return x

    def named_state(self, keep_vars: bool = False) -> dict[str, torch.Tensor]:
        """The stage's parameters and buffers under the names they have in the full model."""
        out = {}
        for name, layer in zip(self.layer_names, self.layers, strict=True):
            for key, value in layer.state_dict(keep_vars=keep_vars).items():
                out[f"{name}.{key}" if name else key] = value
        return out

    def load_named_state(self, state: dict[str, torch.Tensor]) -> None:
        for name, layer in zip(self.layer_names, self.layers, strict=True):
            prefix = f"{name}." if name else ""
            layer.load_state_dict({k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)})


@dataclass
class StageStats:
    """What one stage did in one step."""

    stage: int
    busy_s: float = 0.0
    """Time in forward and backward compute."""
    span_s: float = 0.0
    """Time from the stage's first instruction to the end of its last."""
    peak_live_microbatches: int = 0
    """Most micro-batches whose activations were held at once."""
    peak_activation_bytes: int = 0
    """Most bytes autograd had saved for backward at once (summed over the live micro-batches)."""
    microbatches: int = 0
    bubble_s: float = 0.0
    """Time this stage sat idle in the step: the pipeline's span (the longest of its stages') minus ``busy_s``,
    waits for neighbours included (set by the strategy; `ModelParallelJob.bubble` is their sum's fraction)."""


def _tensors(x: Any) -> list[torch.Tensor]:
    items = list(x) if isinstance(x, (tuple, list)) else [x]
    if not all(isinstance(t, torch.Tensor) for t in items):
        raise TypeError("pipeline stages must pass a tensor or a tuple of tensors to the next stage")
    return items


def _floats(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t for t in tensors if t.is_floating_point()]


def _peer(rank: int | None, ins: Instruction, stage: int) -> int:
    """The rank of the neighbouring stage ``ins`` talks to (``None``: past the first or last stage)."""
    if rank is None:
        raise RuntimeError(
            f"stage {stage}: instruction {ins!r} talks to a neighbouring stage, but there is none on that side "
            "(a bug in the pipeline schedule)"
        )
    return rank


def run_instructions(
    stream: list[Instruction],
    stage: PipelineStage,
    loss_fn: Any,
    inputs: list[Any],
    targets: list[Any],
    sizes: list[int],
    total: int,
    *,
    prev: int | None,
    next_: int | None,
    train: bool,
    device: torch.device,
    replicas: int = 1,
    group: Any = None,
) -> tuple[float, StageStats]:
    """Execute ``stream``; return the sum over micro-batches of ``loss_j * n_j`` (last stage; 0 elsewhere).

    Each micro-batch's loss is weighted by ``n_j * replicas / total`` before backward (``replicas``: the data
    axis's size), as `DataParallel` weights a share, so the data axis *averages* the gradients
    (`loom.parallel.data.data_parallel_sync.GradientAveraging`). ``prev`` and ``next_`` are global ranks,
    ``group`` the job's (`loom.parallel.pipeline.pipeline_communications`)."""
    stats = StageStats(stage.index, microbatches=len(sizes))
    received: dict[int, list[torch.Tensor]] = {}
    outputs: dict[int, list[torch.Tensor]] = {}
    gradients: dict[int, list[torch.Tensor]] = {}
    saved_bytes: dict[int, int] = {}
    pending: list[Any] = []
    loss_sum = 0.0
    weights = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    started = time.perf_counter()
    for ins in stream:
        j = ins.microbatch
        if ins.op is Op.RECV_ACTIVATION:
            received[j] = recv_tensors(_peer(prev, ins, stage.index), device, group)
            if train:
                for t in _floats(received[j]):
                    t.requires_grad_(True)
        elif ins.op is Op.FORWARD:
            t0 = time.perf_counter()
            x = tuple(received[j]) if prev is not None else inputs[j]
            saved_bytes[j] = 0

            def pack(t: torch.Tensor, j: int = j) -> torch.Tensor:
                # autograd saves the stage's weights too: only activations count
                if t.untyped_storage().data_ptr() not in weights:
                    saved_bytes[j] += t.numel() * t.element_size()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = stage(*x) if isinstance(x, tuple) else stage(x)
                if next_ is None:
                    loss = loss_fn(out, targets[j])
                    loss_sum += float(loss.detach().double()) * sizes[j]
                    out = loss * (sizes[j] * replicas / total)
            outputs[j] = _tensors(out)
            stats.busy_s += time.perf_counter() - t0
            stats.peak_live_microbatches = max(stats.peak_live_microbatches, len(outputs) if train else 1)
            stats.peak_activation_bytes = max(stats.peak_activation_bytes, sum(saved_bytes.values()))
            if not train:  # nothing to keep for a backward
                received.pop(j, None)
                saved_bytes.pop(j)
                if next_ is None:
                    outputs.pop(j)
        elif ins.op is Op.SEND_ACTIVATION:
            sent = outputs[j] if train else outputs.pop(j)
            pending += send_tensors(sent, _peer(next_, ins, stage.index), group=group)
        elif ins.op is Op.RECV_GRADIENT:
            gradients[j] = recv_gradients(_floats(outputs[j]), _peer(next_, ins, stage.index), group)
        elif ins.op is Op.BACKWARD:
            t0 = time.perf_counter()
            outs = _floats(outputs.pop(j))
            grads: Sequence[torch.Tensor | None] = gradients.pop(j, []) or [None] * len(outs)
            pairs = [(o, g) for o, g in zip(outs, grads, strict=True) if o.requires_grad]
            if pairs:
                torch.autograd.backward(
                    [o for o, _ in pairs], [g for _, g in pairs] if next_ is not None else None
                )
            saved_bytes.pop(j, None)
            stats.busy_s += time.perf_counter() - t0
        elif ins.op is Op.SEND_GRADIENT:
            sent = [t.grad if t.grad is not None else torch.zeros_like(t) for t in _floats(received.pop(j))]
            pending += send_tensors(sent, _peer(prev, ins, stage.index), with_header=False, group=group)
    stats.span_s = time.perf_counter() - started
    for handle, _ in pending:
        handle.wait()
    return loss_sum, stats
