"""Worker of `loom_bench.links`: `loom.DataParallel` step time, uncompressed and with compression codecs.

Trains the benchmark MLP (`loom_bench.dp_worker.bench_model`, 784-1024-1024-10: 1.9 M parameters, 7.5 MB of
float32 gradients) on synthetic global batches of 256 with SGD, once per configuration, in the same processes:
``DataParallel(allreduce="native")`` (DDP's own gloo all-reduce, the fastest uncompressed algorithm on these
links) and ``DataParallel(compression=codec)`` for each ``--codecs`` entry. Each configuration gets fresh model
and optimizer, ``--warmup`` untimed steps, then ``--steps`` timed ones; each step starts after a barrier and
counts the slowest rank's time. Repetitions rotate the order of configurations, so drift on a shared machine
hits them alike; the median over all timed steps is kept. Rank 0 writes
``{"world_size", "dp_step_s": {config: median s}, "all_step_s": {config: [s, ...]}}`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import loom
from loom_bench.dp_worker import bench_model, synthetic_data

__all__ = ["step_seconds"]

UNCOMPRESSED = "uncompressed"


def step_seconds(codec: str | None, steps: int, warmup: int, global_batch: int = 256) -> list[float]:
    """The slowest rank's time of each timed `DataParallelJob.train_step` (``codec`` None: uncompressed)."""
    model = bench_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    strategy = (
        loom.DataParallel(observe=False, allreduce="native")
        if codec is None
        else loom.DataParallel(observe=False, compression=codec)
    )
    job = strategy.setup(model, optimizer, nn.functional.cross_entropy)
    batches = list(
        loom.data.loader(synthetic_data(global_batch, steps + warmup), global_batch, shuffle=False)
    )
    times = []
    try:
        for i, batch in enumerate(batches):
            dist.barrier()
            started = time.perf_counter()
            job.train_step(batch)
            elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i >= warmup:
                times.append(float(elapsed))
    finally:
        job.guard.watchdog.stop()
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--codecs", default="powersgd:4,topk:0.01")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration and repetition")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repetitions", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    topo = loom.init()
    configs: list[str | None] = [None, *args.codecs.split(",")]
    times: dict[str, list[float]] = {codec or UNCOMPRESSED: [] for codec in configs}
    for rep in range(args.repetitions):
        for codec in configs[rep % len(configs) :] + configs[: rep % len(configs)]:
            times[codec or UNCOMPRESSED] += step_seconds(codec, args.steps, args.warmup)
            if topo.is_main:
                median = statistics.median(times[codec or UNCOMPRESSED])
                print(f"DataParallel step, {codec or UNCOMPRESSED}: {median * 1e3:.0f} ms", flush=True)
    if topo.is_main:
        medians = {name: statistics.median(values) for name, values in times.items()}
        args.out.write_text(
            json.dumps({"world_size": topo.world_size, "dp_step_s": medians, "all_step_s": times})
        )


if __name__ == "__main__":
    main()
