"""A named process mesh ``dp × pp × tp``: validated once, one process group per axis (examples: docs/concepts.md).

Every process has a coordinate on each axis: ``dp`` (outermost: replicas that see different shares of the global
batch), ``pp`` (pipeline stage ``i`` on coordinate ``i``) and ``tp`` (innermost: shards of single layers). Ranks
are row-major with ``tp`` fastest: ``rank = (dp_i * pp + pp_i) * tp + tp_i``. Tensor parallelism exchanges the
most data (collectives inside every layer), so its groups are neighbouring ranks, which launchers place on one
host; data parallelism exchanges the least (once per step) and spans hosts. This is the order of Megatron-LM
(Shoeybi et al. 2019; Narayanan et al. 2021) and of torchtitan's ``ParallelDims``.

`MeshShape` is the pure arithmetic, testable without processes. `Mesh` validates the shape against the world
size once and creates the groups: ``dist.new_group`` must be called by every process for every group in the same
order, so each axis's groups are created everywhere and a process keeps its own. Nothing is stored in module
globals; the mesh is handed to strategies explicitly.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from loom.errors import check_choice, check_int
from loom.topology import Topology, current

__all__ = ["AXES", "REPLICA", "Mesh", "MeshShape"]

AXES = ("dp", "pp", "tp")
"""Axis names, outermost first."""
REPLICA = "replica"
"""Not an axis: the group of the ranks of one model replica (all ``pp`` × ``tp`` coordinates of a ``dp`` index)."""


@dataclass(frozen=True)
class MeshShape:
    """Degrees of the three axes; their product is the number of processes the mesh needs."""

    dp: int = 1
    """Data-parallel degree: replicas over which the global batch is sharded."""
    pp: int = 1
    """Pipeline-parallel degree: stages the model's layers are split into."""
    tp: int = 1
    """Tensor-parallel degree: shards of each split layer."""

    def __post_init__(self) -> None:
        for axis in AXES:
            check_int(f"mesh degree {axis}", getattr(self, axis))

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    def size(self, axis: str) -> int:
        return getattr(self, _check_axis(axis))

    def describe(self) -> str:
        return " × ".join(f"{axis}={self.size(axis)}" for axis in AXES)

    def check_world_size(self, world_size: int) -> None:
        """Raise a `ValueError` naming every degree and the world size unless their product matches."""
        if self.world_size != world_size:
            raise ValueError(
                f"mesh {self.describe()} needs {self.world_size} processes, but the world size is {world_size}. "
                f"HINT: choose degrees whose product is {world_size}, or launch {self.world_size} processes."
            )

    def coordinates(self, rank: int) -> dict[str, int]:
        """The ``{axis: index}`` of global ``rank`` (tp fastest, dp slowest)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside mesh {self.describe()} of {self.world_size} processes")
        rest, tp_i = divmod(rank, self.tp)
        dp_i, pp_i = divmod(rest, self.pp)
        return {"dp": dp_i, "pp": pp_i, "tp": tp_i}

    def rank_at(self, dp: int = 0, pp: int = 0, tp: int = 0) -> int:
        """The global rank at a coordinate."""
        for axis, index in zip(AXES, (dp, pp, tp), strict=True):
            if not 0 <= index < self.size(axis):
                raise ValueError(f"{axis} index {index} is outside 0..{self.size(axis) - 1}")
        return (dp * self.pp + pp) * self.tp + tp

    def ranks_along(self, axis: str, rank: int) -> list[int]:
        """Global ranks that share every coordinate of ``rank`` except ``axis``, in axis order."""
        coords = self.coordinates(rank)
        return [self.rank_at(**{**coords, _check_axis(axis): i}) for i in range(self.size(axis))]

    def groups(self, axis: str) -> list[list[int]]:
        """Every group along ``axis``: the whole world partitioned, in a deterministic order.

        ``axis`` may also be ``"replica"``: the ranks of one model replica (every ``pp`` and ``tp`` coordinate
        of one ``dp`` index), which must see the same samples."""
        if axis == REPLICA:
            per_replica = self.pp * self.tp
            return [list(range(d * per_replica, (d + 1) * per_replica)) for d in range(self.dp)]
        # each group once, from its first member (the one at index 0 on the axis), in rank order
        first = [r for r in range(self.world_size) if self.coordinates(r)[_check_axis(axis)] == 0]
        return [self.ranks_along(axis, r) for r in first]


def _check_axis(axis: str) -> str:
    check_choice("mesh axis", axis, AXES)
    return axis


class Mesh:
    """This process's place on a ``dp × pp × tp`` mesh, with a process group per axis.

    ``Mesh(dp=2, pp=2)`` on 4 processes: validated against the world size on construction (the error names the
    degrees and the world size), then ``group("pp")`` is the group of this process's pipeline, ``index("pp")`` its
    stage, ``peer("pp", i)`` the global rank of stage ``i`` of the same pipeline. An axis of size 1 has no group
    (`group` returns ``None`` and collectives along it are skipped).
    """

    def __init__(self, dp: int = 1, pp: int = 1, tp: int = 1, *, topology: Topology | None = None) -> None:
        self.shape = MeshShape(dp, pp, tp)
        self.topology = topology if topology is not None else current()
        self.shape.check_world_size(self.topology.world_size)
        self.rank = self.topology.rank
        self.coordinates = self.shape.coordinates(self.rank)
        self._groups: dict[str, Any] = {}
        if self.topology.is_distributed:
            for axis in (*AXES, REPLICA):
                for ranks in self.shape.groups(axis):
                    if len(ranks) == 1:
                        break  # an axis of size 1 has no group
                    # An axis spanning the world is the job's group: no second set of connections.
                    whole = len(ranks) == self.shape.world_size
                    group = self.topology.group if whole else dist.new_group(ranks)
                    if self.rank in ranks:
                        self._groups[axis] = group

    def __repr__(self) -> str:
        return f"Mesh({self.shape.describe()}, rank={self.rank}, coordinates={self.coordinates})"

    def size(self, axis: str) -> int:
        return self.shape.size(axis)

    def index(self, axis: str) -> int:
        """This process's coordinate on ``axis``."""
        return self.coordinates[_check_axis(axis)]

    def group(self, axis: str) -> Any:
        """The process group along ``axis`` (or ``"replica"``) this process belongs to, or ``None`` when it
        holds this process alone."""
        return self._groups.get(axis if axis == REPLICA else _check_axis(axis))

    def ranks(self, axis: str) -> list[int]:
        """Global ranks of this process's group along ``axis`` (or ``"replica"``)."""
        if axis == REPLICA:
            return next(g for g in self.shape.groups(REPLICA) if self.rank in g)
        return self.shape.ranks_along(axis, self.rank)

    def peer(self, axis: str, index: int) -> int:
        """Global rank of the process at ``index`` on ``axis`` and this process's coordinates elsewhere."""
        return self.shape.rank_at(**{**self.coordinates, _check_axis(axis): index})

    def data_topology(self) -> Topology:
        """A `Topology` whose ranks are the data-parallel replicas, for ``loom.data.loader(topology=...)``: every
        process of one replica (all its stages and tensor shards) loads the same share. The rest is this process's
        topology, its process group included (the job's group, what a loader's same-data check compares over)."""
        return dataclasses.replace(self.topology, rank=self.index("dp"), world_size=self.size("dp"))
