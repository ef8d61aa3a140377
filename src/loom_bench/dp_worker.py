"""Worker of ``loom bench dp``: times loom DataParallel and raw DistributedDataParallel in the same processes.

Both train the same MLP (784-1024-1024-10) on the same synthetic global batches with SGD; repetitions alternate
which one goes first, so drift on a shared machine hits both equally. With one process (no launcher) it times the
plain model, the baseline for scaling efficiency. Rank 0 writes the per-repetition throughputs as JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import TensorDataset

import loom
from loom.data import share_bounds
from loom.topology import Topology


def bench_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )


def synthetic_data(global_batch: int, steps: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    n = global_batch * steps
    return TensorDataset(torch.randn(n, 784, generator=g), torch.randint(0, 10, (n,), generator=g))


def time_job(job, data: TensorDataset, global_batch: int, warmup: int) -> float:
    """Samples/s of ``job.train_step`` over ``data`` in global batches, after ``warmup`` untimed steps."""
    batches = list(loom.data.loader(data, global_batch, shuffle=False))
    for batch in batches[:warmup]:
        job.train_step(batch)
    started = time.perf_counter()
    for batch in batches[warmup:]:
        job.train_step(batch)
    return (len(batches) - warmup) * global_batch / (time.perf_counter() - started)


def time_loom(topo, data: TensorDataset, global_batch: int, warmup: int, observe: bool = True) -> float:
    model = bench_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    job = loom.DataParallel(observe=observe).setup(model, optimizer, nn.functional.cross_entropy)
    return time_job(job, data, global_batch, warmup)


def time_raw_ddp(topo, data: TensorDataset, global_batch: int, warmup: int) -> float:
    model = bench_model()
    wrapped = DistributedDataParallel(model) if topo.is_distributed else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = data.tensors
    lo, hi = share_bounds(global_batch, topo.rank, topo.world_size)
    steps = len(x) // global_batch

    def step(i: int) -> None:
        base = i * global_batch
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(wrapped(x[base + lo : base + hi]), y[base + lo : base + hi]).backward()
        optimizer.step()

    for i in range(warmup):
        step(i)
    started = time.perf_counter()
    for i in range(warmup, steps):
        step(i)
    return (steps - warmup) * global_batch / (time.perf_counter() - started)


def timing_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options every loom-vs-DDP worker takes (this one, `loom_bench.strategy_worker`)."""
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--out", type=Path, required=True)
    return parser


def main() -> None:
    args = timing_arguments(argparse.ArgumentParser()).parse_args()
    torch.set_num_threads(1)
    topo = loom.init()
    data = synthetic_data(args.global_batch, args.steps + args.warmup)
    results: dict[str, list[float]] = {"loom": [], "loom_unobserved": [], "ddp": []}
    runners: dict[str, Callable[[Topology, TensorDataset, int, int], float]] = {
        "loom": time_loom,
        "loom_unobserved": functools.partial(time_loom, observe=False),
        "ddp": time_raw_ddp,
    }
    if not topo.is_distributed:
        runners = {"ddp": time_raw_ddp}
    for rep in range(args.repetitions):
        names = list(runners)
        order = (
            names[rep % len(names) :] + names[: rep % len(names)]
        )  # each runs first as often as the others
        for name in order:
            results[name].append(runners[name](topo, data, args.global_batch, args.warmup))
        if topo.is_main:
            print(
                f"repetition {rep + 1}/{args.repetitions}: "
                + ", ".join(f"{k} {v[-1]:.0f} samples/s" for k, v in results.items() if v),
                flush=True,
            )
    if topo.is_main:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps({"world_size": topo.world_size, **{k: v for k, v in results.items() if v}})
        )


if __name__ == "__main__":
    main()
