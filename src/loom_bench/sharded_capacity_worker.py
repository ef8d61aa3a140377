"""Worker of ``python -m loom_bench.sharded_capacity``: build an MLP of the given width, set it up with the given
strategy (loom DataParallel, or ShardedDataParallel at a stage) and train 2 Adam steps on synthetic data.

Rank 0 prints one JSON line (``{"ok": true, ...}``) after the second step: the parameter count, each rank's
lifetime peak RSS (``ru_maxrss``, gathered) and rank 0's training state. Running out of memory is the driver's
business: inside its memory cgroup the kernel kills a process and the launcher fails the job.
"""

from __future__ import annotations

import argparse
import json
import resource

import torch
import torch.distributed as dist
from torch import nn

import loom

DEPTH = 8
"""Hidden ``Linear(width, width)`` layers: parameters ~ DEPTH x width^2 (each a unit of FSDP2's wrapping)."""
IN, OUT, GLOBAL_BATCH = 64, 10, 32


def capacity_model(width: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(IN, width), nn.ReLU()]
    for _ in range(DEPTH):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, OUT))


def parameters(width: int) -> int:
    return (IN + 1) * width + DEPTH * (width + 1) * width + (width + 1) * OUT


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", required=True, help="dp, or stage1 / stage2 / stage3")
    parser.add_argument("--width", type=int, required=True)
    args = parser.parse_args()
    topo = loom.init()
    model = capacity_model(args.width)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    if args.strategy == "dp":
        strategy: object = loom.DataParallel(observe=False)
    else:
        strategy = loom.ShardedDataParallel(stage=int(args.strategy.removeprefix("stage")), observe=False)
    job = strategy.setup(model, optimizer, nn.functional.cross_entropy)  # type: ignore[attr-defined]
    del model  # the job holds what it needs (stage 3: only this rank's shards)
    g = torch.Generator().manual_seed(0)
    share = GLOBAL_BATCH // topo.world_size
    for _ in range(2):
        x, y = torch.randn(GLOBAL_BATCH, IN, generator=g), torch.randint(0, OUT, (GLOBAL_BATCH,), generator=g)
        lo = topo.rank * share
        job.train_step((x[lo : lo + share], y[lo : lo + share]))
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024], dtype=torch.int64)
    peaks = [torch.zeros_like(peak) for _ in range(topo.world_size)]
    dist.all_gather(peaks, peak)
    if topo.rank == 0:
        state = job.memory()["state"]
        line = {
            "ok": True,
            "params": parameters(args.width),
            "peak_rss": [int(p) for p in peaks],
            "state": state,
        }
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
