"""ZeRO stage 1 on the data axis of a model-parallel job: ``Hybrid(dp=2, tp=2, zero=1)``, torchtitan's 2-D
layout with the optimizer state sharded over ``dp`` (Rajbhandari et al., 2020, P_os; the user's view:
docs/strategies/hybrid.md#a-sharded-data-axis-zero1).

`ShardedDataAxis` takes the place of `data_parallel_sync.GradientAveraging` in a model-parallel job: the
stage's trainable parameters are cut into one piece per ``dp`` replica by `sharded_flat.FlatShards` and the
optimizer steps this replica's piece. The schedule runs and is judged as without sharding; `average` averages
the gradients into the piece and frees the whole ones (only the piece is kept between steps, as in ZeRO-2);
`gather_parameters` gathers the updated pieces back. The result equals the unsharded data axis up to the order
of summation.

Limits: an elementwise optimizer; no ``compression`` (the codecs need the whole gradient); checkpoints resume
at the mesh and ``dp`` that wrote them. Stages 2 and 3 on this axis are not built: a pipeline stage's schedule
would have to gather parameters per micro-batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from loom.parallel.data.data_parallel_config import DataAxisConfig
from loom.parallel.data.sharded_flat import FlatShards
from loom.topology import Topology

__all__ = ["ShardedDataAxis"]


class ShardedDataAxis:
    """A model-parallel job's data axis with ZeRO stage 1 (the module docstring), with
    `data_parallel_sync.GradientAveraging`'s interface."""

    zero = 1

    def __init__(self, config: DataAxisConfig, shards: FlatShards, rank: int) -> None:
        self.config = config
        self.shards = shards
        """This replica's pieces of the stage's parameters (what the optimizer now steps)."""
        self.rank = rank
        """This process's global rank (for errors)."""

    @classmethod
    def for_stage(
        cls,
        config: DataAxisConfig,
        group: dist.ProcessGroup | None,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        topo: Topology,
    ) -> ShardedDataAxis:
        """Rebind ``optimizer`` to this replica's piece of ``module``'s parameters over ``group`` (the ``dp``
        axis; None: one replica, the piece is everything; compose checked that the optimizer is elementwise)."""
        collective = config.allreduce if topo.device.type == "cpu" else "reduce_scatter"
        return cls(config, FlatShards.over_group(module, optimizer, group, collective), topo.rank)

    def average(self, params: list[torch.Tensor]) -> None:
        """Average the gradients of the stage over ``dp`` into this replica's piece (``params`` are the stage's
        trainable parameters, which `FlatShards` already holds); free the whole gradients. Collective."""
        self.shards.average()

    def gather_parameters(self) -> None:
        """Every replica's updated piece into every replica's parameters. Collective over ``dp``."""
        self.shards.gather_parameters()

    def layout(self) -> dict[str, Any]:
        """How the optimizer state is cut: ``dp`` pieces of ``numel`` elements, this rank's ``[lo, hi)``."""
        s = self.shards
        return {"zero": 1, "dp": s.world_size, "numel": s.numel, "lo": s.lo, "hi": s.hi}

    def state_dict(self) -> dict[str, Any]:
        return {"compression": None, "sharded": self.layout()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Check that ``state`` was written by the same cut of the optimizer state (else a ValueError naming
        both: resharding the optimizer's pieces to another ``dp`` is not supported)."""
        saved, here = state.get("sharded"), self.layout()
        if saved != here:
            raise ValueError(
                f"rank {self.rank}: the checkpoint's data axis holds the optimizer state cut as {saved}, this "
                f"job's is cut as {here}; zero=1 resumes only at the dp and model layout that wrote it. HINT: "
                f"resume with dp={saved['dp'] if isinstance(saved, dict) else '<the one that wrote it>'} and the "
                "same model and mesh."
            )
