"""Worker of `loom_bench.links`: time native, ring and driver all-reduce of one size across the job's hosts.

Each algorithm gets one warm-up call, then ``--reps`` timed calls, each started after a barrier; a call's time
is the slowest rank's, the median is kept. Achieved bandwidth uses the bus-bytes convention of
`loom.comm.counters` (a bandwidth-optimal ring moves ``2 (N-1)/N * D`` bytes each way per process), so it
compares directly with the link rate. With ``--dp-steps S`` it then times S DistributedDataParallel steps of the
benchmark MLP (`loom_bench.dp_worker`, global batch 256) without a hook and with each ``--codecs`` compression
hook (`loom.comm.compression`), after 2 warm-up steps, each config's time the slowest rank's.
Rank 0 writes ``{"results": {algorithm: {"seconds", "bus_bits_per_s"}}, "dp_step_s": {config: s}}`` as JSON.
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
from torch.nn.parallel import DistributedDataParallel

import loom
from loom import comm
from loom.comm.compression import compression_hook
from loom.data import share_bounds
from loom_bench.dp_worker import bench_model, synthetic_data


def dp_step_seconds(topo, codec: str | None, steps: int, warmup: int = 2, global_batch: int = 256) -> float:
    """Median step time of DDP on the benchmark MLP, uncompressed (None) or with a compression codec."""
    model = bench_model()
    ddp = DistributedDataParallel(model)
    if codec is not None:
        ddp.register_comm_hook(None, compression_hook(codec))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = synthetic_data(global_batch, steps + warmup).tensors
    lo, hi = share_bounds(global_batch, topo.rank, topo.world_size)
    times = []
    for i in range(steps + warmup):
        base = i * global_batch
        dist.barrier()
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(ddp(x[base + lo : base + hi]), y[base + lo : base + hi]).backward()
        optimizer.step()
        elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i >= warmup:
            times.append(elapsed.item())
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bytes", type=int, required=True)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--algorithms", default="native,ring,driver")
    parser.add_argument("--dp-steps", type=int, default=0)
    parser.add_argument("--codecs", default="powersgd:4,topk:0.01")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    topo = loom.init()
    n = topo.world_size
    data = torch.ones(args.bytes // 4, dtype=torch.float32)
    results = {}
    for algorithm in args.algorithms.split(","):
        comm.all_reduce(data, algorithm=algorithm)  # warm-up: connections, buffers
        times = []
        for _ in range(args.reps):
            dist.barrier()
            started = time.perf_counter()
            comm.all_reduce(data, algorithm=algorithm)
            elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times.append(elapsed.item())
        seconds = statistics.median(times)
        bus_bits = 8 * 2 * (n - 1) * data.nbytes / n
        results[algorithm] = {"seconds": seconds, "all_seconds": times, "bus_bits_per_s": bus_bits / seconds}
        if topo.is_main:
            print(f"{algorithm}: {seconds * 1e3:.1f} ms, {bus_bits / seconds / 1e6:.0f} Mbit/s", flush=True)
    dp: dict[str, float] = {}
    if args.dp_steps:
        for codec in [None, *args.codecs.split(",")]:
            dp[codec or "uncompressed"] = dp_step_seconds(topo, codec, args.dp_steps)
            if topo.is_main:
                print(
                    f"DDP step, {codec or 'uncompressed'}: {dp[codec or 'uncompressed'] * 1e3:.0f} ms",
                    flush=True,
                )
    if topo.is_main:
        args.out.write_text(
            json.dumps({"world_size": n, "bytes": data.nbytes, "results": results, "dp_step_s": dp})
        )


if __name__ == "__main__":
    main()
