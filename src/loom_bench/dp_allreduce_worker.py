"""Worker of `loom_bench.dp_allreduce`: DDP's gradient all-reduce, with and without loom's hooks, same processes.

Every configuration trains the benchmark MLP of `loom_bench.dp_worker` (784-1024-1024-10, SGD, synthetic data)
for the same steps; within each repetition the configurations run one after the other, in an order rotated
per repetition, so drift on a shared machine hits all of them alike. A configuration's time is the slowest
rank's. The scaling baseline, ``one_process``, is timed in the same rotation: rank 0 alone trains the plain model
on whole global batches while the others wait. Run without the launcher, it times only that.
Rank 0 writes ``{"world_size", "samples_per_s": {config: [per repetition]}, "auto_policy"}`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import loom
from loom.comm import allreduce_hook
from loom.comm.auto import policy_for
from loom.comm.ddp_async import overlapped_allreduce_hook
from loom.comm.shared_gradients import SharedGradients
from loom.data import share_bounds
from loom_bench.dp_worker import bench_model, synthetic_data

CONFIGS = {
    # name: (hook: None | "sync" | "overlap", algorithm, bucket_cap_mb, gradient_as_bucket_view)
    "ddp": (None, "native", 25.0, False),
    "overlap_shm": ("overlap", "shm", 25.0, False),
    "overlap_auto": ("overlap", "auto", 25.0, False),
    "sync_shm": ("sync", "shm", 25.0, False),
    "overlap_shm_view": ("overlap", "shm", 25.0, True),
    "overlap_shm_b2": ("overlap", "shm", 2.0, True),
    "overlap_auto_view": ("overlap", "auto", 25.0, True),
    "ddp_view": (None, "native", 25.0, True),
    "no_comm": ("none", "native", 25.0, True),  # the compute-only ceiling: a hook that does not communicate
    "shared_shm": (
        "shared",
        "shm",
        0.0,
        False,
    ),  # no DDP: SharedGradients after backward (DataParallel's path)
}


def _no_communication(state, bucket):  # unannotated: DDP rejects string annotations (future import)
    """Leave the local gradients as they are: what a step costs with communication free."""
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def time_one_process(topo, data, global_batch: int, warmup: int) -> float:
    """The scaling baseline, inside the job: rank 0 trains the plain model on whole global batches while the
    other ranks wait in a broadcast (blocked, not spinning), so it is timed in the same minute as the others."""
    speed = torch.zeros(1, dtype=torch.float64)
    if topo.rank == 0:
        speed[0] = time_config("one_process", _Alone(), data, global_batch, warmup)
    if topo.is_distributed:
        dist.broadcast(speed, src=0)
    return speed.item()


class _Alone:
    """What `time_config` reads of a topology, for one process."""

    is_distributed, rank, world_size = False, 0, 1


def time_config(name: str, topo, data, global_batch: int, warmup: int) -> float:
    """Samples per second of one configuration: the slowest rank's wall time over the timed steps."""
    if name == "one_process" and topo.is_distributed:
        return time_one_process(topo, data, global_batch, warmup)
    model = bench_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    wrapped: nn.Module = model
    shared: SharedGradients | None = None
    if topo.is_distributed and CONFIGS[name][0] == "shared":
        shared = SharedGradients(model)
    elif topo.is_distributed:
        hook, algorithm, cap, view = CONFIGS[name]
        ddp = DistributedDataParallel(model, bucket_cap_mb=cap, gradient_as_bucket_view=view)
        if hook == "sync":
            ddp.register_comm_hook(None, allreduce_hook(algorithm))
        elif hook == "overlap":
            ddp.register_comm_hook(None, overlapped_allreduce_hook(algorithm))
        elif hook == "none":
            ddp.register_comm_hook(None, _no_communication)
        wrapped = ddp
    x, y = data.tensors
    lo, hi = share_bounds(global_batch, topo.rank, topo.world_size)
    steps = len(x) // global_batch

    def step(i: int) -> None:
        base = i * global_batch
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(wrapped(x[base + lo : base + hi]), y[base + lo : base + hi]).backward()
        if shared is not None:
            shared.average()
        optimizer.step()

    for i in range(warmup):
        step(i)
    if topo.is_distributed:
        dist.barrier()
    started = time.perf_counter()
    for i in range(warmup, steps):
        step(i)
    elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
    if topo.is_distributed:
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return (steps - warmup) * global_batch / elapsed.item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--configs", default="ddp,overlap_shm,overlap_auto,sync_shm")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    topo = loom.init()
    data = synthetic_data(args.global_batch, args.steps + args.warmup)
    names = [*args.configs.split(","), "one_process"] if topo.is_distributed else ["one_process"]
    unknown = [n for n in names if n not in CONFIGS and n != "one_process"]
    if unknown:
        raise ValueError(f"unknown configurations {unknown}; known: {sorted(CONFIGS)}")
    results: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(args.repetitions):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            results[name].append(time_config(name, topo, data, args.global_batch, args.warmup))
        if topo.is_main:
            print(
                f"repetition {rep + 1}/{args.repetitions}: "
                + ", ".join(f"{k} {v[-1]:.0f}" for k, v in results.items())
                + " samples/s",
                flush=True,
            )
    if topo.is_main:
        policy = policy_for(None) if topo.is_distributed else None
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {
                    "world_size": topo.world_size,
                    "samples_per_s": results,
                    "auto_policy": repr(policy) if policy else None,
                }
            )
        )


if __name__ == "__main__":
    main()
