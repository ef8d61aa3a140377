"""Worker of ``python -m loom_bench.model_parallel``: loom's model parallelism vs PyTorch's own, in one job.

For each configuration (``--configs``: ``pp:<model>:<schedule>:<microbatches>`` or ``tp:<model>``) it builds
both implementations from the same initial model, runs two warm-up steps each, then ``--rounds`` rounds; in each
round loom, PyTorch, loom with its messages through the backend (gloo: the path before shared memory) and the
one-process model each run ``--steps`` training steps, in an order that rotates from round to round so that a
slow minute on the shared machine hits them all. A round's figure is the slowest
rank's seconds per step. The one-process model runs on rank 0 while the other ranks wait in a barrier.

- Pipeline: ``loom.Pipeline(stages=world, ...)`` vs ``torch.distributed.pipelining`` (``PipelineStage`` on the
  same layers, ``ScheduleGPipe`` / ``Schedule1F1B``), the same cut (stage ``i`` gets the same layers in both).
- Tensor parallel: ``loom.TensorParallel(size=world)`` vs DTensor's ``parallelize_module`` with
  ``ColwiseParallel`` / ``RowwiseParallel`` on the same linears (attention: q, k, v column-, out row-wise).

Both sides train with SGD on the same batch; the first step's loss of each is recorded as a sanity check (they
start from the same weights on the same batch, so they must agree to rounding). Rank 0 writes the JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import loom
from loom.parallel.pipeline.pipeline_communications import backend_messages
from loom.parallel.pipeline.pipeline_split import chain_layers
from loom.parallel.tensor.tensor_parallel_layers import TensorParallelComm

__all__ = ["main"]

WIDTH, BLOCKS, BATCH = 256, 8, 64
VOCAB, DIM, HEADS, LAYERS, SEQ, TBATCH = 512, 64, 4, 8, 32, 16


def mlp_chain() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], Callable]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(BLOCKS)])
    g = torch.Generator().manual_seed(1)
    return model, (torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)), F.mse_loss


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.out = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def _token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def transformer() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], Callable]:
    """PyTorch's pipelining tutorial's shape, smaller: embedding, pre-norm encoder layers, norm + vocabulary head."""
    torch.manual_seed(0)
    layers = [
        nn.TransformerEncoderLayer(DIM, HEADS, 4 * DIM, dropout=0.0, batch_first=True, norm_first=True)
        for _ in range(LAYERS)
    ]
    model = nn.Sequential(nn.Embedding(VOCAB, DIM), *layers, _Head())
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (TBATCH, SEQ + 1), generator=g)
    return model, (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()), _token_loss


class Attention(nn.Module):
    """Multi-head self-attention written out (q, k, v, out projections), as loom's and DTensor's plans expect."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(dim, dim) for _ in range(3))
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2) for p in self._qkv())
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))

    def _qkv(self) -> tuple[nn.Module, nn.Module, nn.Module]:
        return self.q_proj, self.k_proj, self.v_proj


def tp_model(kind: str) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], dict[str, str]]:
    """The model, a batch, and which linears DTensor splits how (``col`` / ``row``)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if kind == "mlp":  # two Megatron MLP blocks
        model = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
                                for _ in range(2)])  # fmt: skip
        plan = {f"{i}.0": "col" for i in range(2)} | {f"{i}.2": "row" for i in range(2)}
        return model, (torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)), plan
    model = nn.Sequential(Attention(4 * DIM, 8))
    plan = {"0.q_proj": "col", "0.k_proj": "col", "0.v_proj": "col", "0.out_proj": "row"}
    shape = (TBATCH, SEQ, 4 * DIM)
    return model, (torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)), plan


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01, foreach=False)


def loom_pipeline(model, batch, loss_fn, schedule: str, m: int) -> tuple[Callable[[], float], list[str]]:
    world = dist.get_world_size()
    names = [name for name, _ in chain_layers(model)]
    cuts = _cuts(names, world)
    strategy = loom.Pipeline(
        stages=world, microbatches=m, schedule=schedule, split=[names[c] for c in cuts[1:-1]]
    )
    job = strategy.setup(model, _sgd(model), loss_fn)
    return (lambda: job.train_step(batch)), names


def _cuts(names: list[str], stages: int) -> list[int]:
    """Stage boundaries over the chain: the blocks in between shared evenly, the first and last layer added to
    the first and last stage (the embedding and the head of the transformer)."""
    n = len(names)
    if names[0] == "0" and n == BLOCKS:
        return [i * n // stages for i in range(stages + 1)]
    inner = n - 2
    return [0] + [1 + i * inner // stages for i in range(1, stages)] + [n]


def torch_pipeline(model, batch, loss_fn, schedule: str, m: int) -> Callable[[], float]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank, world = dist.get_rank(), dist.get_world_size()
    layers = chain_layers(model)
    cuts = _cuts([name for name, _ in layers], world)
    stage_module = nn.Sequential(*[module for _, module in layers[cuts[rank] : cuts[rank + 1]]])
    stage = PipelineStage(stage_module, rank, world, torch.device("cpu"))
    kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    sched = kind(stage, m, loss_fn=loss_fn)
    optimizer = _sgd(stage_module)
    x, y = batch

    def step() -> float:
        losses: list[torch.Tensor] = []
        optimizer.zero_grad()
        if rank == 0:
            sched.step(x)
        elif rank == world - 1:
            sched.step(target=y, losses=losses)
        else:
            sched.step()
        optimizer.step()
        loss = torch.tensor(
            [float(torch.stack(losses).detach().mean()) if losses else 0.0], dtype=torch.float64
        )
        dist.broadcast(loss, world - 1)  # as loom returns the loss on every rank
        return float(loss)

    return step


def loom_tensor_parallel(model, batch, plan, backend: bool = False) -> Callable[[], float]:
    """loom's step; ``backend``: its all-reduces through the backend (gloo), as before shared memory."""
    job = loom.TensorParallel(size=dist.get_world_size()).setup(model, _sgd(model), F.mse_loss)
    if backend:
        for module in job.module.modules():
            comm = getattr(module, "comm", None)
            if isinstance(comm, TensorParallelComm):
                comm._local = None  # decided: not on one host, so every all-reduce takes dist.all_reduce
    return lambda: job.train_step(batch)


def _over_backend(step: Callable[[], float]) -> Callable[[], float]:
    def run() -> float:
        with backend_messages():
            return step()

    return run


def dtensor_tensor_parallel(model, batch, plan) -> Callable[[], float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.distributed.tensor.parallel.style import ParallelStyle

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    styles: dict[str, ParallelStyle] = {
        name: ColwiseParallel() if kind == "col" else RowwiseParallel() for name, kind in plan.items()
    }
    parallelize_module(model, mesh, styles)
    for module in model.modules():
        if isinstance(module, Attention):  # each rank holds n_heads / world heads, as loom sets for itself
            module.n_heads //= world
    optimizer = _sgd(model)
    x, y = batch

    def step() -> float:
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    return step


def one_process(model, batch, loss_fn) -> Callable[[], float]:
    optimizer = _sgd(model)
    x, y = batch

    def step() -> float:
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    return step


def _time(step: Callable[[], float] | None, steps: int) -> float:
    """The slowest rank's seconds per step (``step`` None: this rank waits while rank 0 works alone)."""
    dist.barrier()
    started = time.perf_counter()
    if step is not None:
        for _ in range(steps):
            step()
    elapsed = torch.tensor([(time.perf_counter() - started) / steps], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def run_config(config: str, rounds: int, steps: int) -> dict:
    parts = config.split(":")
    if parts[0] == "pp":
        _, name, schedule, m = parts
        build = mlp_chain if name == "mlp" else transformer
        model, batch, loss_fn = build()
        loom_step, _ = loom_pipeline(copy.deepcopy(model), batch, loss_fn, schedule, int(m))
        before_step = _over_backend(loom_pipeline(copy.deepcopy(model), batch, loss_fn, schedule, int(m))[0])
        torch_step = torch_pipeline(copy.deepcopy(model), batch, loss_fn, schedule, int(m))
        peer = "torch.distributed.pipelining"
    else:
        _, name = parts
        model, batch, plan = tp_model(name)
        loss_fn = F.mse_loss
        loom_step = loom_tensor_parallel(copy.deepcopy(model), batch, plan)
        before_step = loom_tensor_parallel(copy.deepcopy(model), batch, plan, backend=True)
        torch_step = dtensor_tensor_parallel(copy.deepcopy(model), batch, plan)
        peer = "DTensor parallelize_module"
    single = one_process(model, batch, loss_fn) if dist.get_rank() == 0 else None
    paths = {"loom": loom_step, "torch": torch_step, "loom_backend": before_step, "one_process": single}
    first = {k: step() for k, step in paths.items() if step is not None}  # the same weights and batch
    for _ in range(2):
        for step in paths.values():
            if step is not None:
                step()
    seconds: dict[str, list[float]] = {k: [] for k in paths}
    names = list(paths)
    for r in range(rounds):
        for key in names[r % len(names) :] + names[: r % len(names)]:
            seconds[key].append(_time(paths[key], steps))
    return {"config": config, "peer": peer, "first_loss": first, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", nargs="+", required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    loom.init()
    results = []
    for config in args.configs:
        results.append(run_config(config, args.rounds, args.steps))
        if dist.get_rank() == 0:
            print(json.dumps(results[-1]), flush=True)
    if dist.get_rank() == 0:
        args.out.write_text(json.dumps({"world_size": dist.get_world_size(), "results": results}))
    dist.barrier()


if __name__ == "__main__":
    main()
