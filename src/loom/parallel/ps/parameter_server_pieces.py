"""How a parameter-server worker's parameters map onto the servers' pieces (`loom.ps.plan`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from loom.ps.plan import ParamSpec, Piece

__all__ = ["json_hyperparameters", "param_specs", "piece_gradients", "piece_view", "set_pieces"]


def param_specs(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[list[ParamSpec], dict]:
    """The trainable parameters for the plan (a sparse table by rows, anything else flat), and the sparse tables'
    modules by parameter name."""
    group_of = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
    sparse_modules = {
        f"{prefix}.weight" if prefix else "weight": m
        for prefix, m in model.named_modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
    }
    specs = []
    for name, p in model.named_parameters():
        if id(p) not in group_of or not p.requires_grad:
            continue  # frozen: stays on the worker
        rows, width = (p.shape[0], p.shape[1]) if name in sparse_modules else (p.numel(), 1)
        specs.append(ParamSpec(name, rows, width, name in sparse_modules, group_of[id(p)]))
    return specs, {n: m for n, m in sparse_modules.items() if any(s.name == n for s in specs)}


def json_hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """An optimizer param group as the servers receive it (JSON, without ``params``)."""

    def convert(key: str, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            return value.item()
        if isinstance(value, (list, tuple)):
            return [convert(key, v) for v in value]
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise TypeError(f"optimizer hyperparameter {key}={value!r} cannot be sent to the parameter servers")

    return {k: convert(k, v) for k, v in group.items() if k != "params"}


def piece_view(param: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The values of ``piece`` inside ``param`` (a view, writable)."""
    return (param.data if piece.sparse else param.data.view(-1))[piece.start : piece.stop]


def set_pieces(params: dict[str, torch.Tensor], plan: list[Piece], values: dict[int, torch.Tensor]) -> None:
    """Write piece values (by piece id, as the servers hold them) into the parameters ``params`` (by name)."""
    by_id = {p.id: p for p in plan}
    for pid, value in values.items():
        piece = by_id[pid]
        view = piece_view(params[piece.name], piece)  # of .data: autograd sees no write
        view.copy_(value.view_as(view))


def piece_gradients(
    params: dict[str, torch.Tensor], plan: list[Piece], num_servers: int
) -> list[dict[str, torch.Tensor]]:
    """Per server: ``g<id>`` dense gradient slices; for sparse pieces ``r<id>`` rows and ``g<id>`` values."""
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(num_servers)]
    sparse_cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for piece in plan:
        grad = params[piece.name].grad
        if grad is None:
            continue
        target = out[piece.server]
        if not piece.sparse:
            target[f"g{piece.id}"] = grad.reshape(-1)[piece.start : piece.stop]
            continue
        if piece.name not in sparse_cache:
            g = (grad if grad.is_sparse else grad.to_sparse(1)).coalesce()
            sparse_cache[piece.name] = (g.indices()[0], g.values())
        rows, values = sparse_cache[piece.name]
        mask = (rows >= piece.start) & (rows < piece.stop)
        target[f"r{piece.id}"] = rows[mask] - piece.start
        target[f"g{piece.id}"] = values[mask]
    return out
