"""Worker of ``python -m loom_bench.compare_commits --strategy S``: one loom strategy and raw DDP, same processes.

The strategies other than DataParallel (``localsgd``, ``diloco``, ``gossip``, ``ps-sync``, ``ps-async``) train
`dp_worker`'s MLP on the same synthetic global batches with SGD; each repetition times the strategy and raw
`DistributedDataParallel` (the load reference: ``strategy / DDP`` cancels what the machine's load does to both),
alternating which goes first. Only the public API that every compared commit has is used
(``loom.LocalSGD(sync_every=...)``, ``loom.DiLoCo``, ``loom.Gossip``, ``loom.ParameterServer(mode=...)``,
``loom.data.loader``), so the same worker times old and new code. The parameter-server cases need the launcher's
``--servers``. Rank 0 writes the per-repetition throughputs as JSON.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
from torch import nn

import loom
from loom_bench.dp_worker import bench_model, synthetic_data, time_job, time_raw_ddp, timing_arguments

STRATEGIES = ("localsgd", "diloco", "gossip", "ps-sync", "ps-async")


def _strategy(name: str, rep: int) -> Any:
    """The strategy ``name``; gossip links and parameter-server tables get a namespace per repetition."""
    if name == "localsgd":
        return loom.LocalSGD(sync_every=8)
    if name == "diloco":
        return loom.DiLoCo(sync_every=8)
    if name == "gossip":
        return loom.Gossip(peers="ring", every=1, namespace=f"bench{rep}")
    if name in ("ps-sync", "ps-async"):
        return loom.ParameterServer(mode=name[3:], namespace=f"bench{rep}")
    raise SystemExit(f"--strategy {name!r}: choose one of {', '.join(STRATEGIES)}")


def time_strategy(name: str, rep: int, data, global_batch: int, warmup: int) -> float:
    model = bench_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    job = _strategy(name, rep).setup(model, optimizer, nn.functional.cross_entropy)
    try:
        return time_job(job, data, global_batch, warmup)
    finally:
        close = getattr(job, "close", None)
        if close is not None:
            close()


def main() -> None:
    parser = timing_arguments(argparse.ArgumentParser())
    parser.add_argument("--strategy", required=True, choices=STRATEGIES)
    args = parser.parse_args()
    torch.set_num_threads(1)
    topo = loom.init()
    data = synthetic_data(args.global_batch, args.steps + args.warmup)
    results: dict[str, list[float]] = {"loom": [], "ddp": []}
    for rep in range(args.repetitions):
        for name in ("loom", "ddp") if rep % 2 == 0 else ("ddp", "loom"):
            if name == "loom":
                results[name].append(time_strategy(args.strategy, rep, data, args.global_batch, args.warmup))
            else:
                results[name].append(time_raw_ddp(topo, data, args.global_batch, args.warmup))
        if topo.is_main:
            print(f"repetition {rep + 1}/{args.repetitions}: {args.strategy} {results['loom'][-1]:.0f}, "
                  f"ddp {results['ddp'][-1]:.0f} samples/s", flush=True)  # fmt: skip
    if topo.is_main:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"world_size": topo.world_size, "strategy": args.strategy, **results}))


if __name__ == "__main__":
    main()
