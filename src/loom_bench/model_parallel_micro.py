"""Worker of ``python -m loom_bench.model_parallel``'s micro-benchmark: small messages between 2 processes.

Times, in the same 2 processes, rounds alternating between the paths:

- a ``--bytes`` float32 all-reduce: gloo's (``dist.all_reduce``), loom's chunked shared-memory algorithm
  (``comm.all_reduce(algorithm="shm")``, three barriers), and the one-barrier `loom.comm.shm_small` that
  tensor-parallel layers use;
- a ``--bytes`` message from rank 0 to rank 1 and one back (a ping-pong; one "send/recv pair" is half a round
  trip): gloo's ``send``/``recv`` of the bare tensor, the pipeline's messages over gloo (header + tensor, the
  path before shared memory), and the pipeline's messages over `loom.comm.shm_channel`;
- the shared-memory paths once more with the waits of before the futex (spin, ``sched_yield``, short sleeps), and
  the messages with an adaptive spin allowed to grow to 200 us (`loom.comm.shm_spin`; the default is fixed).

Every call is timed alone (``perf_counter`` around it); a round's figure is the median of its calls, and rank 0
writes every round's figure per path as JSON. ``--spin-us``/``--yield-us`` set `loom.comm.shm_wait`'s budget,
``--spin-max-us`` `loom.comm.shm_spin`'s ceiling (the default path's), ``--paths`` picks paths by name.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import loom
from loom import comm
from loom.comm import shm_channel, shm_wait
from loom.comm.shm_small import SmallAllReduce
from loom.parallel.pipeline import pipeline_communications as pc

__all__ = ["main"]

# Absent before the adaptive spin: `loom_bench.small_messages` runs this worker against older commits too.
shm_spin: Any = (
    importlib.import_module("loom.comm.shm_spin") if importlib.util.find_spec("loom.comm.shm_spin") else None
)


def _gloo_pair(t: torch.Tensor, rank: int) -> None:
    if rank == 0:
        dist.send(t, 1)
        dist.recv(t, 1)
    else:
        dist.recv(t, 0)
        dist.send(t, 0)


def _pipeline_pair(t: torch.Tensor, rank: int, cpu: torch.device) -> None:
    other = 1 - rank
    if rank == 0:
        for handle, _ in pc.send_tensors([t], other):
            handle.wait()
        pc.recv_tensors(other, cpu)
    else:
        (got,) = pc.recv_tensors(other, cpu)
        for handle, _ in pc.send_tensors([got], other):
            handle.wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bytes", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=400, help="timed calls per path and round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--spin-us", type=float, default=None)
    parser.add_argument("--yield-us", type=float, default=None)
    parser.add_argument("--spin-max-us", type=float, default=None, help="the adaptive spin's ceiling")
    parser.add_argument(
        "--paths", nargs="+", default=None, help="time only the paths whose name contains one of these words"
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.spin_us is not None:
        shm_wait.SPIN_S = args.spin_us * 1e-6
    if args.spin_max_us is not None:
        shm_spin.SPIN_MAX_S = args.spin_max_us * 1e-6
    if args.yield_us is not None:
        shm_wait.YIELD_S = args.yield_us * 1e-6
    loom.init()
    rank, cpu = dist.get_rank(), torch.device("cpu")
    data = torch.randn(args.bytes // 4)
    small = SmallAllReduce.for_group(None)
    if small is None:
        raise SystemExit(
            "the one-barrier shared-memory all-reduce is not usable here (2 processes, one host)"
        )
    shm_channel.channel_to(1 - rank) if rank == 0 else shm_channel.channel_from(1 - rank)
    shm_channel.channel_from(1 - rank) if rank == 0 else shm_channel.channel_to(1 - rank)

    def gloo_only(fn):
        with pc.backend_messages():
            fn()

    def yielding(fn):  # the waits without a futex: spin 30 us, sched_yield 300 us, then short sleeps
        def run():
            saved = shm_wait.USE_FUTEX, shm_wait.SPIN_S, shm_wait.YIELD_S
            shm_wait.USE_FUTEX, shm_wait.SPIN_S, shm_wait.YIELD_S = False, 30e-6, 300e-6
            try:
                fn()
            finally:
                shm_wait.USE_FUTEX, shm_wait.SPIN_S, shm_wait.YIELD_S = saved

        return run

    def adaptive_spin(fn):  # the message waits' spin budget allowed to grow to 200 us (default: fixed SPIN_S)
        def run():
            saved = shm_spin.SPIN_MAX_S
            shm_spin.SPIN_MAX_S = 200e-6
            try:
                fn()
            finally:
                shm_spin.SPIN_MAX_S = saved

        return run

    paths = {
        "all_reduce gloo": lambda: dist.all_reduce(data),
        "all_reduce loom shm (3 barriers)": lambda: comm.all_reduce(data, "sum", "shm"),
        "all_reduce loom shm_small (1 barrier)": lambda: small.all_reduce(data),
        "all_reduce loom shm_small, spin+yield waits": yielding(lambda: small.all_reduce(data)),
        "send/recv gloo (bare tensor)": lambda: _gloo_pair(data, rank),
        "send/recv loom pipeline over gloo": lambda: gloo_only(lambda: _pipeline_pair(data, rank, cpu)),
        "send/recv loom pipeline over shm": lambda: _pipeline_pair(data, rank, cpu),
        "send/recv loom pipeline over shm, spin+yield waits": yielding(
            lambda: _pipeline_pair(data, rank, cpu)
        ),
    }
    if shm_spin is not None:
        paths["send/recv loom pipeline over shm, adaptive spin to 200 us"] = adaptive_spin(
            lambda: _pipeline_pair(data, rank, cpu)
        )
    if args.paths:
        paths = {name: fn for name, fn in paths.items() if any(word in name for word in args.paths)}
    per_round: dict[str, list[float]] = {name: [] for name in paths}
    names = list(paths)
    for name in names:  # warm-up: segments, calibration, first messages
        for _ in range(20):
            paths[name]()
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            fn, times = paths[name], []
            dist.barrier()
            for _ in range(args.calls):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            mine = torch.tensor([statistics.median(times)], dtype=torch.float64)
            dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # the slower rank's median
            per_round[name].append(float(mine) * 1e6)
    if rank == 0:
        args.out.write_text(json.dumps({"bytes": args.bytes, "calls": args.calls, "us": per_round}))


if __name__ == "__main__":
    main()
