"""Which server holds which part of which parameter: a size-balanced assignment of pieces to servers.

Every parameter is seen as a matrix of rows: an embedding table (``nn.Embedding(sparse=True)``) as its ``V x D``
rows, so pieces are row ranges that can be pulled row by row; every other parameter as its flattened elements
(rows of width 1). The parameters, in model order, are laid end to end and the line is cut into ``K`` equal key
ranges, one per server, as in Li et al. (OSDI 2014, "Scaling distributed machine learning with the parameter
server"). A parameter straddling a boundary is split there (on a row boundary for tables), so every server holds
``total / K`` values to within one table row, and at most ``K - 1`` parameters are split.

Cutting a parameter is exact only for optimizers that update each element from its own gradient and state, which
is why the server accepts only those (`loom.ps.shard.ELEMENTWISE_OPTIMIZERS`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from loom.ps.wire import WireLimits

__all__ = ["ParamSpec", "Piece", "check_frames", "plan_shards", "server_loads"]


@dataclass(frozen=True)
class ParamSpec:
    """A parameter as the planner sees it."""

    name: str
    rows: int
    """Embedding rows, or the number of elements for a dense parameter."""
    width: int
    """Elements per row (the embedding dimension; 1 for dense parameters)."""
    sparse: bool
    group: int
    """Index of the optimizer param group the parameter belongs to."""

    @property
    def numel(self) -> int:
        return self.rows * self.width


@dataclass(frozen=True)
class Piece:
    """Rows ``[start, stop)`` of parameter ``name``, held by server ``server`` under id ``id``."""

    id: int
    name: str
    start: int
    stop: int
    width: int
    sparse: bool
    group: int
    server: int

    @property
    def rows(self) -> int:
        return self.stop - self.start

    @property
    def numel(self) -> int:
        return self.rows * self.width

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(data: dict[str, Any]) -> Piece:
        return Piece(**{k: data[k] for k in Piece.__dataclass_fields__})


def plan_shards(params: list[ParamSpec], num_servers: int) -> list[Piece]:
    """Cut and place ``params`` on ``num_servers`` servers; deterministic in the order and shapes given."""
    if num_servers < 1:
        raise ValueError(f"num_servers must be >= 1, got {num_servers}")
    total = sum(p.numel for p in params)
    bounds = [total * s // num_servers for s in range(num_servers + 1)]
    pieces: list[Piece] = []
    offset = 0
    for spec in params:
        row = 0
        while row < spec.rows:
            position = offset + row * spec.width
            server = max(s for s in range(num_servers) if bounds[s] <= position)
            # this server's range ends at bounds[server + 1]; cut there, on a row boundary, at least one row on
            rows_left = -(-(bounds[server + 1] - position) // spec.width)
            stop = min(spec.rows, row + max(1, rows_left))
            pieces.append(
                Piece(len(pieces), spec.name, row, stop, spec.width, spec.sparse, spec.group, server)
            )
            row = stop
        offset += spec.numel
    return pieces


def server_loads(pieces: list[Piece], num_servers: int) -> list[int]:
    """Elements held by each server."""
    loads = [0] * num_servers
    for piece in pieces:
        loads[piece.server] += piece.numel
    return loads


def check_frames(plan: list[Piece], params: Mapping[str, torch.Tensor], servers: int) -> None:
    """Refuse a model whose share on one server does not fit one frame: each server's pieces travel together
    (INIT, every push and reply), and a frame above the wire's payload limit is dropped by its receiver, which
    would leave the workers waiting for an answer that never comes."""
    limit = WireLimits().max_payload
    held = [0] * servers
    for piece in plan:
        held[piece.server] += piece.numel * params[piece.name].element_size()
    if max(held) > limit:
        server = held.index(max(held))
        raise ValueError(
            f"ParameterServer: server {server} of {servers} would hold {max(held)} bytes of this model's "
            f"parameters, above the {limit} bytes one parameter-server frame carries. HINT: launch with more "
            f"servers (loom run --servers {servers * math.ceil(max(held) / limit)} or more)"
        )
