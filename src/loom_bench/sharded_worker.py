"""Worker of ``loom bench sharded``: times loom ShardedDataParallel (stages 1-3), raw FSDP2 (``fully_shard``
with the same units, a plain loop) and loom DataParallel in the same processes, alternating, and measures each
one's persistent training state per rank by walking the live tensors (`loom.parallel.data.sharded_memory`), and the
peak of one step: the process's resident memory at its highest during the step (``VmHWM``, reset just before it
through ``/proc/self/clear_refs``) minus what was resident when it began (Linux only; the same measurement the
jobs' step records carry on their sampled steps, `loom.observe.memory`, taken here for the raw FSDP2 loop too).

Every runner trains the same MLP with Adam on the same synthetic global batches; the order rotates between
repetitions so drift on a shared machine hits all alike. Rank 0 writes the samples/s and bytes as JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import loom
from loom.data import share_bounds
from loom.parallel.data.sharded_fsdp import default_units
from loom.parallel.data.sharded_memory import live_tensor_bytes

WIDTH = 1024


def bench_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(784, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 10)
    )


def _batches(global_batch: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(global_batch, 784, generator=g), torch.randint(0, 10, (global_batch,), generator=g))
        for _ in range(steps)
    ]


def _share(batch, topo) -> tuple[torch.Tensor, torch.Tensor]:
    lo, hi = share_bounds(len(batch[0]), topo.rank, topo.world_size)
    return batch[0][lo:hi], batch[1][lo:hi]


def _timed(step: Callable[[Any], None], batches: list, warmup: int, global_batch: int) -> float:
    for batch in batches[:warmup]:
        step(batch)
    started = time.perf_counter()
    for batch in batches[warmup:]:
        step(batch)
    return (len(batches) - warmup) * global_batch / (time.perf_counter() - started)


def _resident_kib() -> dict[str, int]:
    text = Path("/proc/self/status").read_text()
    return {k: int(v) for k, v in re.findall(r"(VmHWM|VmRSS):\s+(\d+) kB", text)}


def step_peak_bytes(step: Callable[[Any], None], batch: Any) -> int:
    """Bytes by which the resident set rose at its highest during one ``step(batch)`` (0 where /proc lacks it)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
    except OSError:
        return 0
    before = _resident_kib()["VmRSS"]
    step(batch)
    return max(0, _resident_kib()["VmHWM"] - before) * 1024


def run_loom(strategy: Any, topo, batches: list, warmup: int) -> tuple[float, dict[str, int]]:
    model = bench_model()
    job = strategy.setup(model, torch.optim.Adam(model.parameters()), nn.functional.cross_entropy)
    rate = _timed(lambda b: job.train_step(_share(b, topo)), batches, warmup, len(batches[0][0]))
    memory = live_tensor_bytes(job.module, job.optimizer)
    memory["step_peak"] = step_peak_bytes(lambda b: job.train_step(_share(b, topo)), batches[0])
    return rate, memory


def run_raw_fsdp2(stage: int, topo, batches: list, warmup: int) -> tuple[float, dict[str, int]]:
    model = bench_model()
    mesh = init_device_mesh("cpu", (topo.world_size,))
    for unit in default_units(model):
        fully_shard(unit, mesh=mesh, reshard_after_forward=stage == 3)
    fully_shard(model, mesh=mesh, reshard_after_forward=stage == 3)
    optimizer = torch.optim.Adam(model.parameters())

    def step(batch) -> None:
        x, y = _share(batch, topo)
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    rate = _timed(step, batches, warmup, len(batches[0][0]))
    memory = live_tensor_bytes(model, optimizer)
    memory["step_peak"] = step_peak_bytes(step, batches[0])
    return rate, memory


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=240)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    topo = loom.init()
    batches = _batches(args.global_batch, args.steps + args.warmup)
    runners: dict[str, Callable[[], tuple[float, dict[str, int]]]] = {
        "loom stage 1": lambda: run_loom(loom.ShardedDataParallel(stage=1), topo, batches, args.warmup),
        "loom stage 1, reduce-scatter": lambda: run_loom(
            loom.ShardedDataParallel(stage=1, gradient_reduce="reduce_scatter"), topo, batches, args.warmup
        ),
        "loom stage 2": lambda: run_loom(loom.ShardedDataParallel(stage=2), topo, batches, args.warmup),
        "loom stage 3": lambda: run_loom(loom.ShardedDataParallel(stage=3), topo, batches, args.warmup),
        "raw FSDP2 stage 2": lambda: run_raw_fsdp2(2, topo, batches, args.warmup),
        "raw FSDP2 stage 3": lambda: run_raw_fsdp2(3, topo, batches, args.warmup),
        "loom DataParallel": lambda: run_loom(loom.DataParallel(), topo, batches, args.warmup),
    }
    rates: dict[str, list[float]] = {name: [] for name in runners}
    memory: dict[str, dict[str, int]] = {}
    names = list(runners)
    for rep in range(args.repetitions):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            rate, bytes_ = runners[name]()
            rates[name].append(rate)
            memory[name] = bytes_
            gc.collect()
        if topo.is_main:
            print(f"repetition {rep + 1}/{args.repetitions}: " + ", ".join(
                f"{k} {v[-1]:.0f}" for k, v in rates.items()), flush=True)  # fmt: skip
    params = sum(p.numel() for p in bench_model().parameters())
    if topo.is_main:
        args.out.write_text(
            json.dumps({"world_size": topo.world_size, "params": params, "rates": rates, "memory": memory})
        )


if __name__ == "__main__":
    main()
