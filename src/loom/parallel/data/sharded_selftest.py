"""The backend self-test of `ShardedDataParallel` (docs/strategies/sharded.md#guards): before training, one tiny
averaged reduce-scatter and all-gather, checked against the values they must give.

Why: an averaged reduce-scatter that silently sums instead (PyTorch issue 162338, gloo; Accelerate #3979 is of
the same class) trains with gradients N times too large and nothing fails. Each rank contributes
``base + 1000 * (rank + 1)``, so the mean over N ranks, ``base + 500 * (N + 1)``, is told apart from a sum and
from a copy of one rank's values. Checked: stage 1's collectives as the job runs them and, for FSDP2, the
gradient of a tiny ``fully_shard``-ed layer (FSDP2's own reduce-scatter and divide factors). Every rank refuses
together, naming the backend and the collective.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from loom.comm import all_reduce
from loom.comm.shards import all_gather, piece_bounds, reduce_scatter
from loom.errors import BackendSelfTestError

__all__ = ["BackendSelfTestError", "check_collectives", "run_self_test"]


def _describe(got: torch.Tensor, mean: torch.Tensor, total: torch.Tensor) -> str:
    if torch.allclose(got, total):
        return "the sum over the ranks, where the mean was asked for"
    return f"{got.tolist()[:4]} where the mean {mean.tolist()[:4]} was expected"


def check_collectives(
    rank: int,
    world_size: int,
    reduce_scatter_fn: Callable[[torch.Tensor], torch.Tensor],
    all_gather_fn: Callable[[torch.Tensor, int], torch.Tensor],
) -> list[str]:
    """Run the averaged reduce-scatter and the all-gather on the test values; the problems found (empty: the
    collectives are right). The functions are injected so that a faulty backend can be simulated."""
    n = 2 * world_size + 1
    base = torch.arange(n, dtype=torch.float32)
    mine = base + 1000.0 * (rank + 1)
    mean = base + 500.0 * (world_size + 1)
    total = base * world_size + 500.0 * world_size * (world_size + 1)
    lo, hi = piece_bounds(n, rank, world_size)
    problems = []
    piece = reduce_scatter_fn(mine)
    if piece.shape != (hi - lo,) or not torch.allclose(piece, mean[lo:hi]):
        got = piece if piece.shape == (hi - lo,) else piece.reshape(-1)[: hi - lo]
        problems.append(f"averaged reduce-scatter returned {_describe(got, mean[lo:hi], total[lo:hi])}")
    gathered = all_gather_fn(mean[lo:hi].clone(), n)
    if gathered.shape != (n,) or not torch.equal(gathered, mean):
        problems.append("all-gather did not return every rank's piece in rank order")
    return problems


def _fsdp_gradient_problem(rank: int, world_size: int, device: torch.device) -> str | None:
    """FSDP2's averaged gradient of a tiny linear layer: ``x = rank + 1`` gives a gradient of the mean
    ``(N + 1) / 2`` in every element, ``N (N + 1) / 2`` if the backend summed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world_size,))
    layer = nn.Linear(1, 2 * world_size, bias=False).to(device)
    fully_shard(layer, mesh=mesh)
    x = torch.full((1, 1), float(rank + 1), device=device)
    layer(x).sum().backward()
    grad = layer.weight.grad.to_local().reshape(-1).cpu()  # type: ignore[union-attr]
    mean = torch.full_like(grad, (world_size + 1) / 2)
    if torch.allclose(grad, mean):
        return None
    return "FSDP2's averaged reduce-scatter of gradients returned " + _describe(grad, mean, mean * world_size)


def run_self_test(
    rank: int,
    world_size: int,
    backend: str,
    device: torch.device,
    fsdp: bool,
    group: dist.ProcessGroup | None,
    collective: str = "reduce_scatter",
) -> None:
    """Check the collectives this job will use (collective) over ``group`` (the job's); raise
    `BackendSelfTestError` on every rank when any rank found a problem. ``collective``: stage 1's,
    ``reduce_scatter`` or a `loom.comm.all_reduce` algorithm (then the reduce-scatter is that averaged
    all-reduce and a slice, as `FlatShards` does it)."""

    def averaged(t: torch.Tensor) -> torch.Tensor:
        if collective == "reduce_scatter":
            return reduce_scatter(t.to(device), op="avg", group=group).cpu()
        lo, hi = piece_bounds(t.numel(), rank, world_size)
        return all_reduce(t.to(device), op="avg", algorithm=collective, group=group)[lo:hi].cpu()

    def gathered(t: torch.Tensor, n: int) -> torch.Tensor:
        return all_gather(t.to(device), n, group=group).cpu()

    problems = check_collectives(rank, world_size, averaged, gathered)
    if fsdp and (found := _fsdp_gradient_problem(rank, world_size, device)):
        problems.append(found)
    flag = torch.tensor([float(bool(problems))], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if flag.item():
        detail = "; ".join(problems) if problems else "another rank found a problem (see its error)"
        raise BackendSelfTestError(
            f"rank {rank}: the {backend} backend failed ShardedDataParallel's self-test over {world_size} "
            f"processes: {detail}. Training would be silently wrong, so it is refused. HINT: update PyTorch, "
            "or use loom.DataParallel, whose all-reduce does not depend on this collective."
        )
