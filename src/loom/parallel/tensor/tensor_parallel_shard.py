"""The tensor-parallel transform: `TensorParallelConfig`, the plan (`auto_plan`) and the stage's layers split over
the ``tp`` group (`shard_stage`, `apply_tensor_parallel`), with `TensorShards` to gather them back.

`loom.parallel.model.compose` applies it for `TensorParallel` and `Hybrid`; the layers themselves are
`tensor_parallel_layers`; the patterns and limits: docs/strategies/tensor-parallel.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from loom.config_docs import document_options
from loom.errors import check_int
from loom.mesh import Mesh
from loom.parallel.pipeline.pipeline_runtime import PipelineStage
from loom.parallel.tensor.tensor_parallel_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelComm,
    VocabParallelEmbedding,
    copy_to_parallel,
)

__all__ = [
    "TensorParallelConfig",
    "TensorShards",
    "apply_tensor_parallel",
    "auto_plan",
    "mlp_pairs",
    "shard_stage",
]

KINDS = ("mlp", "attention", "embedding")
_Q_K_V = ("q_proj", "k_proj", "v_proj")
_HEADS = ("n_heads", "num_heads", "n_head")


@dataclass(frozen=True)
class TensorParallelConfig:
    """How `TensorParallel` splits layers."""

    size: int
    """Tensor-parallel degree ``t``: processes each layer is split over."""
    plan: Any = "auto"
    """``"auto"``, or ``{module name: "mlp" | "attention" | "embedding"}``."""

    def __post_init__(self) -> None:
        check_int("size", self.size)
        if isinstance(self.plan, str):
            if self.plan != "auto":
                raise ValueError(f'plan must be "auto" or a dict of module name -> kind, got {self.plan!r}')
        elif not isinstance(self.plan, dict) or any(kind not in KINDS for kind in self.plan.values()):
            raise ValueError(f"plan must map module names to one of {KINDS}, got {self.plan!r}")


def _is_attention(module: nn.Module) -> bool:
    has_linears = all(isinstance(getattr(module, n, None), nn.Linear) for n in (*_Q_K_V, "out_proj"))
    return has_linears and any(isinstance(getattr(module, h, None), int) for h in _HEADS)


_ELEMENTWISE = (
    nn.ReLU, nn.GELU, nn.Tanh, nn.Sigmoid, nn.SiLU, nn.LeakyReLU, nn.ELU, nn.Mish, nn.Hardtanh, nn.Softplus,
    nn.Identity, nn.Dropout,
)  # fmt: skip
"""Modules that act on each hidden unit alone, so they may sit between a column- and a row-parallel linear."""


def _is_chain(module: nn.Module) -> bool:
    """Modules whose children run in their order: ``nn.Sequential``, and the layers of a pipeline stage."""
    return isinstance(module, (nn.Sequential, nn.ModuleList))


def _chain_pairs(module: nn.Module) -> list[tuple[str, str]]:
    """The ``(first, second)`` children of a chain that form ``Linear → [elementwise] → Linear`` with matching
    sizes, left to right, each child in at most one pair."""
    children = list(module.named_children())
    pairs, i = [], 0
    while i < len(children):
        name, first = children[i]
        for gap in (1, 2):
            if i + gap >= len(children) or not isinstance(first, nn.Linear):
                continue
            between = [c for _, c in children[i + 1 : i + gap]]
            second_name, second = children[i + gap]
            if (
                isinstance(second, nn.Linear)
                and all(isinstance(c, _ELEMENTWISE) for c in between)
                and first.out_features == second.in_features
            ):
                pairs.append((name, second_name))
                i += gap
                break
        i += 1
    return pairs


def mlp_pairs(module: nn.Module) -> list[tuple[str, str]]:
    """The Linear pairs of an MLP block: consecutive pairs of a chain, or a block's two Linear children
    (``fc1``, ``fc2``, the activation applied in its ``forward``)."""
    if _is_chain(module):
        return _chain_pairs(module)
    linears = [(n, c) for n, c in module.named_children() if isinstance(c, nn.Linear)]
    if len(linears) != 2 or len(list(module.children())) > 4:
        return []
    (first_name, first), (second_name, second) = linears
    return [(first_name, second_name)] if first.out_features == second.in_features else []


def auto_plan(model: nn.Module, allow_empty: bool = False) -> dict[str, str]:
    """The blocks of ``model`` that match the patterns of docs/strategies/tensor-parallel.md; attention first, and
    no MLP inside an attention module."""
    plan: dict[str, str] = {}
    for name, module in model.named_modules():
        if any(name.startswith(a + ".") for a, kind in plan.items() if kind == "attention"):
            continue
        if _is_attention(module):
            plan[name] = "attention"
        elif mlp_pairs(module):
            plan[name] = "mlp"
        elif isinstance(module, nn.Embedding):
            plan[name] = "embedding"
    if not plan and not allow_empty:
        raise ValueError(
            f"plan='auto' found no MLP, attention or embedding block to split in {type(model).__name__}. "
            "HINT: pass plan={'module.name': 'mlp' | 'attention' | 'embedding'}."
        )
    return plan


def _enter_block(module: nn.Module, comm: TensorParallelComm) -> None:
    """The ``f`` operator at the block's input: the input gradient is summed over the tp ranks once."""

    def hook(_module: nn.Module, args: tuple) -> tuple:
        return tuple(copy_to_parallel(a, comm) if isinstance(a, torch.Tensor) else a for a in args)

    module.register_forward_pre_hook(hook)


def _split_attention(name: str, module: nn.Module, comm: TensorParallelComm, dims: dict[int, int]) -> None:
    attr = next(h for h in _HEADS if isinstance(getattr(module, h, None), int))
    heads = getattr(module, attr)
    if heads % comm.size:
        raise ValueError(
            f"tensor parallelism of size {comm.size} cannot split the {heads} attention heads of {name!r}. "
            f"HINT: choose a tensor-parallel size that divides {heads}."
        )
    projections: dict[str, nn.Linear] = {}
    for proj in (*_Q_K_V, "out_proj"):
        linear = getattr(module, proj, None)
        if not isinstance(linear, nn.Linear):
            raise ValueError(
                f"module {name!r} planned as 'attention' needs an nn.Linear {proj!r}, got "
                f"{type(linear).__name__}. HINT: see the 'attention' pattern in docs/strategies/tensor-parallel.md."
            )
        projections[proj] = linear
    for proj, linear in projections.items():
        split = RowParallelLinear if proj == "out_proj" else ColumnParallelLinear
        what = "in_features " if proj == "out_proj" else ""
        layer = split(linear, comm, f"{name}.{proj} {what}(heads={heads})")
        setattr(module, proj, layer)
        dims.update(layer.shard_dims)
    setattr(module, attr, heads // comm.size)
    _enter_block(module, comm)


def _split_mlp(name: str, module: nn.Module, comm: TensorParallelComm, dims: dict[int, int]) -> None:
    pairs = mlp_pairs(module)
    if not pairs:
        raise ValueError(
            f"module {name!r} planned as 'mlp' has no Linear pair to split: it needs two Linear children (fc1, "
            "fc2) or, in an nn.Sequential, Linear -> activation -> Linear with matching sizes"
        )
    for first_name, second_name in pairs:
        first, second = getattr(module, first_name), getattr(module, second_name)
        col = ColumnParallelLinear(first, comm, f"the hidden size of {name!r} ({first_name}.out_features)")
        row = RowParallelLinear(second, comm, f"the hidden size of {name!r} ({second_name}.in_features)")
        setattr(module, first_name, col)
        setattr(module, second_name, row)
        dims.update(col.shard_dims | row.shard_dims)
        # ``f`` at the pair's input: the block's input for a block, the first linear's inside a chain.
        _enter_block(col if _is_chain(module) else module, comm)


def apply_tensor_parallel(model: nn.Module, plan: Any, comm: TensorParallelComm) -> dict[int, int]:
    """Split the planned blocks of ``model`` in place; returns ``{id(parameter): shard dim}`` of the shards."""
    plan = auto_plan(model) if plan == "auto" else dict(plan)
    modules = dict(model.named_modules())
    dims: dict[int, int] = {}
    for name, kind in plan.items():
        if name not in modules:
            raise ValueError(f"tensor-parallel plan names {name!r}, which is not a module of the model")
        module = modules[name]
        if kind == "attention":
            _split_attention(name, module, comm, dims)
        elif kind == "mlp":
            _split_mlp(name, module, comm, dims)
        else:
            if not isinstance(module, nn.Embedding):
                raise ValueError(f"module {name!r} planned as 'embedding' is a {type(module).__name__}")
            parent_name, _, child = name.rpartition(".")
            layer = VocabParallelEmbedding(module, comm)
            setattr(modules[parent_name] if parent_name else model, child, layer)
            dims.update(layer.shard_dims)
    return dims


def _stage_plan(stage: PipelineStage, plan: Any) -> Any:
    """A plan in the full model's names, restricted to ``stage`` and renamed into it (``layers.<i>...``)."""
    if plan == "auto":
        return auto_plan(stage, allow_empty=stage.stages > 1)  # a stage may hold nothing to split
    renamed = {}
    for key, kind in plan.items():
        for i, layer in enumerate(stage.layer_names):
            if layer == "":
                renamed[f"layers.{i}.{key}"] = kind
            elif key == layer or key.startswith(layer + "."):
                renamed[f"layers.{i}{key[len(layer) :]}"] = kind
    if stage.stages == 1 and len(renamed) != len(plan):
        raise ValueError(f"tensor-parallel plan {plan} names modules that are not in the model")
    return renamed


@dataclass
class TensorShards:
    """What tensor parallelism did to a stage: its tp group and the shard dim of each split parameter."""

    comm: TensorParallelComm
    dims: dict[int, int]
    """``{id(parameter): dim}`` of the parameters split across the tp group."""

    def gather(self, stage: PipelineStage) -> dict[str, torch.Tensor]:
        """The stage's whole tensors, under the full model's names; collective over the tp group."""
        out = {}
        for key, value in stage.named_state(keep_vars=True).items():
            t = value.detach()
            if id(value) in self.dims and self.comm.group is not None:
                parts = [torch.empty_like(t) for _ in range(self.comm.size)]
                dist.all_gather(parts, t.contiguous(), group=self.comm.group)
                t = torch.cat(parts, dim=self.dims[id(value)])
            out[key] = t
        return out

    def layout(self, stage: PipelineStage) -> dict[str, Any]:
        """The shard layout recorded with the stage's state: tp size and rank, shard dim by name."""
        named = stage.named_state(keep_vars=True)
        return {
            "size": self.comm.size,
            "rank": self.comm.rank,
            "shard_dims": {key: self.dims[id(v)] for key, v in named.items() if id(v) in self.dims},
        }


def shard_stage(stage: PipelineStage, mesh: Mesh, plan: Any) -> TensorShards | None:
    """Split the planned blocks of ``stage`` over the mesh's ``tp`` axis in place (None when tp = 1)."""
    if mesh.size("tp") == 1:
        return None
    comm = TensorParallelComm(mesh.group("tp"), mesh.index("tp"), mesh.size("tp"))
    return TensorShards(comm, apply_tensor_parallel(stage, _stage_plan(stage, plan), comm))


document_options(TensorParallelConfig, TensorParallelConfig)
