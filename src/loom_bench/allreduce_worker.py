"""Worker of ``loom bench allreduce``: times every all-reduce algorithm at every size in the same processes.

For each size (largest first, so shared-memory segments are made once at full size), every algorithm is
warmed up, then timed ``--repetitions`` times; each repetition runs enough calls to last a few milliseconds
and records the slowest rank's time per call (a MAX all-reduce). Algorithms rotate their order from one
repetition to the next so drift on a shared machine hits all of them alike. Rank 0 writes JSON:
``{"world_size", "sizes", "seconds": {algorithm: [[per repetition] per size]}}``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

import loom
from loom import comm
from loom.comm import auto, ring

__all__ = ["RING_OVER_GLOO", "reduce_once", "time_per_call"]


RING_OVER_GLOO = "ring_gloo"
"""Not an algorithm of its own: `ring`'s schedule over gloo's point-to-point calls instead of loom's links."""


def reduce_once(data: torch.Tensor, algorithm: str) -> None:
    if algorithm != RING_OVER_GLOO:
        comm.all_reduce(data, "sum", algorithm)
        return
    chosen, ring.TRANSPORT = ring.TRANSPORT, "gloo"
    try:
        comm.all_reduce(data, "sum", "ring")
    finally:
        ring.TRANSPORT = chosen


def time_per_call(data: torch.Tensor, algorithm: str, calls: int) -> float:
    """Seconds per call of ``comm.all_reduce`` on ``data``, the slowest rank's, all ranks agreeing."""
    dist.barrier()
    started = time.perf_counter()
    for _ in range(calls):
        reduce_once(data, algorithm)
    elapsed = torch.tensor([(time.perf_counter() - started) / calls], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", required=True, help="message sizes in bytes")
    parser.add_argument("--algorithms", nargs="+", default=[*comm.ALGORITHMS, RING_OVER_GLOO])
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--min-seconds", type=float, default=0.02, help="least time of one repetition")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    topo = loom.init()
    sizes = sorted(args.sizes, reverse=True)
    seconds: dict[str, list[list[float]]] = {a: [] for a in args.algorithms}
    for size in sizes:
        data = torch.zeros(size // 4, dtype=torch.float32)  # zeros: repeated sums stay finite
        calls = {}
        for algorithm in args.algorithms:
            reduce_once(data, algorithm)  # set-up (segments, links, calibration) is not timed
            once = time_per_call(data, algorithm, 1)
            calls[algorithm] = max(1, min(1000, round(args.min_seconds / max(once, 1e-6))))
        runs: dict[str, list[float]] = {a: [] for a in args.algorithms}
        for rep in range(args.repetitions):
            shift = rep % len(args.algorithms)
            for algorithm in args.algorithms[shift:] + args.algorithms[:shift]:
                runs[algorithm].append(time_per_call(data, algorithm, calls[algorithm]))
        for algorithm in args.algorithms:
            seconds[algorithm].append(runs[algorithm])
        if topo.is_main:
            print(
                f"{size:>9} B: " + ", ".join(f"{a} {1e6 * min(r):.0f} us" for a, r in runs.items()),
                flush=True,
            )
    if topo.is_main:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        order = [sizes.index(s) for s in sorted(sizes)]
        policy = auto.policy_for(None)
        result = {
            "world_size": topo.world_size,
            "auto_policy": repr(policy) if policy is not None else None,
            "sizes": sorted(sizes),
            "seconds": {a: [v[i] for i in order] for a, v in seconds.items()},
        }
        args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
