"""Cutting a model into pipeline stages: its chain of layers, and where to cut it.

A model can be pipelined when its forward is a *chain* (`SUPPORTED_SHAPES`): each child's output is the whole
input of the next, with ``nn.Sequential`` and ``nn.ModuleList`` children expanded into their elements (so
``blocks.0``, ``blocks.1``, … may land on different stages). loom cannot see a ``forward`` that does more (a
residual around two children, a child called twice): such a model must be written as a chain, e.g. an
encoder–decoder as ``embed → encoder → decoder → head``, each module passing a tuple of tensors on.

Cut points are given as names (the first layer of each later stage) or chosen by `balanced_cuts` over parameter
counts or measured times (`layer_times`); a cut between layers that share a parameter is refused.
"""

from __future__ import annotations

import inspect
import itertools
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = [
    "balanced_cuts",
    "chain_layers",
    "cuts_from_names",
    "layer_times",
    "refuse_shared_parameters",
    "stage_ranges",
]


def chain_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's chain of ``(qualified name, module)`` (the module docstring's). Refuses (ValueError, naming the
    layer) what cannot be a link, so that `Pipeline.setup` fails and not the first step: a layer without a
    ``forward`` of its own (an ``nn.ModuleDict``, a container inside an ``nn.Sequential``), and one needing
    several arguments right after a ``torch.nn`` layer returning one tensor (PyTorch's tutorial's ``layer(h, h)``)."""
    layers: list[tuple[str, nn.Module]] = []
    for name, child in model.named_children():
        if isinstance(child, (nn.Sequential, nn.ModuleList)) and not isinstance(model, nn.Sequential):
            layers += [(f"{name}.{sub}", module) for sub, module in child.named_children()]
        else:
            layers.append((name, child))
    if not layers:
        raise ValueError(f"{type(model).__name__} has no child modules to split into pipeline stages")
    for i, (name, layer) in enumerate(layers):
        if type(layer).forward is nn.Module.forward:
            _refuse(model, f"its layer {name!r} ({type(layer).__name__}) has no forward of its own")
        needed = _required_arguments(layer)
        if i and needed > 1 and _returns_one_tensor(layers[i - 1][1]):
            _refuse(
                model,
                f"its layer {name!r} ({type(layer).__name__}) needs {needed} arguments, but the layer before it, "
                f"{layers[i - 1][0]!r} ({type(layers[i - 1][1]).__name__}), returns one tensor",
            )
    return layers


SUPPORTED_SHAPES = (
    "an nn.Sequential, or a module whose children (nn.Sequential and nn.ModuleList expanded into their "
    "elements) are called in registration order, each on the whole output of the one before (a tuple output "
    "is the next layer's arguments)"
)


def _refuse(model: nn.Module, why: str) -> None:
    raise ValueError(
        f"Pipeline cannot cut {type(model).__name__} into stages: {why}. loom cuts a chain: {SUPPORTED_SHAPES}. "
        "A forward that does more (loops over an nn.ModuleDict, calls a layer as layer(h, h), adds a residual "
        "around children) is not seen. HINT: rewrite the model as such a chain (e.g. nn.Sequential(embedding, "
        "*blocks, norm, head), each block taking the previous output), or train it with a strategy that runs "
        "the model's own forward: DataParallel, ShardedDataParallel or TensorParallel."
    )


def _required_arguments(layer: nn.Module) -> int:
    """Positional parameters of ``layer.forward`` without a default (0 when it takes ``*args``)."""
    try:
        params = inspect.signature(layer.forward).parameters.values()
    except (TypeError, ValueError):
        return 0
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return 0
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in positional and p.default is p.empty for p in params)


_TUPLE_RETURNING = (nn.RNNBase, nn.MultiheadAttention, nn.Transformer)


def _returns_one_tensor(layer: nn.Module) -> bool:
    """Whether ``layer`` is a ``torch.nn`` layer known to return a single tensor (not a container, not a
    recurrent or attention layer, which return tuples); user modules may return anything."""
    if not type(layer).__module__.startswith("torch.nn.modules."):
        return False
    containers = (nn.Sequential, nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)
    return not isinstance(layer, (*containers, *_TUPLE_RETURNING))


def _check_stage_count(stages: int, n_layers: int) -> None:
    if stages > n_layers:
        raise ValueError(
            f"cannot split {n_layers} layers into {stages} pipeline stages (more stages than layers). "
            f"HINT: use at most {n_layers} stages, or a model with more layers."
        )


def cuts_from_names(layers: Sequence[tuple[str, nn.Module]], names: Sequence[str], stages: int) -> list[int]:
    """Indices of the first layer of stages 1..p-1, from the names where each of those stages begins."""
    _check_stage_count(stages, len(layers))
    if len(names) != stages - 1:
        raise ValueError(
            f"split={list(names)} names {len(names)} cut points, but {stages} stages need {stages - 1} "
            "(the first layer of every stage after the first)"
        )
    index = {name: i for i, (name, _) in enumerate(layers)}
    unknown = [name for name in names if name not in index]
    if unknown:
        raise ValueError(
            f"split point {unknown[0]!r} is not a layer of the model's chain; the layers are "
            f"{[n for n, _ in layers]}"
        )
    cuts = [index[name] for name in names]
    if cuts != sorted(set(cuts)) or cuts[0] == 0:
        raise ValueError(
            f"split points {list(names)} must be distinct, in chain order, and not the first layer "
            f"{layers[0][0]!r} (positions {cuts})"
        )
    return cuts


def balanced_cuts(weights: Sequence[float], stages: int) -> list[int]:
    """Contiguous cut points minimising the heaviest stage (ties: the earliest cuts), every stage non-empty.

    Dynamic programming over prefixes, exact for the small layer counts of a chain (O(p · L²)).
    """
    n = len(weights)
    _check_stage_count(stages, n)
    prefix = list(itertools.accumulate((float(w) for w in weights), initial=0.0))
    inf = float("inf")
    # best[k][i]: smallest possible heaviest stage when the first i layers form k stages.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    choice = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], choice[k][i] = cost, j
    cuts, i = [], n
    for k in range(stages, 1, -1):
        i = choice[k][i]
        cuts.append(i)
    return sorted(cuts)


def stage_ranges(cuts: Sequence[int], n_layers: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` of each stage's layers from the cut points."""
    return list(itertools.pairwise([0, *cuts, n_layers]))


def layer_times(layers: list[tuple[str, nn.Module]], sample: Any, repeats: int = 3) -> list[float]:
    """Forward+backward time of each layer on the activations ``sample`` produces (best of ``repeats``)."""
    times, x = [], sample
    for _, layer in layers:
        best = float("inf")
        for _ in range(repeats):
            inputs = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in _as_tuple(x))
            started = time.perf_counter()
            out = layer(*inputs)
            floats = [t for t in _as_tuple(out) if t.is_floating_point() and t.requires_grad]
            if floats:
                torch.autograd.backward(floats, [torch.ones_like(t) for t in floats])
            best = min(best, time.perf_counter() - started)
        layer.zero_grad(set_to_none=True)
        times.append(best)
        x = tuple(t.detach() for t in _as_tuple(out))
    return times


def _as_tuple(x: Any) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def refuse_shared_parameters(layers: list[tuple[str, nn.Module]], ranges: list[tuple[int, int]]) -> None:
    """Raise when one parameter belongs to layers of two stages (``ranges``: each stage's layer range)."""
    owner: dict[int, int] = {}
    for s, (a, b) in enumerate(ranges):
        for name, layer in layers[a:b]:
            for pname, p in layer.named_parameters():
                if owner.setdefault(id(p), s) != s:
                    raise ValueError(
                        f"parameter {name}.{pname} is shared by stages {owner[id(p)]} and {s}. "
                        "HINT: untie the weights, or choose split points that keep the sharing layers together."
                    )
